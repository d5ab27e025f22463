"""Decode over C4R4 and C2R4 pages in 64-head blocks, written in Gluon for Hopper (sm_90): each
tile is reconstructed while the tensor cores run the one before it.

The Triton kernel (:mod:`.triton_decode`) cannot overlap the two: Triton 3.6 waits for every
``wgmma`` whose operand was reconstructed in registers right after issuing it, so at 128 heads
the reconstruction and the products run one after the other. Here, per 64-token tile t, in 8 warps::

    issue S^T = C_t q^T + K_P,t q_pe^T            (five async wgmma: tokens on M, 64 heads on N)
    reconstruct tile t + 1 into the other buffer    (CUDA cores, while the scores run)
    wait for S; online softmax; P^T to shared memory; fence; barrier
    issue O^T += C_t^T P^T                          (four async wgmma, one per 128-channel chunk)
    load tile t + 2's codes and the page of t + 3;  wait for P·V; fence; barrier

Two tile buffers (64 tokens x 576 channels, 144 KB), the query block (72 KB) and P (8 KB) take 225
of the 227 KB of shared memory; O^T is four 128 x 64 float32 accumulators (128 registers per
thread). P enters P·V as one BF16 tile, as in the Triton kernel above 16 heads. Codes are unpacked
eight (4-bit) or sixteen (2-bit) per 32-bit word by one PTX block into a channel order permuted
within each 8- or 16-channel block; the queries, protected rows and the output use the same order. Splits and the
LSE merge are those of :mod:`.splits`; the sink rows are swapped into page tile 0 as it is rebuilt (in the
prologue of split 0), and the last split attends to the recent ring alone, two tiles of 64 where sink and
ring as protected tiles of their own take three (:func:`split`).

Takes C4R4 or C2R4 in a BF16 cache (group 64, d_c 512, d_r 64) with protection buffers, above 16 heads
with P as one BF16 tile, on a Hopper GPU (:func:`supports` says when and why not);
:mod:`quantmla.kernels.dispatch` runs it where it does, unless config ``gluon`` is False. Gluon has no
interpreter: the CPU test suite cannot run this file, the GPU tests do (``tests/test_kernels_decode.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from quantmla.kernels._tiles import INTERPRET, LOG2E, region_args
from quantmla.kernels.splits import Case, Split, split_work

NAME = "gluon"
PERM8 = (0, 2, 4, 6, 1, 3, 5, 7)  # position p of an 8-channel block holds channel PERM8[p]
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # a CTA barrier (Triton 3.6 / later names)


def _word_ptx(f32_scale: bool) -> str:
    lines = [
        ".reg .b32 t0, t1, u0, u1, a0, a1, a2, a3, one, n2, s2, nzero;",
        "mov.b32 one, 0x3f803f80;",
        "mov.b32 nzero, 0x80008000;",
        "mov.b32 n2, {$10, $10};",
        "prmt.b32 t0, $8, 0, 0x4140;",
        "prmt.b32 t1, $8, 0, 0x4342;",
        "shr.u32 u0, t0, 4;",
        "shr.u32 u1, t1, 4;",
        "lop3.b32 a0, t0, 0x000f000f, 0x43004300, 0xea;",
        "lop3.b32 a1, t1, 0x000f000f, 0x43004300, 0xea;",
        "lop3.b32 a2, u0, 0x000f000f, 0x43004300, 0xea;",
        "lop3.b32 a3, u1, 0x000f000f, 0x43004300, 0xea;",
    ]
    lines += [f"fma.rn.bf16x2 a{i}, a{i}, one, n2;" for i in range(4)]
    if f32_scale:
        lines += [".reg .b32 f<8>;"]
        for i in range(4):
            lines += [f"shl.b32 f{2 * i}, a{i}, 16;", f"and.b32 f{2 * i + 1}, a{i}, 0xffff0000;"]
        lines += [f"mul.rn.f32 f{i}, f{i}, $9;" for i in range(8)]
        lines += [f"cvt.rn.bf16x2.f32 a{i}, f{2 * i + 1}, f{2 * i};" for i in range(4)]
    else:
        lines += ["mov.b32 s2, {$9, $9};"]
        lines += [f"fma.rn.bf16x2 a{i}, a{i}, s2, nzero;" for i in range(4)]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, a{i};" for i in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


def _word2_ptx() -> str:
    """Sixteen 2-bit codes of a 32-bit word (byte j holds channels 4j..4j+3, channel k of a byte at
    bits 2k) -> sixteen BF16 s·(q − z), BF16 scale: outputs $0-$15, word $16, scale $17, nz $18.
    Register a_i holds (t0 or t1 shifted by 2·(i // 2)): position p holds channel 4·(p % 4) + p // 4."""
    lines = [
        ".reg .b32 t0, t1, u<6>, a<8>, one, n2, s2, nzero;",
        "mov.b32 one, 0x3f803f80;",
        "mov.b32 nzero, 0x80008000;",
        "mov.b32 n2, {$18, $18};",
        "mov.b32 s2, {$17, $17};",
        "prmt.b32 t0, $16, 0, 0x4140;",
        "prmt.b32 t1, $16, 0, 0x4342;",
    ]
    lines += [f"shr.u32 u{2 * (k - 1) + h}, t{h}, {2 * k};" for k in (1, 2, 3) for h in (0, 1)]
    src = ["t0", "t1", "u0", "u1", "u2", "u3", "u4", "u5"]
    lines += [f"lop3.b32 a{i}, {src[i]}, 0x00030003, 0x43004300, 0xea;" for i in range(8)]
    lines += [f"fma.rn.bf16x2 a{i}, a{i}, one, n2;" for i in range(8)]
    lines += [f"fma.rn.bf16x2 a{i}, a{i}, s2, nzero;" for i in range(8)]
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, a{i};" for i in range(8)]
    return "{\n" + "\n".join(lines) + "\n}"


_W_BF16 = gl.constexpr(_word_ptx(False))
_W_F32 = gl.constexpr(_word_ptx(True))
_W2_BF16 = gl.constexpr(_word2_ptx())


@gluon.jit
def _dequant_words(w, s, nz, ASM: gl.constexpr, SC: gl.constexpr):
    """int32 words (..., W) -> bf16 (..., W*8) in the permuted 8-block order. The outputs are
    early-clobber ("=&h"), as in every multi-instruction block here: never an input's register."""
    o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
        ASM,
        "=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,r," + SC + ",h",
        [w, s, nz],
        dtype=(gl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )
    x = gl.join(gl.join(gl.join(o0, o4), gl.join(o2, o6)), gl.join(gl.join(o1, o5), gl.join(o3, o7)))
    return x


@gluon.jit
def _join8(x0, x1, x2, x3, x4, x5, x6, x7):
    """(..., ) x 8 -> (..., 8) in argument order (join appends the last axis, hence the order)."""
    return gl.join(gl.join(gl.join(x0, x4), gl.join(x2, x6)), gl.join(gl.join(x1, x5), gl.join(x3, x7)))


@gluon.jit
def _dequant_words2(w, s, nz):
    """int32 words of 2-bit codes (..., W) -> bf16 (..., W*16) in the permuted 16-block order."""
    o = gl.inline_asm_elementwise(
        _W2_BF16,
        "=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,=&h,r,h,h",
        [w, s, nz],
        dtype=(gl.bfloat16,) * 16,
        is_pure=True,
        pack=1,
    )
    return gl.join(
        _join8(o[0], o[2], o[4], o[6], o[8], o[10], o[12], o[14]),
        _join8(o[1], o[3], o[5], o[7], o[9], o[11], o[13], o[15]),
    )


@gluon.jit
def _prot_valid(r, L, SINK: gl.constexpr, RECENT: gl.constexpr):
    ring = r - SINK
    base = gl.maximum(L - RECENT, 0)
    tok = gl.where(L <= RECENT, ring, base + (ring - base % RECENT + RECENT) % RECENT)
    return gl.where(r < SINK, r < L, (r < SINK + RECENT) & (tok >= SINK) & (tok < L))


@gluon.jit
def _cperm(c, C_BITS: gl.constexpr):
    """Channel held by content column ``c``: :func:`_perm` for 4-bit codes; for 2-bit codes column
    16k+p holds channel 16k + 4·(p % 4) + p // 4."""
    if C_BITS == 4:
        return _perm(c)
    else:
        return (c // 16) * 16 + 4 * (c % 4) + (c % 16) // 4


@gluon.jit
def _perm(c):
    """Channel held by column ``c`` (columns 8k+p hold channel 8k+PERM8[p])."""
    return (c // 8) * 8 + gl.where((c % 8) < 4, (c % 8) * 2, ((c % 8) - 4) * 2 + 1)


@gluon.jit
def _prot_rows(prot, r, ok, J: gl.constexpr, CW: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr,
               C_BITS: gl.constexpr):  # fmt: skip
    """Content chunk J of protected rows ``r`` (BF16 rows of d_c + d_r at ``prot``; rows not ``ok``
    zero) in the permuted channel order, in ``r``'s layout."""
    pc = gl.arange(0, CW, layout=gl.SliceLayout(0, r.type.layout.parent))
    return gl.load(prot + r[:, None] * (DC + DR) + J * CW + _cperm(pc, C_BITS)[None, :], mask=ok[:, None], other=0.0)


@gluon.jit
def _prot_rope(prot, r, ok, DC: gl.constexpr, DR: gl.constexpr):
    """The RoPE keys of protected rows ``r`` (rows not ``ok`` zero), permuted, in ``r``'s layout."""
    pr = gl.arange(0, DR, layout=gl.SliceLayout(0, r.type.layout.parent))
    return gl.load(prot + r[:, None] * (DC + DR) + DC + _perm(pr)[None, :], mask=ok[:, None], other=0.0)


@gluon.jit
def _prot_tile(c_smem, r_smem, prot, r0, L, SINK: gl.constexpr, RECENT: gl.constexpr, BN: gl.constexpr,
               CW: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, NCH: gl.constexpr, LQ: gl.constexpr,
               LQR: gl.constexpr, C_BITS: gl.constexpr):  # fmt: skip
    """Protected rows r0 .. r0 + BN - 1 into buffer 0; rows that hold no token are zero."""
    r = r0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LQ))
    for j in gl.static_range(NCH):
        c_smem.index(j).store(_prot_rows(prot, r, _prot_valid(r, L, SINK, RECENT), j, CW, DC, DR, C_BITS))
    rr = r0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LQR))
    r_smem.index(0).store(_prot_rope(prot, rr, _prot_valid(rr, L, SINK, RECENT), DC, DR))


