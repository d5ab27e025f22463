"""Triton building blocks shared by the writer, decode and teacher-forced kernels.

``load_tile`` reads the rows of one path (content or RoPE) for a tile of token slots of one
page and returns them in the cache dtype: stored rows for a 16-bit path, else codes
unpacked and dequantized in registers, ``x̂ = s·(q − z)`` in float32 rounded to the cache
dtype, exactly as :meth:`quantmla.quant.QTensor.dequantize` followed by ``.to(dtype)``.
``q − z`` is formed without an int→float conversion: ``q | 0x4B000000`` read as float32 is
``2^23 + q``, and subtracting ``2^23 + z`` is exact.

``quantize_row`` is eq. 35–36 for one token, bit for bit with :func:`quantmla.quant.quantize`:
IEEE divisions (``div_rn``) and round-half-to-even through the ``1.5·2^23`` trick (exact
for |v| < 2^22; larger values are clamped to 0 or m either way).

``dot`` hides two platform details: the Triton interpreter multiplies raw bf16 bit patterns
in ``tl.dot`` (so it computes in float32 there), and float32 caches use IEEE products
instead of TF32 on the GPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

MAGIC_INT = 0x4B000000  # float32 bit pattern of 2^23
TWO23 = 8388608.0
ROUND_MAGIC = 12582912.0  # 1.5 * 2^23


def padded(d: int) -> int:
    """Tile width for a latent of width ``d``: the next power of two (Triton block shapes)."""
    return triton.next_power_of_2(d)


def container_bits(bits: int) -> int:
    return {2: 2, 3: 4, 4: 4, 8: 8, 16: 16}[bits]


def tl_dtype(dtype) -> tl.dtype:
    import torch

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def bf16_rtne(x):
    """float32 → the nearest bfloat16 value (ties to even), still float32 (finite inputs)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def to_cache(x, OUT: tl.constexpr, INTERP: tl.constexpr):
    """Round float32 ``x`` to the cache dtype, to nearest even (the interpreter truncates to bf16)."""
    if INTERP and OUT == tl.bfloat16:
        return bf16_rtne(x).to(OUT)
    else:
        return x.to(OUT)


@triton.jit
def anchor(x, INTERP: tl.constexpr):
    """Identity on a tile that the compiler must compute once: the reconstructed tile
    feeds two matrix products (as K and as V), and without this barrier the layout pass
    recomputes the whole dequantization once per consumer."""
    if INTERP:
        return x
    elif x.dtype.primitive_bitwidth == 32:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def unpack_codes(b, W: tl.constexpr):
    """(N, D*W/8) packed uint8 → (N, D) codes in natural channel order."""
    if W == 8:
        return b
    elif W == 4:
        return tl.interleave(b & 15, b >> 4)
    else:
        even = tl.interleave(b & 3, (b >> 4) & 3)
        odd = tl.interleave((b >> 2) & 3, b >> 6)
        return tl.interleave(even, odd)


