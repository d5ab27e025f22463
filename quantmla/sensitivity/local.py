"""The local amplification model of the paper (eqs. 4–5, 15–18, App. B.3), for any differentiable map y = f(c).

For a path state ``c`` (one path's cache, any shape) and an error direction ``e``:

    J = ∂y/∂c,   H = JᵀJ,   G(e) = ‖J e‖² / ‖e‖²            (directional gain, a Rayleigh quotient)
    T = tr(H) / D                                          (operator sensitivity)
    A = Σ_i H_ii e_i² / (T ‖e‖²)                           (allocation of error energy)
    O = Σ_{i≠j} H_ij e_i e_j / ‖e‖²                        (directional coupling)
    G = T·A + O                                            (exact)

``G`` comes exactly from one JVP. ``T`` and ``A`` come from Hutchinson estimates with
output-space Rademacher probes r: g = Jᵀr is one vector–Jacobian product and
E‖g‖² = tr(H), E[g ⊙ g] = diag(H). ``O`` is then G − T·A, so it carries the probes'
sampling noise. No Jacobian is materialised except in :func:`exact_decomposition`, the
reference for small cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

Fn = Callable[[torch.Tensor], torch.Tensor]

EXACT_LIMIT = 2**24
"""Largest Jacobian (entries) :func:`exact_decomposition` agrees to build."""


def sq(t: torch.Tensor) -> float:
    return float(t.double().pow(2).sum())


def nmse(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """‖approx − ref‖² / ‖ref‖²."""
    den = sq(ref)
    if den == 0:
        raise ValueError("NMSE of a reference that is all zeros is undefined")
    return sq(approx.double() - ref.double()) / den


def rescale(e: torch.Tensor, c: torch.Tensor, target: float) -> torch.Tensor:
    """κ·e with κ = sqrt(target ‖c‖² / ‖e‖²): same direction, cache NMSE = ``target`` (App. B.1)."""
    if not target > 0:
        raise ValueError(f"target cache NMSE must be positive, got {target}")
    ee, cc = sq(e), sq(c)
    if ee == 0:
        raise ValueError("the error direction is zero: there is nothing to rescale")
    if cc == 0:
        raise ValueError("the cache is all zeros: a relative (NMSE) target is undefined")
    return e * math.sqrt(target * cc / ee)


def gain(f: Fn, c: torch.Tensor, e: torch.Tensor) -> float:
    """G(e) = ‖J e‖² / ‖e‖², exact, from one forward-mode JVP."""
    _, jv = torch.func.jvp(f, (c,), (e.to(c.dtype),))
    return sq(jv) / sq(e)


def rademacher(shape, generator: torch.Generator, dtype, device) -> torch.Tensor:
    r = torch.randint(0, 2, tuple(shape), generator=generator, dtype=torch.int8)
    return (2 * r - 1).to(device=device, dtype=dtype)


def probe_statistics(
    f: Fn, c: torch.Tensor, e: torch.Tensor, probes: int, batch: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-probe estimates (t_k, a_k), each (probes,), with E t_k = T and E a_k = T·A.

    t_k = ‖g_k‖² / D and a_k = Σ_i g_k,i² e_i² / ‖e‖², g_k = Jᵀ r_k. Probes are processed
    ``batch`` at a time through one vmapped VJP.
    """
    if probes < 1 or batch < 1:
        raise ValueError(f"probes and probe batch must be positive, got {probes} and {batch}")
    y, vjp = torch.func.vjp(f, c)
    w = (e.double() ** 2 / sq(e)).flatten()
    D = c.numel()
    ts, tas = [], []
    for s in range(0, probes, batch):
        k = min(batch, probes - s)
        r = rademacher((k, *y.shape), generator, y.dtype, y.device)
        g2 = torch.func.vmap(vjp)(r)[0].double().pow(2).flatten(1)  # (k, D)
        ts.append(g2.sum(1) / D)
        tas.append(g2 @ w)
    return torch.cat(ts).cpu(), torch.cat(tas).cpu()


@dataclass
class Decomposition:
    """G = T·A + O along one error direction; ``*_se`` are the probes' standard errors."""

    G: float
    T: float
    A: float
    O: float
    T_se: float
    TA_se: float
    probes: int

    @property
    def TA(self) -> float:
        return self.T * self.A

    def to_dict(self) -> dict:
        return asdict(self)


def decompose(
    f: Fn,
    c: torch.Tensor,
    e: torch.Tensor,
    probes: int = 256,
    batch: int = 16,
    generator: torch.Generator | None = None,
) -> Decomposition:
    """G exactly (JVP), T and A by Hutchinson (``probes`` output-space Rademacher probes), O = G − T·A."""
    if sq(e) == 0:
        raise ValueError("the error direction is zero: there is nothing to measure")
    generator = generator or torch.Generator().manual_seed(0)
    G = gain(f, c, e)
    t, ta = probe_statistics(f, c, e, probes, batch, generator)
    T, TA = float(t.mean()), float(ta.mean())
    se = (lambda v: float(v.std() / math.sqrt(len(v)))) if probes > 1 else (lambda v: float("nan"))
    if T == 0:  # H = 0 (PSD): the response vanishes, A is undefined
        return Decomposition(G=G, T=0.0, A=float("nan"), O=G, T_se=se(t), TA_se=se(ta), probes=probes)
    return Decomposition(G=G, T=T, A=TA / T, O=G - TA, T_se=se(t), TA_se=se(ta), probes=probes)


def exact_decomposition(f: Fn, c: torch.Tensor, e: torch.Tensor) -> Decomposition:
    """The same quantities from the materialised Jacobian (small cases only: tests, toy models)."""
    y = f(c)
    if y.numel() * c.numel() > EXACT_LIMIT:
        raise ValueError(
            f"an exact Jacobian of {y.numel()}×{c.numel()} entries is too large; use decompose() (Hutchinson)"
        )
    J = torch.func.jacfwd(f)(c).reshape(y.numel(), c.numel()).double()
    H = J.T @ J
    v = e.double().flatten()
    ee = float(v @ v)
    d = torch.diagonal(H)
    T = float(d.sum()) / c.numel()
    diag_part = float((d * v * v).sum())
    off = H - torch.diag(d)
    O = float(v @ off @ v) / ee
    G = float(v @ H @ v) / ee
    return Decomposition(G=G, T=T, A=diag_part / (T * ee), O=O, T_se=0.0, TA_se=0.0, probes=0)