@gluon.jit
def _prefetch_rows(prot, r0, NR: gl.constexpr, LAST: gl.constexpr, ROW_BYTES: gl.constexpr):
    """Ask L2 for rows r0 .. min(r0 + NR - 1, LAST) of ``prot`` (ROW_BYTES each, 128-byte lines)."""
    LP: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [8, 1], [1, 0])
    NL: gl.constexpr = (ROW_BYTES + 127) // 128
    r = gl.minimum(r0 + gl.arange(0, NR, layout=gl.SliceLayout(1, LP)), LAST)
    j = gl.minimum(gl.arange(0, 16, layout=gl.SliceLayout(0, LP)), NL - 1)
    p = prot.to(gl.pointer_type(gl.int8)) + r[:, None] * ROW_BYTES + j[None, :] * 128
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _swap_sink(c_smem, r_smem, prot, sink_hi, SINK: gl.constexpr, BN: gl.constexpr, CW: gl.constexpr,
               DC: gl.constexpr, DR: gl.constexpr, NCH: gl.constexpr, LQ: gl.constexpr, LQR: gl.constexpr,
               C_BITS: gl.constexpr):  # fmt: skip
    """Rows 0 .. SINK - 1 of the tile in buffer 0 (page tile 0) replaced by the sink rows of the
    protection buffer (those past the request's ``sink_hi`` tokens by zero); each thread reads
    and writes back the same elements, the other rows unchanged."""
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, LQ))
    for j in gl.static_range(NCH):
        x = c_smem.index(j).load(LQ)
        p = _prot_rows(prot, r, r < sink_hi, j, CW, DC, DR, C_BITS)
        c_smem.index(j).store(gl.where((r < SINK)[:, None], p, x))
    rr = gl.arange(0, BN, layout=gl.SliceLayout(1, LQR))
    xr = r_smem.index(0).load(LQR)
    r_smem.index(0).store(gl.where((rr < SINK)[:, None], _prot_rope(prot, rr, rr < sink_hi, DC, DR), xr))


