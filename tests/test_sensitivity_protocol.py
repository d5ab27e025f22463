"""The matched-error protocol (the paper's App. B.1) on the tiny MLA model, its aggregation, and bad input."""

import math
import subprocess
import sys

import pytest
import torch

from quantmla import attention, data
from quantmla.cache import CacheSpec
from quantmla.evals import EvalContext
from quantmla.evals.sensitivity import Sensitivity
from quantmla.models.tiny import build
from quantmla.quant import qdq
from quantmla.sensitivity import (
    LayerProbe,
    cell_means,
    check_layers,
    frozen_copy,
    mla_layers,
    model_summary,
    per_layer,
    predictor_check,
    quantization_error,
    rescale,
)
from quantmla.sensitivity.aggregate import GAMMA, spearman


@pytest.fixture(scope="module")
def tiny():
    model, tok = build()
    layers = attention.install(model, CacheSpec())
    ids = data.windows(data.token_stream(tok, data.texts("wiki", "test")), 96, 1, seed=0)
    captured = attention.capture_inputs(model, ids)
    probes = [
        LayerProbe(frozen_copy(layer, torch.float64), c.x, c.position_embeddings, c.attention_mask)
        for layer, c in zip(layers, captured)
    ]
    return model, tok, layers, ids, probes


def sq(t):
    return float(t.double().pow(2).sum())


@pytest.mark.parametrize("path", ["C", "P"])
@pytest.mark.parametrize("target", [1e-2, 1e-3, 0.3])
def test_rescaling_hits_the_target_cache_nmse(tiny, path, target):
    for probe in tiny[4]:
        c = probe.cache[path]
        raw = quantization_error(path, c)
        e = probe.matched_error(path, target)
        assert abs(sq(e) / sq(c) - target) <= 0.01 * target
        cos = float((e.flatten() @ raw.flatten()) / math.sqrt(sq(e) * sq(raw)))
        assert cos > 1 - 1e-12  # same direction, only rescaled
        r = probe.response(path, target)
        assert abs(r["nmse_cache"] - target) <= 0.01 * target
        assert r["R"] == pytest.approx(r["nmse_out"] / r["nmse_cache"], rel=1e-12)


@pytest.mark.parametrize("path", ["C", "P"])
def test_error_direction_is_the_int4_cache_error(tiny, path):
    c = tiny[4][0].cache[path]
    deq = c + quantization_error(path, c)
    groups = deq.float().unflatten(-1, (-1, 64)).flatten(0, -2)
    assert max(len(torch.unique(g)) for g in groups) <= 16  # 4-bit codes: at most 16 levels per group
    scale = torch.bfloat16 if path == "C" else torch.float32
    assert torch.equal(deq.float(), qdq(c.float(), 4, 64, scale_dtype=scale))


def test_probe_output_is_the_layers_post_o_proj_output(tiny):
    model, _, layers, ids, probes = tiny
    seen = {}
    hooks = [
        layer.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[0]))
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for i, probe in enumerate(probes):
        assert probe.Y.dtype == torch.float64
        assert sq(probe.Y - seen[i]) / sq(probe.Y) < 1e-10


@pytest.mark.parametrize("path", ["C", "P"])
def test_first_order_prediction_matches_small_finite_errors(tiny, path):
    """NMSE_out ≈ NMSE_cache · ‖c‖²/‖y‖² · G (the paper's eq. 5): exact in the limit of small errors."""
    for probe in tiny[4]:
        small = probe.local(path, 1e-8, probes=2, batch=2)
        assert small["nmse_pred"] == pytest.approx(small["nmse_out"], rel=1e-3)
        assert small["G"] == pytest.approx(small["G_finite"], rel=1e-3)
        r = probe.response(path, 1e-8)
        assert r["R"] == pytest.approx(small["energy"] * small["G"], rel=1e-3)


def records():
    """Two layers, two cells, two sequences per cell, values chosen by hand."""
    R = {  # (dataset, layer) -> [(R_C, R_P) per sequence]
        ("wiki", 0): [(1.0, 2.0), (3.0, 4.0)],
        ("news", 0): [(2.0, 8.0), (2.0, 8.0)],
        ("wiki", 1): [(0.5, 1.0), (0.5, 3.0)],
        ("news", 1): [(1.5, 1.0), (1.5, 1.0)],
    }
    out = []
    for (ds, layer), seqs in R.items():
        for s, (rc, rp) in enumerate(seqs):
            out.append(
                {"dataset": ds, "seed": 0, "sequence": s, "layer": layer}
                | {"R_C": rc, "R_P": rp, "nmse_cache_C": 0.01, "nmse_cache_P": 0.01}
                | {"nmse_out_C": rc / 100, "nmse_out_P": rp / 100}
            )
    return out