@triton.jit
def load_tile(
    rows_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    ps_rows,
    ps_codes,
    ps_scale,
    ps_zero,
    page,
    slots,
    valid,
    D: tl.constexpr,
    DP: tl.constexpr,
    BITS: tl.constexpr,
    W: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT: tl.constexpr,
    INTERP: tl.constexpr,
):
    """(BLOCK_N, DP) rows of one path for tokens at ``slots`` (BLOCK_N,) int32 of physical ``page``
    (a scalar, int64); 0 where not ``valid`` and in the padding columns D..DP (DP is D rounded up
    to a power of two, the width Triton tiles need). The page base is one 64-bit scalar; the
    per-element offsets inside a page stay 32-bit."""
    cols = tl.arange(0, DP)
    if BITS == 16:
        ptr = (rows_ptr + page * ps_rows) + (slots[:, None] * D + cols[None, :])
        return tl.load(ptr, mask=valid[:, None] & (cols[None, :] < D), other=0.0).to(OUT)
    else:
        PB: tl.constexpr = D * W // 8
        NG: tl.constexpr = D // G
        NGP: tl.constexpr = DP // G
        pb = tl.arange(0, DP * W // 8)
        b = tl.load(
            (codes_ptr + page * ps_codes) + (slots[:, None] * PB + pb[None, :]),
            mask=valid[:, None] & (pb[None, :] < PB),
            other=0,
        )
        q = unpack_codes(b, W)
        g = tl.arange(0, NGP)
        gm = valid[:, None] & (g[None, :] < NG)
        s = tl.load((scale_ptr + page * ps_scale) + (slots[:, None] * NG + g[None, :]), mask=gm, other=0.0)
        z = tl.load((zero_ptr + page * ps_zero) + (slots[:, None] * NG + g[None, :]), mask=gm, other=0)
        zf = z.to(tl.float32) + 8388608.0
        q3 = tl.reshape(q, (BLOCK_N, NGP, G))
        f = (q3.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        x = (f - zf[:, :, None]) * s.to(tl.float32)[:, :, None]
        return to_cache(tl.reshape(x, (BLOCK_N, DP)), OUT, INTERP)


@triton.jit
def _round_half_even(v):
    return (v + 12582912.0) - 12582912.0


@triton.jit
def quantize_store(
    x,
    rows_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    ps_rows,
    ps_codes,
    ps_scale,
    ps_zero,
    page,
    slot,
    ok,
    D: tl.constexpr,
    DP: tl.constexpr,
    BITS: tl.constexpr,
    W: tl.constexpr,
    G: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OUT: tl.constexpr,
):
    """Quantize token rows ``x`` (BLOCK_T, DP; columns D..DP are padding) and store codes, scales
    and zero-points (the rows themselves at 16 bits) at ``page``/``slot`` (BLOCK_T,) where ``ok``."""
    if BITS == 16:
        cols = tl.arange(0, DP)
        tl.store(
            rows_ptr + page[:, None] * ps_rows + slot[:, None] * D + cols[None, :],
            x,
            mask=ok[:, None] & (cols[None, :] < D),
        )
    else:
        M: tl.constexpr = (1 << BITS) - 1
        NG: tl.constexpr = D // G
        NGP: tl.constexpr = DP // G
        PER: tl.constexpr = 8 // W
        xg = tl.reshape(x.to(tl.float32), (BLOCK_T, NGP, G))
        xmin = tl.min(xg, axis=2)
        xmax = tl.max(xg, axis=2)
        s = tl.div_rn(tl.maximum(xmax - xmin, 1e-8), M * 1.0)
        if SCALE_BF16:
            s = bf16_rtne(s)
        z = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(-xmin, s)), 0.0), M * 1.0)
        q = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(xg, s[:, :, None]) + z[:, :, None]), 0.0), M * 1.0)
        codes = tl.reshape(q.to(tl.int32), (BLOCK_T, DP // PER, PER))
        shifts = tl.arange(0, PER) * W
        packed = tl.sum(codes << shifts[None, None, :], axis=2).to(tl.uint8)
        cb = tl.arange(0, DP // PER)
        tl.store(
            codes_ptr + page[:, None] * ps_codes + slot[:, None] * (D // PER) + cb[None, :],
            packed,
            mask=ok[:, None] & (cb[None, :] < D // PER),
        )
        g = tl.arange(0, NGP)
        gm = ok[:, None] & (g[None, :] < NG)
        meta = page[:, None] * ps_scale + slot[:, None] * NG + g[None, :]
        if SCALE_BF16:
            tl.store(scale_ptr + meta, s.to(tl.bfloat16), mask=gm)
        else:
            tl.store(scale_ptr + meta, s, mask=gm)
        tl.store(zero_ptr + page[:, None] * ps_zero + slot[:, None] * NG + g[None, :], z.to(tl.uint8), mask=gm)


def region_args(layer, path: str) -> tuple:
    """(rows, codes, scale, zero) views and their page strides for path "C" or "R" of ``layer``."""
    v = layer.views
    names = (f"{path}_rows", f"{path}_codes", f"{path}_scale", f"{path}_zero")
    present = [v[n] for n in names if n in v]
    dummy = present[0]
    tensors = tuple(v.get(n, dummy) for n in names)
    strides = tuple(t.stride(0) for t in tensors)
    return tensors + strides
