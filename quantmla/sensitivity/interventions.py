"""Controlled equal-energy error interventions (the paper's App. B.3, Table 6).

Each control changes how a path's quantization error ``e`` is laid out while keeping its
energy ‖e‖² (so the cache NMSE) fixed, and compares the local gain G(e') = ‖J e'‖²/‖e'‖²
(one JVP) with the gain of the original error:

- ``sign``: every entry multiplied by an independent ±1;
- ``permute``: the error's token rows permuted (each token carries another token's error);
- ``isotropic``: a Gaussian direction rescaled to ‖e‖.

The reported quantity is the geometric mean of G(e') / G(e) over the repetitions. For an
independent sign the expected gain is the diagonal part Σ H_ii e_i² / ‖e‖² = T·A, and for an
isotropic direction it is tr(H)/D = T, so the sign control removes the coupling O and the
isotropic one removes the allocation A as well.
"""

from __future__ import annotations

import math

import torch

from quantmla.sensitivity.local import Fn, gain, rademacher, sq

CONTROLS = ("sign", "permute", "isotropic")
TOKEN_AXIS = -2
"""Caches are (..., n, d): tokens on the second-to-last axis."""


def intervene(kind: str, e: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw of control ``kind`` applied to ``e`` (same shape, same energy)."""
    if kind == "sign":
        return e * rademacher(e.shape, generator, e.dtype, e.device)
    if kind == "permute":
        n = e.shape[TOKEN_AXIS]
        if n < 2:
            raise ValueError("a token permutation needs at least two tokens")
        perm = torch.randperm(n, generator=generator).to(e.device)
        return e.index_select(e.dim() + TOKEN_AXIS, perm)
    if kind == "isotropic":
        g = torch.randn(e.shape, generator=generator, dtype=torch.float64).to(device=e.device, dtype=e.dtype)
        return g * math.sqrt(sq(e) / sq(g))
    raise ValueError(f"unknown intervention '{kind}'; choose from {', '.join(CONTROLS)}")


def gain_ratios(f: Fn, c: torch.Tensor, e: torch.Tensor, reps: int, generator: torch.Generator) -> dict:
    """For each control, ``reps`` draws of G(e')/G(e); plus ``G`` (the original gain)."""
    if reps < 1:
        raise ValueError(f"interventions need at least one repetition, got {reps}")
    if sq(e) == 0:
        raise ValueError("the error direction is zero: there is nothing to intervene on")
    G = gain(f, c, e)
    if G == 0:
        raise ValueError("the original error has zero gain: ratios to it are undefined")
    out = {"G": G}
    for kind in CONTROLS:
        out[kind] = [gain(f, c, intervene(kind, e, generator)) / G for _ in range(reps)]
    return out


def geometric_mean(values) -> float:
    values = list(values)
    if not values or any(v <= 0 for v in values):
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))
