"""Summarise the SASS page of an Nsight Compute report (``ncu --page source --print-source sass --csv``).

    python bench/ncu_summary.py bench/results/ncu/h16-b32-l32768-c4r4.sass.csv [--top 25]

Prints the warp-stall samples by reason, by opcode, and the instructions that collect the most,
with how often each ran; the loop of a kernel shows as the instructions executed most often.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter


def load(path):
    with open(path, newline="") as f:
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    rows = load(args.csv)
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