@gluon.jit
def _chunk_codes(cw, CScale, CZero, page, ok, J: gl.constexpr, ps_ccodes, ps_cscale, ps_czero, tok3,
                 g3, w3, BN: gl.constexpr, WG: gl.constexpr, NG: gl.constexpr, GC: gl.constexpr):  # fmt: skip
    """Code words (BN, GC, WG), scales and zero-points (BN, GC) of content chunk J of a tile
    (codes are group-major in a page: group g of token n at word (g·BN + n)·WG)."""
    g = J * GC + g3
    words = gl.load(
        cw + page * (ps_ccodes // 4) + (g[None, :, None] * BN + tok3[:, None, None]) * WG + w3[None, None, :]
    )
    moff = tok3[:, None] * NG + g[None, :]
    sc = gl.load(CScale + page * ps_cscale + moff, mask=ok[:, None], other=0.0)
    zc = gl.load(CZero + page * ps_czero + moff)
    return words, sc, (-(zc.to(gl.float32) + 128.0)).to(gl.bfloat16)


@gluon.jit
def _codes_lo(cw, CScale, CZero, page, t, low_hi, ps_ccodes, ps_cscale, ps_czero, tok3, g3, w3,
              SINK: gl.constexpr, BN: gl.constexpr, WG: gl.constexpr, NG: gl.constexpr, GC: gl.constexpr,
              J: gl.constexpr = 0):  # fmt: skip
    """Content chunks J and J + 1 (0 and 1 by default) of tile ``t`` on ``page``, in registers."""
    offs3 = t * BN + tok3
    ok3 = (offs3 < low_hi) & (offs3 >= SINK)
    w0, s0, z0 = _chunk_codes(cw, CScale, CZero, page, ok3, J, ps_ccodes, ps_cscale, ps_czero, tok3, g3, w3,
                              BN, WG, NG, GC)  # fmt: skip
    w1, s1, z1 = _chunk_codes(cw, CScale, CZero, page, ok3, J + 1, ps_ccodes, ps_cscale, ps_czero, tok3, g3, w3,
                              BN, WG, NG, GC)  # fmt: skip
    return w0, s0, z0, w1, s1, z1


@gluon.jit
def _codes(cw, CScale, CZero, rw, RScale, RZero, page, t, low_hi, ps_ccodes, ps_cscale, ps_czero, ps_rcodes,
           ps_rscale, ps_rzero, tok3, g3, w3, tokr, wr, SINK: gl.constexpr, BN: gl.constexpr, WG: gl.constexpr,
           NG: gl.constexpr, GC: gl.constexpr):  # fmt: skip
    """The four content chunks and the RoPE rows of tile ``t`` on ``page``, in registers."""
    w0, s0, z0, w1, s1, z1 = _codes_lo(cw, CScale, CZero, page, t, low_hi, ps_ccodes, ps_cscale, ps_czero, tok3,
                                       g3, w3, SINK, BN, WG, NG, GC)  # fmt: skip
    w2, s2, z2, w3_, s3, z3 = _codes_lo(cw, CScale, CZero, page, t, low_hi, ps_ccodes, ps_cscale, ps_czero, tok3,
                                        g3, w3, SINK, BN, WG, NG, GC, 2)  # fmt: skip
    offsr = t * BN + tokr
    okr = (offsr < low_hi) & (offsr >= SINK)
    rwords = gl.load(rw + page * (ps_rcodes // 4) + tokr[:, None] * 8 + wr[None, :])
    sr = gl.load(RScale + page * ps_rscale + tokr, mask=okr, other=0.0)
    zr = gl.load(RZero + page * ps_rzero + tokr)
    nzr = (-(zr.to(gl.float32) + 128.0)).to(gl.bfloat16)
    return w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwords, sr, nzr


@gluon.jit
def _store_chunk(c_smem, i, w, s, nz, BN: gl.constexpr, CW: gl.constexpr, C_BITS: gl.constexpr):
    if C_BITS == 4:
        x = _dequant_words(w, s[:, :, None], nz[:, :, None], _W_BF16, "h")
    else:
        x = _dequant_words2(w, s[:, :, None], nz[:, :, None])
    c_smem.index(i).store(gl.reshape(x, [BN, CW]))


@gluon.jit
def _rebuild(c_smem, r_smem, buf, w0, s0, z0, w1, s1, z1, w2, s2, z2, w3, s3, z3, rwords, sr, nzr, BN: gl.constexpr,
             CW: gl.constexpr, DR: gl.constexpr, C_BITS: gl.constexpr):  # fmt: skip
    """A tile (its codes from :func:`_codes`) reconstructed into buffer ``buf``."""
    _store_chunk(c_smem, 4 * buf + 0, w0, s0, z0, BN, CW, C_BITS)
    _store_chunk(c_smem, 4 * buf + 1, w1, s1, z1, BN, CW, C_BITS)
    _store_chunk(c_smem, 4 * buf + 2, w2, s2, z2, BN, CW, C_BITS)
    _store_chunk(c_smem, 4 * buf + 3, w3, s3, z3, BN, CW, C_BITS)
    xr = _dequant_words(rwords, sr[:, None], nzr[:, None], _W_F32, "r")
    r_smem.index(buf).store(gl.reshape(xr, [BN, DR]))


@gluon.jit
def _scores(c_smem, r_smem, q_smem, qp_smem, buf, BN: gl.constexpr, BH: gl.constexpr, ACC_S: gl.constexpr):
    """Issue S^T = C q^T + K_P q_pe^T for the tile in buffer ``buf`` (five async wgmma groups)."""
    s = gl.zeros([BN, BH], gl.float32, layout=ACC_S)
    s = warpgroup_mma(c_smem.index(4 * buf + 0), q_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(c_smem.index(4 * buf + 1), q_smem.index(1).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(c_smem.index(4 * buf + 2), q_smem.index(2).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(c_smem.index(4 * buf + 3), q_smem.index(3).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(r_smem.index(buf), qp_smem.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(s, valid, m_i, l_i, qk_scale, ACC_O: gl.constexpr):
    s = gl.where(valid[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[None, :])
    l_i = l_i * alpha + gl.sum(p, 0)
    return m_new, l_i, p, gl.convert_layout(alpha, gl.SliceLayout(0, ACC_O))


@gluon.jit
def _pv(c_smem, ph_smem, buf, a0, a1, a2, a3):
    """Issue O^T += C^T P^T for the tile in buffer ``buf`` (four async wgmma groups, one per chunk)."""
    a0 = warpgroup_mma(c_smem.index(4 * buf + 0).permute((1, 0)), ph_smem, a0, is_async=True)
    a1 = warpgroup_mma(c_smem.index(4 * buf + 1).permute((1, 0)), ph_smem, a1, is_async=True)
    a2 = warpgroup_mma(c_smem.index(4 * buf + 2).permute((1, 0)), ph_smem, a2, is_async=True)
    a3 = warpgroup_mma(c_smem.index(4 * buf + 3).permute((1, 0)), ph_smem, a3, is_async=True)
    return a0, a1, a2, a3


@gluon.jit
def _softmax_pv(s, valid, m_i, l_i, a0, a1, a2, a3, qk_scale, c_smem, ph_smem, buf, ACC_O: gl.constexpr):
    """The online softmax of scores ``s`` (tokens x heads, ``valid`` tokens), the accumulators
    rescaled, P^T to shared memory, and O^T += C^T P^T issued for the tile in buffer ``buf``."""
    m_i, l_i, p, alpha = _softmax(s, valid, m_i, l_i, qk_scale, ACC_O)
    a0 = a0 * alpha[None, :]
    a1 = a1 * alpha[None, :]
    a2 = a2 * alpha[None, :]
    a3 = a3 * alpha[None, :]
    ph_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    _barrier()  # P (and a tile stored since the last barrier) visible to both warpgroups' wgmma
    a0, a1, a2, a3 = _pv(c_smem, ph_smem, buf, a0, a1, a2, a3)
    return m_i, l_i, a0, a1, a2, a3


@gluon.jit
def _step(c_smem, r_smem, cur, q_smem, qp_smem, ph_smem, t, t_hi, low_hi, sink_hi, m_i, l_i, a0, a1, a2, a3,
          w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr, page, qk_scale, cw, CScale, CZero, rw,
          RScale, RZero, bt_row, ps_ccodes, ps_cscale, ps_czero, ps_rcodes, ps_rscale, ps_rzero, tok3, g3, w3, tokr,
          wr, tok_s, SINK: gl.constexpr, BN: gl.constexpr, BH: gl.constexpr, CW: gl.constexpr, DR: gl.constexpr,
          WG: gl.constexpr, NG: gl.constexpr, GC: gl.constexpr, ACC_S: gl.constexpr, ACC_O: gl.constexpr,
          C_BITS: gl.constexpr):  # fmt: skip
    """Tile ``t`` (already in buffer ``cur``) into the online softmax, while tile t + 1 (its codes
    in registers) is reconstructed into the other buffer and tile t + 2's codes are loaded."""
    t2 = gl.minimum(t + 2, t_hi - 1)
    nxt = 1 - cur
    s = _scores(c_smem, r_smem, q_smem, qp_smem, cur, BN, BH, ACC_S)
    # while the tensor cores run the scores: tile t + 1 into the other buffer (free: the P·V that
    # read it was waited for at the end of the previous step)
    _rebuild(c_smem, r_smem, nxt, w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr, BN, CW, DR, C_BITS)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    offs_s = t * BN + tok_s
    valid = ((offs_s < low_hi) & (offs_s >= SINK)) | (offs_s < sink_hi)  # page rows; the sink (swapped into tile 0)
    m_i, l_i, a0, a1, a2, a3 = _softmax_pv(s, valid, m_i, l_i, a0, a1, a2, a3, qk_scale, c_smem, ph_smem, cur, ACC_O)
    # while they run P·V: tile t + 2's codes (its page was read a step ahead) and the page of t + 3
    w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr = _codes(
        cw, CScale, CZero, rw, RScale, RZero, page, t2, low_hi, ps_ccodes, ps_cscale, ps_czero, ps_rcodes,
        ps_rscale, ps_rzero, tok3, g3, w3, tokr, wr, SINK, BN, WG, NG, GC)  # fmt: skip
    page = gl.load(bt_row + gl.minimum(t + 3, t_hi - 1)).to(gl.int64)
    # (an accumulator still in flight across the loop's back edge makes ptxas serialize every
    # wgmma, so P·V is waited for within the step)
    a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1, a2, a3))
    fence_async_shared()
    _barrier()
    return m_i, l_i, a0, a1, a2, a3, w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr, page


@gluon.jit
def _store_out(O, o_base, a, inv, J: gl.constexpr, CW: gl.constexpr, hmask, ACC_O: gl.constexpr, C_BITS: gl.constexpr):
    oc = J * CW + gl.arange(0, CW, layout=gl.SliceLayout(1, ACC_O))
    gl.store(o_base + _cperm(oc, C_BITS)[:, None], a * inv[None, :], mask=hmask[None, :])


@gluon.jit
def _h64_decode_kernel(Q, QPE, O, LSE, BT, LENS, PROT,
                       CCodes, CScale, CZero, ps_ccodes, ps_cscale, ps_czero,
                       RCodes, RScale, RZero, ps_rcodes, ps_rscale, ps_rzero,
                       H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb,
                       stride_ob, stride_oh, stride_os, stride_bt, tiles_per_split, qk_scale,
                       SINK: gl.constexpr, RECENT: gl.constexpr, SPLIT: gl.constexpr, C_BITS: gl.constexpr):  # fmt: skip
    DC: gl.constexpr = 512
    DR: gl.constexpr = 64
    BN: gl.constexpr = 64
    BH: gl.constexpr = 64
    NG: gl.constexpr = 8
    WG: gl.constexpr = 2 * C_BITS  # 32-bit words per 64-channel group and token
    NCH: gl.constexpr = 4
    CW: gl.constexpr = DC // NCH
    GC: gl.constexpr = NG // NCH
    L3: gl.constexpr = gl.BlockedLayout([1, 1, WG // 2], [8, 2, 2], [8, 1, 1], [2, 1, 0])  # (tokens, groups, words)
    LR: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [8, 1], [1, 0])  # (tokens, RoPE words)
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])  # (64, 128) BF16 rows
    LQR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # (64, 64) BF16 rows
    ACC_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    ACC_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 64, 16])
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, CW], gl.bfloat16)
    r_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, DR], gl.bfloat16)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, CW], gl.bfloat16)
    qp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DR], gl.bfloat16)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BH], gl.bfloat16)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NCH, BN, CW], c_layout)  # two tile buffers
    r_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DR], r_layout)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NCH, BH, CW], q_layout)
    qp_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, DR], qp_layout)
    ph_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BH], p_layout)

    pid_h = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    L = gl.load(LENS + b).to(gl.int32)

    if SINK > 0:
        if pid_s == 0:  # the sink rows, swapped into page tile 0 after the prologue, on their way to L2
            # (with this branch here ptxas compiles the page loop's cross-warp reductions predicated, not as
            # branches in convergence regions, which is faster; bench/gluon_sass.py checks it)
            _prefetch_rows(PROT + b * stride_pb, 0, 8, SINK - 1, (DC + DR) * 2)
    qh = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LQ))
    qc = gl.arange(0, CW, layout=gl.SliceLayout(0, LQ))
    q_rows = Q + b * stride_qb + qh[:, None] * stride_qh
    for j in gl.static_range(NCH):
        q_smem.index(j).store(gl.load(q_rows + j * CW + _cperm(qc, C_BITS)[None, :], mask=qh[:, None] < H, other=0.0))
    rh = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LQR))
    rc = gl.arange(0, DR, layout=gl.SliceLayout(0, LQR))
    qpe = gl.load(QPE + b * stride_rb + rh[:, None] * stride_rh + _perm(rc)[None, :], mask=rh[:, None] < H, other=0.0)
    qp_smem.store(qpe)

    low_hi = L - RECENT  # tokens SINK <= t < L - RECENT are read from the pages
    sink_hi = gl.minimum(L, SINK)  # tokens t < SINK from the protection buffer, in page tile 0
    n_tiles = gl.cdiv(gl.minimum(gl.maximum(low_hi, SINK), L), BN)  # as splits.work counts them
    t_lo = pid_s * tiles_per_split
    t_hi = gl.minimum(t_lo + tiles_per_split, n_tiles)
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC_S))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(0, ACC_S))
    a0 = gl.zeros([CW, BH], gl.float32, layout=ACC_O)
    a1 = a0
    a2 = a0
    a3 = a0

    tok3 = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    g3 = gl.arange(0, GC, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    w3 = gl.arange(0, WG, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    tokr = gl.arange(0, BN, layout=gl.SliceLayout(1, LR))
    wr = gl.arange(0, DR // 8, layout=gl.SliceLayout(0, LR))
    tok_s = gl.arange(0, BN, layout=gl.SliceLayout(1, ACC_S))
    cw = CCodes.to(gl.pointer_type(gl.int32))
    rw = RCodes.to(gl.pointer_type(gl.int32))
    bt_row = BT + b * stride_bt

    if t_lo < t_hi:
        # prologue: tile t_lo into buffer 0; the codes of t_lo + 1 in registers; the page of t_lo + 2
        page = gl.load(bt_row + t_lo).to(gl.int64)
        w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr = _codes(
            cw, CScale, CZero, rw, RScale, RZero, page, t_lo, low_hi, ps_ccodes, ps_cscale, ps_czero, ps_rcodes,
            ps_rscale, ps_rzero, tok3, g3, w3, tokr, wr, SINK, BN, WG, NG, GC)  # fmt: skip
        _rebuild(c_smem, r_smem, 0, w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr, BN, CW, DR, C_BITS)
        t1 = gl.minimum(t_lo + 1, t_hi - 1)
        page = gl.load(bt_row + t1).to(gl.int64)
        w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr = _codes(
            cw, CScale, CZero, rw, RScale, RZero, page, t1, low_hi, ps_ccodes, ps_cscale, ps_czero, ps_rcodes,
            ps_rscale, ps_rzero, tok3, g3, w3, tokr, wr, SINK, BN, WG, NG, GC)  # fmt: skip
        page = gl.load(bt_row + gl.minimum(t_lo + 2, t_hi - 1)).to(gl.int64)
        fence_async_shared()
        _barrier()
        if SINK > 0:
            if t_lo == 0:  # the sink rows (zero in the rebuilt tile: their scales are masked) swapped in
                _swap_sink(c_smem, r_smem, PROT + b * stride_pb, sink_hi, SINK, BN, CW, DC, DR, NCH, LQ, LQR, C_BITS)
                fence_async_shared()
                _barrier()
        for t in range(t_lo, t_hi):
            m_i, l_i, a0, a1, a2, a3, w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr, page = _step(
                c_smem, r_smem, (t - t_lo) % 2, q_smem, qp_smem, ph_smem, t, t_hi, low_hi, sink_hi, m_i, l_i, a0, a1, a2, a3,
                w0, s0, z0, w1, s1, z1, w2, s2, z2, w3_, s3, z3, rwd, sr, nzr, page, qk_scale, cw, CScale, CZero, rw,
                RScale, RZero, bt_row, ps_ccodes, ps_cscale, ps_czero, ps_rcodes, ps_rscale, ps_rzero, tok3, g3, w3,
                tokr, wr, tok_s, SINK, BN, BH, CW, DR, WG, NG, GC, ACC_S, ACC_O, C_BITS)  # fmt: skip

    if pid_s == gl.num_programs(1) - 1:  # the ring of the latest RECENT rows
        prot = PROT + b * stride_pb
        for r0 in range(SINK, SINK + RECENT, BN):
            _prefetch_rows(prot, r0 + BN, BN, SINK + RECENT - 1, (DC + DR) * 2)  # the next tile's rows
            _prot_tile(c_smem, r_smem, prot, r0, L, SINK, RECENT, BN, CW, DC, DR, NCH, LQ, LQR, C_BITS)
            fence_async_shared()
            _barrier()
            s = _scores(c_smem, r_smem, q_smem, qp_smem, 0, BN, BH, ACC_S)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            valid = _prot_valid(r0 + tok_s, L, SINK, RECENT)
            m_i, l_i, a0, a1, a2, a3 = _softmax_pv(s, valid, m_i, l_i, a0, a1, a2, a3, qk_scale, c_smem, ph_smem, 0,
                                                   ACC_O)  # fmt: skip
            a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1, a2, a3))
            _barrier()

    has = l_i > 0
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    inv = gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), gl.SliceLayout(0, ACC_O))
    oh = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, ACC_O))
    hmask = oh < H
    o_base = O + b * stride_ob + oh[None, :] * stride_oh + pid_s * stride_os
    _store_out(O, o_base, a0, inv, 0, CW, hmask, ACC_O, C_BITS)
    _store_out(O, o_base, a1, inv, 1, CW, hmask, ACC_O, C_BITS)
    _store_out(O, o_base, a2, inv, 2, CW, hmask, ACC_O, C_BITS)
    _store_out(O, o_base, a3, inv, 3, CW, hmask, ACC_O, C_BITS)
    lh = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, ACC_S))
    if SPLIT:
        gl.store(LSE + (b * H + lh) * gl.num_programs(1) + pid_s, lse, mask=lh < H)
    else:
        gl.store(LSE + b * H + lh, lse, mask=lh < H)


