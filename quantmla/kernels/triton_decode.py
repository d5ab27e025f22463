"""Decode attention over the paged cache (the paper's §3.3, App. C.5, Fig. 8) as a Triton kernel: split-KV, fused
dequant, one softmax.

Grid ``(head blocks, splits, batch)``. A program takes ``BLOCK_H`` query heads of one request
and a contiguous range of its tiles (``BLOCK_N`` tokens of one page). Per tile it gathers the
page through the block table, unpacks and dequantizes the content and RoPE rows once for all
its heads, swaps in the protected rows (sink, recent ring) from the protection buffer, and
runs the online softmax of absorbed attention::

    S = tau (q_lat Ĉ^T + q_pe K̂_P^T),   o += softmax(S) Ĉ

The same reconstructed content tile is the key of ``q_lat Ĉ^T`` and the value of ``P Ĉ``.
It is read, reconstructed and staged in up to four column chunks of whole quantization groups
(config ``chunks``), each with its own slice of the query and of the accumulator: the compiler
then holds one chunk, not the whole tile, in registers on its way to shared memory.
With up to 16 heads ``P`` enters the tensor cores as a hi/lo pair in the cache dtype
(P = P_hi + P_lo), so the product keeps float32 accuracy (~1e-6 relative instead of bf16's
~1e-3); above 16 heads it is one BF16 tile by default (config ``pv_split``, see
:data:`quantmla.kernels.dispatch.TILES`). With several splits, each writes a normalized partial
output and its LSE, merged by :func:`quantmla.kernels.splits.merge`.

Takes every decode but the exact one (:func:`supports`); :mod:`quantmla.kernels.dispatch`
chooses it where no Gluon kernel takes the case, and its tiles and split count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla.kernels import fit
from quantmla.kernels._tiles import (
    INTERPRET,
    LOG2E,
    PAGE_TOKENS,
    anchor,
    dot,
    layer_constexprs,
    load_meta,
    load_rows,
    online_softmax,
    padded,
    pv,
    region_args,
    tl_dtype,
)
from quantmla.kernels.splits import Case, Split, split_work

NAME = "triton"


@triton.jit
def _step(q0, q1, q2, q3, qpe, k0, k1, k2, k3, kr, valid, m_i, l_i, a0, a1, a2, a3, qk_scale, NCH: tl.constexpr,
          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PV_SPLIT: tl.constexpr, IEEE: tl.constexpr,
          KV: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """One tile of the online softmax over content keys/values in ``NCH`` column chunks ``k0..``
    (N, d_c / NCH each, with the query chunks ``q0..`` and accumulator chunks ``a0..``) and the
    RoPE keys ``kr`` (N, d_r). Chunks past ``NCH`` are not used and come back as they went in."""
    s = dot(q0, tl.trans(k0), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), IEEE, INTERP)
    if NCH > 1:
        s = dot(q1, tl.trans(k1), s, IEEE, INTERP)
    if NCH > 2:
        s = dot(q2, tl.trans(k2), s, IEEE, INTERP)
        s = dot(q3, tl.trans(k3), s, IEEE, INTERP)
    s = dot(qpe, tl.trans(kr), s, IEEE, INTERP)
    m_new, l_i, p, alpha = online_softmax(s, valid[None, :], m_i, l_i, qk_scale)
    a0 = pv(p, k0, a0 * alpha[:, None], PV_SPLIT, IEEE, KV, INTERP)
    if NCH > 1:
        a1 = pv(p, k1, a1 * alpha[:, None], PV_SPLIT, IEEE, KV, INTERP)
    if NCH > 2:
        a2 = pv(p, k2, a2 * alpha[:, None], PV_SPLIT, IEEE, KV, INTERP)
        a3 = pv(p, k3, a3 * alpha[:, None], PV_SPLIT, IEEE, KV, INTERP)
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _tile(t, low_hi, SINK: tl.constexpr, TPP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page slots of tile ``t`` and which of its tokens the pages serve (SINK <= token < low_hi)."""
    offs = t * BLOCK_N + tl.arange(0, BLOCK_N)
    return (t % TPP) * BLOCK_N + tl.arange(0, BLOCK_N), (offs < low_hi) & (offs >= SINK)


