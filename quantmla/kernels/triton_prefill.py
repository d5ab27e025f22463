"""Teacher-forced attention with the decode-faithful protection rule (equal to token-by-token decoding).

For evaluation: every query of a sequence attends causally to its keys, and the pair
(query ``t``, key ``j``) uses the cache-dtype row of ``j`` iff ``j < sink`` or
``j > t - recent``, else the row stored in the pages, in the scores and in the aggregation
under one softmax::

    S = where(M, S_row, S_stored),   O = (P ⊙ M) C + (P ⊙ ¬M) Ĉ

so log-likelihoods see exactly what token-by-token decoding would. With config ``exact`` the
stored rows are ``s·(q − z)`` in float32, not rounded to the cache dtype: each enters the tensor
cores as a hi/lo pair of cache-dtype tiles (x = x_hi + x_lo to about 2^-17), the teacher-forced
side of the exact decode kernel's contract (:mod:`quantmla.kernels.exact_decode`). All H heads share the
latent keys, so a program takes a block of rows (query, head) — ``BLOCK_M`` of them, query
major — and each key tile is read once for all of them. Key tiles with no protected pair for
any query of the block (most tiles of a long prompt) take the stored rows alone; the sink's
tile and the band behind the queries take both and choose per pair. Grid ``(row blocks, batch)``.

The stored rows are reconstructed once per call, page by page, into the cache dtype
(:func:`_dequant_kernel`, the same :func:`_tiles.load_rows` the tile would run), and the
attention reads them like the given rows: reconstructing them inside every tile repeats that
work once per block of query rows, n·H/BLOCK_M times per key, which made the quantized kernel
about twice as slow as the 16-bit one at long prompts. Rounded to the cache dtype either way, the
two give the same bits. With ``exact`` the rows are reconstructed inside the tile in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla.kernels import fit
from quantmla.kernels._tiles import (
    INTERPRET,
    LOG2E,
    anchor,
    container_bits,
    dot,
    load_meta,
    load_rows,
    online_softmax,
    padded,
    pv,
    region_args,
    tl_dtype,
)
from quantmla.kernels.layout import PAGE


@triton.jit
def _tile(q, qpe, m_i, l_i, acc, k0, b, kv_len, tq, live, qk_scale, given, stored, deq,
          DC: tl.constexpr, DCP: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, C_BITS: tl.constexpr,
          R_BITS: tl.constexpr, C_W: tl.constexpr, R_W: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
          PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PV_SPLIT: tl.constexpr,
          IEEE: tl.constexpr, KV: tl.constexpr, INTERP: tl.constexpr, MODE: tl.constexpr,
          EXACT: tl.constexpr, DEQ: tl.constexpr):  # fmt: skip
    """One key tile k0 .. k0 + BLOCK_N into the block's online softmax. MODE 0: the rows as given
    (16-bit cache); 1: the rows as given and the stored rows, chosen per pair by the protection
    rule; 2: the stored rows alone (the caller knows no pair of this tile is protected).
    ``given`` holds the given rows' pointers and strides, ``stored`` the block table and both
    paths' page regions (:func:`_tiles.region_args`). ``DEQ``: the stored rows are read from ``deq``
    (pointers and strides of both paths' reconstructed rows) instead of reconstructed from the pages.
    ``EXACT``: the stored rows reconstructed in float32 and split into a hi/lo pair in the cache
    dtype, instead of rounded to it."""
    SK: tl.constexpr = tl.float32 if EXACT else KV  # the dtype the stored rows are reconstructed in
    C, KP, stride_cb, stride_cl, stride_kb, stride_kl = given
    BT, stride_bt, CRows, CCodes, CScale, CZero, ps_crows, ps_ccodes, ps_cscale, ps_czero = stored[:10]
    RRows, RCodes, RScale, RZero, ps_rrows, ps_rcodes, ps_rscale, ps_rzero = stored[10:]
    j = k0 + tl.arange(0, BLOCK_N)
    jv = j < kv_len
    dc = tl.arange(0, DCP)
    dr = tl.arange(0, DR)
    if MODE != 2:
        xc = tl.load(
            C + b * stride_cb + j[:, None] * stride_cl + dc[None, :], mask=jv[:, None] & (dc[None, :] < DC), other=0.0
        )
        xr = tl.load(KP + b * stride_kb + j[:, None] * stride_kl + dr[None, :], mask=jv[:, None], other=0.0)
        s = dot(q, tl.trans(xc), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE, INTERP)
        s = dot(qpe, tl.trans(xr), s, IEEE, INTERP)
    if MODE != 0 and DEQ:  # the stored copies, reconstructed once per call by _dequant_kernel
        DQC, DQR, stride_db, stride_dl, stride_eb, stride_el = deq
        hc = tl.load(
            DQC + b * stride_db + j[:, None] * stride_dl + dc[None, :], mask=jv[:, None] & (dc[None, :] < DC), other=0.0
        )
        hr = tl.load(DQR + b * stride_eb + j[:, None] * stride_el + dr[None, :], mask=jv[:, None], other=0.0)
        sh = dot(q, tl.trans(hc), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE, INTERP)
        sh = dot(qpe, tl.trans(hr), sh, IEEE, INTERP)
    elif MODE != 0:  # the stored copies of the same keys, reconstructed here
        page = tl.load(BT + b * stride_bt + k0 // PAGE_SIZE).to(tl.int64)
        slots = k0 % PAGE_SIZE + tl.arange(0, BLOCK_N)
        sc, zc = load_meta(CScale, CZero, ps_cscale, ps_czero, page, slots, jv, DC, DCP, C_BITS, G, BLOCK_N)
        hc = load_rows(CRows, CCodes, ps_crows, ps_ccodes, page, slots, jv, sc, zc,
                       DC, DCP, C_BITS, C_W, G, BLOCK_N, SK, INTERP)  # fmt: skip
        sr, zr = load_meta(RScale, RZero, ps_rscale, ps_rzero, page, slots, jv, DR, DR, R_BITS, G, BLOCK_N)
        hr = load_rows(RRows, RCodes, ps_rrows, ps_rcodes, page, slots, jv, sr, zr,
                       DR, DR, R_BITS, R_W, G, BLOCK_N, SK, INTERP)  # fmt: skip
        if EXACT:  # x = hi + lo: the scores and P·V take both halves
            hc_lo = hc - hc.to(KV).to(tl.float32)
            hr_lo = (hr - hr.to(KV).to(tl.float32)).to(KV)
            hc, hr = anchor(hc.to(KV), INTERP), hr.to(KV)
            hc_lo = anchor(hc_lo.to(KV), INTERP)
        elif C_BITS < 16:
            hc = anchor(hc, INTERP)
        sh = dot(q, tl.trans(hc), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE, INTERP)
        sh = dot(qpe, tl.trans(hr), sh, IEEE, INTERP)
        if EXACT:
            sh = dot(q, tl.trans(hc_lo), sh, IEEE, INTERP)
            sh = dot(qpe, tl.trans(hr_lo), sh, IEEE, INTERP)
    if MODE == 1:
        keep = (j[None, :] < SINK) | (j[None, :] > tq[:, None] - RECENT)
        s = tl.where(keep, s, sh)
    elif MODE == 2:
        s = sh
    ok = jv[None, :] & (j[None, :] <= tq[:, None]) & live[:, None]
    m_new, l_i, p, alpha = online_softmax(s, ok, m_i, l_i, qk_scale)
    acc = acc * alpha[:, None]
    if MODE == 0:
        acc = pv(p, xc, acc, PV_SPLIT, IEEE, KV, INTERP)
    elif MODE == 1:
        pk = tl.where(keep, p, 0.0)
        acc = pv(pk, xc, acc, PV_SPLIT, IEEE, KV, INTERP)
        acc = pv(p - pk, hc, acc, PV_SPLIT, IEEE, KV, INTERP)
        if EXACT:
            acc = pv(p - pk, hc_lo, acc, False, IEEE, KV, INTERP)
    else:
        acc = pv(p, hc, acc, PV_SPLIT, IEEE, KV, INTERP)
        if EXACT:
            acc = pv(p, hc_lo, acc, False, IEEE, KV, INTERP)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["N", "stride_bt"])  # query rows and pages per sequence vary per batch: one compile
def _prefill_kernel(
    Q,
    QPE,
    O,
    LSE,
    C,
    KP,
    KVLEN,
    QLEN,
    BT,
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
    DQC,
    DQR,
    stride_db,
    stride_dl,
    stride_eb,
    stride_el,
    H,
    N,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_rb,
    stride_rh,
    stride_rn,
    stride_ob,
    stride_oh,
    stride_on,
    stride_cb,
    stride_cl,
    stride_kb,
    stride_kl,
    stride_bt,
    qk_scale,
    DC: tl.constexpr,
    DCP: tl.constexpr,
    DR: tl.constexpr,
    G: tl.constexpr,
    C_BITS: tl.constexpr,
    R_BITS: tl.constexpr,
    C_W: tl.constexpr,
    R_W: tl.constexpr,
    QUANT: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PV_SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    KV: tl.constexpr,
    INTERP: tl.constexpr,
    EXACT: tl.constexpr,
    DEQ: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kv_len = tl.load(KVLEN + b).to(tl.int64)
    q_len = tl.load(QLEN + b).to(tl.int64)
    r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    i = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    in_out = i < N
    live = i < q_len
    tq = kv_len - q_len + i  # token index of each row's query
    dc = tl.arange(0, DCP)
    dcm = dc[None, :] < DC
    dr = tl.arange(0, DR)
    q = tl.load(
        Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qn + dc[None, :],
        mask=live[:, None] & dcm,
        other=0.0,
    )
    qpe = tl.load(
        QPE + b * stride_rb + h[:, None] * stride_rh + i[:, None] * stride_rn + dr[None, :],
        mask=live[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DCP], tl.float32)
    given = (C, KP, stride_cb, stride_cl, stride_kb, stride_kl)
    stored = (BT, stride_bt, CRows, CCodes, CScale, CZero, ps_crows, ps_ccodes, ps_cscale, ps_czero,
              RRows, RCodes, RScale, RZero, ps_rrows, ps_rcodes, ps_rscale, ps_rzero)  # fmt: skip
    deq = (DQC, DQR, stride_db, stride_dl, stride_eb, stride_el)
    t_max = tl.max(tl.where(live, tq, -1))
    n_keys = tl.minimum(t_max + 1, kv_len)
    if QUANT:
        # Key tiles [lo, hi) have no protected pair with any query of this block (past the sink,
        # at least RECENT keys behind the earliest query): they take the stored rows alone.
        # The others (the sink's tile, the band behind the queries) choose per pair.
        lo: tl.constexpr = (SINK + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        t_min = tl.min(tl.where(live, tq, kv_len))
        hi = tl.maximum(tl.minimum(tl.maximum(t_min - RECENT + 1, 0) // BLOCK_N * BLOCK_N, n_keys), lo)
        for part in tl.static_range(3):  # [0, lo) and [hi, n_keys) choose per pair, [lo, hi) is stored only
            if part == 0:
                start, end = 0, tl.minimum(lo, n_keys)
            elif part == 1:
                start, end = lo, hi
            else:
                start, end = hi, n_keys
            for k0 in range(start, end, BLOCK_N):
                m_i, l_i, acc = _tile(q, qpe, m_i, l_i, acc, k0, b, kv_len, tq, live, qk_scale, given, stored, deq,
                                      DC, DCP, DR, G, C_BITS, R_BITS, C_W, R_W, SINK, RECENT, PAGE_SIZE, BLOCK_M,
                                      BLOCK_N, PV_SPLIT, IEEE, KV, INTERP, 2 if part == 1 else 1, EXACT,
                                      DEQ)  # fmt: skip
    else:
        for k0 in range(0, n_keys, BLOCK_N):
            m_i, l_i, acc = _tile(q, qpe, m_i, l_i, acc, k0, b, kv_len, tq, live, qk_scale, given, stored, deq, DC,
                                  DCP, DR, G, C_BITS, R_BITS, C_W, R_W, SINK, RECENT, PAGE_SIZE, BLOCK_M, BLOCK_N,
                                  PV_SPLIT, IEEE, KV, INTERP, 0, False, False)  # fmt: skip
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(
        O + b * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_on + dc[None, :], o, mask=in_out[:, None] & dcm
    )
    tl.store(LSE + (b * H + h) * N + i, lse, mask=in_out)


@triton.jit(do_not_specialize=["stride_bt"])
def _dequant_kernel(
    BT, stride_bt, KVLEN, CRows, CCodes, CScale, CZero, ps_crows, ps_ccodes, ps_cscale, ps_czero,
    RRows, RCodes, RScale, RZero, ps_rrows, ps_rcodes, ps_rscale, ps_rzero,
    DQC, DQR, stride_db, stride_dl, stride_eb, stride_el,
    DC: tl.constexpr, DCP: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, C_BITS: tl.constexpr,
    R_BITS: tl.constexpr, C_W: tl.constexpr, R_W: tl.constexpr, PAGE_SIZE: tl.constexpr, KV: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    """The stored rows of one page of one sequence, reconstructed into the cache dtype exactly as
    :func:`_tile` reconstructs them (the same :func:`_tiles.load_rows`), so the attention kernel
    reads each stored row once per call instead of reconstructing it once per block of query rows.
    Grid ``(pages, batch)``."""
    b = tl.program_id(1).to(tl.int64)
    k0 = tl.program_id(0) * PAGE_SIZE
    kv_len = tl.load(KVLEN + b).to(tl.int64)
    if k0 < kv_len:
        j = k0 + tl.arange(0, PAGE_SIZE)
        jv = j < kv_len
        page = tl.load(BT + b * stride_bt + k0 // PAGE_SIZE).to(tl.int64)
        slots = tl.arange(0, PAGE_SIZE)
        dc = tl.arange(0, DCP)
        dr = tl.arange(0, DR)
        sc, zc = load_meta(CScale, CZero, ps_cscale, ps_czero, page, slots, jv, DC, DCP, C_BITS, G, PAGE_SIZE)
        hc = load_rows(CRows, CCodes, ps_crows, ps_ccodes, page, slots, jv, sc, zc,
                       DC, DCP, C_BITS, C_W, G, PAGE_SIZE, KV, INTERP)  # fmt: skip
        sr, zr = load_meta(RScale, RZero, ps_rscale, ps_rzero, page, slots, jv, DR, DR, R_BITS, G, PAGE_SIZE)
        hr = load_rows(RRows, RCodes, ps_rrows, ps_rcodes, page, slots, jv, sr, zr,
                       DR, DR, R_BITS, R_W, G, PAGE_SIZE, KV, INTERP)  # fmt: skip
        tl.store(DQC + b * stride_db + j[:, None] * stride_dl + dc[None, :], hc, mask=jv[:, None] & (dc[None, :] < DC))
        tl.store(DQR + b * stride_eb + j[:, None] * stride_el + dr[None, :], hr, mask=jv[:, None])


def dequantized(layer, block_table, kv_len, L: int, dtype):
    """(C, K_P) of shape (B, L, ·) in ``dtype``: the stored rows of the first ``L`` tokens of each
    sequence, as the teacher-forced kernel reconstructs them (rows at or past ``kv_len`` are left
    unwritten)."""
    fmt = layer.fmt
    B = block_table.shape[0]
    dq_c = torch.empty(B, L, fmt.d_c, dtype=dtype, device=block_table.device)
    dq_r = torch.empty(B, L, fmt.d_r, dtype=dtype, device=block_table.device)
    if B and L:
        _dequant_kernel[(triton.cdiv(L, PAGE), B)](
            block_table, block_table.stride(0), kv_len, *region_args(layer, "C"), *region_args(layer, "R"),
            dq_c, dq_r, dq_c.stride(0), dq_c.stride(1), dq_r.stride(0), dq_r.stride(1),
            DC=fmt.d_c, DCP=padded(fmt.d_c), DR=fmt.d_r, G=fmt.group, C_BITS=fmt.content_bits,
            R_BITS=fmt.rope_bits, C_W=container_bits(fmt.content_bits), R_W=container_bits(fmt.rope_bits),
            PAGE_SIZE=PAGE, KV=tl_dtype(dtype), INTERP=INTERPRET, num_warps=4,
        )  # fmt: skip
    return dq_c, dq_r


def default_config(H: int, n: int, fmt, quantized: bool, exact: bool = False) -> dict:
    """Tiles for the teacher-forced kernel: the fastest of ``bench/prefill.py --tune`` on the H200 for
    every format (32 rows × 64 keys, 8 warps; 64-row tiles of 64 keys exceed shared memory). The
    quantized variant keeps both key tiles live; 16-key tiles, chosen for its registers, are much
    slower. With ``exact`` (each stored row a hi/lo pair) 16 rows × 16 keys, 4 warps, the fastest of
    ``bench/prefill.py --exact --tune c4r4_exact``, where the rounded kernel's tiles spill
    (sm_90 compile, ``bench/gluon_sass.py --prefill``)."""
    if INTERPRET:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=1)
    if exact:
        return dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
    if fmt.dtype.itemsize == 4:  # twice the bytes per row: the BF16 tiles ask for ~388 KB of shared memory
        return dict(block_m=16, block_n=32, num_warps=4, num_stages=1)
    return dict(block_m=32, block_n=64, num_warps=8, num_stages=2)


FALLBACK = ({"num_stages": 1}, {"block_n": 32}, {"block_m": 16}, {"block_n": 16}, {"num_warps": 4})
"""Steps down from the default tiles, in order, for a device whose shared memory they exceed."""


def prefill(
    q_lat,
    q_pe,
    C,
    K_P,
    kv_len,
    q_len,
    tau: float,
    sink: int,
    recent: int,
    layer=None,
    block_table=None,
    config=None,
    out=None,
):
    """Triton teacher-forced attention; see :func:`quantmla.kernels.reference.prefill`."""
    B, H, n, d_c = q_lat.shape
    d_r = K_P.shape[-1]
    dtype = C.dtype
    quant = layer is not None
    fmt = layer.fmt if quant else _Plain(d_c, d_r, dtype)
    exact = bool((config or {}).get("exact")) and quant and dtype != torch.float32  # float32 rows are unrounded
    given = {k: v for k, v in (config or {}).items() if k != "exact"}
    cfg = default_config(H, n, fmt, quant, exact) | given
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    if block_n < 16 or block_m < 16 or PAGE % block_n or (block_m & (block_m - 1)):
        raise ValueError(f"prefill tiles: block_n must divide {PAGE}, both powers of two of at least 16; got {cfg}")
    # tiles the caller did not choose step down until the kernel fits the GPU's shared memory
    ladder = [cfg] if given or INTERPRET else fit.smaller(cfg, FALLBACK)
    q = q_lat.to(dtype)
    qpe = q_pe.to(dtype)
    if out is not None:
        o, lse = out
    else:
        o = torch.empty(B, H, n, d_c, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, n, dtype=torch.float32, device=q.device)
    if B == 0 or n == 0:
        return o, lse
    key = (str(q.device), dtype, d_c, d_r, fmt.content_bits, fmt.rope_bits, quant, exact)
    fit.launch("teacher-forced attention", key, ladder, lambda c: _run(c, q, qpe, o, lse, C, K_P, kv_len, q_len, layer,
               block_table, fmt, quant, exact, sink, recent, tau))  # fmt: skip
    return o, lse


def _run(cfg, q, qpe, o, lse, C, K_P, kv_len, q_len, layer, block_table, fmt, quant, exact, sink, recent, tau):
    B, H, n, d_c = q.shape
    d_r, dtype = K_P.shape[-1], C.dtype
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    regions = region_args(layer, "C") + region_args(layer, "R") if quant else (C, C, C, C, 0, 0, 0, 0) * 2
    bt = block_table if quant else kv_len
    deq = quant and not exact
    dq_c, dq_r = dequantized(layer, block_table, kv_len, C.shape[1], dtype) if deq else (C, K_P)
    grid = (triton.cdiv(n * H, block_m), B)
    _prefill_kernel[grid](
        q,
        qpe,
        o,
        lse,
        C,
        K_P,
        kv_len,
        q_len,
        bt,
        *regions,
        dq_c,
        dq_r,
        dq_c.stride(0),
        dq_c.stride(1),
        dq_r.stride(0),
        dq_r.stride(1),
        H,
        n,
        *q.stride()[:3],
        *qpe.stride()[:3],
        *o.stride()[:3],
        C.stride(0),
        C.stride(1),
        K_P.stride(0),
        K_P.stride(1),
        bt.stride(0),
        tau * LOG2E,
        DC=d_c,
        DCP=padded(d_c),
        DR=d_r,
        G=fmt.group,
        C_BITS=fmt.content_bits,
        R_BITS=fmt.rope_bits,
        C_W=container_bits(fmt.content_bits),
        R_W=container_bits(fmt.rope_bits),
        QUANT=quant,
        SINK=sink if quant else 0,
        RECENT=recent if quant else 0,
        PAGE_SIZE=PAGE,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PV_SPLIT=dtype != torch.float32,
        IEEE=dtype == torch.float32,
        KV=tl_dtype(dtype),
        INTERP=INTERPRET,
        EXACT=exact,
        DEQ=deq,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


class _Plain:
    """Format stand-in for an unquantized teacher-forced call (no pages)."""

    def __init__(self, d_c, d_r, dtype):
        self.d_c, self.d_r, self.dtype = d_c, d_r, dtype
        self.group, self.content_bits, self.rope_bits = 64, 16, 16
