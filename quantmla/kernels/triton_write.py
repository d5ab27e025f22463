"""The paper's fused writer: quantize, pack and scatter new tokens into their pages.

One program per token: eq. 35–36 on the content row (BF16 scales) and the RoPE row (FP32
scales), codes packed into the token's page slot, and the protection buffer updated (a sink
row for ``t < sink``; a ring row for the tokens that end up among the ``recent`` latest of
their request, so a long chunk never races on a ring row).
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantmla.kernels._tiles import INTERPRET, layer_constexprs, quantize_store, region_args, tl_dtype


@triton.jit(do_not_specialize=["T", "stride_bt"])  # token count and pages per sequence vary per call
def _write_kernel(
    C,
    KP,
    REQ,
    POS,
    LENS_AFTER,
    BT,
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
    T,
    stride_c,
    stride_r,
    stride_bt,
    stride_pb,
    DC: tl.constexpr,
    DR: tl.constexpr,
    DCP: tl.constexpr,
    G: tl.constexpr,
    C_BITS: tl.constexpr,
    R_BITS: tl.constexpr,
    C_W: tl.constexpr,
    R_W: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    HAS_PROT: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    OUT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tok < T
    b = tl.load(REQ + tok, mask=ok, other=0).to(tl.int64)
    t = tl.load(POS + tok, mask=ok, other=0).to(tl.int64)
    page = tl.load(BT + b * stride_bt + t // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    slot = t % PAGE_SIZE
    dc = tl.arange(0, DCP)
    dcm = dc[None, :] < DC
    dr = tl.arange(0, DR)
    x = tl.load(C + tok[:, None] * stride_c + dc[None, :], mask=ok[:, None] & dcm, other=0.0)
    xr = tl.load(KP + tok[:, None] * stride_r + dr[None, :], mask=ok[:, None], other=0.0)
    quantize_store(
        x, CRows, CCodes, CScale, CZero, ps_crows, ps_ccodes, ps_cscale, ps_czero,
        page, slot, ok, DC, DCP, C_BITS, C_W, G, True, BLOCK_T, OUT,
    )  # fmt: skip
    quantize_store(
        xr, RRows, RCodes, RScale, RZero, ps_rrows, ps_rcodes, ps_rscale, ps_rzero,
        page, slot, ok, DR, DR, R_BITS, R_W, G, False, BLOCK_T, OUT,
    )  # fmt: skip
    if HAS_PROT:
        base = PROT + b * stride_pb
        sink = ok & (t < SINK)
        row = tl.where(sink, t, 0)
        tl.store(base[:, None] + row[:, None] * (DC + DR) + dc[None, :], x, mask=sink[:, None] & dcm)
        tl.store(base[:, None] + row[:, None] * (DC + DR) + DC + dr[None, :], xr, mask=sink[:, None])
        if RECENT > 0:
            ring = ok & (t >= tl.load(LENS_AFTER + b, mask=ok, other=0) - RECENT)
            row = SINK + t % RECENT
            tl.store(base[:, None] + row[:, None] * (DC + DR) + dc[None, :], x, mask=ring[:, None] & dcm)
            tl.store(base[:, None] + row[:, None] * (DC + DR) + DC + dr[None, :], xr, mask=ring[:, None])


def write(layer, block_table, C, K_P, req, pos, lens_after, block_t: int | None = None) -> None:
    """Triton writer; see :func:`quantmla.kernels.reference.write` for the contract."""
    T = C.shape[0]
    if T == 0:
        return
    fmt = layer.fmt
    prot = layer.prot if layer.prot is not None else C
    block_t = block_t or (64 if INTERPRET else 4)
    _write_kernel[(triton.cdiv(T, block_t),)](
        C,
        K_P,
        req,
        pos,
        lens_after,
        block_table,
        prot,
        *region_args(layer, "C"),
        *region_args(layer, "R"),
        T,
        C.stride(0),
        K_P.stride(0),
        block_table.stride(0),
        prot.stride(0),
        **layer_constexprs(layer),
        BLOCK_T=block_t,
        OUT=tl_dtype(fmt.dtype),
        num_warps=4,
    )
