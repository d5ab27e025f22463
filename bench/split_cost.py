"""Where the time of a short split goes: 16-head decode broken into kernel, merge and fixed costs.

    python bench/split_cost.py --out DIR          # H200, ~2 minutes

At each shape (default: batch 1 at 4K, 32K and 128K tokens, and batch 32 at 4K, where every
split holds one to nine tiles) and for C16R16, the default C4R4 kernel and C4R4 exact, it times
with ``bench/decode.py``'s method (CUDA-graph replays, L2 flushed, medians):

- ``full``: the decode as the sweep times it (kernel, then the LSE merge of the splits);
- ``kernel``: the decode kernel alone, into the partial outputs; ``merge``: the merge alone;
- ``per``: the decode kernel with the shape's split count but ``per`` work tiles per split
  (0: programs that only set up their queries and write empty partials) — the intercept is a
  program's fixed cost, the slope the cost of a tile at that occupancy;
- ``splits``: the full decode at other split counts;
- ``merge_variants``: the merge kernel with other column blocks and warps;
- ``floor``: a graph of one trivial kernel under the same flush (what the method itself costs);
- ``protected``: at batch 1, 128K, the exact kernel with and without its last split (before v33 the
  one that held the protected tiles; now they come first and the last split holds page tiles), each
  with and without the protected rows' L2 prefetch;
- ``skeleton`` (``--skeleton``): at each shape, the exact kernel alone, shipped (``ablate`` 0) and
  with its page copies only (``ablate`` 8), at 0, 1, 2, 4, 8 … work tiles per split, at the shape's
  split count without its last split, without the L2 prefetch of the protected rows, without the
  protected rows (``ablate`` 11), and the full decode with protected tiles of each ``--weights``;
- ``flush``: the full exact decode at batch 1, 128K timed by events after no flush, after
  do_bench's flush (a 256 MB memset, which leaves L2 full of dirty lines) and after a flush by
  reading 256 MB (clean lines).

Writes ``splitcost-<date>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode import Shape, run_meta, time_calls, write_record  # noqa: E402

from quantmla.kernels import triton_decode  # noqa: E402

DEV = torch.device("cuda")
TAU = 576**-0.5
FORMATS = {"c16r16": ("c16r16", {}), "c4r4": ("c4r4", {}), "c4r4_exact": ("c4r4", {"exact": True})}


class Parts:
    """The plan of one format at one shape, with partial buffers to launch its kernel and merge alone."""

    def __init__(self, sh: Shape, name: str, cfg: dict, splits: int | None = None):
        self.sh, self.layer, self.tables = sh, sh.layers[name], sh.tables[name]
        cfg = dict(cfg, max_len=sh.L) | ({} if splits is None else {"num_splits": splits})
        self.cfg = triton_decode.default_config(sh.B, sh.H, sh.L, self.layer, DEV, cfg)
        self.plan = triton_decode.plan(self.layer, sh.H, self.cfg, DEV, sh.L)
        self.kernel, self.splits, self.per, _ = self.plan
        self.o = torch.empty(sh.B, sh.H, 512, device=DEV)
        self.lse = torch.empty(sh.B, sh.H, device=DEV)
        self.op, self.lsep = triton_decode.partials(self.o, self.lse, self.splits)

    def launch(self, bt, per=None, splits=None, ablate=0):
        sh, pl = self.sh, self.plan._replace(per=self.per if per is None else per, splits=splits or self.splits)
        if ablate:  # the exact kernel's timing variants
            w = triton_decode.prot_weight(self.cfg)
            triton_decode._exact().decode(
                self.layer,
                bt,
                sh.lengths,
                sh.q,
                sh.qp,
                self.op,
                self.lsep,
                TAU,
                pl.splits,
                pl.per,
                ablate=ablate,
                weight=w,
            )
        else:
            triton_decode.launch(pl, self.layer, bt, sh.lengths, sh.q, sh.qp, self.op, self.lsep, TAU, self.cfg)

    def kernel_ms(self, per=None) -> float:
        return time_calls([functools.partial(self.launch, t, per) for t in self.tables])

    def merge_ms(self) -> float:
        return time_calls([functools.partial(triton_decode.merge, self.op, self.lsep, self.o, self.lse)])

    def merge_variant_ms(self, block_d: int, block_s: int, warps: int) -> float:
        B, H, S, d_c = self.op.shape

        def go():
            triton_decode._combine_kernel[(B * H, d_c // block_d)](
                self.op, self.lsep, self.o, self.lse, S, DC=d_c, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps
            )

        return time_calls([go])


def events_ms(fn, flush, n=200) -> float:
    """Median ms of ``fn`` by CUDA events, ``flush`` (or nothing) enqueued before each call."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        if flush is not None:
            flush()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def shape_report(H, B, L, gen, l2, full_splits) -> dict:
    sh = Shape(H, B, L, gen, l2, formats={"c16r16": (16, 16), "c4r4": (4, 4)})
    out = {"H": H, "B": B, "L": L, "sets": len(sh.tables["c4r4"])}
    for key, (name, cfg) in FORMATS.items():
        p = Parts(sh, name, cfg)
        r = {"kernel_name": p.kernel, "splits": p.splits, "per": p.per}
        r["full"] = sh.time(name, cfg)
        r["kernel"] = p.kernel_ms()
        r["merge"] = p.merge_ms() if p.splits > 1 else 0.0
        r["per_ms"] = {str(k): p.kernel_ms(k) for k in sorted({0, 1, 2, 4, p.per}) if k <= p.per}
        if p.splits > 1:
            r["merge_variants"] = {
                f"d{bd}-s{bs}-w{w}": p.merge_variant_ms(bd, bs, w)
                for bd, bs, w in ((16, 512, 4), (16, 512, 8), (32, 256, 4), (64, 64, 4), (64, 32, 2), (512, 8, 4))
            }
        if key != "c16r16":
            r["splits_ms"] = {}
            for s in full_splits:
                q = Parts(sh, name, cfg, splits=s)
                r["splits_ms"][f"{s}->{q.splits}x{q.per}"] = sh.time(name, dict(cfg, num_splits=s))
        out[key] = r
        print(H, B, L, key, {k: v for k, v in r.items() if k != "merge_variants"}, flush=True)
        if "merge_variants" in r:
            print("   merge", {k: round(v * 1e3, 1) for k, v in r["merge_variants"].items()}, flush=True)
    return out, sh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="16:1:4096,16:1:32768,16:1:131072,16:32:4096")
    ap.add_argument("--splits", default="66,132,264,528")
    ap.add_argument("--skeleton", action="store_true", help="only the exact kernel's skeleton at --shapes")
    ap.add_argument("--weights", default="1,3,4,5,6,8", help="with --skeleton: protected-tile weights to time")
    ap.add_argument(
        "--b1-only", action="store_true", help="only the protected-tile and flush comparisons at batch 1, 128K"
    )
    a = ap.parse_args()
    stamp = datetime.datetime.now(datetime.UTC)
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    gen = torch.Generator(DEV).manual_seed(0)
    meta = run_meta(props, stamp, "python bench/split_cost.py " + " ".join(sys.argv[1:]))
    tiny = torch.zeros(1, device=DEV)
    meta["floor_ms"] = time_calls([lambda: tiny.add_(1)])
    print("floor (one trivial kernel, graph, flushed):", meta["floor_ms"], flush=True)
    meta["rows"] = []
    splits = [int(s) for s in a.splits.split(",")]
    last = None
    if a.skeleton:
        meta["skeleton"], weights = [], [int(w) for w in a.weights.split(",")]
        for spec in a.shapes.split(","):
            meta["skeleton"].append(skeleton_report(*map(int, spec.split(":")), gen, l2, weights))
            write_record(meta, "splitcost", stamp, a.out)
        return
    for spec in [] if a.b1_only else a.shapes.split(","):
        H, B, L = map(int, spec.split(":"))
        row, sh = shape_report(H, B, L, gen, l2, splits)
        meta["rows"].append(row)
        last = sh if (B, L) == (1, 131072) else last
        write_record(meta, "splitcost", stamp, a.out)
    if a.b1_only:
        last = Shape(16, 1, 131072, gen, l2, formats={"c16r16": (16, 16), "c4r4": (4, 4)})
    if last is not None:
        meta["protected"] = protected_report(last)
        meta["flush"] = flush_report(last)
        write_record(meta, "splitcost", stamp, a.out)