def test_aggregation_follows_the_spec():
    layers = per_layer(cell_means(records()))
    # layer 0: cell means wiki (2, 3), news (2, 8) -> R_C 2, R_P 5.5, envelope R_P 3..8
    # layer 1: wiki (0.5, 2), news (1.5, 1) -> R_C 1, R_P 1.5
    assert [r["R_C"] for r in layers] == [2.0, 1.0]
    assert [r["R_P"] for r in layers] == [5.5, 1.5]
    assert (layers[0]["R_P_min"], layers[0]["R_P_max"]) == (3.0, 8.0)
    assert (layers[1]["R_C_min"], layers[1]["R_C_max"]) == (0.5, 1.5)
    assert [r["ratio"] for r in layers] == [2.75, 1.5]
    m = model_summary(layers)
    assert m["content_response"] == 1.5 and m["rope_response"] == 3.5
    assert m["ratio"] == pytest.approx(3.5 / 1.5)  # RoPE response / content response ...
    assert m["ratio"] != pytest.approx((2.75 + 1.5) / 2)  # ... not the mean of the layer ratios
    assert m["layers_rope_above_content"] == 2


def test_predictor_check_on_constructed_points():
    pts = []
    for i in range(6):
        T_C, T_P, A_C, A_P = 1.0 + i, 3.0 / (1 + i), 1.0 + 0.1 * i, 0.8
        true = math.log(T_P / T_C) + math.log(A_P / A_C) + GAMMA
        G_C = 0.5 + i
        p = {"T_C": T_C, "T_P": T_P, "A_C": A_C, "A_P": A_P, "G_C": G_C, "G_P": G_C * math.exp(true)}
        p |= {"G_finite_C": p["G_C"], "G_finite_P": p["G_P"]}
        p |= {f"nmse_{k}_{b}": 1e-3 for k in ("pred", "out") for b in "CP"}
        pts.append(p)
    out = predictor_check(pts)
    assert out["points"] == 6
    assert out["spearman"] == pytest.approx(1.0)
    assert out["mae_operator_allocation"] == pytest.approx(0.0, abs=1e-12)
    measured = [math.log(p["G_finite_P"] / p["G_finite_C"]) for p in pts]
    assert out["mae_cache_only"] == pytest.approx(sum(abs(GAMMA - m) for m in measured) / 6)
    assert out["mae_trace_only"] > 0.01


def test_spearman_matches_pandas():
    import pandas as pd

    a = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    b = [2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0, 8.0]
    assert spearman(a, b) == pytest.approx(pd.Series(a).corr(pd.Series(b), method="spearman"))


