"""Table 9's latency protocol (the paper's App. F.1) on this GPU: C4R4 decode against BF16, 16 heads.

    python bench/table9.py            # batch 8 and 32, N = 1K … 1M, the paper's sampling
    python bench/table9.py --quick    # batch 8 and 32, N = 1K … 16K, 10 samples per round

The paper's setup: 16 query heads and one query token per request (DeepSeek-V3/R1 per GPU under
TP8), QK dim 576, V dim 512, 64-token pages, every request owning its pages, context = max-length
hint = N; synthetic BF16 queries and cache values (random codes and metadata for C4R4, which keeps
sink 4 + recent 128 tokens in BF16).

Its timing: two independent runs (here: the caches, queries and CUDA graphs built anew with another
seed), each of two rounds with the format order reversed between rounds, 30 samples per round, so
120 samples per configuration and format, averaged (the median is recorded too). A sample is one
CUDA-graph replay of the decode core, its main kernel and the LSE combine, timed with CUDA events
after L2 was flushed; the writer and the host's metadata are outside the span, as in the paper.
Δ = (t_C4R4 / t_BF16 − 1) × 100 %.

What differs from the paper, and is written into the record: the GPU (the paper used a 78-SM
Hopper part and 78 scheduling partitions; here the core splits work for this GPU's SMs), the
baseline (the paper: FlashMLA's BF16 kernel with its own partitioning; here the core's C16R16
kernel, so both formats share one scheduler), and P·V (by default the core's 16-head choice, P as
a hi/lo BF16 pair; ``--pv bf16`` takes one BF16 P for both formats, as FlashMLA does). Writes
``table9-<date>.json`` and ``.md`` (beside the paper's numbers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import D_C, SINK, TAU, Shape, pv_config, run_meta  # noqa: E402
from decode import FORMATS as BITS_OF  # noqa: E402

from analysis.paper_numbers import TABLE9, context_label  # noqa: E402
from quantmla import kernels  # noqa: E402
from quantmla.kernels import PageFormat, dispatch  # noqa: E402
from quantmla.kernels.splits import Case  # noqa: E402

H = 16
FORMATS = ("c16r16", "c4r4")
BATCHES = (8, 32)
LENGTHS = tuple(1 << k for k in range(10, 21))  # 1K … 1M
TIMING = (
    "mean (and median) of 120 samples per format: 2 runs x 2 rounds (format order reversed) x 30; "
    "a sample = CUDA events around one CUDA-graph replay of decode (main kernel + LSE combine), L2 flushed before"
)


def graph(sh: Shape, name: str, pv: dict) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """A CUDA graph of one decode over the shape's first page set, and the outputs it writes."""
    layer, table = sh.layers[name], sh.tables[name][0]
    kernels.decode(layer, table, sh.lengths, sh.q, sh.qp, TAU, "triton", pv)  # validated once; compiles
    out = (torch.empty(sh.B, H, D_C, device=sh.q.device), torch.empty(sh.B, H, device=sh.q.device))
    cfg = dict(pv, max_len=sh.L)
    dispatch.decode(layer, table, sh.lengths, sh.q, sh.qp, TAU, cfg, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dispatch.decode(layer, table, sh.lengths, sh.q, sh.qp, TAU, cfg, out)
    return g, out


def samples(g: torch.cuda.CUDAGraph, flush: torch.Tensor, n: int) -> list[float]:
    """``n`` timed replays (µs), each after flushing L2; queued back to back, read once."""
    events = []
    for _ in range(n):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [1e3 * s.elapsed_time(e) for s, e in events]


def measure(B: int, N: int, runs: int, per_round: int, l2: int, flush: torch.Tensor, pv: dict) -> dict:
    times = {name: [] for name in FORMATS}
    row = {"B": B, "N": N}
    for run in range(runs):
        gen = torch.Generator(device="cuda").manual_seed(1000 * run + 7)
        sh = Shape(H, B, N, gen, l2, formats=FORMATS)
        graphs = {name: graph(sh, name, pv) for name in FORMATS}
        for name, (g, out) in graphs.items():  # every output written, and finite
            g.replay()
            torch.cuda.synchronize()
            if not (torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()):
                raise RuntimeError(f"decode wrote non-finite values for {name} at B={B} N={N}")
            if run == 0:
                layer = sh.layers[name]
                full = dispatch.default_config(B, H, N, layer, layer.pool.device, pv)
                p = dispatch.plan(Case(layer, H, N, layer.pool.device, False, full))
                row[f"{name}_plan"] = {"kernel": p.name, "splits": p.split.splits, "tiles_per_split": p.split.per,
                                       "sink_in_tile0": p.split.sink_in_tile0}  # fmt: skip
        for rnd in range(2):
            for name in FORMATS if rnd == 0 else FORMATS[::-1]:
                times[name] += samples(graphs[name][0], flush, per_round)
        del sh, graphs
        torch.cuda.empty_cache()
    for name in FORMATS:
        row[f"{name}_us"] = statistics.fmean(times[name])
        row[f"{name}_median_us"] = statistics.median(times[name])
        row[f"{name}_samples"] = len(times[name])
    row["delta_pct"] = (row["c4r4_us"] / row["c16r16_us"] - 1) * 100
    row["speedup"] = row["c16r16_us"] / row["c4r4_us"]
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| batch | N | BF16 (µs) | C4R4 (µs) | Δ (%) | C4R4 speed-up | paper BF16 | paper C4R4 | paper Δ (%) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = TABLE9.get((r["B"], r["N"]))
        paper = f"{p[0]:.2f} | {p[1]:.2f} | {p[2]:+.2f}" if p else "— | — | —"
        n = context_label(r["N"])
        lines.append(
            f"| {r['B']} | {n} | {r['c16r16_us']:.2f} | {r['c4r4_us']:.2f} | {r['delta_pct']:+.2f} | "
            f"{r['speedup']:.2f}× | {paper} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N up to 16K and 10 samples per round")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument(
        "--pv",
        choices=("default", "bf16"),
        default="default",
        help="P·V as the core chooses at 16 heads (P as a hi/lo BF16 pair, float32 accuracy) or with P as "
        "one BF16 tile (FlashMLA's choice), for both formats",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/table9.py needs a CUDA GPU")
    lengths = [n for n in LENGTHS if n <= 1 << 14] if args.quick else list(LENGTHS)
    pv = pv_config(args.pv)
    per_round = 10 if args.quick else 30
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    flush = torch.empty(4 * l2, dtype=torch.uint8, device="cuda")
    stamp = datetime.datetime.now(datetime.UTC)
    meta = run_meta(props, stamp, "python bench/table9.py " + " ".join(sys.argv[1:] if argv is None else argv))
    meta |= {
        "timing": TIMING,
        "sms": props.multi_processor_count,
        "heads": H,
        "pv": args.pv,
        "sink": SINK,
        "differences": "core's own split rule for this GPU (paper: 78 partitions on a 78-SM GPU); baseline is "
        "the core's C16R16 kernel (paper: FlashMLA BF16)",
        "rows": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"table9-{stamp:%Y%m%d-%H%M%S}"

    def save():  # after every configuration: an interrupted run keeps what it measured
        base.with_suffix(".json").write_text(json.dumps(meta, indent=1))
        head = f"# Table 9's protocol, {meta['date']}\n\n{props.name} ({props.multi_processor_count} SMs), "
        head += f"torch {meta['torch']}, Triton {meta['triton']}, P·V: {args.pv}. {TIMING}.\n\n"
        base.with_suffix(".md").write_text(head + table(meta["rows"]))

    free = torch.cuda.mem_get_info()[0]
    for B in BATCHES:
        for N in lengths:
            need = B * sum(PageFormat(*BITS_OF[f]).request_bytes(N) for f in FORMATS)
            if need * 1.2 > free:
                print(f"skip B={B} N={N}: needs ~{need / 2**30:.0f} GiB", flush=True)
                continue
            r = measure(B, N, 2, per_round, l2, flush, pv)
            meta["rows"].append(r)
            save()
            print(
                f"B={B:2d} N={N:8d}  BF16 {r['c16r16_us']:9.2f} µs  C4R4 {r['c4r4_us']:9.2f} µs  "
                f"Δ {r['delta_pct']:+6.2f} %  ({r['speedup']:.2f}×)",
                flush=True,
            )
    save()
    print(table(meta["rows"]))
    print(f"wrote {base}.json and .md")


if __name__ == "__main__":
    main()
