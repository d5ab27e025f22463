"""Summarise the SASS page of an Nsight Compute report (``ncu --page source --print-source sass --csv``).

    python bench/ncu_summary.py bench/results/ncu/h16-b32-l32768-c4r4.sass.csv [--top 25] [--phases]

Prints the warp-stall samples by reason, by opcode, and the instructions that collect the most,
with how often each ran; the loop of a kernel shows as the instructions executed most often.
``--phases`` splits the exact kernel's page loop (the instructions run at least 90 % as often as the
most frequent one) at its first wgmma, its first ``MUFU`` after that and the barrier after that: tile
start, scores, softmax, P·V, each with its share of instructions and samples. Reads ``.csv.gz`` too.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
from collections import Counter


def load(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head = rows[start]
    return [dict(zip(head, r)) for r in rows[start + 1 :] if len(r) == len(head)]


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(src: str) -> str:
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return s.split()[0] if s else "?"


def phases(rows) -> list[tuple[str, float, float, float, Counter]]:
    """(phase, share of the loop's instructions, share of its samples, instructions per execution
    of the loop, opcode counts per execution) for the exact kernel's page loop."""
    most = max(num(r["Instructions Executed"]) for r in rows)
    loop = [r for r in rows if num(r["Instructions Executed"]) >= 0.9 * most]
    name, out = "tile start", {}
    for r in loop:
        op = opcode(r["Source"])
        if name == "tile start" and op.startswith("HGMMA"):
            name = "scores"
        elif name == "scores" and op.startswith("MUFU"):
            name = "softmax"
        elif name == "softmax" and op.startswith("BAR"):
            name = "P·V"
        acc = out.setdefault(name, [0.0, 0.0, Counter()])
        n = num(r["Instructions Executed"])
        acc[0] += n
        acc[1] += num(r["Warp Stall Sampling (All Samples)"])
        acc[2][op.split(".")[0]] += n / most
    ti = sum(v[0] for v in out.values())
    ts = sum(v[1] for v in out.values())
    return [(k, v[0] / ti, v[1] / ts, v[0] / most, v[2]) for k, v in out.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--phases", action="store_true", help="the exact kernel's page loop by phase")
    args = ap.parse_args(argv)
    rows = load(args.csv)
    if args.phases:
        print("phase: share of the loop's instructions, of its samples; instructions per loop iteration and warp")
        for k, fi, fs, n, ops in phases(rows):
            top = ", ".join(f"{o} {c:.0f}" for o, c in ops.most_common(5))
            print(f"  {k:10s} {fi:6.1%} {fs:6.1%} {n:6.0f}  {top}")
        return
    reasons = [k for k in rows[0] if k.startswith("stall_") and not k.endswith("(Not Issued)")]
    total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows)
    executed = sum(num(r["Instructions Executed"]) for r in rows)
    print(f"{len(rows)} instructions, {executed:,.0f} warp-instructions executed, {total:,.0f} stall samples")
    by_reason = Counter({k[6:]: sum(num(r[k]) for r in rows) for k in reasons})
    print("\nsamples by reason:")
    for k, v in by_reason.most_common(12):
        print(f"  {k:18s} {v / total:6.1%}")
    by_op, ex_op = Counter(), Counter()
    for r in rows:
        op = opcode(r["Source"])
        by_op[op] += num(r["Warp Stall Sampling (All Samples)"])
        ex_op[op] += num(r["Instructions Executed"])
    print("\nby opcode: share of samples, share of executed instructions")
    for op, v in by_op.most_common(args.top):
        print(f"  {op:22s} {v / total:6.1%} {ex_op[op] / executed:6.1%}")
    print("\ntop instructions: samples, executed, main reasons")
    top = sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[: args.top]
    for r in top:
        why = sorted(((num(r[k]), k[6:]) for k in reasons), reverse=True)[:2]
        s = num(r["Warp Stall Sampling (All Samples)"])
        tags = ", ".join(f"{k} {v / max(s, 1):.0%}" for v, k in why if v)
        print(
            f"  {r['Address']:>6} {s / total:6.1%} {num(r['Instructions Executed']):>11,.0f}  {r['Source'][:60]:60s} {tags}"
        )


if __name__ == "__main__":
    main()
