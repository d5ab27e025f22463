"""How a decode is cut along the context and put back together: work tiles, split counts, the
partial outputs and their LSE merge, for every decode kernel.

A request's work is its page tiles (``block_n`` tokens of one page, up to the recent window) and,
with protection, its protected tiles (the sink and the recent ring from the protection buffer).
A decode runs ``splits`` programs per (request, head block), split ``s`` taking work units
``s·per … (s+1)·per − 1``; each writes a normalized partial output and its LSE, and
:func:`merge` combines them: m = max_j m_j, O = sum_j e^(m_j − m) s_j o_j / sum_j e^(m_j − m) s_j.
The kernels choose how their work is counted (:func:`split_work`, evenly, with the sink in page
tile 0 or among the protected tiles; :func:`front_split_work`, protected tiles first and heavier);
:func:`split_count` chooses how many splits fill the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, eq=False)
class Case:
    """One decode as a kernel is asked to run it: the layer (page format, protection), the query
    heads, the longest request, the device, whether attention is over the exactly dequantized
    cache (``exact``) or the reference's rounded reconstruction, and the full tile config (the
    defaults with the caller's overrides; keys: :data:`quantmla.kernels.DECODE_CONFIG`)."""

    layer: object
    heads: int
    max_len: int
    device: torch.device
    exact: bool
    config: dict

    @property
    def fmt(self):
        return self.layer.fmt


class Split(NamedTuple):
    """Splits per (request, head block), work units per split, and whether the sink rows ride in
    page tile 0 (else they are protected tiles of their own)."""

    splits: int
    per: int
    sink_in_tile0: bool


def protected(layer) -> tuple[int, int] | None:
    """(sink, recent) rows a layer attends to from its protection buffer, or None without one."""
    return None if layer.prot is None else (layer.sink, layer.recent)


def work(max_len: int, block_n: int, prot: tuple[int, int] | None, sink_in_tile0: bool = False) -> tuple[int, int]:
    """(page tiles, protected tiles) of a request of ``max_len`` tokens: the page tiles up to the
    recent window (at least the one that holds the sink), then the protected rows (sink and ring,
    or only the ring where the sink is swapped into page tile 0) in tiles of their own."""
    if prot is None:
        return triton.cdiv(max_len, block_n), 0
    sink, recent = prot
    end = min(max(max_len - recent, sink), max_len)
    return triton.cdiv(end, block_n), triton.cdiv(recent + (0 if sink_in_tile0 else sink), block_n)


def split_work(layer, max_len: int, block_n: int, num_splits: int, sink_in_tile0: bool = False) -> Split:
    """The :class:`Split` for ``num_splits`` requested: the work tiles of :func:`work` (page tiles,
    then protected tiles) cut into equal shares. Split ``s`` takes a request's work tiles
    ``s·per … (s+1)·per − 1``; those past its page tiles are its protected tiles, so a short
    request's protected rows fall to earlier splits, and they spread over several splits where a
    share is shorter than they are. With ``sink_in_tile0`` the sink rides in page tile 0 and the
    protected tiles are the ring's: 2 of 64 for the default 128 rows, as many as BF16 reads there;
    else sink and ring are 132 rows, 3 tiles."""
    units = max(1, sum(work(max_len, block_n, protected(layer), sink_in_tile0)))
    splits = max(1, min(num_splits, units))
    per = triton.cdiv(units, splits)
    return Split(triton.cdiv(units, per), per, sink_in_tile0)


def front_share(per: int, weight: int, k: int) -> tuple[int, int]:
    """(protected tiles per split, first page unit) of :func:`front_split_work`: ``k`` protected
    tiles of ``weight`` units each (at most a split's ``per``) at the front, as many to a split as fit
    in it whole, and the page tiles (one unit each) from the unit after the last of them."""
    if per <= 0:
        return 0, 0
    if k == 0:
        return 1, 0
    w = max(1, min(weight, per))
    m = per // w
    return m, ((k - 1) // m) * per + ((k - 1) % m + 1) * w


def front_split_work(layer, max_len: int, num_splits: int, weight: int) -> Split:
    """The :class:`Split` of 64-token tiles for a request's protected tiles first, each weighing
    ``weight`` page tiles, then its page tiles: at most ``num_splits`` splits of the fewest equal
    units that fit (a protected tile weighs a whole split where splits are shorter than ``weight``).
    Split ``s`` takes units ``s·per … (s+1)·per − 1`` (:func:`front_ranges`)."""
    n, k = work(max_len, 64, protected(layer))
    per = max(1, triton.cdiv(n + k, max(1, num_splits)))  # the fewest units per split that can do
    while True:
        end = front_share(per, weight, k)[1]
        splits = max(1, triton.cdiv(end + n, per))
        if splits <= max(1, num_splits):
            return Split(splits, per, False)
        per += 1


def front_ranges(s: int, per: int, weight: int, k: int, n: int) -> tuple[range, range]:
    """(page tiles, protected tiles) split ``s`` of :func:`front_split_work` attends to in a request of
    ``n`` page tiles and ``k`` protected tiles: what a kernel that splits so computes from its program id."""
    m, end = front_share(per, weight, k)
    lo = s * per
    return range(max(lo - end, 0), min(max(lo + per - end, 0), n)), range(min(s * m, k), min(s * m + m, k))


SM_COUNT: dict[int, int] = {}


def sms(device) -> int:
    """Streaming multiprocessors of ``device`` (an H200's 132 for a device that is not a GPU)."""
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in SM_COUNT:
        SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return SM_COUNT[i]


def programs_per_sm(cfg: dict) -> int:
    """Programs of ``cfg`` one SM holds, as the split count assumes: the register file (65,536
    registers) over a register cap ``maxnreg`` if one is set, else two 4-warp or one 8-warp
    program (the compiler takes all 255 registers per thread when it can). Shared memory is the
    tuning's business: a candidate whose tiles do not fit that many times is simply slower."""
    if cfg.get("maxnreg"):
        return max(1, 65536 // (int(cfg["maxnreg"]) * 32 * cfg["num_warps"]))
    return 2 if cfg["num_warps"] <= 4 else 1


def split_count(B: int, heads: int, tiles: int, slots: int) -> int:
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
    # one pass, and at batch 1 hundreds of programs
    block_s = min(512, triton.next_power_of_2(splits))
    block_d = min(d_c & -d_c, max(16, 8192 // block_s))  # a power of two dividing d_c
    _combine_kernel[(B * H, d_c // block_d)](op, lsep, o, lse, splits, DC=d_c, BLOCK_S=block_s, BLOCK_D=block_d)


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


__all__ = [
    "Case",
    "Split",
    "front_ranges",
    "front_split_work",
    "merge",
    "partials",
    "programs_per_sm",
    "split_count",
    "split_work",
    "work",
]
