"""Prototype, not used by the harness: C4R4 decode with tokens on the wgmma M side (Gluon, Hopper).

Written to measure one alternative layout of the decode core (bench/NOTES.md, v7): Gluon's
explicit shared memory lets the reconstructed tile feed wgmma straight from shared memory,
with no ``ldmatrix`` and no query fragments held in registers. C4R4 in a BF16 cache only,
d_c = 512, d_r = 64, group 64, up to 16 heads, protection buffers on; ``bench/prototypes/
gluon_check.py`` compares it with the Triton kernel and times both. Gluon has no interpreter,
so this file needs a Hopper GPU and Triton 3.6's ``triton.experimental.gluon``.

S^T (64 tokens x 16 heads) = C_tile (64 x 512, shared) . q^T (512 x 16, shared)
O^T (512 x 16) += C_tile^T (shared, transposed view) . P^T (64 x 16, shared)
Codes are dequantized in registers (8 per 32-bit word) into a channel order permuted within
each 8-channel block; q, q_pe, the protected rows and the output use the same permutation.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from quantmla.kernels._tiles import region_args
from quantmla.kernels.gluon_decode import _W_BF16, _W_F32, LOG2E, _dequant_words, _prot_valid


@gluon.jit
def _load_tile(cw, CScale, CZero, rw, RScale, RZero, page, t, low_hi, ps_ccodes, ps_cscale, ps_czero,
               ps_rcodes, ps_rscale, ps_rzero, woff, moff, tok3, roff, tokr, SINK: gl.constexpr, BN: gl.constexpr):  # fmt: skip
    """Code words, scales and zero-points of tile ``t`` (one page), in registers."""
    offs3 = t * BN + tok3
    ok3 = (offs3 < low_hi) & (offs3 >= SINK)
    words = gl.load(cw + page * (ps_ccodes // 4) + woff)
    sc = gl.load(CScale + page * ps_cscale + moff, mask=ok3[:, None], other=0.0)
    zc = gl.load(CZero + page * ps_czero + moff)
    offsr = t * BN + tokr
    okr = (offsr < low_hi) & (offsr >= SINK)
    rwords = gl.load(rw + page * (ps_rcodes // 4) + roff)
    sr = gl.load(RScale + page * ps_rscale + tokr, mask=okr, other=0.0)
    zr = gl.load(RZero + page * ps_rzero + tokr)
    return words, sc, zc, rwords, sr, zr


@gluon.jit
def _perm8(x, R: gl.constexpr, D: gl.constexpr):
    """Columns of (R, D) reordered within 8-blocks: column 8k+p <- channel 8k+PERM8[p]."""
    x5 = gl.reshape(x, [R, D // 8, 2, 2, 2])
    return gl.reshape(gl.permute(x5, (0, 1, 4, 2, 3)), [R, D])


@gluon.jit
def _prot_rows(PROT, b, stride_pb, r0, L, SINK: gl.constexpr, RECENT: gl.constexpr,
               DC: gl.constexpr, DR: gl.constexpr, BN: gl.constexpr, LC: gl.constexpr, LR: gl.constexpr):  # fmt: skip
    r = r0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LC))
    cc = gl.arange(0, DC, layout=gl.SliceLayout(0, LC))
    valid = _prot_valid(r, L, SINK, RECENT)
    kc = gl.load(PROT + b * stride_pb + r[:, None] * (DC + DR) + cc[None, :], mask=valid[:, None], other=0.0)
    rr = r0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LR))
    rc = gl.arange(0, DR, layout=gl.SliceLayout(0, LR))
    valid_r = _prot_valid(rr, L, SINK, RECENT)
    kr = gl.load(PROT + b * stride_pb + rr[:, None] * (DC + DR) + DC + rc[None, :], mask=valid_r[:, None], other=0.0)
    return _perm8(kc, BN, DC), _perm8(kr, BN, DR)


@gluon.jit
def _step(c_smem, r_smem, q_smem, qp_smem, ph_smem, pl_smem, valid, m_i, l_i, acc, qk_scale,
          BN: gl.constexpr, BH: gl.constexpr, ACC: gl.constexpr, PV_SPLIT: gl.constexpr):  # fmt: skip
    """One tile already in c_smem/r_smem: scores, online softmax, P.V (hi/lo)."""
    s = gl.zeros([BN, BH], gl.float32, layout=ACC)
    s = warpgroup_mma(c_smem, q_smem.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(r_smem, qp_smem.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    s = gl.where(valid[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[None, :])
    l_i = l_i * alpha + gl.sum(p, 0)
    acc = acc * alpha[None, :]
    p_hi = p.to(gl.bfloat16)
    ph_smem.store(p_hi)
    if PV_SPLIT:
        pl_smem.store((p - p_hi.to(gl.float32)).to(gl.bfloat16))
    fence_async_shared()
    acc = warpgroup_mma(c_smem.permute((1, 0)), ph_smem, acc, is_async=True)
    if PV_SPLIT:
        acc = warpgroup_mma(c_smem.permute((1, 0)), pl_smem, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return m_new, l_i, acc


@gluon.jit
def _gluon_decode_kernel(Q, QPE, O, LSE, BT, LENS, PROT,
                         CCodes, CScale, CZero, ps_ccodes, ps_cscale, ps_czero,
                         RCodes, RScale, RZero, ps_rcodes, ps_rscale, ps_rzero,
                         H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb,
                         stride_ob, stride_oh, stride_os, stride_bt, tiles_per_split, qk_scale,
                         SINK: gl.constexpr, RECENT: gl.constexpr, SPLIT: gl.constexpr, PV_SPLIT: gl.constexpr):  # fmt: skip
    DC: gl.constexpr = 512
    DR: gl.constexpr = 64
    BN: gl.constexpr = 64
    BH: gl.constexpr = 16
    NG: gl.constexpr = 8
    WG: gl.constexpr = 8  # words per 64-channel group
    # register layouts
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [4, 1, 1], [2, 1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0])  # (64 tokens, 8 words)
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # (64, 512) bf16 rows
    LRB: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # (64, 64) bf16 rows
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, DC], gl.bfloat16)
    r_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, DR], gl.bfloat16)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DC], gl.bfloat16)
    qp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, DR], gl.bfloat16)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BH], gl.bfloat16)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, DC], c_layout)
    r_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, DR], r_layout)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, DC], q_layout)
    qp_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, DR], qp_layout)
    ph_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BH], p_layout)
    pl_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BH], p_layout)

    pid_s = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    L = gl.load(LENS + b).to(gl.int32)

    # permuted channel index of each column: column 8k+p holds channel 8k+PERM8[p]
    qc = gl.arange(0, DC, layout=gl.SliceLayout(0, LQ))
    qperm = (qc // 8) * 8 + gl.where((qc % 8) < 4, (qc % 8) * 2, ((qc % 8) - 4) * 2 + 1)
    qh = gl.arange(0, BH, layout=gl.SliceLayout(1, LQ))
    q = gl.load(Q + b * stride_qb + qh[:, None] * stride_qh + qperm[None, :], mask=qh[:, None] < H, other=0.0)
    q_smem.store(q)
    LQR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rc = gl.arange(0, DR, layout=gl.SliceLayout(0, LQR))
    rperm_q = (rc // 8) * 8 + gl.where((rc % 8) < 4, (rc % 8) * 2, ((rc % 8) - 4) * 2 + 1)
    rh = gl.arange(0, BH, layout=gl.SliceLayout(1, LQR))
    qpe = gl.load(QPE + b * stride_rb + rh[:, None] * stride_rh + rperm_q[None, :], mask=rh[:, None] < H, other=0.0)
    qp_smem.store(qpe)

    n_tiles = gl.cdiv(L, BN)
    t_lo = pid_s * tiles_per_split
    t_hi = gl.minimum(t_lo + tiles_per_split, n_tiles)
    low_hi = L - RECENT
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(0, ACC))
    acc = gl.zeros([DC, BH], gl.float32, layout=ACC)

    # index tensors for one tile
    tok3 = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    g3 = gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    w3 = gl.arange(0, WG, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    woff = (g3[None, :, None] * BN + tok3[:, None, None]) * WG + w3[None, None, :]  # int32 words, group-major
    moff = tok3[:, None] * NG + g3[None, :]
    tokr = gl.arange(0, BN, layout=gl.SliceLayout(1, LR))
    wr = gl.arange(0, DR // 8, layout=gl.SliceLayout(0, LR))
    roff = tokr[:, None] * (DR // 8) + wr[None, :]
    tok_s = gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
    cw = CCodes.to(gl.pointer_type(gl.int32))
    rw = RCodes.to(gl.pointer_type(gl.int32))

    bt_row = BT + b * stride_bt
    page = gl.load(bt_row + gl.minimum(t_lo, n_tiles - 1)).to(gl.int64)
    words, sc, zc, rwords, sr, zr = _load_tile(cw, CScale, CZero, rw, RScale, RZero, page, t_lo, low_hi,
                                               ps_ccodes, ps_cscale, ps_czero, ps_rcodes, ps_rscale, ps_rzero,
                                               woff, moff, tok3, roff, tokr, SINK, BN)  # fmt: skip
    for t in range(t_lo, t_hi):
        nzc = (-(zc.to(gl.float32) + 128.0)).to(gl.bfloat16)
        nzr = (-(zr.to(gl.float32) + 128.0)).to(gl.bfloat16)
        xc = _dequant_words(words, sc[:, :, None], nzc[:, :, None], _W_BF16, "h")
        xc = gl.reshape(xc, [BN, DC])
        xr = _dequant_words(rwords, sr[:, None], nzr[:, None], _W_F32, "r")
        xr = gl.reshape(xr, [BN, DR])
        c_smem.store(xc)
        r_smem.store(xr)
        tn = gl.minimum(t + 1, t_hi - 1)
        page = gl.load(bt_row + tn).to(gl.int64)
        words, sc, zc, rwords, sr, zr = _load_tile(cw, CScale, CZero, rw, RScale, RZero, page, tn, low_hi,
                                                   ps_ccodes, ps_cscale, ps_czero, ps_rcodes, ps_rscale, ps_rzero,
                                                   woff, moff, tok3, roff, tokr, SINK, BN)  # fmt: skip
        fence_async_shared()
        offs_s = t * BN + tok_s
        valid = (offs_s < low_hi) & (offs_s >= SINK)
        m_i, l_i, acc = _step(c_smem, r_smem, q_smem, qp_smem, ph_smem, pl_smem, valid, m_i, l_i, acc, qk_scale,
                              BN, BH, ACC, PV_SPLIT)  # fmt: skip

    if pid_s == gl.num_programs(1) - 1:  # the protected rows: sink rows, then the ring of the latest RECENT
        for r0 in range(0, SINK + RECENT, BN):
            kc, kr = _prot_rows(PROT, b, stride_pb, r0, L, SINK, RECENT, DC, DR, BN, LC, LRB)
            c_smem.store(kc)
            r_smem.store(kr)
            fence_async_shared()
            valid = _prot_valid(r0 + tok_s, L, SINK, RECENT)
            m_i, l_i, acc = _step(c_smem, r_smem, q_smem, qp_smem, ph_smem, pl_smem, valid, m_i, l_i, acc,
                                  qk_scale, BN, BH, ACC, PV_SPLIT)  # fmt: skip

    has = l_i > 0
    o = acc / gl.where(has, l_i, 1.0)[None, :]
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    oc = gl.arange(0, DC, layout=gl.SliceLayout(1, ACC))
    operm = (oc // 8) * 8 + gl.where((oc % 8) < 4, (oc % 8) * 2, ((oc % 8) - 4) * 2 + 1)
    oh = gl.arange(0, BH, layout=gl.SliceLayout(0, ACC))
    o_ptr = O + b * stride_ob + oh[None, :] * stride_oh + pid_s * stride_os + operm[:, None]
    gl.store(o_ptr, o, mask=oh[None, :] < H)
    if SPLIT:
        gl.store(LSE + (b * H + oh) * gl.num_programs(1) + pid_s, lse, mask=oh < H)
    else:
        gl.store(LSE + b * H + oh, lse, mask=oh < H)


def decode(layer, block_table, lengths, q_lat, q_pe, tau: float, num_splits: int, max_len: int, pv_split: bool = True):
    """C4R4 BF16 decode through the prototype; returns (o, lse) like triton_decode.decode."""
    from quantmla.kernels.triton_decode import merge, partials

    fmt = layer.fmt
    if (fmt.content_bits, fmt.rope_bits, fmt.dtype, fmt.group, fmt.d_c, fmt.d_r) != (4, 4, torch.bfloat16, 64, 512, 64):
        raise ValueError(f"the prototype takes C4R4 in a BF16 cache, group 64, d_c 512, d_r 64; got {fmt}")
    if layer.prot is None:
        raise ValueError("the prototype needs the protection buffers (sink and recent rows)")
    B, H, _ = q_lat.shape
    if H > 16:
        raise ValueError(f"the prototype takes up to 16 heads, got {H}")
    dev = q_lat.device
    tiles = max(1, triton.cdiv(max_len, 64))
    splits = max(1, min(num_splits, tiles))
    per = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, per)
    q = q_lat.to(torch.bfloat16).contiguous()
    qpe = q_pe.to(torch.bfloat16).contiguous()
    o = torch.empty(B, H, fmt.d_c, dtype=torch.float32, device=dev)
    lse = torch.empty(B, H, dtype=torch.float32, device=dev)
    split = splits > 1
    op, lsep = partials(o, lse, splits)
    prot = layer.prot
    c = region_args(layer, "C")
    r = region_args(layer, "R")
    _gluon_decode_kernel[(1, splits, B)](
        q, qpe, op, lsep, block_table, lengths, prot,
        c[1], c[2], c[3], c[5], c[6], c[7],
        r[1], r[2], r[3], r[5], r[6], r[7],
        H, q.stride(0), q.stride(1), qpe.stride(0), qpe.stride(1), prot.stride(0),
        op.stride(0), op.stride(1), op.stride(2), block_table.stride(0), per, tau * LOG2E,
        SINK=layer.sink, RECENT=layer.recent, SPLIT=split, PV_SPLIT=pv_split, num_warps=4,
    )  # fmt: skip
    merge(op, lsep, o, lse)
    return o, lse


__all__ = ["decode"]
