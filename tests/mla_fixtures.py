"""Small random MLA models of each family, with every norm weight and bias randomized so that
fusion mistakes (a forgotten Γ, a bias left unrotated) change the logits."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from quantmla import attention
from quantmla.cache import CacheSpec
from quantmla.data import CalibrationData
from quantmla.methods import MethodContext
from quantmla.models.tiny import build, byte_tokenizer, tiny_config

VOCAB = 259


def _randomize(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(torch.exp(0.3 * torch.randn(p.shape, generator=g)))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _common(**kw):
    return (
        dict(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=128,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            max_position_embeddings=2048,
            initializer_range=0.08,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
            tie_word_embeddings=False,
        )
        | kw
    )


def tiny_v2(seed: int = 0):
    """The project's `tiny` DeepseekV2 (complex RoPE, no q-LoRA), norms randomized."""
    model, tok = build(tiny_config(), seed=seed)
    return _randomize(model, seed + 100), tok


def random_v3(seed: int = 0, interleave: bool = True):
    """DeepseekV3-shaped: q-LoRA, rope_interleave (or half-split), one dense and one MoE layer."""
    cfg = DeepseekV3Config(
        **_common(q_lora_rank=64, rope_interleave=interleave, first_k_dense_replace=1, n_group=1, topk_group=1)
    )
    torch.manual_seed(seed)
    return _randomize(DeepseekV3ForCausalLM(cfg).eval(), seed + 100), byte_tokenizer()


def random_glm(seed: int = 0):
    """Glm4MoeLite-shaped: q-LoRA, attention biases, rope_interleave."""
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    cfg = Glm4MoeLiteConfig(
        **_common(q_lora_rank=64, attention_bias=True, rope_interleave=True, n_group=1, topk_group=1)
    )
    torch.manual_seed(seed)
    return _randomize(Glm4MoeLiteForCausalLM(cfg).eval(), seed + 100), byte_tokenizer()


def random_longcat(seed: int = 0):
    """LongcatFlash-shaped: two MLA modules in its one layer, q-LoRA, and the constant latent scalars
    mla_scale_q_lora = sqrt(512/64) and mla_scale_kv_lora = sqrt(512/128) = 2 that fusion must respect."""
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

    drop = (
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "num_key_value_heads",
    )
    kw = {k: v for k, v in _common(q_lora_rank=64, hidden_size=512).items() if k not in drop}
    cfg = LongcatFlashConfig(
        **kw,
        num_layers=1,
        n_routed_experts=4,
        moe_topk=2,
        zero_expert_num=1,
        expert_ffn_hidden_size=64,
        ffn_hidden_size=256,
    )
    torch.manual_seed(seed)
    return _randomize(LongcatFlashForCausalLM(cfg).eval(), seed + 100), byte_tokenizer()


FAMILIES = {
    "tiny": tiny_v2,
    "v3": random_v3,
    "v3_half": lambda seed=0: random_v3(seed, interleave=False),
    "glm": random_glm,
    "longcat": random_longcat,
}


def installed(family: str, seed: int = 0):
    model, tok = FAMILIES[family](seed)
    layers = attention.install(model, CacheSpec())
    return model, tok, layers


def small_calibration(**kw) -> CalibrationData:
    return CalibrationData(**({"seq_len": 128, "train": 8, "heldout": 4, "batch_size": 4} | kw))


def method_context(tok, cache_dir, bits: str = "c4r4", calibration: CalibrationData | None = None):
    """A method's context on a small calibration bank, without progress bars."""
    return MethodContext(
        spec=CacheSpec.parse(bits),
        tokenizer=tok,
        calibration=calibration or small_calibration(seq_len=64, train=4, heldout=4),
        cache_dir=cache_dir,
        progress=False,
    )


def set_spec(layers, spec: CacheSpec) -> None:
    for layer in layers:
        layer.spec = spec


CONTENT_OUTLIERS = (3, 77)  # one loud latent channel in each 64-channel group of d_c = 128
ROPE_OUTLIER_ROWS = (10, 11)  # weight-space frequency pair 5 of the pre-RoPE key


def planted_outliers(seed: int = 0, content_gain: float = 20.0, rope_gain: float = 8.0, consumer_gain: float = 0.25):
    """The `tiny` DeepseekV2 with outlier channels planted in its real projections.

    In every layer the producer rows of two latent channels (one per quantization group) are
    scaled by ``content_gain`` and the pre-RoPE key rows of one frequency pair by ``rope_gain``,
    so the captured u, C and post-RoPE K_P carry outlier channels the way trained MLA models do
    (data flows through the real embedding, norms and projections). Γ is randomized. The
    ``kv_b_proj`` columns reading the loud latent channels are scaled by ``consumer_gain``: loud
    channels matter less per unit for the output, so the output's sensitivity is not isotropic in
    the latent (the premise of the paper's function-aligned objective, its §2.3); with
    ``consumer_gain=1`` a random consumer makes cache and output errors nearly proportional.
    """
    model, tok = build(tiny_config(), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            d_c = a.kv_lora_rank
            a.kv_a_proj_with_mqa.weight[list(CONTENT_OUTLIERS)] *= content_gain
            a.kv_a_proj_with_mqa.weight[[d_c + r for r in ROPE_OUTLIER_ROWS]] *= rope_gain
            a.kv_b_proj.weight[:, list(CONTENT_OUTLIERS)] *= consumer_gain
            a.kv_a_layernorm.weight.copy_(torch.exp(0.3 * torch.randn(d_c, generator=g)))
    layers = attention.install(model, CacheSpec())
    return model, tok, layers


def small_layer_probe(tokens: int):
    """A float64 LayerProbe of layer 1 of a small random DeepseekV2 on ``tokens`` random tokens:
    small enough for exact Jacobians."""
    from quantmla.sensitivity import LayerProbe, frozen_copy

    model, _ = build(tiny_config(layers=2, hidden=64, heads=2, kv_lora_rank=64, qk_nope_head_dim=16, v_head_dim=16))
    layers = attention.install(model, CacheSpec())
    ids = torch.randint(3, 259, (1, tokens), generator=torch.Generator().manual_seed(0))
    inp = attention.capture_inputs(model, ids)[1]
    return LayerProbe(frozen_copy(layers[1], torch.float64), inp.x, inp.position_embeddings, inp.attention_mask)
