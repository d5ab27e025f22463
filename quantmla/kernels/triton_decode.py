"""Decode attention over the paged cache (the paper's §3.3, App. C.5): split-KV, fused dequant, one softmax.

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
~1e-3); above 16 heads it is one BF16 tile by default (``pv_split``, see :data:`TILES`). With several
splits, each writes a normalized partial output and its LSE and a second kernel merges
them: m = max_j m_j, O = sum_j e^(m_j − m) s_j o_j / sum_j e^(m_j − m) s_j.

Tiles, warps, pipeline depth and split counts come from :data:`TILES` (the fastest of
``bench/decode.py --tune`` on the H200) and :func:`_splits`; docs/kernels.md describes them and
their speed.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from quantmla.kernels import fit
from quantmla.kernels._tiles import (
    INTERPRET,
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
from quantmla.kernels.layout import PAGE

LOG2E = 1.4426950408889634


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


def chunks(fmt, requested: int) -> int:
    """Column chunks of the content path the kernel can use for ``fmt``: ``requested`` (1, 2 or 4)
    when d_c is a power of two that many chunks of whole groups (and of >= 16 channels) tile, else 1."""
    n = int(requested)
    if n not in (1, 2, 4):
        raise ValueError(f"decode config chunks must be 1, 2 or 4, got {requested}")
    d_c = fmt.d_c
    ok = d_c == padded(d_c) and d_c % n == 0 and d_c // n >= 16 and (not fmt.quantized or (d_c // n) % fmt.group == 0)
    return n if ok else 1


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


@triton.jit
def _combine_kernel(OP, LSEP, O, LSE, S, DC: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the ``S`` partial (output, LSE) pairs of one (request, head) row, ``BLOCK_D`` columns per
    program, in one pass over blocks of ``BLOCK_S`` splits (the running maximum rescales the sums;
    :func:`merge` sizes the block to hold every split, so there is usually one)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    sp = tl.arange(0, BLOCK_S)
    m_run = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ok = s0 + sp < S
        lse = tl.load(LSEP + row * S + s0 + sp, mask=ok, other=float("-inf"))
        o = tl.load(OP + (row * S + s0 + sp[:, None]) * DC + d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_run - m_safe)  # 0 while nothing has been summed (m_run = -inf)
        w = tl.exp(lse - m_safe)
        total = total * alpha + w
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m_run = m_new
    t = tl.sum(total, 0)
    has = t > 0
    tl.store(O + row * DC + d, acc / tl.where(has, t, 1.0))
    if tl.program_id(1) == 0:
        m_safe = tl.where(m_run == float("-inf"), 0.0, m_run)
        tl.store(LSE + row, tl.where(has, m_safe + tl.log(tl.where(has, t, 1.0)), float("-inf")))


SM_COUNT = {}


def _sms(device) -> int:
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in SM_COUNT:
        SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return SM_COUNT[i]


def _splits(B: int, heads: int, tiles: int, slots: int) -> int:
    """Split count for ``B · heads`` rows of ``tiles`` tiles on ``slots`` resident programs
    (SMs × programs per SM). The kernel's time goes as waves / splits (every program of a
    wave does ``tiles / splits`` tiles); among the fullest split count of 1 to 4 waves the
    cheapest wins, and more splits must win by 5% (each split adds a partial output to merge)."""
    rows = B * heads
    best, cost = 1, -(-rows // slots)
    for waves in range(1, 5):
        s = max(1, min(tiles, waves * slots // rows))
        c = -(-rows * s // slots) / s
        if c < cost * 0.95:
            best, cost = s, c
    return best


TILES = {
    # (H > 16, quantized) -> tiles, warps, pipeline depth, content chunks: the fastest of
    # bench/decode.py --tune on the H200. Four-warp programs run
    # two per SM. Above 16 heads, P enters P·V as one BF16 tile (FlashMLA's precision): that is
    # what lets 64-head programs compile to wgmma, one program per 64 heads reconstructing each
    # tile once. Four content chunks cut the registers a reconstructed tile holds. Where the
    # Gluon Hopper kernel applies (C4R4 and C2R4, see gluon_decode.applies), it runs instead.
    # At up to 16 heads the default keeps the hi/lo P; asked for P as one BF16 tile (pv_split=False),
    # C4R4 runs the register-fed Gluon kernel where its splits are long enough (uses_mma16).
    (False, False): dict(block_h=16, block_n=64, num_warps=4, num_stages=2, chunks=4),
    (False, True): dict(block_h=16, block_n=64, num_warps=4, num_stages=2, chunks=4),
    (True, False): dict(block_h=64, block_n=64, num_warps=8, num_stages=2, pv_split=False),
    (True, True): dict(block_h=64, block_n=64, num_warps=8, num_stages=2, pv_split=False, chunks=4, gluon=True),
}


def programs_per_sm(cfg: dict) -> int:
    """Programs of ``cfg`` one SM holds, as the split count assumes: the register file (65,536
    registers) over a register cap ``maxnreg`` if one is set, else two 4-warp or one 8-warp
    program (the compiler takes all 255 registers per thread when it can). Shared memory is the
    tuning's business: a candidate whose tiles do not fit that many times is simply slower."""
    if cfg.get("maxnreg"):
        return max(1, 65536 // (int(cfg["maxnreg"]) * 32 * cfg["num_warps"]))
    return 2 if cfg["num_warps"] <= 4 else 1


def default_config(B: int, H: int, max_len: int, layer, device, config: dict | None = None) -> dict:
    """Tiles, warps and splits for one decode shape over ``layer``; ``config`` overrides any of them.

    One request's heads share each tile. Splits fill the GPU (SMs × programs per SM) at small
    batch and vanish at large batch; they are counted for the work tiles :func:`split_work` cuts
    (page tiles and protected tiles alike).
    """
    key = tuple(sorted((config or {}).items()))
    return dict(_config(B, H, max_len, layer.fmt, _protected(layer), device, key))


def _protected(layer) -> tuple[int, int] | None:
    """(sink, recent) rows a layer attends to from its protection buffer, or None without one."""
    return None if layer.prot is None else (layer.sink, layer.recent)


@functools.lru_cache(maxsize=4096)
def _config(B: int, H: int, max_len: int, fmt, prot, device, key: tuple) -> dict:
    """Cached body of :func:`default_config` (the split search stays off the per-step host path)."""
    config = dict(key)
    if INTERPRET:
        block_h = max(16, triton.next_power_of_2(min(H, 64)))
        base = dict(block_h=block_h, block_n=64, num_splits=2, num_warps=4, num_stages=1, pv_split=H <= 16)
        return base | config
    cfg = dict(TILES[(H > 16, fmt.quantized)])
    cfg["block_h"] = min(cfg["block_h"], max(16, triton.next_power_of_2(H)))
    if fmt.dtype.itemsize == 4:  # twice the bytes per stage: keep the tiles within shared memory
        cfg.update(block_h=min(cfg["block_h"], 32), block_n=32, num_stages=2)
    cfg |= config
    if "num_splits" not in cfg:
        heads = triton.cdiv(H, cfg["block_h"])
        tiles = max(1, sum(_work(max_len, cfg["block_n"], prot)))
        per_sm = programs_per_sm(cfg)
        cfg["num_splits"] = _splits(B, heads, tiles, per_sm * _sms(device))
    return cfg


def _work(max_len: int, block_n: int, prot: tuple[int, int] | None, sink_in_tile0: bool = False) -> tuple[int, int]:
    """(page tiles, protected tiles) of a request of ``max_len`` tokens: the page tiles up to the
    recent window (at least the one that holds the sink), then the protected rows (sink and ring,
    or only the ring where the sink is swapped into page tile 0) in tiles of their own."""
    if prot is None:
        return triton.cdiv(max_len, block_n), 0
    sink, recent = prot
    end = min(max(max_len - recent, sink), max_len)
    return triton.cdiv(end, block_n), triton.cdiv(recent + (0 if sink_in_tile0 else sink), block_n)


def swaps_sink(sink: int, block_n: int) -> bool:
    """Whether the Triton kernel can attend to the sink rows inside page tile 0 (swapped in from
    the protection buffer) rather than as protected rows of their own: when they fit in one tile
    (:func:`plan` decides where it does)."""
    return 0 < sink <= block_n


def split_work(layer, max_len: int, block_n: int, num_splits: int, sink_in_tile0: bool = False) -> tuple[int, int]:
    """(splits, tiles per split) for ``num_splits`` requested: the work tiles of :func:`_work`
    (page tiles, then protected tiles) cut into equal shares. Split ``s`` takes a request's work
    tiles ``s·per … (s+1)·per − 1``; those past its page tiles are its protected tiles, so a short
    request's protected rows fall to earlier splits, and they spread over several splits where a
    share is shorter than they are. With ``sink_in_tile0`` (the Triton kernel where :func:`plan`
    chooses it, and the Gluon kernel) the sink rides in page tile 0 and the protected tiles
    are the ring's: 2 of 64 for the default 128 rows, as many as BF16 reads there; else sink and
    ring are 132 rows, 3 tiles (the register-fed kernel). The Gluon kernel attends to its ring
    tiles in its last split."""
    work = max(1, sum(_work(max_len, block_n, _protected(layer), sink_in_tile0)))
    splits = max(1, min(num_splits, work))
    per = triton.cdiv(work, splits)
    return triton.cdiv(work, per), per


EXACT_PROT_WEIGHT = 5  # page tiles one protected tile weighs in the exact kernel's splits (rows off the pipeline)


def prot_weight(cfg: dict) -> int:
    """The weight of a protected tile in the exact kernel's splits under decode config ``cfg``."""
    return int(cfg.get("prot_weight", EXACT_PROT_WEIGHT))


def front_share(per: int, weight: int, k: int) -> tuple[int, int]:
    """(protected tiles per split, first page unit) of :func:`front_split_work`: ``k`` protected
    tiles of ``weight`` units each (at most a split's ``per``) at the front, as many to a split as fit
    in it whole, and the page tiles (one unit each) from the unit after the last of them."""
    if per <= 0:  # no work (timing probes of a split's fixed cost)
        return 0, 0
    if k == 0:
        return 1, 0
    w = max(1, min(weight, per))
    m = per // w
    return m, ((k - 1) // m) * per + ((k - 1) % m + 1) * w


def front_split_work(layer, max_len: int, num_splits: int, weight: int) -> tuple[int, int]:
    """(splits, units per split) for the exact kernel: a request's protected tiles first, each
    weighing ``weight`` page tiles (a protected tile reads 64 BF16 rows, 3.6x a C4R4 page, without the
    page copies' pipeline), then its page tiles; at most ``num_splits`` splits of the fewest equal
    units that fit (a protected tile weighs a whole split where splits are shorter than ``weight``).
    Split ``s`` takes units ``s·per … (s+1)·per − 1`` (:func:`front_ranges`)."""
    n, k = _work(max_len, PAGE, _protected(layer))
    per = max(1, triton.cdiv(n + k, max(1, num_splits)))  # the fewest units per split that can do
    while True:
        end = front_share(per, weight, k)[1]
        splits = max(1, triton.cdiv(end + n, per))
        if splits <= max(1, num_splits):
            return splits, per
        per += 1


def front_ranges(s: int, per: int, weight: int, k: int, n: int) -> tuple[range, range]:
    """(page tiles, protected tiles) split ``s`` of :func:`front_split_work` attends to in a request of
    ``n`` page tiles and ``k`` protected tiles: what the exact kernel computes from its program id."""
    m, end = front_share(per, weight, k)
    lo = s * per
    return range(max(lo - end, 0), min(max(lo + per - end, 0), n)), range(min(s * m, k), min(s * m + m, k))


@functools.cache
def _gluon():
    """The Gluon Hopper kernel's module, or None where this Triton has no (compatible) Gluon."""
    try:
        from quantmla.kernels import gluon_decode
    except (ImportError, AttributeError):
        return None
    return gluon_decode


@functools.cache
def _mma16():
    """The 16-head register-fed Gluon kernel's module, or None where this Triton has no (compatible) Gluon."""
    try:
        from quantmla.kernels import mma_decode
    except (ImportError, AttributeError):
        return None
    return mma_decode


@functools.cache
def _exact():
    """The 16-head exact-dequantization Gluon kernel's module, or None where this Triton has no (compatible) Gluon."""
    try:
        from quantmla.kernels import exact_decode
    except (ImportError, AttributeError):
        return None
    return exact_decode


GLUON_MIN_TILES = 4
"""Fewest tiles per split for the Gluon kernel: with 1-2 its prologue (the query block and the first
tile, not overlapped) costs more than the overlap wins."""

MMA16_MIN_TILES = 64
"""Fewest tiles per split for the 16-head register-fed kernel (config ``mma16_min_tiles`` overrides).
Against the Triton kernel with the same BF16 P it is slower on short splits, even around this
length, and faster on long ones."""


def uses_gluon(layer, H: int, cfg: dict, device, per: int) -> bool:
    """Whether a decode with tiles ``cfg`` and ``per`` tiles per split runs on :mod:`.gluon_decode`
    (config ``gluon``, P as one BF16 tile, 64-token tiles, enough tiles per split, and a layer and
    device that kernel takes)."""
    if INTERPRET or not cfg.get("gluon") or cfg.get("pv_split", True) or cfg["block_n"] != 64:
        return False
    if per < GLUON_MIN_TILES:
        return False
    g = _gluon()
    return g is not None and g.applies(layer, H, device)


def uses_mma16(layer, H: int, cfg: dict, device, per: int) -> bool:
    """Whether a decode with tiles ``cfg`` and ``per`` tiles per split runs on :mod:`.mma_decode`:
    at most 16 heads with P as one BF16 tile (``pv_split=False``), 64-token tiles, config ``mma16``
    not False, at least ``mma16_min_tiles`` (default :data:`MMA16_MIN_TILES`) tiles per split, and
    a layer and device that kernel takes."""
    if INTERPRET or H > 16 or cfg.get("pv_split", True) or not cfg.get("mma16", True) or cfg["block_n"] != 64:
        return False
    if per < int(cfg.get("mma16_min_tiles", MMA16_MIN_TILES)):
        return False
    m = _mma16()
    return m is not None and m.applies(layer, H, device)


def exact_refusal(layer, H: int, device) -> str | None:
    """Why the exact kernel cannot take this decode (None when it can)."""
    try:
        check_exact(layer, H, device)
    except ValueError as e:
        return str(e)
    return None


def check_exact(layer, H: int, device) -> None:
    """Raise where config ``exact`` cannot be honoured: only :mod:`.exact_decode` computes attention
    over the exactly dequantized cache, for the layers, head counts and devices it takes."""
    check_exact_format(layer.fmt, layer.prot is not None, H, device)


def check_exact_format(fmt, protected: bool, H: int, device) -> None:
    """:func:`check_exact` for a page format, whether it has protection buffers, ``H`` and a device:
    what a run checks before it loads a model."""
    e = None if INTERPRET else _exact()
    if e is None or not e.takes(fmt, protected, H, device):
        raise ValueError(
            "decode config exact=True (attention over the exactly dequantized cache) runs only on the "
            "exact_decode Gluon kernel: C4R4 or C2R4 in a BF16 cache with protection buffers, group 64, d_c 512, "
            f"d_r 64, at most 16 heads, on a Hopper (sm_90) GPU; got {fmt.name} in {fmt.dtype}, group {fmt.group}, "
            f"d_c {fmt.d_c}, d_r {fmt.d_r}, {H} heads, protection {'on' if protected else 'off'}, device {device}"
        )


class Plan(NamedTuple):
    """What :func:`decode` launches: the kernel (``"exact"``, ``"gluon"``, ``"mma16"`` or ``"triton"``), its
    splits and work tiles per split, and whether the sink rides in page tile 0."""

    kernel: str
    splits: int
    per: int
    sink_in_tile0: bool


def plan(layer, H: int, cfg: dict, device, max_len: int) -> Plan:
    """The :class:`Plan` for a decode with tiles ``cfg``: the Gluon kernel where :func:`uses_gluon`
    takes the shape with its own work count, the register-fed one where :func:`uses_mma16` does,
    else the Triton kernel. That one takes the sink into page tile 0 (one work tile fewer) at up to
    16 heads where splits hold more than one tile: alone, the peeled tile 0 takes longer than a
    protected tile of its own."""
    bn, ns = cfg["block_n"], int(cfg["num_splits"])
    if cfg.get("exact"):
        check_exact(layer, H, device)
        return Plan("exact", *front_split_work(layer, max_len, ns, prot_weight(cfg)), False)
    if cfg.get("gluon"):
        splits, per = split_work(layer, max_len, bn, ns, sink_in_tile0=True)
        if uses_gluon(layer, H, cfg, device, per):
            return Plan("gluon", splits, per, True)
    splits, per = split_work(layer, max_len, bn, ns)
    if uses_mma16(layer, H, cfg, device, per):
        return Plan("mma16", splits, per, False)
    if per > 1 and H <= 16 and layer.prot is not None and swaps_sink(layer.sink, bn):
        return Plan("triton", *split_work(layer, max_len, bn, ns, sink_in_tile0=True), True)
    return Plan("triton", splits, per, False)


def decode(layer, block_table, lengths, q_lat, q_pe, tau: float, config: dict | None = None, out=None):
    """Triton decode; see :func:`quantmla.kernels.reference.decode` for the contract."""
    fmt = layer.fmt
    B, H, _ = q_lat.shape
    dev = q_lat.device
    config = config or {}
    max_len = int(config["max_len"]) if "max_len" in config else (int(lengths.max()) if B else 0)
    cfg = default_config(B, H, max_len, layer, dev, config)
    block_h, block_n = cfg["block_h"], cfg["block_n"]
    if block_h < 16 or block_n < 16 or PAGE % block_n or (block_h & (block_h - 1)):
        raise ValueError(f"decode tiles: block_n must divide {PAGE}, both powers of two of at least 16; got {cfg}")
    if cfg.get("exact") and (why := exact_refusal(layer, H, dev)):
        fit.say_once(("exact decode", fmt, H, str(dev)), "exact decode: %s; running the torch reference on %s (slower)",
                     why, dev)  # fmt: skip
        from quantmla.kernels import reference

        return reference.decode(layer, block_table, lengths, q_lat, q_pe, tau, None, out, exact=True)
    pl = plan(layer, H, cfg, dev, max_len)
    q = q_lat.to(fmt.dtype).contiguous()
    qpe = q_pe.to(fmt.dtype).contiguous()
    o, lse = out if out is not None else (torch.empty(B, H, fmt.d_c, dtype=torch.float32, device=dev), None)
    lse = lse if lse is not None else torch.empty(B, H, dtype=torch.float32, device=dev)
    if B == 0:
        return o, lse
    op, lsep = partials(o, lse, pl.splits)
    launch(pl, layer, block_table, lengths, q, qpe, op, lsep, tau, cfg)
    merge(op, lsep, o, lse)
    return o, lse


def launch(pl: Plan, layer, block_table, lengths, q, qpe, op, lsep, tau: float, cfg: dict) -> None:
    """The decode kernel of plan ``pl`` into the partials ``op``/``lsep`` of :func:`partials` (no
    merge): ``q``, ``qpe`` in the cache dtype, contiguous; ``cfg`` the full tile config."""
    kernel, splits, per, sink_in_tile0 = pl
    args = (layer, block_table, lengths, q, qpe, op, lsep, tau, splits, per)
    if kernel == "exact":
        _exact().decode(*args, cfg.get("maxnreg"), weight=prot_weight(cfg))
    elif kernel == "gluon":
        _gluon().decode(*args)
    elif kernel == "mma16":
        _mma16().decode(*args)
    else:
        _launch(*args[:8], cfg, splits, per, sink_in_tile0)


def partials(o, lse, splits: int):
    """Where the decode kernels write: float32 partial outputs (B, H, splits, d_c) and LSEs (B, H,
    splits) for :func:`merge` when ``splits > 1``, else the outputs ``o`` (B, H, d_c) and ``lse``
    (B, H) themselves, viewed (B, H, 1, d_c) and (B, H)."""
    if splits == 1:
        return o.unsqueeze(2), lse
    B, H, d_c = o.shape
    return (
        torch.empty(B, H, splits, d_c, dtype=torch.float32, device=o.device),
        torch.empty(B, H, splits, dtype=torch.float32, device=o.device),
    )


def merge(op, lsep, o, lse) -> None:
    """Combine the splits of :func:`partials` into ``o`` and ``lse`` by their LSEs (nothing to do
    for one split)."""
    B, H, splits, d_c = op.shape
    if splits == 1:
        return
    # every split in one block (up to 512), columns so that a program holds ~8K partial values:
    # one pass, and at batch 1 hundreds of programs (v25)
    block_s = min(512, triton.next_power_of_2(splits))
    block_d = min(d_c & -d_c, max(16, 8192 // block_s))  # a power of two dividing d_c
    _combine_kernel[(B * H, d_c // block_d)](op, lsep, o, lse, splits, DC=d_c, BLOCK_S=block_s, BLOCK_D=block_d)


def constexprs(layer, cfg: dict, split: bool, sink_in_tile0: bool) -> dict:
    """The decode kernel's compile-time arguments for ``layer`` and tiles ``cfg`` (also what
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


def _launch(layer, block_table, lengths, q, qpe, op, lsep, tau, cfg, splits, per, sink_in_tile0):
    """The Triton decode kernel over ``splits`` splits of ``per`` work tiles (partials into
    ``op``/``lsep`` when split), the sink in page tile 0 or in the protected tiles; the tiles step
    down (:data:`FALLBACK`) where the tuned ones do not fit the GPU."""
    fmt = layer.fmt
    tiles = tuple(
        cfg.get(k) for k in ("block_h", "block_n", "num_warps", "num_stages", "chunks", "pv_split", "maxnreg")
    )
    key = (str(q.device), fmt, q.shape[1], layer.prot is not None, splits > 1, sink_in_tile0, tiles)
    ladder = [cfg] if INTERPRET else fit.smaller(cfg, FALLBACK)
    fit.launch("decode", key, ladder, lambda c: _launch_one(layer, block_table, lengths, q, qpe, op, lsep, tau, c,
               splits, per, sink_in_tile0))  # fmt: skip


def _launch_one(layer, block_table, lengths, q, qpe, op, lsep, tau, cfg, splits, per, sink_in_tile0):
    B, H, _ = q.shape
    prot = layer.prot if layer.prot is not None else q
    grid = (triton.cdiv(H, cfg["block_h"]), splits, B)
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
        per,
        tau * LOG2E,
        **constexprs(layer, cfg, splits > 1, sink_in_tile0),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        maxnreg=cfg.get("maxnreg"),
    )


__all__ = ["decode", "default_config", "launch", "merge", "partials", "plan", "split_work", "uses_gluon", "uses_mma16"]