MIN_TILES = 4
"""Fewest tiles per split: with one or two the kernel's prologue (the query block and the first tile,
not overlapped) costs more than the overlap wins, and the Triton kernel is faster (docs/kernels.md)."""


def split(case: Case) -> Split:
    """The even split of 64-token tiles with the sink in page tile 0 (the protected tiles are the ring's)."""
    return split_work(case.layer, case.max_len, 64, int(case.config["num_splits"]), sink_in_tile0=True)


def supports(case: Case) -> str | None:
    """Why this kernel cannot run ``case`` (None: it can): config ``gluon`` on, P as one BF16 tile,
    64-token tiles, more than 16 heads, C4R4 or C2R4 with a sink that fits page tile 0, the page
    layout and device of :func:`hopper_page`, and at least :data:`MIN_TILES` tiles per split."""
    cfg, layer = case.config, case.layer
    if case.exact:
        return "the Gluon 64-head kernel attends to the rows rounded to BF16, not the exactly dequantized cache"
    if INTERPRET:
        return "Gluon kernels do not run in the Triton interpreter"
    if not cfg.get("gluon"):
        return "config gluon is off"
    if cfg.get("pv_split", True) or cfg["block_n"] != 64:
        return "it takes P as one BF16 tile (pv_split=False) and 64-token tiles (block_n=64)"
    if case.heads <= 16:
        return f"it takes more than 16 heads, got {case.heads}"
    if layer.fmt.content_bits not in (2, 4) or layer.sink > 64:
        return f"it takes C4R4 or C2R4 with a sink of at most 64 rows, got {layer.fmt.name} with sink {layer.sink}"
    if not hopper_page(layer, case.device):
        return "it takes 4-bit RoPE codes in a BF16 cache, group 64, d_c 512, d_r 64, protection on, on an sm_90 GPU"
    if split(case).per < MIN_TILES:
        return f"splits shorter than {MIN_TILES} tiles run faster on the Triton kernel"
    return None


