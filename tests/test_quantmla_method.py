"""QuantMLA: exact fusion after calibration, learned-transform properties, and the paper's
claims measured on the planted-outlier fixture of the baselines."""

from __future__ import annotations

import math

import pytest
import torch
from mla_fixtures import installed, method_context, planted_outliers, set_spec, small_calibration

from baselines.quarot import QuaRotConfig
from baselines.rtn import RTNConfig
from baselines.smoothquant import SmoothQuantConfig
from quantmla import methods, mla
from quantmla.attention import capture_inputs
from quantmla.cache import CacheSpec
from quantmla.calibration import transform_objectives
from quantmla.methods.quantmla import QuantMLAConfig
from quantmla.transforms import from_state, pair_matrix

FAR = dict(lr_rotation=0.3, lr_content_scale=0.3, lr_angle=0.5, lr_rope_scale=0.3, select="last")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny", "v3", "glm", "longcat"])
def test_fused_logits_equal_the_original_after_calibration(family, tmp_path):
    """The quantization-disabled check (the paper's App. C.4) after a real calibration whose transforms
    end far from identity (large learning
    rates, last step kept): quantization off, fused logits equal the original's (fp32, 1e-4)."""
    model, tok, layers = installed(family)
    ids = torch.randint(3, 259, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    m = methods.get(QuantMLAConfig(steps=6, val_every=3, **FAR))
    state = m.apply(model, mla.adapters(model), method_context(tok, tmp_path))
    t = from_state(state, len(layers))[0]
    assert (t.R_C - torch.eye(t.R_C.shape[0])).norm() > 1.0  # far from identity
    assert t.theta_P.abs().max() > 0.3 and t.s_P.log().std() > 0.1
    set_spec(layers, CacheSpec())
    with torch.no_grad():
        out = model(ids, use_cache=False).logits
    assert (out - ref).abs().max() <= 1e-4
    assert m.info["fusion_nll_drift"] < 1e-4
    assert all(layer.rope_transform is None for layer in layers)  # nothing online


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every method's transforms on the planted-outlier model at C4R4 and C2R4, and their held-out
    L_C and L_P; QuantMLA with 100 steps per path (the RoPE path is learned once and reused)."""
    base, tok, _ = planted_outliers()
    cal = small_calibration(seq_len=128, train=8, heldout=4)
    _, held = cal.banks(tok)
    cache = tmp_path_factory.mktemp("transforms")
    configs = {
        "rtn": RTNConfig(),
        "smoothquant": SmoothQuantConfig(),
        "quarot": QuaRotConfig(),
        "quantmla": QuantMLAConfig(steps=100, val_every=10),
        "cache_mse": QuantMLAConfig(steps=100, val_every=10, content_objective="cache_mse", paths={"rope": False}),
    }
    out = {}
    for bits in ("c4r4", "c2r4"):
        spec = CacheSpec.parse(bits)
        for name, cfg in configs.items():
            m = methods.get(cfg)
            # calibrate leaves the model as it is: every method starts from the same original
            state = m.calibrate(base, mla.adapters(base), method_context(tok, cache, bits, cal))
            transforms = from_state(state, 2)
            out[bits, name] = transform_objectives(base, held, 4, transforms, spec) | {"info": m.info, "t": transforms}
    return base, out


@pytest.mark.slow
def test_learned_transforms_are_orthogonal_and_commute_with_rope(trained):
    base, out = trained
    for bits in ("c4r4", "c2r4"):
        for t in out[bits, "quantmla"]["t"]:
            R = t.R_C.double()
            assert (R.T @ R - torch.eye(R.shape[0], dtype=torch.float64)).abs().max() < 1e-5
            assert (R - torch.eye(R.shape[0], dtype=torch.float64)).norm() > 1e-3  # it did learn
    a = base.model.layers[0].self_attn.mla
    pe = capture_inputs(base, torch.arange(3, 3 + 2048).remainder(256).add(3).unsqueeze(0))[0].position_embeddings
    t = out["c4r4", "quantmla"]["t"][0]
    d_r = a.dims.d_r
    x = torch.randn(2, 1, 2048, d_r, generator=torch.Generator().manual_seed(0))
    M_pre = pair_matrix(a.rope_pairs(), d_r, t.theta_P, t.s_P)
    M_post = pair_matrix(a.post_rope_pairs(), d_r, t.theta_P, t.s_P)
    lhs = a.rope(x @ M_pre, x, pe)[0]
    rhs = a.rope(x, x, pe)[0] @ M_post
    assert (lhs - rhs).abs().max() / rhs.abs().max() < 1e-5  # at every one of 2048 positions
    assert t.theta_P.abs().max() > 0


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["c4r4", "c2r4"])
def test_quantmla_beats_every_baseline_on_its_heldout_objectives(trained, bits):
    """Held-out L_C (content at C4 or C2) and L_P (RoPE at 4 bits), each path with the other exact,
    for the transforms each method produced. Observed on this fixture (seed 0, 100 steps), C4R4 /
    C2R4: L_C 0.0033 / 0.074 for QuantMLA against 0.0085 / 0.20 (SmoothQuant†), 0.017 / 0.46
    (QuaRot†), 0.050 / 0.49 (RTN); L_P 0.0049 against 0.0051 (SmoothQuant†), 0.0068 (QuaRot†),
    0.026 (RTN). The RoPE path starts from the α-grid, which contains SmoothQuant†'s scales; its
    300-step paper budget is cut to 100 here, so its margin over SmoothQuant† is small (~3%)."""
    _, out = trained
    q = out[bits, "quantmla"]
    for name in ("rtn", "smoothquant", "quarot"):
        assert q["L_C"] < out[bits, name]["L_C"], name
        assert q["L_P"] < out[bits, name]["L_P"], name
    assert q["L_C"] < 0.6 * out[bits, "smoothquant"]["L_C"]  # learning the rotation, not only the α-init
    if bits == "c2r4":
        assert q["info"]["cached_P"] == 1  # the 4-bit RoPE path of the C4R4 run was reused
    assert q["info"]["heldout_C"] < q["info"]["heldout_init_C"]


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["c4r4", "c2r4"])
def test_output_objective_beats_cache_mse_training(trained, bits):
    """The function-alignment claim, measured: the same parameters, budget and selection, trained on
    plain cache reconstruction, reach a higher held-out L_C. The fixture's loud latent channels
    feed quieter consumers, so cache error and output error weigh channels differently; cache-MSE
    spends its budget on the loud channels. Observed L_C ratio (output-trained / cache-MSE-trained)
    0.79-0.87 at C4R4 and 0.86-0.97 at C2R4 over seeds 0-2; asserted ≤ 0.95 on seed 0 (0.79, 0.86).
    With an isotropic consumer (``consumer_gain=1``) the two objectives nearly coincide."""
    _, out = trained
    assert out[bits, "quantmla"]["L_C"] <= 0.95 * out[bits, "cache_mse"]["L_C"]
    assert math.isclose(out[bits, "cache_mse"]["L_P"], out[bits, "rtn"]["L_P"])  # RoPE path off there


@pytest.mark.slow
def test_training_without_a_bar_logs_each_validation(tmp_path, caplog):
    """Without a progress bar (a log file, a SLURM job) each path logs a line per validation."""
    model, tok, _ = installed("tiny")
    m = methods.get(QuantMLAConfig(steps=4, val_every=2))
    with caplog.at_level("INFO", logger="quantmla.optim"):
        m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.name == "quantmla.optim"]
    for path in ("content", "RoPE"):
        steps = [ln for ln in lines if ln.startswith(f"QuantMLA {path} path step")]
        assert [s.split()[4].rstrip(":") for s in steps] == ["2/4", "4/4"], lines
