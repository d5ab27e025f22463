"""Decode over C4R4 pages for up to 16 heads, in Gluon for sm_90: codes reach the tensor cores from
registers, with no reconstructed tile in shared memory.

The Triton kernel (:mod:`.triton_decode`) reconstructs each 64-token tile, stores it to shared
memory and reads it back for both products: ~4 KB of shared-memory traffic per token, more than
the 2.8x bar at 16 heads leaves time for (docs/kernel-design-notes.md). Here every operand
of ``mma.sync.m16n8k16`` (16 heads = one M tile) is built in the registers of the thread that
feeds it, each thread unpacking its own code words twice: once in the score product's B layout
(channels along K) and once in P·V's (tokens along K). Both contractions may run in any order,
so the channel and token orders inside a fragment follow the code words, not memory:

- scores: a thread of quad lane ``c`` loads 8 code bytes (channels 16c..16c+15 of one group) of
  one token; register ``2·kb + e`` of those becomes k-block ``kb``'s half ``e``. The queries are
  loaded once in the same order (:func:`_q_channel`).
- P·V: a thread of group lane ``g`` loads the 4 code bytes with channels 8g..8g+7 of one group
  for the tokens it owns along K; nibble ``n`` becomes output column ``g`` of n-block ``n``, i.e.
  channel 8g + n (the kernel's last lines write them back in place). These codes enter as the
  exact q − z; each token's scale multiplies its column of P instead (``_pv_page``).

Four warps per program. Warp ``w`` owns content groups 2w and 2w+1 (128 channels) and RoPE
channels 16w..16w+15: it computes the partial scores of those channels for all 64 tokens of a
tile and the output of its 128 channels. Per tile: partial scores to shared memory (16 KB);
each warp sums the 16 tokens it owns, takes their row maxima; maxima exchanged; each warp's
16 tokens of P (BF16) exchanged as mma A fragments; P·V. Three barriers per tile, ~0.7 KB of
shared-memory traffic per token.

Addresses are a per-thread pointer, formed once per tile, plus per-register constants, which the
compiler folds into the loads.

The tensors here are per-thread register arrays: shape ``(regs..., 4 warps, 32 lanes)`` in
layouts whose last two axes are the warp and the lane, so a tensor element is one register of
one thread, and ``gl.inline_asm_elementwise`` issues one ``mma.sync`` per element index across
the warp. Protected rows (sink and recent ring) come from the BF16 protection buffer as three
work tiles after the page tiles, as in the Triton kernel (``triton_decode.split_work``).

Takes C4R4 in a BF16 cache (group 64, d_c 512, d_r 64, protection buffers on) for at most 16 heads
on a Hopper GPU (:func:`applies`), with P as one BF16 tile. :func:`.triton_decode.plan` sends a
decode here when its config asks for that precision (``pv_split=False``; the default at 16 heads
keeps the hi/lo P of the Triton kernel) and each split walks at least ``MMA16_MIN_TILES`` tiles.
With the same BF16 P this kernel pays off on long splits only; on short ones the Triton kernel is
faster, hence the threshold.
No interpreter runs Gluon: the GPU tests cover this file; ``python bench/gluon_sass.py --mma16``
compiles it for sm_90 without a GPU. ``ablate`` leaves stages out, for timing only.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from quantmla.kernels._tiles import region_args
from quantmla.kernels.gluon_decode import _prot_valid, hopper_page

LOG2E = 1.4426950408889634
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
WARPS = 4

_MMA = gl.constexpr(
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
)
_PACK = gl.constexpr("cvt.rn.bf16x2.f32 $0, $2, $1;")  # (lo, hi) float32 -> bf16x2
_SHFL = gl.constexpr("shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;")

# One code word of a token (8 channels, nibble k = channel k) -> four bf16x2 registers s·(q − z):
# (ch0, ch2), (ch1, ch3), (ch4, ch6), (ch5, ch7). $4 word, $5 scale pair, $6 −(128 + z) pair.
# This block and _PV_CODES write outputs before their last input is read, so their outputs are
# early-clobber ("=&r"): never given an input's register.
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

# The same word of two tokens a, b -> eight bf16x2 registers (a, b) of q − z of channels 0..7.
# $8 word a, $9 word b, $10 −(128 + z) pair.
_PV_CODES = gl.constexpr(
    "{\n.reg .b32 t0, t1, u<6>, one;\n"
    "mov.b32 one, 0x3f803f80;\n"
    "prmt.b32 t0, $8, $9, 0x5410;\nprmt.b32 t1, $8, $9, 0x7632;\n"
    "shr.u32 u0, t0, 4;\nshr.u32 u1, t0, 8;\nshr.u32 u2, t0, 12;\n"
    "shr.u32 u3, t1, 4;\nshr.u32 u4, t1, 8;\nshr.u32 u5, t1, 12;\n"
    "lop3.b32 $0, t0, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $1, u0, 0x000f000f, 0x43004300, 0xea;\n"
    "lop3.b32 $2, u1, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $3, u2, 0x000f000f, 0x43004300, 0xea;\n"
    "lop3.b32 $4, t1, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $5, u3, 0x000f000f, 0x43004300, 0xea;\n"
    "lop3.b32 $6, u4, 0x000f000f, 0x43004300, 0xea;\nlop3.b32 $7, u5, 0x000f000f, 0x43004300, 0xea;\n"
    + "".join(f"fma.rn.bf16x2 ${i}, ${i}, one, $10;\n" for i in range(8))
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
    """Index tensors of a (regs, warp, lane) layout."""
    i = gl.arange(0, N, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
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
    """A fragment of RoPE k-block ``w`` (channels 16w + 4c + (0, 2) and (1, 3) in a thread's halves)."""
    out = ()
    for ai in gl.static_range(4):
        head = g + 8 * (ai % 2)
        ptr = (qb + head * stride_qh + 16 * w + 4 * c + ai // 2).to(gl.pointer_type(gl.int16))
        lo = gl.load(ptr, mask=head < H, other=0).to(gl.int32)
        hi = gl.load(ptr + 2, mask=head < H, other=0).to(gl.int32)
        out = out + (_pair(lo, hi),)
    return out


@gluon.jit
def _score_tile(ccodes, cscale, czero, rcodes, rscale, rzero, jreg, g, ok, w, c, qa, qr, L3: gl.constexpr):
    """Partial scores of this warp's channels for 32 tokens of a page tile (token ``jreg + g`` in
    the page: ``jreg`` per register, ``g`` per lane); tokens not ``ok`` get zero scales (and are
    masked later). Addresses are a per-thread pointer plus a per-register constant."""
    acc = (gl.zeros([4, 4, 32], gl.float32, L3),) * 4
    sc = gl.load(((cscale + (g * 8 + 2 * w)) + jreg * 8).to(gl.pointer_type(gl.int32)), mask=ok, other=0)
    zz = gl.load(((czero + (g * 8 + 2 * w)) + jreg * 8).to(gl.pointer_type(gl.int16)), mask=ok, other=0).to(gl.int32)
    cthr = ccodes + (w * 4096 + g * 32 + 8 * c)
    for gi in gl.static_range(2):
        x = gl.load((cthr + (jreg * 32 + gi * 2048)).to(gl.pointer_type(gl.int64)))
        if gi == 0:
            s = sc & 0xFFFF
            z = zz & 0xFF
        else:
            s = (sc >> 16) & 0xFFFF
            z = (zz >> 8) & 0xFF
        s2 = s | (s << 16)
        n2 = _pair(_nz(z), _nz(z))
        for half in gl.static_range(2):
            word = (x >> (32 * half)).to(gl.int32)
            r = gl.inline_asm_elementwise(_SCORE_WORD, "=&r,=&r,=&r,=&r,r,r,r", [word, s2, n2], dtype=(gl.int32,) * 4,
                                          is_pure=True, pack=1)  # fmt: skip
            acc = _mma(qa[gi * 4 + 2 * half], r[0], r[1], acc)
            acc = _mma(qa[gi * 4 + 2 * half + 1], r[2], r[3], acc)
    # RoPE channels 16w + 4c .. +3 of the token, float32 scale as the reference multiplies
    h = gl.load(((rcodes + (g * 32 + 8 * w + 2 * c)) + jreg * 32).to(gl.pointer_type(gl.int16))).to(gl.int32)
    sr = gl.load((rscale + g) + jreg, mask=ok, other=0.0)
    zr = gl.load((rzero + g) + jreg, mask=ok, other=0).to(gl.float32)
    x = ()
    for k in gl.static_range(4):
        v = (((h >> (4 * k)) & 15).to(gl.float32) - zr) * sr
        x = x + (v.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32),)
    acc = _mma(qr, _pair(x[0], x[2]), _pair(x[1], x[3]), acc)
    return acc


@gluon.jit
def _score_prot(prow, ok, w, c, qa, qr, L3: gl.constexpr):
    """Partial scores for 32 protected BF16 rows at ``prow`` (pointer per (jp, warp, lane); rows
    not ``ok`` read as zeros)."""
    acc = (gl.zeros([4, 4, 32], gl.float32, L3),) * 4
    for gi in gl.static_range(2):
        base = (prow + (2 * w + gi) * 64 + 16 * c).to(gl.pointer_type(gl.int64))
        for kb in gl.static_range(4):  # channels 4kb .. 4kb+3 of the thread's 16: registers (0,2), (1,3)
            v = gl.load(base + kb, mask=ok, other=0)
            lo = v.to(gl.int32)
            hi = (v >> 32).to(gl.int32)
            acc = _mma(qa[gi * 4 + kb], _prmt(lo, hi, 0x5410), _prmt(lo, hi, 0x7632), acc)
    v = gl.load((prow + 512 + 16 * w + 4 * c).to(gl.pointer_type(gl.int64)), mask=ok, other=0)
    lo = v.to(gl.int32)
    hi = (v >> 32).to(gl.int32)
    acc = _mma(qr, _prmt(lo, hi, 0x5410), _prmt(lo, hi, 0x7632), acc)
    return acc


@gluon.jit
def _pv_page(acc, pa, ccodes, cscale, czero, t0, low_hi, gi3, w3, g3, c3, SINK: gl.constexpr):
    """P·V for a page tile: ``acc`` (8 n-blocks x 4 registers of (2 groups, warp, lane)) plus the
    products with P (``pa``: A fragments of the four 16-token k-blocks). The codes enter as the
    exact q − z; each token's scale multiplies its column of P instead (one bf16x2 product per
    A register and group)."""
    cthr = ccodes + (w3 * 4096 + 2 * c3 * 32 + 4 * g3)
    sthr = cscale + (2 * c3 * 8 + 2 * w3)
    zthr = czero + (2 * c3 * 8 + 2 * w3)
    for kb in gl.static_range(4):
        bs = ()
        s2 = ()
        for e in gl.static_range(2):
            ws = ()
            ss = ()
            ns = ()
            for d in gl.static_range(2):
                tr = 16 * kb + 8 * e + d  # token = tr + 2c
                absl = t0 + tr + 2 * c3
                ok = (absl >= SINK) & (absl < low_hi)
                ws = ws + (gl.load((cthr + (tr * 32 + gi3 * 2048)).to(gl.pointer_type(gl.int32))),)
                sc = gl.load((sthr + tr * 8).to(gl.pointer_type(gl.int32)), mask=ok, other=0)
                zz = gl.load((zthr + tr * 8).to(gl.pointer_type(gl.int16))).to(gl.int32)
                ss = ss + (gl.where(gi3 == 0, sc, sc >> 16) & 0xFFFF,)
                ns = ns + (_nz(gl.where(gi3 == 0, zz, zz >> 8) & 0xFF),)
            s2 = s2 + (_pair(ss[0], ss[1]),)
            bs = bs + (gl.inline_asm_elementwise(_PV_CODES, "=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,r,r,r",
                                                 [ws[0], ws[1], _pair(ns[0], ns[1])],
                                                 dtype=(gl.int32,) * 8, is_pure=True, pack=1),)  # fmt: skip
        a = pa[kb]
        ap = (_hmul2(a[0], s2[0]), _hmul2(a[1], s2[0]), _hmul2(a[2], s2[1]), _hmul2(a[3], s2[1]))
        out = ()
        for n in gl.static_range(8):
            out = out + (_mma(ap, bs[0][n], bs[1][n], acc[n]),)
        acc = out
    return acc


@gluon.jit
def _hmul2(a, b):
    """bf16x2 product, rounded to nearest even."""
    return gl.inline_asm_elementwise("{\n.reg .b32 nz;\nmov.b32 nz, 0x80008000;\nfma.rn.bf16x2 $0, $1, $2, nz;\n}", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)  # fmt: skip


@gluon.jit
def _pv_prot(acc, pa, prot, r0, L, gi3, w3, g3, c3, SINK: gl.constexpr, RECENT: gl.constexpr):
    """P·V for the 64 protected BF16 rows from ``r0`` of the protection buffer at ``prot``."""
    for kb in gl.static_range(4):
        bs = ()
        for e in gl.static_range(2):
            v = ()
            for d in gl.static_range(2):
                r = r0 + 16 * kb + 8 * e + 2 * c3 + d
                ok = _prot_valid(r, L, SINK, RECENT)
                ptr = (prot + r * 576 + 64 * (2 * w3 + gi3) + 8 * g3).to(gl.pointer_type(gl.int64))
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
    """Register ``i`` along axis 0 of an int32 (regs, warp, lane) tensor, as (1, warp, lane)."""
    return gl.sum(gl.where(i3 == i, x, 0), axis=0)[None, :, :]


@gluon.jit
def _to_all(x, L3T: gl.constexpr):
    """A per-thread value (warp, lane) as (source warp, 4 destination copies, lane) in ``L3T``."""
    y = gl.convert_layout(x, gl.SliceLayout(1, L3T), assert_trivial=True)
    return y[:, None, :] + gl.zeros([4, 4, 32], x.dtype, L3T)


@gluon.jit
def _exchange(acc_s, ok, m0, m1, l0, l1, qk_scale, sbuf, mbuf, pbuf, L3: gl.constexpr, L3T: gl.constexpr):
    """Sum the four warps' partial scores for this warp's 16 tokens, online softmax (maxima shared
    across warps), and share P: returns the A fragments of the four k-blocks, the row rescales
    and the new row state. ``ok[jj][d]``: token 16w + 8jj + 2c + d is attended to."""
    LW: gl.constexpr = gl.SliceLayout(0, L3)
    for creg in gl.static_range(4):
        for jj in gl.static_range(2):
            sbuf[2 * creg + jj].store(acc_s[jj][creg])
    _barrier()
    x = ()
    for creg in gl.static_range(4):
        for jj in gl.static_range(2):
            v = gl.sum(sbuf[2 * creg + jj].load(L3T), axis=1)  # (this warp's n-block, lane)
            v = gl.convert_layout(v, LW, assert_trivial=True)
            x = x + (gl.where(ok[jj * 2 + creg % 2], v * qk_scale, float("-inf")),)
    # x[creg * 2 + jj]; rows g (creg 0, 1) and g + 8 (creg 2, 3)
    mt0 = _quad(gl.maximum(gl.maximum(x[0], x[1]), gl.maximum(x[2], x[3])), True)
    mt1 = _quad(gl.maximum(gl.maximum(x[4], x[5]), gl.maximum(x[6], x[7])), True)
    mbuf[0].store(_to_all(mt0, L3T))
    mbuf[1].store(_to_all(mt1, L3T))
    _barrier()
    mt0 = gl.max(mbuf[0].load(L3), axis=0)
    mt1 = gl.max(mbuf[1].load(L3), axis=0)
    n0 = gl.maximum(m0, mt0)
    n1 = gl.maximum(m1, mt1)
    u0 = gl.where(n0 == float("-inf"), 0.0, n0)
    u1 = gl.where(n1 == float("-inf"), 0.0, n1)
    alpha0 = gl.exp2(m0 - u0)
    alpha1 = gl.exp2(m1 - u1)
    p = ()
    for i in gl.static_range(8):
        if i < 4:
            p = p + (gl.exp2(x[i] - u0),)
        else:
            p = p + (gl.exp2(x[i] - u1),)
    l0 = l0 * alpha0 + _quad(p[0] + p[1] + p[2] + p[3], False)
    l1 = l1 * alpha1 + _quad(p[4] + p[5] + p[6] + p[7], False)
    # A fragment of k-block w: (row g, k 2c..) = jj 0 of creg 0/1; (row g+8) creg 2/3; k + 8: jj 1
    a = (_pack(p[0], p[2]), _pack(p[4], p[6]), _pack(p[1], p[3]), _pack(p[5], p[7]))
    for ai in gl.static_range(4):
        pbuf[ai].store(_to_all(a[ai], L3T))
    _barrier()
    kb3 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    f = ()
    for ai in gl.static_range(4):
        f = f + (pbuf[ai].load(L3),)  # (k-block, warp, lane)
    pa = ()
    for kb in gl.static_range(4):
        pa = pa + ((_pick(f[0], kb3, kb), _pick(f[1], kb3, kb), _pick(f[2], kb3, kb), _pick(f[3], kb3, kb)),)
    return pa, alpha0, alpha1, n0, n1, l0, l1


@gluon.jit
def _own_ok(base, L, low_hi, w, c, PROT: gl.constexpr, SINK: gl.constexpr, RECENT: gl.constexpr):
    """Whether each of a warp's 16 tokens (16w + 8jj + 2c + d, in (jj, d) order) is attended to:
    page tokens ``base + i`` with SINK <= token < low_hi, or protected rows ``base + i``."""
    ok = ()
    for jj in gl.static_range(2):
        for d in gl.static_range(2):
            i = base + 16 * w + 8 * jj + 2 * c + d
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
        out = out + ((a[0] * alpha0[None, :, :], a[1] * alpha0[None, :, :], a[2] * alpha1[None, :, :],
                      a[3] * alpha1[None, :, :]),)  # fmt: skip
    return out


@gluon.jit
def _h16_decode_kernel(Q, QPE, O, LSE, BT, LENS, PROT,
                       CCodes, CScale, CZero, ps_ccodes, ps_cscale, ps_czero,
                       RCodes, RScale, RZero, ps_rcodes, ps_rscale, ps_rzero,
                       H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb,
                       stride_ob, stride_oh, stride_os, stride_bt, tiles_per_split, qk_scale,
                       SINK: gl.constexpr, RECENT: gl.constexpr, SPLIT: gl.constexpr, ABL: gl.constexpr):  # fmt: skip
    BN: gl.constexpr = 64
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [1, 4, 1], [2, 1, 0])
    L3T: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [4, 1, 1], [2, 1, 0])  # (warp, regs, lane)
    LW: gl.constexpr = gl.SliceLayout(0, L3)
    S3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    sbuf = ()  # one buffer per stored tensor: the compiler puts a barrier between two stores into one
    for _i in gl.static_range(8):
        sbuf = sbuf + (gl.allocate_shared_memory(gl.float32, [4, 4, 32], S3),)
    mbuf = ()
    for _i in gl.static_range(2):
        mbuf = mbuf + (gl.allocate_shared_memory(gl.float32, [4, 4, 32], S3),)
    pbuf = ()
    for _i in gl.static_range(4):
        pbuf = pbuf + (gl.allocate_shared_memory(gl.int32, [4, 4, 32], S3),)

    pid_s = gl.program_id(0)
    b = gl.program_id(1).to(gl.int64)
    L = gl.load(LENS + b).to(gl.int32)

    jp3, w4, l4 = _idx3(4, L3)
    g4 = l4 // 4
    c4 = l4 % 4
    gi3, w3, l3 = _idx3(2, L3)
    g3 = l3 // 4
    c3 = l3 % 4
    wl = gl.arange(0, 4, layout=gl.SliceLayout(1, LW))[:, None]
    ll = gl.arange(0, 32, layout=gl.SliceLayout(0, LW))[None, :]
    gl_ = ll // 4
    cl = ll % 4

    qb = Q + b * stride_qb
    qa = ()
    for gi in gl.static_range(2):
        for kb in gl.static_range(4):
            qa = qa + (_q_regs(qb, stride_qh, H, g4, c4, 2 * w4 + gi, kb),)
    qr = _qr_regs(QPE + b * stride_rb, stride_rh, H, g4, c4, w4)

    m0 = gl.full([4, 32], float("-inf"), gl.float32, LW)
    m1 = m0
    l0 = gl.zeros([4, 32], gl.float32, LW)
    l1 = l0
    z3 = gl.zeros([2, 4, 32], gl.float32, L3)
    acc = ((z3, z3, z3, z3),) * 8

    low_hi = L - RECENT
    n_tiles = gl.cdiv(gl.minimum(gl.maximum(low_hi, SINK), L), BN)
    t_lo = pid_s * tiles_per_split
    t_hi = gl.minimum(t_lo + tiles_per_split, n_tiles)
    tok0 = 16 * jp3 + g4  # page token of n-block 2·jp (score tiles run per jj: n-block 2·jp + jj)
    bt_row = BT + b * stride_bt
    tid = w3 * 32 + l3
    wp = w3
    lp = l3
    if t_lo < t_hi:
        _prefetch_page(CCodes + gl.load(bt_row + t_lo).to(gl.int64) * ps_ccodes, tid, ps_ccodes.to(gl.int32))
    for t in range(t_lo, t_hi):
        page = gl.load(bt_row + t).to(gl.int64)
        nxt = gl.load(bt_row + gl.minimum(t + 1, t_hi - 1)).to(gl.int64)
        nxt2 = gl.load(bt_row + gl.minimum(t + 2, t_hi - 1)).to(gl.int64)
        _prefetch_page(CCodes + nxt2 * ps_ccodes, tid, ps_ccodes.to(gl.int32))
        _prefetch(CCodes + nxt * ps_ccodes, wp, lp)
        ccodes = CCodes + page * ps_ccodes
        cscale = CScale + page * ps_cscale
        czero = CZero + page * ps_czero
        t0 = t * BN
        acc_s = ()
        for jj in gl.static_range(2):
            tok = tok0 + 8 * jj
            if ABL == 3:  # ablation: no score product
                acc_s = acc_s + ((gl.zeros([4, 4, 32], gl.float32, L3),) * 4,)
            else:
                acc_s = acc_s + (_score_tile(ccodes, cscale, czero, RCodes + page * ps_rcodes,
                                             RScale + page * ps_rscale, RZero + page * ps_rzero, 16 * jp3 + 8 * jj, g4,
                                             (t0 + tok >= SINK) & (t0 + tok < low_hi), w4, c4, qa, qr, L3),)  # fmt: skip
        ok = _own_ok(t0, L, low_hi, wl, cl, False, SINK, RECENT)
        if ABL == 2:  # ablation: no exchange between warps (wrong results, timing only)
            v = gl.convert_layout(gl.sum(acc_s[0][0] + acc_s[1][1], axis=0), LW, assert_trivial=True)
            a = _pack(v, v)[None, :, :]
            pa = ((a, a, a, a),) * 4
            alpha0 = gl.exp2(v - m0)
            alpha1 = alpha0
            m0 = gl.maximum(m0, v)
        else:
            pa, alpha0, alpha1, m0, m1, l0, l1 = _exchange(acc_s, ok, m0, m1, l0, l1, qk_scale, sbuf, mbuf, pbuf,
                                                           L3, L3T)  # fmt: skip
        if ABL != 1:  # ablation 1: no P·V
            acc = _rescale(acc, alpha0, alpha1)
            acc = _pv_page(acc, pa, ccodes, cscale, czero, t0, low_hi, gi3, w3, g3, c3, SINK)

    # the protected rows (sink, then the recent ring) are this request's work tiles n_tiles, …: the
    # split whose share holds them attends to them (triton_decode.split_work)
    p_lo = gl.maximum(t_lo - n_tiles, 0) * BN
    p_hi = gl.minimum(t_lo + tiles_per_split - n_tiles, (SINK + RECENT + BN - 1) // BN) * BN
    if p_lo < p_hi:
        prot = PROT + b * stride_pb
        for r0 in range(p_lo, p_hi, BN):
            acc_s = ()
            for jj in gl.static_range(2):
                r = r0 + tok0 + 8 * jj
                acc_s = acc_s + (_score_prot(prot + r * 576, _prot_valid(r, L, SINK, RECENT), w4, c4, qa, qr, L3),)
            ok = _own_ok(r0, L, low_hi, wl, cl, True, SINK, RECENT)
            pa, alpha0, alpha1, m0, m1, l0, l1 = _exchange(acc_s, ok, m0, m1, l0, l1, qk_scale, sbuf, mbuf, pbuf,
                                                           L3, L3T)  # fmt: skip
            acc = _rescale(acc, alpha0, alpha1)
            acc = _pv_prot(acc, pa, prot, r0, L, gi3, w3, g3, c3, SINK, RECENT)

    # each warp summed P over its own tokens: the row sums are the four warps' together
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
        if SPLIT:
            gl.store(LSE + (b * H + head) * gl.num_programs(0) + pid_s, lse, mask=(head < H) & (wl == 0) & (cl == 0))
        else:
            gl.store(LSE + b * H + head, lse, mask=(head < H) & (wl == 0) & (cl == 0))
        h3 = g3 + 8 * hh
        o_base = O + b * stride_ob + h3 * stride_oh + pid_s * stride_os + 64 * (2 * w3 + gi3)
        for n in gl.static_range(8):
            for d in gl.static_range(2):
                gl.store(o_base + 8 * (2 * c3 + d) + n, acc[n][2 * hh + d] * inv[None, :, :], mask=h3 < H)


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
    """Whether this kernel takes ``layer`` for ``H`` heads on ``device``: C4R4, at most 16 heads, in
    the page layout :func:`.gluon_decode.hopper_page` describes."""
    return layer.fmt.content_bits == 4 and H <= 16 and hopper_page(layer, device)


__all__ = ["applies", "decode"]