def launch(case: Case, sp: Split, block_table, lengths, q, qpe, o, lse, tau: float) -> None:
    """Launch over ``sp.splits`` splits of ``sp.per`` work tiles each (:func:`split`): ``q``, ``qpe``
    BF16 contiguous; ``o`` (B, H, splits, d_c) and ``lse`` (B, H, splits) float32 partials when
    ``splits > 1``, else the outputs themselves (viewed (B, H, 1, d_c) and (B, H))."""
    layer = case.layer
    B, H, _ = q.shape
    c = region_args(layer, "C")
    r = region_args(layer, "R")
    prot = layer.prot
    _h64_decode_kernel[(triton.cdiv(H, 64), sp.splits, B)](
        q, qpe, o, lse, block_table, lengths, prot,
        c[1], c[2], c[3], c[5], c[6], c[7],
        r[1], r[2], r[3], r[5], r[6], r[7],
        H, q.stride(0), q.stride(1), qpe.stride(0), qpe.stride(1), prot.stride(0),
        o.stride(0), o.stride(1), o.stride(2), block_table.stride(0), sp.per, tau * LOG2E,
        SINK=layer.sink, RECENT=layer.recent, SPLIT=sp.splits > 1, C_BITS=layer.fmt.content_bits, num_warps=8,
    )  # fmt: skip


def hopper_page(layer, device) -> bool:
    """The layer and device the Gluon decode kernels are written for: 4-bit RoPE codes in a BF16
    cache, group 64, d_c 512, d_r 64, protection buffers on, a Hopper (sm_90) GPU."""
    return hopper_format(layer.fmt, layer.prot is not None, device)


def hopper_format(fmt, protected: bool, device) -> bool:
    """:func:`hopper_page` for a page format, whether it has protection buffers, and a device."""
    device = torch.device(device)
    return (
        (fmt.rope_bits, fmt.dtype, fmt.group, fmt.d_c, fmt.d_r) == (4, torch.bfloat16, 64, 512, 64)
        and protected
        and device.type == "cuda"
        and _sm90(device.index if device.index is not None else torch.cuda.current_device())
    )


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


__all__ = ["MIN_TILES", "NAME", "hopper_format", "hopper_page", "launch", "split", "supports"]
