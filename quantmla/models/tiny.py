"""``tiny``: a random-initialised DeepseekV2 MLA model and a byte-level tokenizer, built in code.

No files, no hub: everything comes from the seed, so unit tests and the quick sweep run
anywhere. Its weights are random, so its metrics only check that the pipeline works.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, DeepseekV2Config, PreTrainedTokenizerFast

SPECIALS = ("<s>", "</s>", "<pad>")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte symbols + BOS/EOS/PAD), no merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_config(
    vocab_size: int = 259,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_lora_rank: int = 128,
    q_lora_rank: int | None = None,
    qk_rope_head_dim: int = 64,
    qk_nope_head_dim: int = 32,
    v_head_dim: int = 32,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.08,
) -> DeepseekV2Config:
    return DeepseekV2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
        first_k_dense_replace=layers,  # every layer dense: no MoE in the tiny model
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )


def lite_config(layers: int = 1, **kw) -> DeepseekV2Config:
    """A random config with DeepSeek-V2-Lite's attention shapes (hidden 2048, 16 heads, d_c 512,
    d_r 64, d_nope = d_v = 128, no q-LoRA) and dense MLPs: the benchmarks' full-size layer."""
    shapes = dict(hidden=2048, heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    return tiny_config(layers=layers, initializer_range=0.02, **(shapes | kw))


FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")


def family_config(family: str = "deepseek_v2", q_lora_rank: int | None = None, **kw):
    """A tiny random config of another MLA family with the same shapes as :func:`tiny_config`.

    ``deepseek_v3`` and ``glm4_moe_lite`` use interleaved RoPE weights (``rope_interleave``),
    so tests cover both RoPE layouts and q-LoRA (``q_lora_rank``).
    """
    base = tiny_config(q_lora_rank=q_lora_rank, **kw)
    if family == "deepseek_v2":
        return base
    shared = {
        k: getattr(base, k)
        for k in (
            "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
            "num_key_value_heads kv_lora_rank q_lora_rank qk_rope_head_dim qk_nope_head_dim v_head_dim "
            "max_position_embeddings initializer_range bos_token_id eos_token_id pad_token_id tie_word_embeddings"
        ).split()
    }
    shared.update(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**shared, first_k_dense_replace=base.num_hidden_layers, rope_interleave=True)
    if family == "glm4_moe_lite":
        from transformers.models.glm4_moe_lite import Glm4MoeLiteConfig

        return Glm4MoeLiteConfig(**shared, mlp_layer_types=["dense"] * base.num_hidden_layers, rope_interleave=True)
    raise ValueError(f"unknown family '{family}'; choose one of {', '.join(FAMILIES)}")


def build(config=None, seed: int = 0, dtype: torch.dtype = torch.float32):
    """(model, tokenizer): the seeded random model in eval mode."""
    config = config or tiny_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval(), byte_tokenizer()