@pytest.mark.slow
def test_eval_end_to_end_in_process(tiny):
    model, tok, layers, _, _ = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    specs = [layer.spec for layer in layers]
    ev = Sensitivity(seeds=[0, 1], sequences=2, seq_len=64, batch_size=1, local_layers=[1], probes=8, probe_batch=4)
    ev.check()
    m = ev.run(model, tok, EvalContext(progress=False))
    assert m["cells"] == ["wiki/0", "wiki/1", "news/0", "news/1"]
    assert len(m["records"]) == 4 * 2 * 2  # cells × sequences × layers
    assert len(m["local_points"]) == 4 * 1  # cells × local layers × local_sequences
    for row in m["per_layer"]:
        cells = [c for c in m["per_cell"] if c["layer"] == row["layer"]]
        for b in "CP":
            assert row[f"R_{b}"] == pytest.approx(sum(c[f"R_{b}"] for c in cells) / len(cells))
            assert row[f"R_{b}_min"] <= row[f"R_{b}"] <= row[f"R_{b}_max"]
    assert m["ratio"] == pytest.approx(m["rope_response"] / m["content_response"])
    assert all(abs(r[f"nmse_cache_{b}"] - 0.01) < 1e-4 for r in m["records"] for b in "CP")
    assert m["local"]["points"] == 4 and m["local"]["target_nmse"] == 1e-3
    assert all(p["G_C"] == pytest.approx(p["T_C"] * p["A_C"] + p["O_C"]) for p in m["local_points"])
    assert [layer.spec for layer in layers] == specs
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_eval_interventions_at_the_local_points(tiny):
    model, tok, _, _, _ = tiny
    ev = Sensitivity(seeds=[0], sequences=1, seq_len=48, layers=[1], local_layers=[1], probes=4, interventions=3)
    ev.check()
    m = ev.run(model, tok, EvalContext(progress=False))
    pts = m["local_points"]
    assert len(pts) == 2 and m["interventions"]["points"] == 2  # wiki/0, news/0 at layer 1
    assert m["interventions"]["draws"] == 3 and m["interventions"]["target_nmse"] == 1e-3
    for p in pts:
        for b in "CP":
            assert p[f"iv_G_{b}"] == pytest.approx(p[f"G_{b}"], rel=1e-9)  # the same error direction and map
            assert all(0 < p[f"iv_{k}_{b}"] < math.inf for k in ("sign", "permute", "isotropic"))
    for k in ("sign", "permute", "isotropic"):
        for b in "CP":
            want = math.exp(sum(math.log(p[f"iv_{k}_{b}"]) for p in pts) / 2)
            assert m["interventions"][f"{k}_{b}"] == pytest.approx(want)
    plain = Sensitivity(seeds=[0], sequences=1, seq_len=48, layers=[1], local_layers=[1], probes=4).run(
        model, tok, EvalContext(progress=False)
    )
    assert "interventions" not in plain
    # the interventions draw from their own stream: the probes' statistics (Table 5) are unchanged
    for p, q in zip(pts, plain["local_points"]):
        assert all(p[f"{k}_{b}"] == q[f"{k}_{b}"] for k in ("T", "A", "O", "G") for b in "CP")


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"target_nmse": 0}, "target_nmse must be positive"),
        ({"target_nmse": -0.01}, "target_nmse must be positive"),
        ({"local_target_nmse": 0.0}, "local_target_nmse must be positive"),
        ({"bits": 16}, "no quantization error"),
        ({"bits": 5}, "not supported"),
        ({"datasets": ["c4"]}, "unknown sensitivity dataset 'c4'"),
        ({"layers": [-1]}, "layer indices >= 0"),
        ({"dtype": "float16"}, "dtype"),
        ({"interventions": -1}, "interventions must be >= 0"),
        ({"interventions": 4, "local": False}, "set local=true"),
    ],
)
def test_bad_config_is_refused_before_loading(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Sensitivity(**kw).check()


def test_bad_targets_and_layers(tiny):
    probe = tiny[4][0]
    with pytest.raises(ValueError, match="must be positive"):
        probe.response("C", 0.0)
    with pytest.raises(ValueError, match="must be positive"):
        rescale(torch.ones(3), torch.ones(3), -1.0)
    with pytest.raises(ValueError, match="unknown path"):
        probe.output("K", probe.cache["C"])
    with pytest.raises(ValueError, match="out of range: the model has 2 MLA layers"):
        check_layers([0, 2], 2)
    with pytest.raises(ValueError, match="listed twice"):
        check_layers([1, 1], 2)
    model, tok, layers, _, _ = tiny
    specs = [layer.spec for layer in layers]
    with pytest.raises(ValueError, match="layer index 5 is out of range"):
        Sensitivity(layers=[5], seq_len=32, sequences=1, seeds=[0]).run(model, tok, EvalContext(progress=False))
    with pytest.raises(ValueError, match="longer than the text|holds only"):
        Sensitivity(seq_len=10**7, sequences=1, seeds=[0]).run(model, tok, EvalContext(progress=False))
    assert [layer.spec for layer in layers] == specs


def test_model_without_mla_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantmla.models.tiny import byte_tokenizer

    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
    llama = LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MLA attention"):
        mla_layers(llama)
    with pytest.raises(ValueError, match="no MLA attention"):
        Sensitivity(seq_len=32, sequences=1, seeds=[0]).run(llama, byte_tokenizer(), EvalContext(progress=False))
    with pytest.raises(ValueError, match="no MLA attention"):
        attention.install(llama, CacheSpec())


@pytest.mark.slow
def test_cli_refuses_bad_target_before_loading(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "quantmla.run", "model=tiny", "eval=sensitivity", "eval.target_nmse=0", "logger=none"]
        + [f"runs_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert "error: sensitivity target_nmse must be positive, got 0" in out.stderr
    assert not any(tmp_path.rglob("metrics.json"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["DeepseekV3", "Glm4MoeLite", "LongcatFlash"])
def test_probe_output_on_other_mla_families(family):
    """q-LoRA, interleaved RoPE and LongCat's latent scalars: the probe's Y is the layer's output."""
    import transformers

    from quantmla.evals.sensitivity import _row

    kw = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=64,
        q_lora_rank=32,
        qk_rope_head_dim=64,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        max_position_embeddings=512,
    )
    if family == "LongcatFlash":
        kw |= dict(num_layers=2, ffn_hidden_size=128, expert_ffn_hidden_size=32, zero_expert_num=0, moe_topk=2)
    config = getattr(transformers, f"{family}Config")(**kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    layers = attention.install(model, CacheSpec())
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = {}
    hooks = [
        layer.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[0]))
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    for i, (layer, c) in enumerate(zip(layers, attention.capture_inputs(model, ids))):
        probe = LayerProbe(
            frozen_copy(layer, torch.float64), c.x[1:2], _row(c.position_embeddings, 1), _row(c.attention_mask, 1)
        )
        assert sq(probe.Y - seen[i][1:2]) / sq(probe.Y) < 1e-10
        for b in "CP":
            assert probe.response(b, 0.01)["R"] > 0
