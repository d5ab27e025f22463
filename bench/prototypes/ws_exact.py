"""A probe beside the core: the exact C4R4 decode at 16 heads with its warps split by role.

The shipped exact kernel (``quantmla/kernels/exact_decode.py``) runs one warpgroup per program and
two programs per SM: each warpgroup copies, scores, takes the softmax and does P·V of one tile after
the other, and the tile's dependent chain at two warps per scheduler sets its time (bench/NOTES.md
v32-v35). Here one program per SM holds three warpgroups with their own jobs (``gl.warp_specialize``;
168 registers each, 12 warps):

- two **score** warpgroups (workers) take alternate page tiles: the tile's metadata, the unpacking,
  the 39 score wgmma, the scaling, a lazy running maximum, and P' = P·s with the zero-point column into
  one of two P buffers, one per score warpgroup, each with the maximum its P was taken against.
  Score warpgroup 0 first prepares the queries' tiles for both;
- the **P·V** warpgroup (the default partition; ``pv_warps`` 4, or 8 with one group per warp) takes
  the tiles in order: the codes through ``ldmatrix.trans``, the 72 ``mma.sync`` per warp into the only
  output accumulators, and the TMA copy of the tile ``STAGES`` ahead into the stage it has just
  finished with (the last reader of a stage is the P·V warpgroup).

The maximum: each score warpgroup keeps its own, raised when a tile passes it by more than 2^LAZY,
and reads the other's from shared memory before each tile (taking it when higher, so the two agree
after the first tiles). The P·V warpgroup rescales its accumulators when a tile's maximum is above
its own, and a tile's P' in shared memory when it is below (rare: both warpgroups raised at once).
The denominators stay with the score warpgroups and are combined at the end.

What it leaves out, so compare it with ``ablate=11`` of the shipped kernel (the same attention,
over the page tiles only): the protected rows (sink and ring). C4R4 pages only. Measured slower
than the shipped kernel (bench/NOTES.md v36). Correctness and timing: ``bench/ws_check.py``; compiled
for sm_90 without a GPU by running this file. Not part of the package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from quantmla.kernels.exact_decode import (  # noqa: E402
    ACC,
    L3Z,
    LA8,
    LAZY,
    LOG2E,
    NV0,
    NV32,
    NV32_3,
    _barrier,
    _copy_tile,
    _mma_each,
    _pv_wgmma,
    _pv_words,
    _queries,
    _scores,
    _store_out,
    _store_p,
    _tile_meta,
    _tile_words,
    _unpack,
    _view,
    constexprs,
    descriptors,
)

BN = gl.constexpr(64)
NEG = gl.constexpr(float("-inf"))


@gluon.jit
def _score_part(cs, ms, ztm, psm, pm, mg, fin, chs, qc, qr, zb, bc, bm, pready, pempty, qready,
                Qb, stride_qh, Rb, stride_rh, H, qk_scale,
                t_lo, t_hi, low_hi, which: gl.constexpr, NS: gl.constexpr, SINK: gl.constexpr,
                Z_OFF: gl.constexpr, S_OFF: gl.constexpr, RS_OFF: gl.constexpr, RZ_OFF: gl.constexpr,
                ABL: gl.constexpr):  # fmt: skip
    """Score warpgroup ``which``: tiles t_lo + which, t_lo + which + 2, … into P buffer ``which``."""
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    COLS: gl.constexpr = gl.SliceLayout(0, ACC)
    SW: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 2, order=[1, 0])
    if which == 0:  # the queries' tiles for both score warpgroups
        kq = _queries(Qb, stride_qh, Rb, stride_rh, H, qc, qr, zb, 4)
        chs.store(gl.convert_layout(qk_scale * ((151 - kq) << 23).to(gl.float32, bitcast=True), COLS))
        mg.store(gl.full([16], NEG, gl.float32, COLS))
        fence_async_shared()
        _barrier()
        mbarrier.arrive(qready)
    else:
        mbarrier.wait(qready, 0)
    ch = chs.load(COLS)
    m_w = gl.full([16], NEG, gl.float32, COLS)
    lacc = gl.zeros([64, 16], gl.float32, ACC)
    rows = gl.arange(0, BN, layout=ROWS)
    n8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3Z)))[None, None, :]
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, LA8))[None, :]
    for t in range(t_lo + which, t_hi, 2):
        it = t - t_lo
        st = it % NS
        ph = (it // NS) & 1
        k = it // 2
        mbarrier.wait(bc.index(st), ph)
        mbarrier.wait(bm.index(st), ph)
        if ABL == 4:  # timing only: the copies and the hand-offs alone
            mbarrier.wait(pempty.index(which), (k & 1) ^ 1)
        else:
            cst = _view(cs.index(st), gl.int16, [512, 16], SW)
            tok = t * BN + rows
            valid = (tok >= SINK) & (tok < low_hi)
            rst, s8, sr, wz, zc = _tile_meta(ms.index(st), valid, c8, S_OFF, Z_OFF, RS_OFF, RZ_OFF, AL)
            if (ABL == 2) or (ABL == 3):  # timing only: no score products
                x = gl.zeros([64, 16], gl.float32, ACC) + ch[None, :]
            else:
                xs = _tile_words(cst, rst, 4, AL)
                x = _scores(xs, qc, qr, zb, s8, sr, wz, 4, AL, ACC, False) * ch[None, :]
            x = gl.where(valid[:, None], x, NEG)
            # the other score warpgroup's maximum, where it passed this one's
            g = mg.load(COLS)
            up = g > m_w
            if gl.max(up.to(gl.int32), axis=0) > 0:
                lacc = lacc * gl.where(up, gl.exp2(m_w - g), 1.0)[None, :]
                m_w = gl.where(up, g, m_w)
            over = gl.max(gl.max(gl.where(valid[:, None], x - m_w[None, :], NEG), axis=1), axis=0)
            if over > LAZY:
                m_new = gl.maximum(m_w, gl.max(x, axis=0))
                lacc = lacc * gl.where(m_new > m_w, gl.exp2(m_w - m_new), 1.0)[None, :]
                m_w = m_new
                mg.store(
                    gl.maximum(m_w, mg.load(COLS))
                )  # racy between the two warpgroups, and harmless: P' carries its own
            p = gl.exp2(x - gl.where(m_w == NEG, 0.0, m_w)[None, :])
            lacc = lacc + p
            mbarrier.wait(pempty.index(which), (k & 1) ^ 1)  # the P·V warpgroup done with this buffer's last tile
            _store_p(psm.index(which), p, s8)
            ztm.index(which).permute((1, 0, 2)).store(gl.where(n8 == 0, zc, 0).to(gl.float16, bitcast=True))
            pm.index(which).store(m_w)
        fence_async_shared()  # this tile's stage is read: the TMA may refill it once P·V is done too
        mbarrier.arrive(pready.index(which))
    fin.index(2 * which).store(m_w)
    fin.index(2 * which + 1).store(gl.sum(lacc, axis=0))


@gluon.jit
def _pv_part_wg(cs, ms, ztm, psm, pm, bc, bm, pready, pempty, DC, DM, bt_row, t_lo, t_hi,
                NS: gl.constexpr, PAGE_BYTES: gl.constexpr, R_OFF: gl.constexpr, ABL: gl.constexpr, M2: gl.constexpr):  # fmt: skip
    """Timing only (ablation 12): :func:`_pv_part` with P·V as 32 wgmma per tile (channels on M, P' from
    shared memory as B; the A operands are the score phase's nibble tensors, so the values are wrong,
    and there is no zero-point column and no rescaling): one kind of product on the SM."""
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    a0 = gl.zeros([64, 16], gl.float32, ACC)
    acc = (a0, a0, a0, a0, a0, a0, a0, a0)
    pn = gl.load(bt_row + gl.minimum(t_lo + NS, t_hi - 1), mask=t_lo < t_hi, other=0)
    for t in range(t_lo, t_hi):
        it = t - t_lo
        st = it % NS
        w = it % 2
        page = pn
        pn = gl.load(bt_row + gl.minimum(t + NS + 1, t_hi - 1))
        mbarrier.wait(bc.index(st), (it // NS) & 1)
        mbarrier.wait(pready.index(w), (it // 2) & 1)
        acc = _pv_wgmma(
            psm.index(w),
            _view(cs.index(st), gl.int16, [512, 16], gl.SwizzledSharedLayout(8, 4, 2, order=[1, 0])),
            acc,
            AL,
        )
        _barrier()
        mbarrier.arrive(pempty.index(w))
        if t + NS < t_hi:
            fence_async_shared()
            _copy_tile(
                DC, DM, cs.index(st), ms.index(st), bc.index(st), bm.index(st), page, PAGE_BYTES, R_OFF, 4, False
            )
    return acc, acc[0], acc[1]  # the shape of :func:`_pv_loop`'s results (accumulators, az, M)


@gluon.jit
def _pv_part(cs, ms, ztm, psm, pm, bc, bm, pready, pempty, DC, DM, bt_row, t_lo, t_hi,
             NS: gl.constexpr, PAGE_BYTES: gl.constexpr, R_OFF: gl.constexpr, ABL: gl.constexpr, M2: gl.constexpr):  # fmt: skip
    """The default partition: :func:`_pv_loop`, or for ablation 12 :func:`_pv_part_wg`."""
    if ABL == 12:
        res = _pv_part_wg(cs, ms, ztm, psm, pm, bc, bm, pready, pempty, DC, DM, bt_row, t_lo, t_hi, NS, PAGE_BYTES,
                          R_OFF, ABL, M2)  # fmt: skip
    else:
        res = _pv_loop(cs, ms, ztm, psm, pm, bc, bm, pready, pempty, DC, DM, bt_row, t_lo, t_hi, NS, PAGE_BYTES,
                       R_OFF, ABL, M2)  # fmt: skip
    return res


@gluon.jit
def _pv_loop(cs, ms, ztm, psm, pm, bc, bm, pready, pempty, DC, DM, bt_row, t_lo, t_hi,
             NS: gl.constexpr, PAGE_BYTES: gl.constexpr, R_OFF: gl.constexpr, ABL: gl.constexpr, M2: gl.constexpr):  # fmt: skip
    """The P·V warpgroup: every tile in order, then the copy of the tile NS ahead into its stage."""
    A2: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M2, k_width=2)
    B2: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=M2, k_width=2)
    HM: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, M2))
    SW: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 2, order=[1, 0])
    LPS: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 16, 2], [gl.num_warps(), 1, 1], [2, 1, 0])
    M = gl.full([16], NEG, gl.float32, HM)
    a0 = gl.zeros([8, 16, 16], gl.float32, M2)
    acc = (a0, a0, a0, a0)
    az = gl.zeros([8, 16, 8], gl.float32, M2)
    # the block-table entry of the next copy, read an iteration before it is needed
    pn = gl.load(bt_row + gl.minimum(t_lo + NS, t_hi - 1), mask=t_lo < t_hi, other=0)
    for t in range(t_lo, t_hi):
        it = t - t_lo
        st = it % NS
        ph = (it // NS) & 1
        w = it % 2
        page = pn
        pn = gl.load(bt_row + gl.minimum(t + NS + 1, t_hi - 1))
        mbarrier.wait(bc.index(st), ph)
        if ABL == 4:
            mbarrier.wait(pready.index(w), (it // 2) & 1)
        else:
            words = _pv_words(_view(cs.index(st), gl.int16, [512, 16], SW), 4, B2)
            mbarrier.wait(pready.index(w), (it // 2) & 1)
            mt = pm.index(w).load(HM)
            up = mt > M
            if gl.max(up.to(gl.int32), axis=0) > 0:
                al = gl.where(up, gl.exp2(M - mt), 1.0)[None, :, None]
                acc = (acc[0] * al, acc[1] * al, acc[2] * al, acc[3] * al)
                az = az * al
                M = gl.where(up, mt, M)
            low = mt < M
            if gl.max(low.to(gl.int32), axis=0) > 0:  # this P' was taken against a lower maximum: bring it to M
                f = gl.convert_layout(gl.where(low, gl.exp2(mt - M), 1.0), gl.SliceLayout(0, gl.SliceLayout(1, LPS)))
                pw = psm.index(w)
                v = pw.load(LPS).to(gl.float32) * f[None, None, :]
                _barrier()
                pw.store(v.to(gl.float16))
                _barrier()
            if (ABL != 1) and (ABL != 3):  # ablations 1 and 3 (timing only): no P·V products
                pa = psm.index(w).permute((0, 2, 1)).load(A2)
                acc = _mma_each(pa, _unpack(words, 4), acc, 4)
                az = mma_v2(pa, ztm.index(w).load(B2), az)
        _barrier()  # every warp done with the P buffer and the stage
        mbarrier.arrive(pempty.index(w))
        if t + NS < t_hi:
            fence_async_shared()
            _copy_tile(
                DC, DM, cs.index(st), ms.index(st), bc.index(st), bm.index(st), page, PAGE_BYTES, R_OFF, 4, False
            )
    return acc, az, M


@gluon.jit
def _ws_kernel(Q, QPE, O, LSE, BT, LENS, DC, DM,
               H, stride_qb, stride_qh, stride_rb, stride_rh,
               stride_ob, stride_oh, stride_os, stride_bt, tiles_per_split, qk_scale,
               PAGE_BYTES: gl.constexpr, R_OFF: gl.constexpr, S_OFF: gl.constexpr, RS_OFF: gl.constexpr,
               Z_OFF: gl.constexpr, RZ_OFF: gl.constexpr, SINK: gl.constexpr, RECENT: gl.constexpr,
               SPLIT: gl.constexpr, NS: gl.constexpr, SCORE_REGS: gl.constexpr, ABL: gl.constexpr):  # fmt: skip
    PW: gl.constexpr = gl.num_warps()  # the P·V warpgroup(s): 4 or 8 warps, one or two groups each
    M2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[PW, 1, 1], instr_shape=[1, 16, 8])
    HM: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, M2))
    LO: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 2, 16, 1], [PW, 1, 1, 1], [3, 2, 1, 0])
    QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, 16], gl.float16)
    P1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    cs = gl.allocate_shared_memory(gl.int16, [NS, 512, 16], NV32)
    ms = gl.allocate_shared_memory(gl.int16, [NS, 128, 16], NV0)
    bc = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    bm = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pempty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qready, count=1)
    for i in gl.static_range(NS):
        mbarrier.init(bc.index(i), count=1)
        mbarrier.init(bm.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(pready.index(i), count=1)
        mbarrier.init(pempty.index(i), count=1)
    qc = gl.allocate_shared_memory(gl.float16, [32, 16, 16], QS)
    qr = gl.allocate_shared_memory(gl.float16, [4, 16, 16], QS)
    zb = gl.allocate_shared_memory(gl.float16, [2, 16, 16], QS)
    if ABL == 12:  # P' read by wgmma
        psm = gl.allocate_shared_memory(gl.float16, [2, 8, 64, 16], NV32_3)
    else:
        psm = gl.allocate_shared_memory(gl.float16, [2, 8, 64, 16], gl.SwizzledSharedLayout(8, 4, 2, order=[2, 1, 0]))
    ztm = gl.allocate_shared_memory(gl.float16, [2, 8, 64, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    pm = gl.allocate_shared_memory(gl.float32, [2, 16], P1)  # the maximum each buffer's P was taken against
    mg = gl.allocate_shared_memory(gl.float32, [16], P1)  # the score warpgroups' shared maximum
    fin = gl.allocate_shared_memory(gl.float32, [4, 16], P1)  # per score warpgroup: its maximum, its denominators
    chs = gl.allocate_shared_memory(gl.float32, [16], P1)

    pid_s = gl.program_id(0)
    b = gl.program_id(1).to(gl.int64)
    L = gl.load(LENS + b).to(gl.int32)
    low_hi = L - RECENT
    n_tiles = gl.cdiv(gl.minimum(gl.maximum(low_hi, SINK), L), BN)
    t_lo = gl.minimum(pid_s * tiles_per_split, n_tiles)
    t_hi = gl.minimum(t_lo + tiles_per_split, n_tiles)
    bt_row = BT + b * stride_bt
    Qb = Q + b * stride_qb
    Rb = QPE + b * stride_rb
    for i in gl.static_range(NS):
        if t_lo + i < t_hi:
            page = gl.load(bt_row + t_lo + i)
            _copy_tile(DC, DM, cs.index(i), ms.index(i), bc.index(i), bm.index(i), page, PAGE_BYTES, R_OFF, 4, False)
    _barrier()

    res = gl.warp_specialize([
        (_pv_part, (cs, ms, ztm, psm, pm, bc, bm, pready, pempty, DC, DM, bt_row, t_lo, t_hi, NS, PAGE_BYTES, R_OFF, ABL, M2)),
        (_score_part, (cs, ms, ztm, psm, pm, mg, fin, chs, qc, qr, zb, bc, bm, pready, pempty, qready, Qb, stride_qh,
                       Rb, stride_rh, H, qk_scale, t_lo, t_hi, low_hi,
                       0, NS, SINK, Z_OFF, S_OFF, RS_OFF, RZ_OFF, ABL)),
        (_score_part, (cs, ms, ztm, psm, pm, mg, fin, chs, qc, qr, zb, bc, bm, pready, pempty, qready, Qb, stride_qh,
                       Rb, stride_rh, H, qk_scale, t_lo, t_hi, low_hi,
                       1, NS, SINK, Z_OFF, S_OFF, RS_OFF, RZ_OFF, ABL)),
    ], [4, 4], [SCORE_REGS, SCORE_REGS])  # fmt: skip
    _barrier()
    acc, az, M = res
    if ABL == 12:  # timing only: each group's accumulator as 64 output channels (values wrong)
        o_b = O + b * stride_ob + pid_s * stride_os
        oc = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))[:, None]
        oh = gl.arange(0, 16, layout=gl.SliceLayout(0, ACC))[None, :]
        for g in gl.static_range(8):
            gl.store(o_b + oh * stride_oh + 64 * g + oc, acc[g], mask=(oh < H) & (oc >= 0))
    else:
        # the two warpgroups' denominators at the common maximum; the accumulators from M to it
        m0 = fin.index(0).load(HM)
        l0 = fin.index(1).load(HM)
        m1 = fin.index(2).load(HM)
        l1 = fin.index(3).load(HM)
        mf = gl.maximum(M, gl.maximum(gl.where(l0 > 0, m0, NEG), gl.where(l1 > 0, m1, NEG)))
        base = gl.where(mf == NEG, 0.0, mf)
        l = gl.where(l0 > 0, l0 * gl.exp2(m0 - base), 0.0) + gl.where(l1 > 0, l1 * gl.exp2(m1 - base), 0.0)
        has = l > 0
        sa = gl.where(has, gl.exp2(gl.where(M == NEG, base, M) - base) / gl.where(has, l, 1.0), 0.0)
        acc = (acc[0] * 16777216.0, acc[1] * 1048576.0, acc[2] * 16777216.0, acc[3] * 1048576.0)
        az = az * 16777216.0
        inv = sa[None, :, None]
        nz = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, M2)))
        zsum = gl.sum(gl.where(nz[None, None, :] == 0, az, 0.0), axis=2)[:, :, None]
        y = gl.join(
            gl.join((acc[0] - zsum) * inv, (acc[2] - zsum) * inv), gl.join((acc[1] - zsum) * inv, (acc[3] - zsum) * inv)
        )
        o_b = O + b * stride_ob + pid_s * stride_os
        _store_out(o_b, gl.convert_layout(gl.reshape(y, [8, 16, 16, 4]), LO), H, stride_oh, LO)
        lse = gl.where(has, (base + gl.log2(gl.where(has, l, 1.0))) * 0.6931471805599453, NEG)
        lh = gl.arange(0, 16, layout=HM)
        if SPLIT:
            gl.store(LSE + (b * H + lh) * gl.num_programs(0) + pid_s, lse, mask=lh < H)
        else:
            gl.store(LSE + b * H + lh, lse, mask=lh < H)


MAXNREG = {4: 168, 8: 128}  # 12 or 16 warps in all: what fits the register file of one SM


def plan(B: int, max_len: int, sms: int, sink: int = 4, recent: int = 128) -> tuple[int, int]:
    """(splits, page tiles per split): one program per SM over the batch."""
    n = max(1, -(-min(max(max_len - recent, sink), max_len) // 64))
    want = max(1, sms // B)
    per = -(-n // min(want, n))
    return -(-n // per), per


def decode(layer, bt, lens, q, qpe, o, lse, tau: float, splits: int, per: int, stages: int = 5,
           score_regs: int = 168, ablate: int = 0, pv_warps: int = 4) -> None:  # fmt: skip
    """Launch over ``splits`` splits of ``per`` page tiles: ``o`` (B, H, splits, 512) and ``lse``
    (B, H, splits) float32 partials when ``splits > 1``, else the outputs. ``ablate`` (timing only,
    wrong outputs): 1 the P·V warpgroup without its products, 2 the score warpgroups without theirs, 3
    neither, 4 nothing but the copies and the hand-offs between the warpgroups, 12 P·V as wgmma
    (:func:`_pv_part_wg`)."""
    B, H, _ = q.shape
    if layer.fmt.content_bits != 4 or H > 16:
        raise ValueError("the probe takes C4R4 pages and at most 16 heads")
    c = constexprs(layer.fmt, layer.sink, layer.recent, splits > 1)
    keep = ("PAGE_BYTES", "R_OFF", "S_OFF", "RS_OFF", "Z_OFF", "RZ_OFF", "SINK", "RECENT", "SPLIT")
    _ws_kernel[(splits, B)](
        q, qpe, o, lse, bt, lens, *descriptors(layer.pool, 4),
        H, q.stride(0), q.stride(1), qpe.stride(0), qpe.stride(1),
        o.stride(0), o.stride(1), o.stride(2), bt.stride(0), per, tau * LOG2E,
        **{k: c[k] for k in keep}, NS=stages, SCORE_REGS=score_regs, ABL=ablate,
        num_warps=pv_warps, maxnreg=MAXNREG[pv_warps],
    )  # fmt: skip


def compile_sm90(stages: int = 5, score_regs: int = 168, ablate: int = 0, pv_warps: int = 4):
    """The kernel compiled for sm_90 without a GPU (Triton's private API; a measuring tool)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from quantmla.kernels import PageFormat, exact_decode

    c = constexprs(PageFormat(4, 4, 512, 64, 64, torch.bfloat16), 4, 128, True)
    keep = ("PAGE_BYTES", "R_OFF", "S_OFF", "RS_OFF", "Z_OFF", "RZ_OFF", "SINK", "RECENT", "SPLIT")
    consts = {k: c[k] for k in keep} | dict(NS=stages, SCORE_REGS=score_regs, ABL=ablate)
    descs = exact_decode.descriptor_blocks(4)
    ptr = dict(Q="bf16", QPE="bf16", O="fp32", LSE="fp32", BT="i32", LENS="i64")
    k = _ws_kernel
    sig, attrs = {}, {}
    for i, n in enumerate(k.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in descs:
            block, lay = descs[n]
            sig[n] = f"tensordesc<i16[{', '.join(map(str, block))}],{lay!r}>"
        elif n in ptr:
            sig[n] = "*" + ptr[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n == "qk_scale" else "i32"
    src = GluonASTSource(k, sig, constexprs=consts, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=pv_warps, maxnreg=MAXNREG[pv_warps])
    )


def summary(stages: int = 4, score_regs: int = 168, ablate: int = 0, pv_warps: int = 4, keep: str = "") -> str:
    """One line per compiled variant: registers, stack, shared memory, register reallocations
    (``USETMAXREG``: the partitions were formed) and each loop's instructions, HGMMA, HMMA and
    local-memory accesses (``bench/gluon_sass.py``'s loop finder)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gluon_sass import _sass, loops

    cc = compile_sm90(stages, score_regs, ablate, pv_warps)
    sass, res, shared = _sass(cc)
    if keep:
        Path(keep).write_text(sass)
    body = [
        (lp["instructions"], lp["hgmma"], lp["hmma"], lp["local"]) for lp in loops(sass) if lp["instructions"] > 300
    ]
    return (
        f"VARIANT {stages}:{score_regs}:{pv_warps} ablate {ablate}: {res} "
        f"shared={shared} USETMAXREG={sass.count('USETMAXREG')} loops {body}"
    )


if __name__ == "__main__":
    # python bench/prototypes/ws_exact.py [STAGES SCORE_REGS ABLATE PV_WARPS [SASS_FILE]]: compile for sm_90 and
    # summarize (no GPU); with no arguments, the default variant and ablation 12
    if len(sys.argv) > 1:
        print(summary(*(int(a) for a in sys.argv[1:5]), keep=sys.argv[5] if len(sys.argv) > 5 else ""))
    else:
        print(summary())
        print(summary(ablate=12))