@triton.jit
def _meta(scale_ptr, zero_ptr, ps_scale, ps_zero, page, slots, valid, J: tl.constexpr, NCH: tl.constexpr,
          DC: tl.constexpr, DCP: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Scales and zero-points of content chunk ``J`` of ``NCH`` (:func:`_tiles.load_meta` for one chunk)."""
    if NCH == 1:
        return load_meta(scale_ptr, zero_ptr, ps_scale, ps_zero, page, slots, valid, DC, DCP, BITS, G, BLOCK_N)
    elif BITS == 16:
        return tl.zeros([BLOCK_N, 1], tl.float32), tl.zeros([BLOCK_N, 1], tl.uint8)
    else:
        GC: tl.constexpr = DC // NCH // G  # groups per chunk
        g = J * GC + tl.arange(0, GC)
        off = slots[:, None] * (DC // G) + g[None, :]
        s = tl.load((scale_ptr + page * ps_scale) + off, mask=valid[:, None], other=0.0)
        z = tl.load((zero_ptr + page * ps_zero) + off)
        return s, z


@triton.jit
def _rows(rows_ptr, codes_ptr, ps_rows, ps_codes, page, slots, valid, s, z, J: tl.constexpr, NCH: tl.constexpr,
          DC: tl.constexpr, DCP: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
          BLOCK_N: tl.constexpr, KV: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """(BLOCK_N, DCP / NCH) content rows of chunk ``J`` (:func:`_tiles.load_rows` for one chunk).
    A chunk is whole quantization groups (codes are group-major in a page, so its codes start
    at group J·DC/NCH/G); a reconstructed chunk passes through ``anchor`` so that the two
    products reading it (scores and P·V) share it."""
    CW: tl.constexpr = DCP // NCH
    if NCH == 1:
        x = load_rows(rows_ptr, codes_ptr, ps_rows, ps_codes, page, slots, valid, s, z,
                      DC, DCP, BITS, W, G, BLOCK_N, KV, INTERP)  # fmt: skip
    elif BITS == 16:
        cols = J * CW + tl.arange(0, CW)
        x = tl.load((rows_ptr + page * ps_rows) + (slots[:, None] * DC + cols[None, :]), mask=valid[:, None], other=0.0)
    else:
        x = load_rows(rows_ptr, codes_ptr + J * (CW // G) * (PAGE_TOKENS * (G * W // 8)), ps_rows, ps_codes, page,
                      slots, valid, s, z, CW, CW, BITS, W, G, BLOCK_N, KV, INTERP)  # fmt: skip
    if BITS < 16:
        x = anchor(x, INTERP)
    return x.to(KV)


@triton.jit
def _metas(scale_ptr, zero_ptr, ps_scale, ps_zero, page, slots, valid, NCH: tl.constexpr, DC: tl.constexpr,
           DCP: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Scales and zero-points of the ``NCH`` content chunks, ``(s0, z0, ..., s3, z3)``; the slots
    of chunks past ``NCH`` repeat chunk 0 (unused)."""
    s0, z0 = _meta(scale_ptr, zero_ptr, ps_scale, ps_zero, page, slots, valid, 0, NCH, DC, DCP, BITS, G, BLOCK_N)
    s1, z1, s2, z2, s3, z3 = s0, z0, s0, z0, s0, z0
    if NCH > 1:
        s1, z1 = _meta(scale_ptr, zero_ptr, ps_scale, ps_zero, page, slots, valid, 1, NCH, DC, DCP, BITS, G, BLOCK_N)
    if NCH > 2:
        s2, z2 = _meta(scale_ptr, zero_ptr, ps_scale, ps_zero, page, slots, valid, 2, NCH, DC, DCP, BITS, G, BLOCK_N)
        s3, z3 = _meta(scale_ptr, zero_ptr, ps_scale, ps_zero, page, slots, valid, 3, NCH, DC, DCP, BITS, G, BLOCK_N)
    return s0, z0, s1, z1, s2, z2, s3, z3


@triton.jit
def _ahead(bt_row, tn, low_hi, CScale, CZero, ps_cscale, ps_czero, RScale, RZero, ps_rscale, ps_rzero,
           SINK: tl.constexpr, TPP: tl.constexpr, NCH: tl.constexpr, DC: tl.constexpr, DCP: tl.constexpr,
           C_BITS: tl.constexpr, DR: tl.constexpr, R_BITS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Tile ``tn``'s block-table entry and its content and RoPE scales and zero-points, ``(page,
    s0, z0, ..., s3, z3, sr, zr)``: loaded a tile ahead, so their latency hides behind a tile's work."""
    page = tl.load(bt_row + tn // TPP).to(tl.int64)
    slots, valid = _tile(tn, low_hi, SINK, TPP, BLOCK_N)
    s0, z0, s1, z1, s2, z2, s3, z3 = _metas(CScale, CZero, ps_cscale, ps_czero, page, slots, valid, NCH,
                                            DC, DCP, C_BITS, G, BLOCK_N)  # fmt: skip
    sr, zr = load_meta(RScale, RZero, ps_rscale, ps_rzero, page, slots, valid, DR, DR, R_BITS, G, BLOCK_N)
    return page, s0, z0, s1, z1, s2, z2, s3, z3, sr, zr


@triton.jit
def _chunk_rows(rows_ptr, codes_ptr, ps_rows, ps_codes, page, slots, valid, s0, z0, s1, z1, s2, z2, s3, z3,
                NCH: tl.constexpr, DC: tl.constexpr, DCP: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr,
                G: tl.constexpr, BLOCK_N: tl.constexpr, KV: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """The ``NCH`` content chunks of a tile (:func:`_rows` for each), ``(k0, k1, k2, k3)``; the
    slots of chunks past ``NCH`` repeat chunk 0 (unused)."""
    k0 = _rows(rows_ptr, codes_ptr, ps_rows, ps_codes, page, slots, valid, s0, z0, 0, NCH,
               DC, DCP, BITS, W, G, BLOCK_N, KV, INTERP)  # fmt: skip
    k1, k2, k3 = k0, k0, k0
    if NCH > 1:
        k1 = _rows(rows_ptr, codes_ptr, ps_rows, ps_codes, page, slots, valid, s1, z1, 1, NCH,
                   DC, DCP, BITS, W, G, BLOCK_N, KV, INTERP)  # fmt: skip
    if NCH > 2:
        k2 = _rows(rows_ptr, codes_ptr, ps_rows, ps_codes, page, slots, valid, s2, z2, 2, NCH,
                   DC, DCP, BITS, W, G, BLOCK_N, KV, INTERP)  # fmt: skip
        k3 = _rows(rows_ptr, codes_ptr, ps_rows, ps_codes, page, slots, valid, s3, z3, 3, NCH,
                   DC, DCP, BITS, W, G, BLOCK_N, KV, INTERP)  # fmt: skip
    return k0, k1, k2, k3


@triton.jit
def _chunks(base, offs, mask, CW: tl.constexpr, NCH: tl.constexpr):
    """The ``NCH`` column chunks of ``CW`` at ``base + offs`` (rows of queries or of protected keys
    in memory; chunk j at ``base + j·CW + offs``), ``(x0, x1, x2, x3)``; the slots of chunks past
    ``NCH`` repeat chunk 0 (unused)."""
    x0 = tl.load(base + offs, mask=mask, other=0.0)
    x1, x2, x3 = x0, x0, x0
    if NCH > 1:
        x1 = tl.load(base + CW + offs, mask=mask, other=0.0)
    if NCH > 2:
        x2 = tl.load(base + 2 * CW + offs, mask=mask, other=0.0)
        x3 = tl.load(base + 3 * CW + offs, mask=mask, other=0.0)
    return x0, x1, x2, x3


@triton.jit
def _swap(rows, p0, p1, p2, p3, k0, k1, k2, k3, NCH: tl.constexpr):
    """The content chunks ``k0..`` with the ``rows`` taken from ``p0..`` instead."""
    k0 = tl.where(rows[:, None], p0, k0)
    if NCH > 1:
        k1 = tl.where(rows[:, None], p1, k1)
    if NCH > 2:
        k2 = tl.where(rows[:, None], p2, k2)
        k3 = tl.where(rows[:, None], p3, k3)
    return k0, k1, k2, k3


@triton.jit
def _decode_kernel(
    Q,
    QPE,
    O,
    LSE,
    BT,
    LENS,
    PROT,
    CRows,
    CCodes,
    CScale,
    CZero,
    ps_crows,
    ps_ccodes,
    ps_cscale,
    ps_czero,
    RRows,
    RCodes,
    RScale,
    RZero,
    ps_rrows,
    ps_rcodes,
    ps_rscale,
    ps_rzero,
    H,
    stride_qb,
    stride_qh,
    stride_rb,
    stride_rh,
    stride_pb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_bt,
    tiles_per_split,
    qk_scale,
    DC: tl.constexpr,
    DCP: tl.constexpr,
    DR: tl.constexpr,
    G: tl.constexpr,
    C_BITS: tl.constexpr,
    R_BITS: tl.constexpr,
    C_W: tl.constexpr,
    R_W: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    HAS_PROT: tl.constexpr,
    SWAP_SINK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NCH: tl.constexpr,
    SPLIT: tl.constexpr,
    PV_SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    KV: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    L = tl.load(LENS + b).to(tl.int32)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dr = tl.arange(0, DR)
    # the content path in NCH column chunks (see chunks()): query, keys and accumulator alike
    CW: tl.constexpr = DCP // NCH
    cw = tl.arange(0, CW)
    q_rows = Q + b * stride_qb + heads[:, None] * stride_qh
    qm = hmask[:, None] & (cw[None, :] < DC)
    q0, q1, q2, q3 = _chunks(q_rows, cw[None, :], qm, CW, NCH)
    qpe = tl.load(QPE + b * stride_rb + heads[:, None] * stride_rh + dr[None, :], mask=hmask[:, None], other=0.0)

    if HAS_PROT:
        low_hi = L - RECENT  # tokens SINK <= t < L - RECENT are read from the pages
        n_tiles = tl.cdiv(tl.minimum(tl.maximum(low_hi, SINK), L), BLOCK_N)  # as split_work counts them
    else:
        low_hi = L
        n_tiles = tl.cdiv(L, BLOCK_N)
    t_lo = pid_s * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    a0 = tl.zeros([BLOCK_H, CW], tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    TPP: tl.constexpr = PAGE_SIZE // BLOCK_N  # tiles per page: a tile never straddles two pages
    # The block-table entry and the small metadata loads of a tile are issued one tile ahead,
    # so their latency hides behind the previous tile's work (the codes and rows themselves
    # are software-pipelined by the compiler).
    page = tl.load(BT + b * stride_bt + t_lo // TPP, mask=t_lo < t_hi, other=0).to(tl.int64)
    slots, valid = _tile(t_lo, low_hi, SINK, TPP, BLOCK_N)
    s0, z0, s1, z1, s2, z2, s3, z3 = _metas(CScale, CZero, ps_cscale, ps_czero, page, slots, valid, NCH,
                                            DC, DCP, C_BITS, G, BLOCK_N)  # fmt: skip
    sr, zr = load_meta(RScale, RZero, ps_rscale, ps_rzero, page, slots, valid, DR, DR, R_BITS, G, BLOCK_N)
    t_first = t_lo
    if SWAP_SINK:  # page tile 0 on its own, its first SINK rows swapped for the protection buffer's
        if (t_lo == 0) & (t_lo < t_hi):
            slots, valid = _tile(t_lo, low_hi, SINK, TPP, BLOCK_N)
            k0, k1, k2, k3 = _chunk_rows(CRows, CCodes, ps_crows, ps_ccodes, page, slots, valid, s0, z0, s1, z1, s2,
                                         z2, s3, z3, NCH, DC, DCP, C_BITS, C_W, G, BLOCK_N, KV, INTERP)  # fmt: skip
            kr = load_rows(RRows, RCodes, ps_rrows, ps_rcodes, page, slots, valid, sr, zr,
                           DR, DR, R_BITS, R_W, G, BLOCK_N, KV, INTERP)  # fmt: skip
            r = tl.arange(0, BLOCK_N)
            sink = (r < SINK) & (r < L)
            rows = PROT + b * stride_pb + r[:, None] * (DC + DR)
            p0, p1, p2, p3 = _chunks(rows, cw[None, :], sink[:, None] & (cw[None, :] < DC), CW, NCH)
            k0, k1, k2, k3 = _swap(sink, p0, p1, p2, p3, k0, k1, k2, k3, NCH)
            kr = tl.where(sink[:, None], tl.load(rows + DC + dr[None, :], mask=sink[:, None], other=0.0), kr)
            page, s0, z0, s1, z1, s2, z2, s3, z3, sr, zr = _ahead(
                BT + b * stride_bt, tl.minimum(t_lo + 1, t_hi - 1), low_hi, CScale, CZero, ps_cscale, ps_czero, RScale,
                RZero, ps_rscale, ps_rzero, SINK, TPP, NCH, DC, DCP, C_BITS, DR, R_BITS, G, BLOCK_N)  # fmt: skip
            m_i, l_i, a0, a1, a2, a3 = _step(q0, q1, q2, q3, qpe, k0, k1, k2, k3, kr, valid | sink, m_i, l_i, a0, a1,
                                             a2, a3, qk_scale, NCH, BLOCK_H, BLOCK_N, PV_SPLIT, IEEE, KV, INTERP)  # fmt: skip
            t_first = t_lo + 1
    for t in range(t_first, t_hi):
        slots, valid = _tile(t, low_hi, SINK, TPP, BLOCK_N)
        k0, k1, k2, k3 = _chunk_rows(CRows, CCodes, ps_crows, ps_ccodes, page, slots, valid, s0, z0, s1, z1, s2, z2,
                                     s3, z3, NCH, DC, DCP, C_BITS, C_W, G, BLOCK_N, KV, INTERP)  # fmt: skip
        kr = load_rows(RRows, RCodes, ps_rrows, ps_rcodes, page, slots, valid, sr, zr,
                       DR, DR, R_BITS, R_W, G, BLOCK_N, KV, INTERP)  # fmt: skip
        page, s0, z0, s1, z1, s2, z2, s3, z3, sr, zr = _ahead(
            BT + b * stride_bt, tl.minimum(t + 1, t_hi - 1), low_hi, CScale, CZero, ps_cscale, ps_czero, RScale, RZero,
            ps_rscale, ps_rzero, SINK, TPP, NCH, DC, DCP, C_BITS, DR, R_BITS, G, BLOCK_N)  # fmt: skip
        m_i, l_i, a0, a1, a2, a3 = _step(q0, q1, q2, q3, qpe, k0, k1, k2, k3, kr, valid, m_i, l_i, a0, a1, a2, a3,
                                         qk_scale, NCH, BLOCK_H, BLOCK_N, PV_SPLIT, IEEE, KV, INTERP)  # fmt: skip
    if HAS_PROT:
        # the protected rows (the sink unless page tile 0 took it, then the ring of the latest RECENT)
        # are this request's work tiles n_tiles, n_tiles + 1, …: the split whose share holds one
        # attends to it (split_work)
        ROWS: tl.constexpr = SINK + RECENT
        R0: tl.constexpr = SINK if SWAP_SINK else 0
        p_lo = tl.maximum(t_lo - n_tiles, 0) * BLOCK_N
        p_hi = tl.minimum(t_lo + tiles_per_split - n_tiles, (ROWS - R0 + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        for r0 in range(p_lo, p_hi, BLOCK_N):
            r = R0 + r0 + tl.arange(0, BLOCK_N)
            ring = r - SINK
            base = tl.maximum(L - RECENT, 0)
            tok = tl.where(L <= RECENT, ring, base + (ring - base % RECENT + RECENT) % RECENT)
            valid = tl.where(r < SINK, r < L, (r < ROWS) & (tok >= SINK) & (tok < L))
            rows = PROT + b * stride_pb + r[:, None] * (DC + DR)
            km = valid[:, None] & (cw[None, :] < DC)
            k0, k1, k2, k3 = _chunks(rows, cw[None, :], km, CW, NCH)
            kr = tl.load(rows + DC + dr[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, a0, a1, a2, a3 = _step(q0, q1, q2, q3, qpe, k0, k1, k2, k3, kr, valid, m_i, l_i,
                                             a0, a1, a2, a3, qk_scale, NCH, BLOCK_H, BLOCK_N, PV_SPLIT,
                                             IEEE, KV, INTERP)  # fmt: skip

    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_ptr = O + b * stride_ob + heads[:, None] * stride_oh + pid_s * stride_os + cw[None, :]
    tl.store(o_ptr, a0 * inv, mask=qm)
    if NCH > 1:
        tl.store(o_ptr + CW, a1 * inv, mask=qm)
    if NCH > 2:
        tl.store(o_ptr + 2 * CW, a2 * inv, mask=qm)
        tl.store(o_ptr + 3 * CW, a3 * inv, mask=qm)
    if SPLIT:
        tl.store(LSE + (b * H + heads) * tl.num_programs(1) + pid_s, lse, mask=hmask)
    else:
        tl.store(LSE + b * H + heads, lse, mask=hmask)


def supports(case: Case) -> str | None:
    """Why this kernel cannot run ``case`` (None: it can). It computes the reference's attention,
    over the reconstructed rows rounded to the cache dtype, for any layer, head count and device
    that Triton runs on, so it refuses only the exact decode."""
    if case.exact:
        return "the Triton kernel attends to the rows rounded to the cache dtype, not the exactly dequantized cache"
    return None


def swaps_sink(sink: int, block_n: int) -> bool:
    """Whether the kernel can attend to the sink rows inside page tile 0 (swapped in from the
    protection buffer) rather than as protected rows of their own: when they fit in one tile."""
    return 0 < sink <= block_n


def split(case: Case) -> Split:
    """The even split of :func:`quantmla.kernels.splits.split_work`, with the sink in page tile 0
    at up to 16 heads where splits hold more than one tile: alone, the peeled tile 0 takes longer
    than a protected tile of its own."""
    layer, cfg = case.layer, case.config
    bn, ns = cfg["block_n"], int(cfg["num_splits"])
    plain = split_work(layer, case.max_len, bn, ns)
    if plain.per > 1 and case.heads <= 16 and layer.prot is not None and swaps_sink(layer.sink, bn):
        return split_work(layer, case.max_len, bn, ns, sink_in_tile0=True)
    return plain


def chunks(fmt, requested: int) -> int:
    """Column chunks of the content path the kernel can use for ``fmt``: ``requested`` (1, 2 or 4)
    when d_c is a power of two that many chunks of whole groups (and of >= 16 channels) tile, else 1."""
    n = int(requested)
    if n not in (1, 2, 4):
        raise ValueError(f"decode config chunks must be 1, 2 or 4, got {requested}")
    d_c = fmt.d_c
    ok = d_c == padded(d_c) and d_c % n == 0 and d_c // n >= 16 and (not fmt.quantized or (d_c // n) % fmt.group == 0)
    return n if ok else 1


def constexprs(layer, cfg: dict, split: bool, sink_in_tile0: bool) -> dict:
    """The kernel's compile-time arguments for ``layer`` and tiles ``cfg`` (also what
    ``bench/gluon_sass.py --triton`` compiles for sm_90 without a GPU)."""
    fmt = layer.fmt
    return layer_constexprs(layer) | dict(
        SWAP_SINK=sink_in_tile0,
        BLOCK_H=cfg["block_h"],
        BLOCK_N=cfg["block_n"],
        NCH=chunks(fmt, cfg.get("chunks", 1)),
        SPLIT=split,
        PV_SPLIT=fmt.dtype != torch.float32 and cfg.get("pv_split", True),
        IEEE=fmt.dtype == torch.float32,
        KV=tl_dtype(fmt.dtype),
        INTERP=INTERPRET,
    )


FALLBACK = ({"num_stages": 1}, {"block_h": 16}, {"chunks": 1})
"""Steps down from the tuned tiles, in order, for a device whose shared memory they exceed (none of
them changes how the context is cut into splits)."""


def launch(case: Case, sp: Split, block_table, lengths, q, qpe, op, lsep, tau: float) -> None:
    """The kernel over ``sp.splits`` splits of ``sp.per`` work tiles into the partials ``op``/``lsep``
    of :func:`quantmla.kernels.splits.partials` (``q``, ``qpe`` in the cache dtype, contiguous); the
    tiles step down (:data:`FALLBACK`) where the tuned ones do not fit the GPU."""
    layer, cfg = case.layer, case.config
    tiles = tuple(
        cfg.get(k) for k in ("block_h", "block_n", "num_warps", "num_stages", "chunks", "pv_split", "maxnreg")
    )
    key = (str(q.device), layer.fmt, q.shape[1], layer.prot is not None, sp.splits > 1, sp.sink_in_tile0, tiles)
    ladder = [cfg] if INTERPRET else fit.smaller(cfg, FALLBACK)
    fit.launch("decode", key, ladder, lambda c: _launch_one(layer, block_table, lengths, q, qpe, op, lsep, tau, c, sp))


def _launch_one(layer, block_table, lengths, q, qpe, op, lsep, tau, cfg, sp: Split):
    B, H, _ = q.shape
    prot = layer.prot if layer.prot is not None else q
    grid = (triton.cdiv(H, cfg["block_h"]), sp.splits, B)
    _decode_kernel[grid](
        q,
        qpe,
        op,
        lsep,
        block_table,
        lengths,
        prot,
        *region_args(layer, "C"),
        *region_args(layer, "R"),
        H,
        q.stride(0),
        q.stride(1),
        qpe.stride(0),
        qpe.stride(1),
        prot.stride(0),
        op.stride(0),
        op.stride(1),
        op.stride(2),
        block_table.stride(0),
        sp.per,
        tau * LOG2E,
        **constexprs(layer, cfg, sp.splits > 1, sp.sink_in_tile0),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        maxnreg=cfg.get("maxnreg"),
    )


__all__ = ["NAME", "chunks", "constexprs", "launch", "split", "supports", "swaps_sink"]
