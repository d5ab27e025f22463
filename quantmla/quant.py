"""The cache quantizer of the paper (its eqs. 35–36) and code packing.

Per token, each vector is cut into contiguous groups of ``group`` channels. Each group
gets an asymmetric affine code with its own scale ``s`` and zero-point ``z``::

    m = 2**bits - 1
    s = max(x_max - x_min, 1e-8) / m
    z = clip(round(-x_min / s), 0, m)
    q = clip(round(x / s + z), 0, m)
    x_hat = s * (q - z)

``round`` is round-half-to-even (``torch.round``). Arithmetic is float32 whatever the
input dtype. ``scale_dtype`` mirrors the paper's native storage (BF16 content and FP32 RoPE scales): the scale is
computed in float32, rounded to ``scale_dtype`` (bfloat16 for the content cache,
float32 for the RoPE cache) and ``z``, ``q`` and ``x_hat`` are computed with that stored
scale. With ``ste=True`` rounding passes gradients straight through (calibration).

Bit width 16 means "not quantized" everywhere in the project (the BF16 cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 3, 4, 8, 16)
"""Bit widths a cache path may use; 16 means the value is kept as is (BF16 cache)."""

CONTAINER_BITS = {2: 2, 3: 4, 4: 4, 8: 8}
"""How many bits a code occupies once packed: 3-bit codes travel in 4-bit nibbles."""


class CxRy:
    """What a cache format's two bit widths say by themselves (a base of ``CacheSpec`` and ``PageFormat``)."""

    content_bits: int
    rope_bits: int

    @property
    def name(self) -> str:
        """``c4r4``, ``c2r4``, ``c16r16`` (the plain cache-dtype cache)."""
        return f"c{self.content_bits}r{self.rope_bits}"

    @property
    def quantized(self) -> bool:
        return self.content_bits < 16 or self.rope_bits < 16


def check_bits(bits: int, what: str = "bits") -> int:
    if bits not in BITS:
        raise ValueError(f"{what}={bits} is not supported; choose one of {', '.join(map(str, BITS))}")
    return bits


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"group size {group} does not divide the last dimension {x.shape[-1]}")
    return x.float().unflatten(-1, (-1, group))


def _round(t: torch.Tensor, ste: bool) -> torch.Tensor:
    if ste:
        return t + (torch.round(t) - t).detach()
    return torch.round(t)


def _scale(xg: torch.Tensor, m: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    xmin = xg.amin(-1, keepdim=True)
    xmax = xg.amax(-1, keepdim=True)
    # m as a tensor on the data's device: CUDA torch turns division by a Python number into a
    # multiplication by its reciprocal (1 ulp off for m = 15), and the GPU writer divides exactly.
    # Filled there (torch.full), not copied from the host: a host-to-device copy waits for the queue
    s = (xmax - xmin).clamp_min(1e-8) / torch.full((), float(m), device=xg.device)
    if scale_dtype != torch.float32:
        s = s.to(scale_dtype).float()
    return s, xmin


@dataclass
class QTensor:
    """Integer codes (uint8, one per element, unpacked) with per-group scale and zero-point."""

    codes: torch.Tensor  # (..., D) uint8
    scale: torch.Tensor  # (..., D // group) scale_dtype
    zero: torch.Tensor  # (..., D // group) uint8
    bits: int
    group: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.codes.float().unflatten(-1, (-1, self.group))
        x = self.scale.float().unsqueeze(-1) * (q - self.zero.float().unsqueeze(-1))
        return x.flatten(-2).to(dtype)


def quantize(x: torch.Tensor, bits: int, group: int = 64, scale_dtype: torch.dtype = torch.float32) -> QTensor:
    """Codes, scales and zero-points of ``x`` (no gradient)."""
    check_bits(bits)
    if bits == 16:
        raise ValueError("bits=16 keeps values unquantized; there are no codes to make")
    m = 2**bits - 1
    xg = _groups(x, group)
    s, xmin = _scale(xg, m, scale_dtype)
    z = torch.clamp(torch.round(-xmin / s), 0, m)
    q = torch.clamp(torch.round(xg / s + z), 0, m)
    return QTensor(
        codes=q.flatten(-2).to(torch.uint8),
        scale=s.squeeze(-1).to(scale_dtype),
        zero=z.squeeze(-1).to(torch.uint8),
        bits=bits,
        group=group,
    )


def qdq(
    x: torch.Tensor,
    bits: int,
    group: int = 64,
    ste: bool = False,
    scale_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Quantize then dequantize ``x`` (same shape and dtype); ``bits=16`` returns ``x``."""
    check_bits(bits)
    if bits == 16:
        return x
    m = 2**bits - 1
    xg = _groups(x, group)
    s, xmin = _scale(xg, m, scale_dtype)
    z = torch.clamp(_round(-xmin / s, ste), 0, m)
    q = torch.clamp(_round(xg / s + z, ste), 0, m)
    return (s * (q - z)).flatten(-2).to(x.dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes along the last dimension into bytes.

    4-bit containers hold two codes per byte, element ``2k`` in the low nibble; 2-bit
    containers hold four, the lowest index in the lowest bits (the paper does not give the order).
    """
    width = CONTAINER_BITS[check_bits(bits)] if bits != 16 else None
    if width is None:
        raise ValueError("bits=16 has no packed form")
    per_byte = 8 // width
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dimension {codes.shape[-1]} is not a multiple of {per_byte}")
    c = codes.to(torch.uint8).unflatten(-1, (-1, per_byte)).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * width
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 codes, ``8 // container`` per byte."""
    width = CONTAINER_BITS[check_bits(bits)] if bits != 16 else None
    if width is None:
        raise ValueError("bits=16 has no packed form")
    per_byte = 8 // width
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * width
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << width) - 1)
    return c.flatten(-2).to(torch.uint8)
