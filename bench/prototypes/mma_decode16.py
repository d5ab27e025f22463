"""Decode over C4R4 pages for up to 16 heads, in Gluon for sm_90: codes reach the tensor cores from
registers, with no reconstructed tile in shared memory.

The Triton kernel (:mod:`.triton_decode`) reconstructs each 64-token tile, stores it to shared
memory and reads it back for both products: ~4 KB of shared-memory traffic per token, more than
the 2.8x bar at 16 heads leaves time for (bench/NOTES.md, "Where it stands"). Here every operand
of ``mma.sync.m16n8k16`` (16 heads = one M tile) is built in the registers of the thread that
feeds it, each thread unpacking its own code words twice: once in the score product's B layout
(channels along K) and once in P·V's (tokens along K). Both contractions may run in any order,
so the channel and token orders inside a fragment follow the code words, not memory:

- scores: a thread of quad lane ``c`` loads 8 code bytes (channels 16c..16c+15 of one group) of
  one token; register ``2·kb + e`` of those becomes k-block ``kb``'s half ``e``. The queries are
  loaded once in the same order (:func:`_q_channel`).
- P·V: a thread of group lane ``g`` loads the 4 code bytes with channels 8g..8g+7 of one group
  for the tokens it owns along K; nibble ``n`` becomes output column ``g`` of n-block ``n``, i.e.
  channel 8g + n (:func:`_store_out` writes them back in place).

Four warps per program. Warp ``w`` owns content groups 2w and 2w+1 (128 channels) and RoPE
channels 16w..16w+15: it computes the partial scores of those channels for all 64 tokens of a
tile and the output of its 128 channels. Per tile: partial scores to shared memory (16 KB);
each warp sums the 16 tokens it owns, takes their row maxima; maxima exchanged; each warp's
16 tokens of P (BF16) exchanged as mma A fragments; P·V. Three barriers per tile, ~0.7 KB of
shared-memory traffic per token.

The tensors here are per-thread register arrays: shape ``(regs..., 4 warps, 32 lanes)`` in
layouts whose last two axes are the warp and the lane, so a tensor element is one register of
one thread, and ``gl.inline_asm_elementwise`` issues one ``mma.sync`` per element index across
the warp. Protected rows (sink and recent ring) come from the BF16 protection buffer in the last
split, as three tiles, as in the Triton kernel (``triton_decode.split_work``).

A prototype beside the core (bench/NOTES.md, v17): correct against the float32 reference, and
slower than the Triton kernel it would replace (0.76-0.85x of BF16), so decode does not dispatch
here. It takes C4R4 in a BF16 cache (group 64, d_c 512, d_r 64, protection buffers on) for at most
16 heads on a Hopper GPU (:func:`applies`). ``python bench/prototypes/mma_check.py`` checks and
times it on the GPU; ``python bench/gluon_sass.py --mma16`` compiles it for sm_90 without one.
``ablate`` (1-3) leaves a stage out, for timing only.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from quantmla.kernels._tiles import region_args
from quantmla.kernels.gluon_decode import _prot_valid

LOG2E = 1.4426950408889634
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
WARPS = 8  # warps per program: warp w owns content group w

_MMA = gl.constexpr(
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
)
_MMA8 = gl.constexpr("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5}, {$6}, {$7,$8,$9,$10};")
_PACK = gl.constexpr("cvt.rn.bf16x2.f32 $0, $2, $1;")  # (lo, hi) float32 -> bf16x2
_SHFL = gl.constexpr("shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;")

# One code word of a token (8 channels, nibble k = channel k) -> four bf16x2 registers s·(q − z):
# (ch0, ch2), (ch1, ch3), (ch4, ch6), (ch5, ch7). $4 word, $5 scale pair, $6 −(128 + z) pair.
_SCORE_WORD = gl.constexpr(
    "{\n.reg .b32 t0, t1, u0, u1, one, nzero;\n"
    "mov.b32 one, 0x3f803f80;\nmov.b32 nzero, 0x80008000;\n"
    "prmt.b32 t0, $4, 0, 0x4140;\nprmt.b32 t1, $4, 0, 0x4342;\n"
    "shr.u32 u0, t0, 4;\nshr.u32 u1, t1, 4;\n"
    "lop3.b32 $0, t0, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $1, u0, 0x000f000f, 0x43004300, 0xea;\n"
    "lop3.b32 $2, t1, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $3, u1, 0x000f000f, 0x43004300, 0xea;\n"
    + "".join(f"fma.rn.bf16x2 ${i}, ${i}, one, $6;\n" for i in range(4))
    + "".join(f"fma.rn.bf16x2 ${i}, ${i}, $5, nzero;\n" for i in range(4))
    + "}"
)

# The same word of two tokens a, b -> eight bf16x2 registers (a, b) of channels 0..7.
# $8 word a, $9 word b, $10 scale pair (a, b), $11 −(128 + z) pair.
_PV_WORDS = gl.constexpr(
    "{\n.reg .b32 t0, t1, u<6>, one, nzero;\n"
    "mov.b32 one, 0x3f803f80;\nmov.b32 nzero, 0x80008000;\n"
    "prmt.b32 t0, $8, $9, 0x5410;\nprmt.b32 t1, $8, $9, 0x7632;\n"
    "shr.u32 u0, t0, 4;\nshr.u32 u1, t0, 8;\nshr.u32 u2, t0, 12;\n"
    "shr.u32 u3, t1, 4;\nshr.u32 u4, t1, 8;\nshr.u32 u5, t1, 12;\n"
    "lop3.b32 $0, t0, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $1, u0, 0x000f000f, 0x43004300, 0xea;\n"
    "lop3.b32 $2, u1, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $3, u2, 0x000f000f, 0x43004300, 0xea;\n"
    "lop3.b32 $4, t1, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $5, u3, 0x000f000f, 0x43004300, 0xea;\n"
    "lop3.b32 $6, u4, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $7, u5, 0x000f000f, 0x43004300, 0xea;\n"
    + "".join(f"fma.rn.bf16x2 ${i}, ${i}, one, $11;\n" for i in range(8))
    + "".join(f"fma.rn.bf16x2 ${i}, ${i}, $10, nzero;\n" for i in range(8))
    + "}"
)


@gluon.jit
def _mma(a, b0, b1, c):
    """c + a·b for each element index: one m16n8k16 BF16 product per index (a: 4 registers,
    b0/b1: 2, c: 4 float32), broadcast over the register axes."""
    return gl.inline_asm_elementwise(
        _MMA, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", [a[0], a[1], a[2], a[3], b0, b1, c[0], c[1], c[2], c[3]],
        dtype=(gl.float32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _mma8(a, b, c):
    """c + a·b with one m16n8k8 BF16 product per element index (a: 2 registers, b: 1)."""
    return gl.inline_asm_elementwise(
        _MMA8, "=f,=f,=f,=f,r,r,r,0,1,2,3", [a[0], a[1], b, c[0], c[1], c[2], c[3]],
        dtype=(gl.float32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _pack(lo, hi):
    return gl.inline_asm_elementwise(_PACK, "=r,f,f", [lo, hi], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _prmt(a, b, SEL: gl.constexpr):
    if SEL == 0x5410:
        return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b], dtype=gl.int32,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b], dtype=gl.int32,
                                         is_pure=True, pack=1)  # fmt: skip


@gluon.jit
def _prefetch(ccodes, w, lane):
    """This warp's 32 lines of content codes (groups 2w, 2w + 1 of the page at ``ccodes``) into L1."""
    line = (ccodes + w * 4096 + lane * 128).to(gl.pointer_type(gl.int8))
    gl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [line], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _prefetch_page(page_base, tid, nbytes):
    """Thread 0 of the program: ``nbytes`` (a multiple of 16) from ``page_base`` into L2."""
    gl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.eq.u32 p, $1, 0;\n@p cp.async.bulk.prefetch.L2.global [$2], $3;\nmov.u32 $0, 0;\n}",
        "=r,r,l,r", [tid, page_base.to(gl.pointer_type(gl.int8)), nbytes], dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _quad(x, MAX: gl.constexpr):
    """Max (or sum) over the four lanes of a quad (lanes 4g..4g+3)."""
    for d in gl.static_range(2):
        y = gl.inline_asm_elementwise(_SHFL, "=f,f,r", [x, 1 << d], dtype=gl.float32, is_pure=False, pack=1)
        if MAX:
            x = gl.maximum(x, y)
        else:
            x = x + y
    return x