def skeleton_report(H, B, L, gen, l2, weights) -> dict:
    """The exact C4R4 kernel alone (no merge), shipped and as its page copies only (``ablate`` 8):
    at the shape's split count with 0 … ``per`` work tiles per split, without its last split (timing
    only: each request's last page tiles are left out), and without the prefetch
    of the protected rows (``ablate`` 4, shipped only)."""
    sh = Shape(H, B, L, gen, l2, formats={"c4r4": (4, 4)})
    p = Parts(sh, "c4r4", {"exact": True})
    out = {"H": H, "B": B, "L": L, "splits": p.splits, "per": p.per, "full": sh.time("c4r4", {"exact": True})}
    pers = sorted({0, 1, 2, 4, 8, 16, 32, p.per} & set(range(p.per + 1)))
    for abl in (0, 8):
        r = {f"per{k}": time_calls([functools.partial(p.launch, t, k, None, abl) for t in p.tables]) for k in pers}
        if p.splits > 1:
            r["no_last_split"] = time_calls([functools.partial(p.launch, t, None, p.splits - 1, abl) for t in p.tables])
        out[f"ablate{abl}"] = r
    out["ablate4"] = time_calls([functools.partial(p.launch, t, None, None, 4) for t in p.tables])
    out["ablate11"] = time_calls([functools.partial(p.launch, t, None, None, 11) for t in p.tables])
    out["merge"] = p.merge_ms() if p.splits > 1 else 0.0
    out["weights"] = {}
    for w in weights:
        q = Parts(sh, "c4r4", {"exact": True, "prot_weight": w})
        full = sh.time("c4r4", {"exact": True, "prot_weight": w})
        out["weights"][str(w)] = {"splits": q.splits, "per": q.per, "full": full, "kernel": q.kernel_ms()}
    print("skeleton", out, flush=True)
    return out


