"""One MLA layer on one sequence: the matched-error protocol (the paper's App. B.1) and its local analysis (App. B.3).

A :class:`LayerProbe` holds a frozen high-precision copy of the layer, its exact caches
(C and post-RoPE K_P, in the model's declared cache coordinates) computed from the
unperturbed layer input, and the exact post-``o_proj`` output Y. ``output(path, c)`` is Y
with one path's cache replaced by ``c`` and the other exact: the map y = f_b(c_b) of the
spec, differentiable.

Paths are named ``"C"`` (content latent) and ``"P"`` (RoPE key).
"""

from __future__ import annotations

import torch
from torch import nn

from quantmla import placement
from quantmla.attention import LatentAttention, latent_layers, layer_output
from quantmla.cache import CacheSpec
from quantmla.mla import supported_classes
from quantmla.sensitivity.interventions import CONTROLS, gain_ratios, geometric_mean
from quantmla.sensitivity.local import decompose, nmse, rescale, sq

PATHS = ("C", "P")


def mla_layers(model: nn.Module) -> list[LatentAttention]:
    """The model's MLA layers as installed by :func:`quantmla.attention.install`; a clear error otherwise."""
    layers = latent_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no MLA attention routed through the latent cache "
            f"(supported attention classes: {', '.join(supported_classes())}; "
            "call quantmla.attention.install(model, CacheSpec()) first)"
        )
    return layers


def check_layers(wanted, count: int) -> list[int]:
    """Validated layer indices (``None`` = all ``count`` layers)."""
    if wanted is None:
        return list(range(count))
    out = []
    for i in wanted:
        if isinstance(i, bool) or int(i) != i:
            raise ValueError(f"layer index {i!r} is not an integer")
        i = int(i)
        if not 0 <= i < count:
            raise ValueError(f"layer index {i} is out of range: the model has {count} MLA layers (0–{count - 1})")
        if i in out:
            raise ValueError(f"layer index {i} is listed twice")
        out.append(i)
    return out


def frozen_copy(layer: LatentAttention, dtype: torch.dtype) -> LatentAttention:
    """A copy of ``layer`` in ``dtype`` with no parameter gradients (the model is left untouched), on the
    device the layer computes on, with any weights accelerate offloads loaded."""
    twin = placement.detached_copy(layer).to(dtype)
    twin.spec = CacheSpec(group=layer.spec.group)
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin


def quantization_error(path: str, c: torch.Tensor, bits: int = 4, group: int = 64) -> torch.Tensor:
    """e_b = QDQ(c_b) − c_b with the cache's own quantizer (per token, groups of ``group``;
    content scales stored in BF16, RoPE scales in FP32, as the paper stores them)."""
    spec = CacheSpec(content_bits=bits, rope_bits=bits, group=group, protect=False)
    c_hat = spec.qdq_content(c) if path == "C" else spec.qdq_rope(c)
    return c_hat.to(c.dtype) - c


class LayerProbe:
    def __init__(self, layer: LatentAttention, x: torch.Tensor, position_embeddings, attention_mask=None):
        """``layer`` is a :func:`frozen_copy`; ``x`` (1, n, d_model) its unperturbed input."""
        self.layer = layer
        dt = next(layer.parameters()).dtype
        with torch.no_grad():
            q_nope, q_pe, C, K_P = layer.mla.paths(x.to(dt), position_embeddings)
            if layer.rope_transform is not None:  # an online post-RoPE map is part of the cached coordinates
                t = layer.rope_transform.to(device=K_P.device, dtype=dt)
                q_pe, K_P = q_pe.to(dt) @ t, K_P.to(dt) @ t
        self.q_nope, self.q_pe = q_nope.to(dt), q_pe.to(dt)
        self.cache = {"C": C.to(dt), "P": K_P.to(dt)}
        self.mask = attention_mask
        with torch.no_grad():
            self.Y = self.output("C", self.cache["C"])
        if sq(self.Y) == 0:
            raise ValueError("the layer's attention output is all zeros: output NMSE is undefined")

    def output(self, path: str, c: torch.Tensor) -> torch.Tensor:
        """Y with path ``path``'s cache replaced by ``c``, the other path exact."""
        if path not in PATHS:
            raise ValueError(f"unknown path '{path}' (C = content, P = RoPE)")
        C = c if path == "C" else self.cache["C"]
        K_P = c if path == "P" else self.cache["P"]
        return layer_output(self.layer, self.q_nope, self.q_pe, C, K_P, self.mask)

    def fn(self, path: str):
        return lambda c: self.output(path, c)

    def matched_error(self, path: str, target: float, bits: int = 4, group: int = 64) -> torch.Tensor:
        """The path's INT4 error direction rescaled to cache NMSE ``target``."""
        c = self.cache[path]
        e = quantization_error(path, c, bits, group)
        if sq(e) == 0:
            raise ValueError(f"the {bits}-bit quantization error of path {path} is zero: nothing to measure")
        return rescale(e, c, target)

    @torch.no_grad()
    def response(self, path: str, target: float, bits: int = 4, group: int = 64) -> dict:
        """The paper's App. B.1: NMSE_cache, NMSE_out and R = NMSE_out / NMSE_cache for one path."""
        c = self.cache[path]
        c_hat = c + self.matched_error(path, target, bits, group)
        nc = nmse(c_hat, c)
        no = nmse(self.output(path, c_hat), self.Y)
        return {"nmse_cache": nc, "nmse_out": no, "R": no / nc}

    def local(
        self,
        path: str,
        target: float,
        bits: int = 4,
        group: int = 64,
        probes: int = 256,
        batch: int = 16,
        generator: torch.Generator | None = None,
    ) -> dict:
        """The paper's eqs. 4–5 and App. B.3 at cache NMSE ``target``: T, A, O, G (JVP), the finite gain and the
        first-order prediction NMSE_out ≈ NMSE_cache · ‖c‖²/‖y‖² · G."""
        c = self.cache[path]
        e = self.matched_error(path, target, bits, group)
        d = decompose(self.fn(path), c, e, probes, batch, generator)
        with torch.no_grad():
            dy = self.output(path, c + e) - self.Y
        nc = sq(e) / sq(c)
        energy = sq(c) / sq(self.Y)
        return d.to_dict() | {
            "G_finite": sq(dy) / sq(e),
            "energy": energy,
            "nmse_cache": nc,
            "nmse_out": sq(dy) / sq(self.Y),
            "nmse_pred": nc * energy * d.G,
        }

    def interventions(
        self,
        path: str,
        target: float,
        reps: int,
        bits: int = 4,
        group: int = 64,
        generator: torch.Generator | None = None,
    ) -> dict:
        """The paper's Table 6 at cache NMSE ``target``: the original error's JVP gain ``iv_G`` and,
        per control, the geometric mean over ``reps`` draws of the gain ratio (``iv_<control>``)."""
        e = self.matched_error(path, target, bits, group)
        r = gain_ratios(self.fn(path), self.cache[path], e, reps, generator or torch.Generator().manual_seed(0))
        return {"iv_G": r["G"]} | {f"iv_{k}": geometric_mean(r[k]) for k in CONTROLS}