@gluon.jit
def _pair(lo, hi):
    """Two 16-bit patterns (in int32) -> one register (lo | hi << 16)."""
    return (lo & 0xFFFF) | (hi << 16)


@gluon.jit
def _nz(z):
    """−(128 + z) as a BF16 bit pattern (z < 128): 0xC300 | z."""
    return z | 0xC300


@gluon.jit
def _idx3(N: gl.constexpr, L3: gl.constexpr):
    """Index tensors of a (regs, warp, lane) layout of 8 warps."""
    i = gl.arange(0, N, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    w = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    return i, w, lane


@gluon.jit
def _q_channel(G, c, r: gl.constexpr):
    """Channel (relative to the row) of the lower half of B register ``r`` (0..7) of a thread of
    quad lane ``c`` for content group ``G``: registers hold channels (0,2), (1,3), (4,6), (5,7) of
    each 8-channel word; the upper half is 2 channels further."""
    return 64 * G + 16 * c + 8 * (r // 4) + (r % 4) % 2 + 4 * ((r % 4) // 2)


@gluon.jit
def _q_regs(qb, stride_qh, H, g, c, G, kb: gl.constexpr):
    """A fragment (4 registers) of content k-block ``kb`` of group ``G`` from the BF16 query rows of
    one request at ``qb`` (heads g and g + 8; heads from H on read as zeros)."""
    out = ()
    for ai in gl.static_range(4):
        head = g + 8 * (ai % 2)
        ptr = (qb + head * stride_qh + _q_channel(G, c, 2 * kb + ai // 2)).to(gl.pointer_type(gl.int16))
        lo = gl.load(ptr, mask=head < H, other=0).to(gl.int32)
        hi = gl.load(ptr + 2, mask=head < H, other=0).to(gl.int32)
        out = out + (_pair(lo, hi),)
    return out


@gluon.jit
def _qr_regs(qb, stride_qh, H, g, c, w):
    """A fragment of the m16n8k8 RoPE product of warp ``w``: channels 8w + 2c, 8w + 2c + 1."""
    out = ()
    for ai in gl.static_range(2):
        head = g + 8 * ai
        out = out + (gl.load((qb + head * stride_qh + 8 * w + 2 * c).to(gl.pointer_type(gl.int32)), mask=head < H,
                             other=0),)  # fmt: skip
    return out


@gluon.jit
def _score_tile(ccodes, cscale, czero, rcodes, rscale, rzero, tok, ok, w, c, qa, qr, L3: gl.constexpr):
    """Partial scores of warp ``w``'s channels (content group w, RoPE channels 8w..8w+7) for tokens
    ``tok`` of a page (per (regs, warp, lane)); tokens not ``ok`` get zero scales."""
    acc = (gl.zeros(tok.shape, gl.float32, L3),) * 4
    s = gl.load((cscale + tok * 8 + w).to(gl.pointer_type(gl.int16)), mask=ok, other=0).to(gl.int32) & 0xFFFF
    z = gl.load(czero + tok * 8 + w).to(gl.int32)
    s2 = s | (s << 16)
    n2 = _pair(_nz(z), _nz(z))
    x = gl.load((ccodes + w * 2048 + tok * 32 + 8 * c).to(gl.pointer_type(gl.int64)))
    for half in gl.static_range(2):
        word = (x >> (32 * half)).to(gl.int32)
        r = gl.inline_asm_elementwise(_SCORE_WORD, "=r,=r,=r,=r,r,r,r", [word, s2, n2], dtype=(gl.int32,) * 4,
                                      is_pure=True, pack=1)  # fmt: skip
        acc = _mma(qa[2 * half], r[0], r[1], acc)
        acc = _mma(qa[2 * half + 1], r[2], r[3], acc)
    # RoPE channels 8w + 2c, +1 of the token, float32 scale as the reference multiplies
    h = gl.load(rcodes + tok * 32 + 4 * w + c).to(gl.int32)
    sr = gl.load(rscale + tok, mask=ok, other=0.0)
    zr = gl.load(rzero + tok, mask=ok, other=0).to(gl.float32)
    lo = ((((h & 15).to(gl.float32) - zr) * sr).to(gl.bfloat16).to(gl.int16, bitcast=True)).to(gl.int32)
    hi = (((((h >> 4) & 15).to(gl.float32) - zr) * sr).to(gl.bfloat16).to(gl.int16, bitcast=True)).to(gl.int32)
    return _mma8(qr, _pair(lo, hi), acc)


@gluon.jit
def _score_prot(prow, ok, w, c, qa, qr, L3: gl.constexpr):
    """Partial scores for protected BF16 rows at ``prow`` (rows not ``ok`` read as zeros)."""
    acc = (gl.zeros(prow.shape, gl.float32, L3),) * 4
    base = (prow + w * 64 + 16 * c).to(gl.pointer_type(gl.int64))
    for kb in gl.static_range(4):  # channels 4kb .. 4kb+3 of the thread's 16: registers (0,2), (1,3)
        v = gl.load(base + kb, mask=ok, other=0)
        lo = v.to(gl.int32)
        hi = (v >> 32).to(gl.int32)
        acc = _mma(qa[kb], _prmt(lo, hi, 0x5410), _prmt(lo, hi, 0x7632), acc)
    b = gl.load((prow + 512 + 8 * w + 2 * c).to(gl.pointer_type(gl.int32)), mask=ok, other=0)
    return _mma8(qr, b, acc)


@gluon.jit
def _pv_page(acc, pa, ccodes, cscale, czero, t0, low_hi, w, g, c, SINK: gl.constexpr):
    """P·V of a page tile for warp ``w``'s group: ``acc`` (8 n-blocks x 4 registers, (warp, lane))
    plus the products with P (``pa``: A fragments of the four 16-token k-blocks)."""
    for kb in gl.static_range(4):
        bs = ()
        for e in gl.static_range(2):
            ws = ()
            ss = ()
            ns = ()
            for d in gl.static_range(2):
                tk = 16 * kb + 8 * e + 2 * c + d
                ok = (t0 + tk >= SINK) & (t0 + tk < low_hi)
                ws = ws + (gl.load((ccodes + w * 2048 + tk * 32 + 4 * g).to(gl.pointer_type(gl.int32))),)
                ss = ss + (gl.load((cscale + tk * 8 + w).to(gl.pointer_type(gl.int16)), mask=ok, other=0).to(gl.int32),)
                ns = ns + (_nz(gl.load(czero + tk * 8 + w).to(gl.int32)),)
            bs = bs + (gl.inline_asm_elementwise(_PV_WORDS, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                                                 [ws[0], ws[1], _pair(ss[0], ss[1]), _pair(ns[0], ns[1])],
                                                 dtype=(gl.int32,) * 8, is_pure=True, pack=1),)  # fmt: skip
        out = ()
        for n in gl.static_range(8):
            out = out + (_mma(pa[kb], bs[0][n], bs[1][n], acc[n]),)
        acc = out
    return acc


@gluon.jit
def _pv_prot(acc, pa, prot, r0, L, w, g, c, SINK: gl.constexpr, RECENT: gl.constexpr):
    """P·V for the 64 protected BF16 rows from ``r0`` of the protection buffer at ``prot``."""
    for kb in gl.static_range(4):
        bs = ()
        for e in gl.static_range(2):
            v = ()
            for d in gl.static_range(2):
                r = r0 + 16 * kb + 8 * e + 2 * c + d
                ok = _prot_valid(r, L, SINK, RECENT)
                ptr = (prot + r * 576 + 64 * w + 8 * g).to(gl.pointer_type(gl.int64))
                x0 = gl.load(ptr, mask=ok, other=0)
                x1 = gl.load(ptr + 1, mask=ok, other=0)
                v = v + ((x0.to(gl.int32), (x0 >> 32).to(gl.int32), x1.to(gl.int32), (x1 >> 32).to(gl.int32)),)
            b = ()
            for n in gl.static_range(8):
                if n % 2 == 0:
                    b = b + (_prmt(v[0][n // 2], v[1][n // 2], 0x5410),)
                else:
                    b = b + (_prmt(v[0][n // 2], v[1][n // 2], 0x7632),)
            bs = bs + (b,)
        out = ()
        for n in gl.static_range(8):
            out = out + (_mma(pa[kb], bs[0][n], bs[1][n], acc[n]),)
        acc = out
    return acc


@gluon.jit
def _pick(x, i3, i: gl.constexpr):
    """Register ``i`` along axis 0 of an int32 (regs, warp, lane) tensor, as (warp, lane)."""
    return gl.sum(gl.where(i3 == i, x, 0), axis=0)


@gluon.jit
def _to_all(x, L3T: gl.constexpr):
    """A per-thread value (warp, lane) as (source warp, 8 destination copies, lane) in ``L3T``."""
    y = gl.convert_layout(x, gl.SliceLayout(1, L3T), assert_trivial=True)
    return y[:, None, :] + gl.zeros([8, 8, 32], x.dtype, L3T)


@gluon.jit
def _exchange(acc_s, ok, m0, m1, l0, l1, qk_scale, sbuf, mbuf, pbuf, L3: gl.constexpr, L3T: gl.constexpr):
    """Sum the eight warps' partial scores of n-block w (tokens 8w + 2c + d) in warp w, online
    softmax (maxima shared across warps), and share P: returns the A fragments of the four
    16-token k-blocks, the row rescales and the new row state. ``ok[d]``: token 8w + 2c + d is
    attended to. ``acc_s``: the four C registers of the partial scores, (n-block, warp, lane)."""
    LW: gl.constexpr = gl.SliceLayout(0, L3)
    # one buffer per stored tensor: the compiler puts a barrier between two stores into one buffer
    for creg in gl.static_range(4):
        sbuf[creg].store(acc_s[creg])
    _barrier()
    x = ()
    for creg in gl.static_range(4):
        v = gl.sum(sbuf[creg].load(L3T), axis=1)  # (this warp's n-block, lane)
        v = gl.convert_layout(v, LW, assert_trivial=True)
        x = x + (gl.where(ok[creg % 2], v * qk_scale, float("-inf")),)
    # x[creg]: rows g (creg 0, 1) and g + 8 (creg 2, 3), tokens 8w + 2c + creg % 2
    mbuf[0].store(_to_all(_quad(gl.maximum(x[0], x[1]), True), L3T))
    mbuf[1].store(_to_all(_quad(gl.maximum(x[2], x[3]), True), L3T))
    _barrier()
    mt0 = gl.max(mbuf[0].load(L3), axis=0)
    mt1 = gl.max(mbuf[1].load(L3), axis=0)
    n0 = gl.maximum(m0, mt0)
    n1 = gl.maximum(m1, mt1)
    u0 = gl.where(n0 == float("-inf"), 0.0, n0)
    u1 = gl.where(n1 == float("-inf"), 0.0, n1)
    alpha0 = gl.exp2(m0 - u0)
    alpha1 = gl.exp2(m1 - u1)
    p0 = gl.exp2(x[0] - u0)
    p1 = gl.exp2(x[1] - u0)
    p2 = gl.exp2(x[2] - u1)
    p3 = gl.exp2(x[3] - u1)
    l0 = l0 * alpha0 + _quad(p0 + p1, False)
    l1 = l1 * alpha1 + _quad(p2 + p3, False)
    # this warp's n-block is half (w % 2) of k-block w // 2: rows g and g + 8
    pbuf[0].store(_to_all(_pack(p0, p1), L3T))
    pbuf[1].store(_to_all(_pack(p2, p3), L3T))
    _barrier()
    i3 = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    f0 = pbuf[0].load(L3)  # (source warp, warp, lane)
    f1 = pbuf[1].load(L3)
    pa = ()
    for kb in gl.static_range(4):
        pa = pa + ((_pick(f0, i3, 2 * kb), _pick(f1, i3, 2 * kb), _pick(f0, i3, 2 * kb + 1),
                    _pick(f1, i3, 2 * kb + 1)),)  # fmt: skip
    return pa, alpha0, alpha1, n0, n1, l0, l1


@gluon.jit
def _own_ok(base, L, low_hi, w, c, PROT: gl.constexpr, SINK: gl.constexpr, RECENT: gl.constexpr):
    """Whether each of warp w's tokens 8w + 2c + d (d = 0, 1) is attended to: page tokens
    ``base + i`` with SINK <= token < low_hi, or protected rows ``base + i``."""
    ok = ()
    for d in gl.static_range(2):
        i = base + 8 * w + 2 * c + d
        if PROT:
            ok = ok + (_prot_valid(i, L, SINK, RECENT),)
        else:
            ok = ok + ((i >= SINK) & (i < low_hi),)
    return ok


@gluon.jit
def _rescale(acc, alpha0, alpha1):
    out = ()
    for n in gl.static_range(8):
        a = acc[n]
        out = out + ((a[0] * alpha0, a[1] * alpha0, a[2] * alpha1, a[3] * alpha1),)
    return out


@gluon.jit
def _h16_decode_kernel(Q, QPE, O, LSE, BT, LENS, PROT,
                       CCodes, CScale, CZero, ps_ccodes, ps_cscale, ps_czero,
                       RCodes, RScale, RZero, ps_rcodes, ps_rscale, ps_rzero,
                       H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb,
                       stride_ob, stride_oh, stride_os, stride_bt, tiles_per_split, qk_scale,
                       SINK: gl.constexpr, RECENT: gl.constexpr, SPLIT: gl.constexpr, ABL: gl.constexpr):  # fmt: skip
    BN: gl.constexpr = 64
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [1, 8, 1], [2, 1, 0])  # (regs, warp, lane)
    L3T: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [8, 1, 1], [2, 1, 0])  # (warp, regs, lane)
    LW: gl.constexpr = gl.SliceLayout(0, L3)
    S3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    sbuf = ()  # per c register: (n-block, source warp, lane)
    for _i in gl.static_range(4):
        sbuf = sbuf + (gl.allocate_shared_memory(gl.float32, [8, 8, 32], S3),)
    mbuf = ()  # per row half: (source warp, dest warp, lane)
    pbuf = ()
    for _i in gl.static_range(2):
        mbuf = mbuf + (gl.allocate_shared_memory(gl.float32, [8, 8, 32], S3),)
        pbuf = pbuf + (gl.allocate_shared_memory(gl.int32, [8, 8, 32], S3),)

    pid_s = gl.program_id(0)
    b = gl.program_id(1).to(gl.int64)
    L = gl.load(LENS + b).to(gl.int32)

    j3, w3, l3 = _idx3(8, L3)
    g3 = l3 // 4
    c3 = l3 % 4
    wl = gl.arange(0, 8, layout=gl.SliceLayout(1, LW))[:, None]
    ll = gl.arange(0, 32, layout=gl.SliceLayout(0, LW))[None, :]
    gl_ = ll // 4
    cl = ll % 4

    qb = Q + b * stride_qb
    qa = ()
    for kb in gl.static_range(4):
        qa = qa + (_q_regs(qb, stride_qh, H, g3, c3, w3, kb),)
    qr = _qr_regs(QPE + b * stride_rb, stride_rh, H, g3, c3, w3)

    m0 = gl.full([8, 32], float("-inf"), gl.float32, LW)
    m1 = m0
    l0 = gl.zeros([8, 32], gl.float32, LW)
    l1 = l0
    z = gl.zeros([8, 32], gl.float32, LW)
    acc = ((z, z, z, z),) * 8

    low_hi = L - RECENT
    n_tiles = gl.cdiv(gl.minimum(gl.maximum(low_hi, SINK), L), BN)
    t_lo = pid_s * tiles_per_split
    t_hi = gl.minimum(t_lo + tiles_per_split, n_tiles)
    tok = 8 * j3 + g3  # page token of n-block j in the score product
    bt_row = BT + b * stride_bt
    tid = wl * 32 + ll
    if t_lo < t_hi:
        _prefetch_page(CCodes + gl.load(bt_row + t_lo).to(gl.int64) * ps_ccodes, tid, ps_ccodes.to(gl.int32))
    for t in range(t_lo, t_hi):
        page = gl.load(bt_row + t).to(gl.int64)
        nxt = gl.load(bt_row + gl.minimum(t + 1, t_hi - 1)).to(gl.int64)
        nxt2 = gl.load(bt_row + gl.minimum(t + 2, t_hi - 1)).to(gl.int64)
        _prefetch_page(CCodes + nxt2 * ps_ccodes, tid, ps_ccodes.to(gl.int32))
        _prefetch(CCodes + nxt * ps_ccodes, wl, ll)
        ccodes = CCodes + page * ps_ccodes
        cscale = CScale + page * ps_cscale
        czero = CZero + page * ps_czero
        t0 = t * BN
        if ABL == 3:  # ablation: no score product
            acc_s = (gl.zeros([8, 8, 32], gl.float32, L3),) * 4
        else:
            acc_s = _score_tile(ccodes, cscale, czero, RCodes + page * ps_rcodes, RScale + page * ps_rscale,
                                RZero + page * ps_rzero, tok, (t0 + tok >= SINK) & (t0 + tok < low_hi), w3, c3, qa,
                                qr, L3)  # fmt: skip
        ok = _own_ok(t0, L, low_hi, wl, cl, False, SINK, RECENT)
        if ABL == 2:  # ablation: no exchange between warps (wrong results, timing only)
            v = gl.sum(acc_s[0] + acc_s[1], axis=0)
            a = _pack(v, v)
            pa = ((a, a, a, a),) * 4
            alpha0 = gl.exp2(v - m0)
            alpha1 = alpha0
            m0 = gl.maximum(m0, v)
        else:
            pa, alpha0, alpha1, m0, m1, l0, l1 = _exchange(acc_s, ok, m0, m1, l0, l1, qk_scale, sbuf, mbuf, pbuf,
                                                           L3, L3T)  # fmt: skip
        if ABL != 1:  # ablation 1: no P·V
            acc = _rescale(acc, alpha0, alpha1)
            acc = _pv_page(acc, pa, ccodes, cscale, czero, t0, low_hi, wl, gl_, cl, SINK)

    if pid_s == gl.num_programs(0) - 1:  # the protected rows: sink and recent ring
        prot = PROT + b * stride_pb
        for r0 in range(0, SINK + RECENT, BN):
            r = r0 + tok
            acc_s = _score_prot(prot + r * 576, _prot_valid(r, L, SINK, RECENT), w3, c3, qa, qr, L3)
            ok = _own_ok(r0, L, low_hi, wl, cl, True, SINK, RECENT)
            pa, alpha0, alpha1, m0, m1, l0, l1 = _exchange(acc_s, ok, m0, m1, l0, l1, qk_scale, sbuf, mbuf, pbuf,
                                                           L3, L3T)  # fmt: skip
            acc = _rescale(acc, alpha0, alpha1)
            acc = _pv_prot(acc, pa, prot, r0, L, wl, gl_, cl, SINK, RECENT)

    # each warp summed P over its own tokens: the row sums are the eight warps' together
    mbuf[0].store(_to_all(l0, L3T))
    mbuf[1].store(_to_all(l1, L3T))
    _barrier()
    l0 = gl.sum(mbuf[0].load(L3), axis=0)
    l1 = gl.sum(mbuf[1].load(L3), axis=0)
    for hh in gl.static_range(2):
        if hh == 0:
            li = l0
            mi = m0
        else:
            li = l1
            mi = m1
        has = li > 0
        inv = 1.0 / gl.where(has, li, 1.0)
        head = gl_ + 8 * hh + 0 * wl
        lse = gl.where(has, (mi + gl.log2(gl.where(has, li, 1.0))) * 0.6931471805599453, float("-inf"))
        first = (head < H) & (wl == 0) & (cl == 0)
        if SPLIT:
            gl.store(LSE + (b * H + head) * gl.num_programs(0) + pid_s, lse, mask=first)
        else:
            gl.store(LSE + b * H + head, lse, mask=first)
        o_base = O + b * stride_ob + head * stride_oh + pid_s * stride_os + 64 * wl
        for n in gl.static_range(8):
            for d in gl.static_range(2):
                gl.store(o_base + 8 * (2 * cl + d) + n, acc[n][2 * hh + d] * inv, mask=head < H)


def decode(
    layer, block_table, lengths, q, qpe, o, lse, tau: float, splits: int, per: int, maxnreg=None, ablate: int = 0
) -> None:
    """Launch over ``splits`` splits of ``per`` work tiles each (:func:`.triton_decode.split_work`,
    sink and ring as three tiles): ``q``, ``qpe`` BF16 contiguous; ``o`` (B, H, splits, d_c) and
    ``lse`` (B, H, splits) float32 partials when ``splits > 1``, else the outputs themselves."""
    B, H, _ = q.shape
    c = region_args(layer, "C")
    r = region_args(layer, "R")
    prot = layer.prot
    _h16_decode_kernel[(splits, B)](
        q, qpe, o, lse, block_table, lengths, prot,
        c[1], c[2], c[3], c[5], c[6], c[7],
        r[1], r[2], r[3], r[5], r[6], r[7],
        H, q.stride(0), q.stride(1), qpe.stride(0), qpe.stride(1), prot.stride(0),
        o.stride(0), o.stride(1), o.stride(2), block_table.stride(0), per, tau * LOG2E,
        SINK=layer.sink, RECENT=layer.recent, SPLIT=splits > 1, ABL=ablate, num_warps=WARPS,
        maxnreg=maxnreg,
    )  # fmt: skip


def applies(layer, H: int, device) -> bool:
    """Whether this kernel takes ``layer`` for ``H`` heads on ``device``: C4R4 in a BF16 cache,
    group 64, d_c 512, d_r 64, protection buffers on, at most 16 heads, a Hopper GPU."""
    fmt = layer.fmt
    shape = (fmt.content_bits, fmt.rope_bits, fmt.dtype, fmt.group, fmt.d_c, fmt.d_r)
    return (
        shape == (4, 4, torch.bfloat16, 64, 512, 64)
        and layer.prot is not None
        and H <= 16
        and device.type == "cuda"
        and _sm90(device.index if device.index is not None else torch.cuda.current_device())
    )


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


__all__ = ["applies", "decode"]
