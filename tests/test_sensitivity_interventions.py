"""Equal-energy error interventions (the paper's App. B.3, Table 6): the controls, their expected gains
against exact Jacobians, invariances that pin each control down, and the summary."""

import math

import pytest
import torch

from quantmla.sensitivity import CONTROLS, exact_decomposition, gain, gain_ratios, intervene, intervention_summary
from quantmla.sensitivity.interventions import geometric_mean

F64 = torch.float64


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kind", CONTROLS)
def test_every_control_keeps_shape_and_energy(kind):
    e = randn(1, 1, 9, 6, seed=1)
    out = intervene(kind, e, gen(2))
    assert out.shape == e.shape and out.dtype == e.dtype
    assert float(out.pow(2).sum()) == pytest.approx(float(e.pow(2).sum()), rel=1e-12)
    assert not torch.equal(out, e)


def test_sign_keeps_magnitudes_and_permutation_moves_whole_rows():
    e = randn(1, 1, 7, 5, seed=3)
    s = intervene("sign", e, gen(4))
    assert torch.equal(s.abs(), e.abs())
    p = intervene("permute", e, gen(5))[0, 0]
    rows = e[0, 0]
    # every output row is one input row, each used once
    match = [[torch.equal(p[i], rows[j]) for j in range(7)] for i in range(7)]
    assert all(sum(m) == 1 for m in match) and all(sum(col) == 1 for col in zip(*match))


# Invariances: each control leaves the gain unchanged exactly when the map cannot see the change.
def test_permutation_is_invisible_to_a_per_token_map():
    W = randn(6, 4, seed=6)
    f = lambda c: c @ W  # noqa: E731  the same linear map on every token
    c, e = randn(1, 1, 8, 6, seed=7), randn(1, 1, 8, 6, seed=8)
    r = gain_ratios(f, c, e, reps=5, generator=gen(9))
    assert r["permute"] == pytest.approx([1.0] * 5, rel=1e-12)
    assert min(abs(v - 1) for v in r["sign"]) > 1e-6  # W mixes coordinates: signs matter


def test_signs_are_invisible_to_a_diagonal_map():
    w = randn(1, 1, 8, 6, seed=10)
    f = lambda c: c * w  # noqa: E731  H diagonal: no coupling O
    c, e = randn(1, 1, 8, 6, seed=11), randn(1, 1, 8, 6, seed=12)
    r = gain_ratios(f, c, e, reps=5, generator=gen(13))
    assert r["sign"] == pytest.approx([1.0] * 5, rel=1e-12)
    assert min(abs(v - 1) for v in r["isotropic"]) > 1e-6


def test_every_control_is_invisible_to_a_scaled_identity():
    f = lambda c: 3.0 * c  # noqa: E731
    c, e = randn(1, 1, 5, 4, seed=14), randn(1, 1, 5, 4, seed=15)
    r = gain_ratios(f, c, e, reps=3, generator=gen(16))
    assert r["G"] == pytest.approx(9.0)
    for k in CONTROLS:
        assert r[k] == pytest.approx([1.0] * 3, rel=1e-12)


# Expected gains against the materialised Jacobian of a real MLA layer (tiny model, float64):
# independent signs keep only the diagonal part, E G = T·A; an isotropic direction, E G = T.
@pytest.fixture(scope="module")
def small_probe():
    from mla_fixtures import small_layer_probe

    return small_layer_probe(10)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["C", "P"])
def test_expected_gains_match_the_exact_operator(small_probe, path):
    c = small_probe.cache[path]
    e = small_probe.matched_error(path, 1e-3)
    f = small_probe.fn(path)
    ex = exact_decomposition(f, c, e)
    reps = 300
    r = gain_ratios(f, c, e, reps, gen(17))
    assert r["G"] == pytest.approx(ex.G, rel=1e-9)
    for kind, want in (("sign", ex.T * ex.A), ("isotropic", ex.T)):
        g = torch.tensor(r[kind], dtype=F64) * r["G"]
        se = float(g.std()) / math.sqrt(reps)
        assert abs(float(g.mean()) - want) < 5 * se, (kind, float(g.mean()), want, se)
        assert abs(float(g.mean()) - want) < 0.1 * want


def test_probe_reports_the_original_gain_and_geometric_means(small_probe):
    iv = small_probe.interventions("C", 1e-3, reps=4, generator=gen(18))
    again = gain_ratios(small_probe.fn("C"), small_probe.cache["C"], small_probe.matched_error("C", 1e-3), 4, gen(18))
    assert iv["iv_G"] == pytest.approx(
        gain(small_probe.fn("C"), small_probe.cache["C"], small_probe.matched_error("C", 1e-3))
    )
    for k in CONTROLS:
        assert iv[f"iv_{k}"] == pytest.approx(math.exp(sum(math.log(v) for v in again[k]) / 4))


def test_summary_on_constructed_points():
    pts = []
    for i, (G_C, G_P) in enumerate([(1.0, 4.0), (2.0, 1.0), (8.0, 2.0)]):
        p = {"iv_G_C": G_C, "iv_G_P": G_P}
        for j, k in enumerate(CONTROLS):
            p[f"iv_{k}_C"] = 2.0 ** (i + j)
            p[f"iv_{k}_P"] = 0.5
        pts.append(p)
    pts.append({"iv_G_C": 1.0})  # a point without interventions is left out
    out = intervention_summary(pts)
    assert out["points"] == 3
    assert out["sign_C"] == pytest.approx(2.0)  # 2^((0+1+2)/3)
    assert out["permute_C"] == pytest.approx(4.0)
    assert out["isotropic_C"] == pytest.approx(8.0)
    assert all(out[f"{k}_P"] == pytest.approx(0.5) for k in CONTROLS)
    # permuted gains 1·2, 2·4, 8·8 -> median 8; original median 2
    assert out["permute_median_rise_C"] == pytest.approx(4.0)
    assert out["permute_median_rise_P"] == pytest.approx(0.5)
    assert intervention_summary([]) == {"points": 0}


def test_bad_input_is_refused():
    e = randn(1, 1, 4, 3, seed=19)
    with pytest.raises(ValueError, match="unknown intervention 'shuffle'"):
        intervene("shuffle", e, gen())
    with pytest.raises(ValueError, match="at least two tokens"):
        intervene("permute", e[..., :1, :], gen())
    with pytest.raises(ValueError, match="at least one repetition"):
        gain_ratios(lambda c: c, e, e, 0, gen())
    with pytest.raises(ValueError, match="zero"):
        gain_ratios(lambda c: c, e, torch.zeros_like(e), 2, gen())
    assert math.isnan(geometric_mean([])) and math.isnan(geometric_mean([1.0, 0.0]))
