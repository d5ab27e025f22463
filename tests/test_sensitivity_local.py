"""The local amplification model G = T·A + O (the paper's eqs. 4–5, App. B.3) against closed forms and
exact Jacobians."""

import math

import pytest
import torch

from quantmla.sensitivity import decompose, exact_decomposition, gain
from quantmla.sensitivity.local import probe_statistics

F64 = torch.float64


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


# ---------------------------------------------------------------------------------------------
# Toy 1: content path with fixed attention. Y = A C B is linear in C, J = A ⊗ Bᵀ (row-major vec),
# H = (AᵀA) ⊗ (B Bᵀ): tr(H) = ‖A‖²‖B‖², diag(H)_(i,j) = ‖A[:, i]‖² ‖B[j, :]‖².
# ---------------------------------------------------------------------------------------------
def linear_toy(n=6, d=5, m=7, seed=0):
    S = randn(n, n, seed=seed).masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf)
    A = torch.softmax(S, -1)  # one head, causal, fixed
    return A, randn(d, m, seed=seed + 100), randn(n, d, seed=seed + 200)


def closed_form(A, B, E):
    n, d = E.shape
    H = torch.kron(A.T @ A, B @ B.T)  # ((n d) × (n d)), row-major vec of E
    v = E.flatten()
    diag = (A**2).sum(0)[:, None] * (B**2).sum(1)[None, :]  # ‖A[:, i]‖² ‖B[j, :]‖²
    assert torch.allclose(torch.diagonal(H), diag.flatten())
    T = float((A**2).sum() * (B**2).sum()) / (n * d)
    TA = float((diag * E**2).sum() / (E**2).sum())
    G = float((A @ E @ B).pow(2).sum() / (E**2).sum())
    O = float((v @ H @ v - (torch.diagonal(H) * v * v).sum()) / (v @ v))
    return {"T": T, "A": TA / T, "O": O, "G": G}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_linear_toy_matches_closed_form(seed):
    A, B, C = linear_toy(seed=seed)
    E = randn(*C.shape, seed=10 + seed)
    want = closed_form(A, B, E)
    f = lambda c: A @ c @ B  # noqa: E731
    ex = exact_decomposition(f, C, E)
    for k in "TAOG":
        assert rel(getattr(ex, k), want[k]) < 1e-10, k
    assert rel(gain(f, C, E), want["G"]) < 1e-12
    est = decompose(f, C, E, probes=4000, batch=500, generator=torch.Generator().manual_seed(seed))
    assert rel(est.G, want["G"]) < 1e-12
    assert abs(est.T - want["T"]) < 5 * est.T_se and rel(est.T, want["T"]) < 0.05
    assert abs(est.TA - want["T"] * want["A"]) < 5 * est.TA_se
    assert abs(est.G - (est.T * est.A + est.O)) < 1e-12 * est.G


def test_uniform_attention_hand_values():
    """Uniform (non-causal) attention and B = s·Q with orthonormal rows: T = s²/n, and
    A = 1 for any error. Token-coherent error (every row equal) has G = s², so O = s²(n−1)/n;
    error with zero mean over tokens cancels, G = 0 and O = −s²/n."""
    n, d, m, s = 8, 4, 6, 1.7
    A = torch.full((n, n), 1.0 / n, dtype=F64)
    Q, _ = torch.linalg.qr(randn(m, d, seed=0))
    B = s * Q.T  # (d, m), B Bᵀ = s² I
    C = randn(n, d, seed=1)
    f = lambda c: A @ c @ B  # noqa: E731
    coherent = randn(d, seed=2).expand(n, d).clone()
    alternating = randn(n, d, seed=3)
    alternating -= alternating.mean(0, keepdim=True)
    for E, G, O in ((coherent, s**2, s**2 * (n - 1) / n), (alternating, 0.0, -(s**2) / n)):
        ex = exact_decomposition(f, C, E)
        assert rel(ex.T, s**2 / n) < 1e-12
        assert rel(ex.A, 1.0) < 1e-12
        assert abs(ex.G - G) < 1e-12 and abs(ex.O - O) < 1e-12
        assert abs(gain(f, C, E) - G) < 1e-12


