"""Triton building blocks shared by the writer, decode and teacher-forced kernels.

``load_meta`` + ``load_rows`` read the rows of one path (content or
RoPE) for a tile of token slots of one page and return them in the cache dtype: stored rows
for a 16-bit path, else codes unpacked and dequantized in registers, ``x̂ = s·(q − z)``
rounded to the cache dtype, exactly as :meth:`quantmla.quant.QTensor.dequantize` followed
by ``.to(dtype)``. Into a BF16 cache the common formats take ``dequant_bf16``: two elements
per instruction through bf16x2 arithmetic on the ``0x4300`` (128.0) pattern. Otherwise
``q − z`` is formed without an int→float conversion: ``q | 0x4B000000`` read as float32 is
``2^23 + q``, and subtracting ``2^23 + z`` is exact. The decode kernel reads a tile's
metadata one tile ahead, so ``load_meta`` is separate.

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

from quantmla.kernels.layout import PAGE

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634  # scores are taken in log2 units: tau·log2(e)·(q·k)

PAGE_TOKENS = tl.constexpr(PAGE)  # tokens per page; a codes region is group-major (layout.py)
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
def online_softmax(s, ok, m_i, l_i, qk_scale):
    """One tile of the online softmax in base 2: raw scores ``s`` (rows, keys), where ``ok`` is
    true for the pairs that count, the running row maxima ``m_i`` and sums ``l_i``. Returns the
    new maxima and sums, the tile's probabilities (unnormalized) and the factor ``alpha`` that
    rescales what was accumulated so far. Rows with no key yet keep maximum -inf and weight 0."""
    s = tl.where(ok, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def pv(p, v, acc, PV_SPLIT: tl.constexpr, IEEE: tl.constexpr, KV: tl.constexpr, INTERP: tl.constexpr):
    """acc + P·V in the cache dtype ``KV``: P as a hi/lo pair (P = P_hi + P_lo, float32 accuracy)
    or as one tile."""
    if PV_SPLIT:
        p_hi = p.to(KV)
        acc = dot(p_hi, v, acc, IEEE, INTERP)
        return dot((p - p_hi.to(tl.float32)).to(KV), v, acc, IEEE, INTERP)
    else:
        return dot(p.to(KV), v, acc, IEEE, INTERP)


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


# Two elements per instruction: a code c <= 15 ORed into the bf16 pattern 0x4300 (128.0) reads
# as 128 + c exactly; adding nz = -(128 + z) (exact, small integers) leaves q - z, and one
# bf16x2 multiply by the BF16 scale rounds the exact product once, to nearest even: bit for
# bit the reference's round_bf16(float32(s) * (q - z)). Each call takes four packed bytes.


def _unpack_ptx(planes: int, b: str, nz: tuple[str, str]) -> list[str]:
    """PTX lines: the four code bytes in register ``b`` → ``2·planes`` bf16x2 registers
    ``a0, a1, ...`` holding q − z (plane j of bytes 0,1 then of bytes 2,3: ``a2j``, ``a2j+1``)."""
    width = 8 // planes
    mask = (1 << width) - 1
    src = ["t0", "t1"] + [f"u{i}" for i in range(2 * (planes - 1))]
    lines = [f"prmt.b32 t0, {b}, 0, 0x4140;", f"prmt.b32 t1, {b}, 0, 0x4342;"]
    lines += [f"shr.u32 u{2 * (j - 1) + h}, t{h}, {width * j};" for j in range(1, planes) for h in (0, 1)]
    lines += [f"lop3.b32 a{i}, {src[i]}, 0x000{mask:x}000{mask:x}, 0x43004300, 0xea;" for i in range(2 * planes)]
    lines += [f"fma.rn.bf16x2 a{i}, a{i}, one, {nz[i % 2]};" for i in range(2 * planes)]
    return lines


def _deq_bf16_ptx(planes: int) -> str:
    """Outputs $0.. (two registers per plane), then the bytes, two scale and two nz registers."""
    b = 2 * planes
    lines = [
        f".reg .b32 t<2>, u<{2 * (planes - 1)}>, a<{2 * planes}>, one, nzero;",
        "mov.b32 one, 0x3f803f80;",
        "mov.b32 nzero, 0x80008000;",
        *_unpack_ptx(planes, f"${b}", (f"${b + 3}", f"${b + 4}")),
        *(f"fma.rn.bf16x2 ${i}, a{i}, ${b + 1 + i % 2}, nzero;" for i in range(2 * planes)),
    ]
    return "{\n" + "\n".join(lines) + "\n}"


def _deq4_f32_ptx() -> str:
    """The same with FLOAT32 scales (the RoPE path): q − z widened to float32 by a shift (lower
    half) or a mask (upper half), one float32 multiply as the reference does, one rounding to
    bf16 per pair. Outputs $0-$3, bytes $4, four scale registers $5-$8, nz $9-$10."""
    lines = [".reg .b32 t<2>, u<2>, a<4>, f<8>, one;", "mov.b32 one, 0x3f803f80;", *_unpack_ptx(2, "$4", ("$9", "$10"))]
    for i in range(4):
        lines += [f"shl.b32 f{2 * i}, a{i}, 16;", f"and.b32 f{2 * i + 1}, a{i}, 0xffff0000;"]
    lines += [f"mul.rn.f32 f{i}, f{i}, ${5 + i % 4};" for i in range(8)]
    lines += [f"cvt.rn.bf16x2.f32 ${i}, f{2 * i + 1}, f{2 * i};" for i in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


# These blocks write outputs before their last input is read: dequant_bf16 declares the
# outputs early-clobber ("=&r"), so no output is given an input's register.
_DEQ4_ASM = tl.constexpr(_deq_bf16_ptx(2))
_DEQ2_ASM = tl.constexpr(_deq_bf16_ptx(4))
_DEQ4F_ASM = tl.constexpr(_deq4_f32_ptx())


@triton.jit
def _dq_plane(b, s, z, shift: tl.constexpr, mask: tl.constexpr):
    """Portable form of one plane of the packed dequantization (the interpreter runs this)."""
    q = ((b >> shift) & mask).to(tl.float32)
    return bf16_rtne((q - z.to(tl.float32)) * s.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def dequant_bf16(b, s, z, W: tl.constexpr, INTERP: tl.constexpr):
    """Packed bytes ``b`` (uint8) with per-element scales ``s`` (BF16, or float32 for 4-bit codes)
    and uint8 zero-points ``z`` (broadcast to ``b``'s shape) → BF16 rows in natural channel order along a new last axis:
    ``(..., K)`` bytes give ``(..., K * 8 / W)`` elements."""
    if INTERP:
        if W == 4:
            return tl.interleave(_dq_plane(b, s, z, 0, 15), _dq_plane(b, s, z, 4, 15))
        else:
            even = tl.interleave(_dq_plane(b, s, z, 0, 3), _dq_plane(b, s, z, 4, 3))
            odd = tl.interleave(_dq_plane(b, s, z, 2, 3), _dq_plane(b, s, z, 6, 3))
            return tl.interleave(even, odd)
    else:
        nz = (-(z.to(tl.float32) + 128.0)).to(tl.bfloat16)
        if W == 4 and s.dtype == tl.float32:
            lo, hi = tl.inline_asm_elementwise(
                _DEQ4F_ASM,
                "=&r,=&r,=&r,=&r,r,r,r,r,r,r,r",
                [b, s, nz],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=4,
            )
            return tl.interleave(lo, hi)
        elif W == 4:
            lo, hi = tl.inline_asm_elementwise(
                _DEQ4_ASM,
                "=&r,=&r,=&r,=&r,r,r,r,r,r",
                [b, s, nz],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=4,
            )
            return tl.interleave(lo, hi)
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _DEQ2_ASM,
                "=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,r,r,r,r,r",
                [b, s, nz],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=4,
            )
            return tl.interleave(tl.interleave(p0, p2), tl.interleave(p1, p3))


@triton.jit
def load_meta(scale_ptr, zero_ptr, ps_scale, ps_zero, page, slots, valid, D: tl.constexpr, DP: tl.constexpr,
              BITS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Scales and zero-points (BLOCK_N, DP/G) of one quantized path for tokens at ``slots`` of ``page``.
    Scales are 0 for tokens that are not ``valid`` (their rows then reconstruct to exact zeros
    whatever their codes); a 16-bit path has no metadata (two dummy (BLOCK_N, 1) tiles)."""
    if BITS == 16:
        return tl.zeros([BLOCK_N, 1], tl.float32), tl.zeros([BLOCK_N, 1], tl.uint8)
    else:
        NG: tl.constexpr = D // G
        NGP: tl.constexpr = DP // G
        g = tl.arange(0, NGP)
        off = slots[:, None] * NG + g[None, :]
        s = tl.load((scale_ptr + page * ps_scale) + off, mask=valid[:, None] & (g[None, :] < NG), other=0.0)
        z = tl.load((zero_ptr + page * ps_zero) + off, mask=g[None, :] < NG, other=0)
        return s, z


@triton.jit
def load_rows(
    rows_ptr,
    codes_ptr,
    ps_rows,
    ps_codes,
    page,
    slots,
    valid,
    s,
    z,
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
    (a scalar, int64), given the tile's metadata from :func:`load_meta`; 0 where not ``valid``
    and in the padding columns D..DP (DP is D rounded up to a power of two, the width Triton
    tiles need). The page base is one 64-bit scalar; the per-element offsets inside a page
    stay 32-bit. Into a BF16 cache, 4-bit containers and 2-bit ones with BF16 scales take the
    packed two-per-instruction dequantization (:func:`dequant_bf16`)."""
    cols = tl.arange(0, DP)
    if BITS == 16:
        ptr = (rows_ptr + page * ps_rows) + (slots[:, None] * D + cols[None, :])
        return tl.load(ptr, mask=valid[:, None] & (cols[None, :] < D), other=0.0).to(OUT)
    else:
        PB: tl.constexpr = D * W // 8
        NG: tl.constexpr = D // G
        NGP: tl.constexpr = DP // G
        KG: tl.constexpr = G * W // 8  # bytes per group and token
        if OUT == tl.bfloat16 and (W == 4 or (W == 2 and s.dtype == tl.bfloat16)):
            g = tl.arange(0, NGP)
            kb = tl.arange(0, KG)
            if NGP == 1:
                off = slots[:, None, None] * KG + kb[None, None, :]
                b = tl.load((codes_ptr + page * ps_codes) + off, mask=g[None, :, None] < NG, other=0)
            else:
                # The compiler stages the tile in shared memory in the order of the loaded
                # shape and reads it back with one thread per token and group. Loaded as
                # (token, group, byte), a warp's 16 tokens sat a 256-byte row apart there, on
                # the same banks (16-way conflicts); loaded as (group, token·byte) they sit
                # KG bytes apart, as in the page (codes are group-major), and the view back
                # to (token, group, byte) moves no data.
                j = tl.arange(0, BLOCK_N * KG)
                tok = tl.reshape(tl.broadcast_to(slots[:, None], (BLOCK_N, KG)), (BLOCK_N * KG,))
                off = g[:, None] * (PAGE_TOKENS * KG) + (tok * KG + j % KG)[None, :]
                # two threads per group and token (16 B each for 4-bit codes, 8 B for 2-bit): the
                # reconstructed rows then leave each thread in runs of channels, and the tile is
                # stored channel-fastest in 16-byte pieces (with one thread per 2-bit group the
                # compiler chose a token-fastest tile, written 2 bytes at a time)
                CH: tl.constexpr = KG // 2 if KG < 32 else 16
                off = tl.max_contiguous(tl.multiple_of(off, (1, CH)), (1, CH))
                b = tl.load((codes_ptr + page * ps_codes) + off, mask=g[:, None] < NG, other=0)
                b = tl.permute(tl.reshape(b, (NGP, BLOCK_N, KG)), (1, 0, 2))
            x = dequant_bf16(b, s[:, :, None], z[:, :, None], W, INTERP)
            return tl.reshape(x, (BLOCK_N, DP))
        else:
            pb = tl.arange(0, DP * W // 8)
            off = (pb[None, :] // KG) * (PAGE_TOKENS * KG) + slots[:, None] * KG + pb[None, :] % KG
            b = tl.load((codes_ptr + page * ps_codes) + off, mask=valid[:, None] & (pb[None, :] < PB), other=0)
            q = unpack_codes(b, W)
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
        KG: tl.constexpr = G // PER  # bytes per group and token: codes are group-major in a page
        cb = tl.arange(0, DP // PER)
        tl.store(
            codes_ptr
            + page[:, None] * ps_codes
            + (cb[None, :] // KG) * (PAGE_TOKENS * KG)
            + slot[:, None] * KG
            + cb[None, :] % KG,
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


def layer_constexprs(layer) -> dict:
    """The compile-time arguments that describe ``layer``'s pages to a kernel (the writer's and
    the decode kernel's): latent widths, group, bits and containers of both paths, protection."""
    fmt = layer.fmt
    return dict(
        DC=fmt.d_c,
        DCP=padded(fmt.d_c),
        DR=fmt.d_r,
        G=fmt.group,
        C_BITS=fmt.content_bits,
        R_BITS=fmt.rope_bits,
        C_W=container_bits(fmt.content_bits),
        R_W=container_bits(fmt.rope_bits),
        SINK=layer.sink,
        RECENT=layer.recent,
        HAS_PROT=layer.prot is not None,
        PAGE_SIZE=PAGE,
    )