def protected_report(sh: Shape) -> dict:
    """The exact kernel alone at the shape's split count and with its last split left out (before
    v33 that split held only the three protected tiles at batch 1, 128K; now it holds page tiles;
    outputs incomplete, timing only), each with and without the L2 prefetch of the protected rows (``ablate=4``)."""
    p = Parts(sh, "c4r4", {"exact": True})
    out = {}
    for s in (p.splits, p.splits - 1):
        for abl in (0, 4):
            out[f"splits{s}-ablate{abl}"] = time_calls([functools.partial(p.launch, t, None, s, abl) for t in p.tables])
    print("protected", out, flush=True)
    return out


def flush_report(sh: Shape) -> dict:
    """Event-timed medians at one shape after no flush, a 256 MB memset (do_bench's flush: L2 left
    full of dirty lines) and a 256 MB read (clean lines): the full exact decode, and the exact and
    the default C4R4 kernels with no work tiles (code and queries only)."""
    big = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    flushes = {"none": None, "memset": big.zero_, "read": lambda: big.view(torch.int64).sum()}
    graphs = {}
    for key, per in (("c4r4_exact_full", None), ("c4r4_exact_per0", 0), ("c4r4_per0", 0), ("c16r16_per0", 0)):
        name, cfg = FORMATS[key.rsplit("_", 1)[0]]
        p = Parts(sh, name, cfg)
        bt = sh.tables[name][0]
        if per is None:
            full = dict(cfg, max_len=sh.L)

            def fn(p=p, bt=bt, name=name, full=full):
                triton_decode.decode(sh.layers[name], bt, sh.lengths, sh.q, sh.qp, TAU, full, (p.o, p.lse))
        else:
            fn = functools.partial(p.launch, bt, per)
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs[key] = g
    out = {k: {f: events_ms(g.replay, fl) for f, fl in flushes.items()} for k, g in graphs.items()}
    print("flush", out, flush=True)
    return out


if __name__ == "__main__":
    main()