# ---------------------------------------------------------------------------------------------
# Toy 2: RoPE path with fixed content. Y = softmax(τ Q_P K_Pᵀ + M) V; the JVP along E is
# dA = A ⊙ (dS − rowsum(A ⊙ dS)) with dS = τ Q_P Eᵀ, dY = dA V (softmax derivative by hand).
# ---------------------------------------------------------------------------------------------
def rope_toy(n=7, r=4, dv=5, tau=0.4, seed=0):
    Q, K, V = randn(n, r, seed=seed), randn(n, r, seed=seed + 1), randn(n, dv, seed=seed + 2)
    causal = torch.ones(n, n).triu(1).bool()

    def f(k):
        return torch.softmax((tau * Q @ k.T).masked_fill(causal, -math.inf), -1) @ V

    def jvp_by_hand(k, E):
        P = torch.softmax((tau * Q @ k.T).masked_fill(causal, -math.inf), -1)
        dS = (tau * Q @ E.T).masked_fill(causal, 0.0)
        dA = P * (dS - (P * dS).sum(-1, keepdim=True))
        return dA @ V

    return f, jvp_by_hand, K


@pytest.mark.parametrize("seed", [0, 1])
def test_rope_toy_against_hand_derivative(seed):
    f, jvp_by_hand, K = rope_toy(seed=seed)
    E = randn(*K.shape, seed=20 + seed)
    G_hand = float(jvp_by_hand(K, E).pow(2).sum() / E.pow(2).sum())
    assert rel(gain(f, K, E), G_hand) < 1e-10
    # exact H from the hand derivative applied to every basis direction (no autograd)
    D = K.numel()
    J = torch.stack([jvp_by_hand(K, torch.eye(D, dtype=F64)[i].view_as(K)).flatten() for i in range(D)], 1)
    H = J.T @ J
    v = E.flatten()
    T = float(torch.trace(H)) / D
    TA = float((torch.diagonal(H) * v * v).sum() / (v @ v))
    O = float((v @ H @ v - (torch.diagonal(H) * v * v).sum()) / (v @ v))
    ex = exact_decomposition(f, K, E)
    assert rel(ex.T, T) < 1e-10 and rel(ex.A, TA / T) < 1e-10 and abs(ex.O - O) < 1e-10 * G_hand
    assert abs(ex.G - (ex.T * ex.A + ex.O)) < 1e-6 * ex.G


# ---------------------------------------------------------------------------------------------
# Random cases on a real MLA layer (tiny model, float64, few tokens): the identity with exact H,
# the JVP gain, and the Hutchinson estimates against the exact statistics.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_probe():
    from mla_fixtures import small_layer_probe

    return small_layer_probe(12)


@pytest.mark.parametrize("path", ["C", "P"])
@pytest.mark.parametrize("kind", ["gaussian", "int4", "sparse"])
def test_real_layer_random_directions(small_probe, path, kind):
    from quantmla.sensitivity import quantization_error

    c = small_probe.cache[path]
    seed = {"C": 0, "P": 1}[path] + {"gaussian": 10, "int4": 20, "sparse": 30}[kind]
    if kind == "gaussian":
        e = randn(*c.shape, seed=seed)
    elif kind == "int4":
        e = quantization_error(path, c)
    else:  # a few coordinates only: A far from 1
        e = randn(*c.shape, seed=seed) * (randn(*c.shape, seed=seed + 1) > 1.6)
    f = small_probe.fn(path)
    ex = exact_decomposition(f, c, e)
    assert abs(ex.G - (ex.T * ex.A + ex.O)) < 1e-6 * ex.G
    assert rel(gain(f, c, e), ex.G) < 1e-9
    est = decompose(f, c, e, probes=1024, batch=128, generator=torch.Generator().manual_seed(1))
    assert rel(est.G, ex.G) < 1e-9
    assert abs(est.T - ex.T) < 5 * est.T_se and rel(est.T, ex.T) < 0.05
    assert abs(est.TA - ex.T * ex.A) < 5 * est.TA_se
    assert abs(est.G - (est.T * est.A + est.O)) < 1e-12 * est.G


def test_probe_statistics_unbiased_per_probe(small_probe):
    """Each probe's t_k = ‖Jᵀr‖²/D; its mean converges to tr(H)/D and the spread shrinks as 1/√K."""
    c = small_probe.cache["P"]
    e = randn(*c.shape, seed=5)
    f = small_probe.fn("P")
    ex = exact_decomposition(f, c, e)
    t, ta = probe_statistics(f, c, e, 256, 64, torch.Generator().manual_seed(3))
    assert t.shape == ta.shape == (256,)
    assert (t > 0).all() and (ta > 0).all()
    assert abs(float(t.mean()) - ex.T) < 5 * float(t.std()) / 16


def test_zero_direction_and_huge_jacobian_are_refused():
    f = lambda c: 2 * c  # noqa: E731
    with pytest.raises(ValueError, match="zero"):
        decompose(f, torch.ones(3, 4, dtype=F64), torch.zeros(3, 4, dtype=F64))
    with pytest.raises(ValueError, match="too large"):
        exact_decomposition(f, torch.ones(4096, 8, dtype=F64), torch.ones(4096, 8, dtype=F64))
