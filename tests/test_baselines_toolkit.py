"""The fusion toolkit and calibration plumbing against independent references."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from mla_fixtures import FAMILIES, installed

from quantmla import mla
from quantmla.attention import capture_inputs
from quantmla.calibration import Percentile, alpha_log_scales, qk_nmse
from quantmla.transforms import (
    LayerTransform,
    block_hadamard,
    cayley,
    check_rope_pairing,
    fuse,
    hadamard,
    interleaved_order,
    pair_matrix,
)


def test_hadamard_is_sylvester_and_orthogonal():
    n = 64
    H = hadamard(n, torch.float64)
    popcount = torch.tensor([[bin(a & b).count("1") for b in range(n)] for a in range(n)])
    assert torch.equal(H * math.sqrt(n), (-1.0) ** popcount.double())  # H[i,j] = (-1)^<i,j> / sqrt(n)
    assert torch.allclose(H @ H.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    B = block_hadamard(128, 32)
    assert torch.allclose(B @ B.T, torch.eye(128), atol=1e-6) and B[0, 32:].abs().sum() == 0
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(48)
    with pytest.raises(ValueError, match="does not divide"):
        block_hadamard(96, 64)


def test_cayley_is_orthogonal_and_matches_its_definition():
    g = torch.Generator().manual_seed(0)
    P = torch.randn(32, 32, generator=g, dtype=torch.float64)
    R = cayley(P)
    A = P - P.T
    eye = torch.eye(32, dtype=torch.float64)
    assert torch.allclose(R, (eye - A) @ torch.linalg.inv(eye + A), atol=1e-10)
    assert torch.allclose(R.T @ R, eye, atol=1e-10)
    assert (R - eye).norm() > 1.0  # far from identity
    assert torch.allclose(cayley(torch.zeros(8, 8)), torch.eye(8))


def test_pair_matrix_is_tied_rotation_and_scale():
    pairs = [(2 * i, 2 * i + 1) for i in range(4)]
    theta = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64)
    s = torch.tensor([2.0, 0.5, 1.0, 3.0], dtype=torch.float64)
    M = pair_matrix(pairs, 8, theta, s)
    Mq = pair_matrix(pairs, 8, theta, s, inverse_scale=True)
    assert torch.allclose(M @ Mq.T, torch.eye(8, dtype=torch.float64))  # scores preserved: Q Mq (K M)^T = Q K^T
    c, sn = math.cos(0.3), math.sin(0.3)
    assert torch.allclose(M[:2, :2], 2.0 * torch.tensor([[c, sn], [-sn, c]], dtype=torch.float64))
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)  # row-vector rotation = complex multiply by e^{iθ}
    z = complex(1.0, 2.0) * complex(c, sn)
    assert torch.allclose(x @ M[:2, :2] / 2.0, torch.tensor([[z.real, z.imag]], dtype=torch.float64))
    P = interleaved_order([(i, i + 4) for i in range(4)], 8)
    v = torch.arange(8.0).unsqueeze(0)
    assert v @ P == pytest.approx(torch.tensor([[0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pair_transforms_commute_with_each_models_rope(family):
    model, _, layers = installed(family)
    ids = torch.arange(3, 3 + 200).unsqueeze(0)  # positions 0..199
    inp = capture_inputs(model, ids)[0]
    err = check_rope_pairing(layers[0].mla, inp.position_embeddings, tol=1e-5)
    assert err < 1e-5


def test_a_wrong_pairing_is_detected():
    model, _, layers = installed("v3")
    inp = capture_inputs(model, torch.arange(3, 40).unsqueeze(0))[0]
    a = layers[0].mla
    a.rope_style = "complex"  # V3 interleaves: the weight pairs are right but the post-RoPE pairs are not
    with pytest.raises(ValueError, match="cannot determine the RoPE pairing"):
        check_rope_pairing(a, inp.position_embeddings)
    a.rope_style = "yarn-4d"
    with pytest.raises(ValueError, match="cannot determine the RoPE pairing.*rope_style 'yarn-4d'"):
        check_rope_pairing(a, inp.position_embeddings)


def _random_transform(d, g, online=False):
    """Far from identity: a random Cayley rotation, scales e^N(0,1), any angles (built in float64)."""
    half, f64 = d.d_r // 2, torch.float64
    return LayerTransform(
        R_C=cayley(torch.randn(d.d_c, d.d_c, generator=g, dtype=f64) * 0.3),
        s_C=torch.exp(torch.randn(d.d_c, generator=g, dtype=f64)),
        theta_P=None if online else torch.rand(half, generator=g, dtype=f64) * 2 * math.pi,
        s_P=None if online else torch.exp(torch.randn(half, generator=g, dtype=f64)),
        H_P=cayley(torch.randn(d.d_r, d.d_r, generator=g, dtype=f64)) if online else None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("online", [False, True])
def test_fusing_random_transforms_keeps_the_logits(family, online):
    """Transforms far from identity (random Cayley rotation, e^N(0,1) scales, any angles) fold exactly."""
    model, _, layers = installed(family)
    ids = torch.randint(3, 259, (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    g = torch.Generator().manual_seed(1)
    ts = [_random_transform(a.dims, g, online) for a in mla.adapters(model)]
    for a, t in zip(mla.adapters(model), ts):
        fuse(a, t)
    with torch.no_grad():
        out = model(ids, use_cache=False).logits
    assert (out - ref).abs().max() <= 1e-4
    assert (layers[0].kv_a_layernorm.weight - ts[0].s_C.float() / layers[0].mla.kv_scale).abs().max() < 1e-6


def _attention_terms(layer, x, pe):
    """Per-head content scores, positional scores and values of one layer, in float64."""
    a = layer.mla
    q_nope, q_pe = a.queries(x)
    c_pre, k_pre = a.latent_pre(x)
    Q_P, K_P = a.rope(q_pe, k_pre, pe)
    if layer.rope_transform is not None:
        Q_P, K_P = Q_P @ layer.rope_transform, K_P @ layer.rope_transform
    C = a.content(c_pre).double()
    content = torch.einsum("bhnd,hdc,bmc->bhnm", q_nope.double(), a.W_UK().double(), C.squeeze(1))
    positional = Q_P.double() @ K_P.double().transpose(-1, -2)
    values = torch.einsum("bmc,hvc->bhmv", C.squeeze(1), a.W_UV().double())
    return content, positional, values


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("online", [False, True])
def test_fusion_algebra_is_exact_in_float64(family, online):
    """The fused layer's scores and values equal the original's in float64 (no fp32 round-off to hide
    a small algebra slip); DeepseekV2's own RoPE computes in float32, so its positional scores only
    reach that precision."""
    model, _, layers = installed(family)
    inp = capture_inputs(model, torch.arange(3, 60).unsqueeze(0))[0]
    pe = inp.position_embeddings
    pe = type(pe)(t.double() for t in pe) if isinstance(pe, tuple) else pe.to(torch.complex128)
    x = torch.randn(2, 57, model.config.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    original = copy.deepcopy(layers[0]).double()
    fused = copy.deepcopy(layers[0]).double()
    fuse(fused.mla, _random_transform(fused.mla.dims, torch.Generator().manual_seed(1), online))
    for ref, got in zip(_attention_terms(original, x, pe), _attention_terms(fused, x, pe)):
        assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_percentile_is_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, 7, generator=g).abs() * torch.arange(1, 8)
    acc = Percentile(5000, 0.999)
    for chunk in x.split(333):
        acc.update(chunk)
    assert torch.allclose(acc.result(), torch.quantile(x, 0.999, dim=0), rtol=1e-5, atol=0)
    a = torch.tensor([1.0, 4.0, 16.0])
    ls = alpha_log_scales(a, 0.5)
    assert torch.allclose(ls, 0.5 * (torch.log(a).mean() - torch.log(a)))  # geometric mean stays 1
    assert alpha_log_scales(torch.tensor([1e-12, 1e6]), 1.0).abs().max() == 2.0  # clipped


def test_positional_qk_loss_matches_explicit_score_matrices():
    g = torch.Generator().manual_seed(0)
    B, H, n, d = 2, 3, 37, 8
    Q = torch.randn(B, H, n, d, generator=g, dtype=torch.float64)
    K = torch.randn(B, 1, n, d, generator=g, dtype=torch.float64)
    Kh = K + 0.1 * torch.randn(B, 1, n, d, generator=g, dtype=torch.float64)
    # reference: explicit loops over heads and causal pairs
    num = torch.zeros(B, dtype=torch.float64)
    den = torch.zeros(B, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            Z = Q[b, h] @ K[b, 0].T
            Zh = Q[b, h] @ Kh[b, 0].T
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
            num[b] += ((Zh - Z)[mask] ** 2).sum()
            den[b] += (Z[mask] ** 2).sum()
    ref = num / den
    assert torch.allclose(qk_nmse(Q, K, Kh, chunk=5).double(), ref, rtol=1e-5)
    assert torch.allclose(qk_nmse(Q, K, Kh).double(), ref, rtol=1e-5)
