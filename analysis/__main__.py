"""``python -m analysis table|paper|sensitivity|claims <runs-dir> [--out DIR]``: print and write result tables
(and figures) from recorded runs (``table|paper --wandb ENTITY/PROJECT``: from a W&B project's runs); ``python -m analysis latency <table9 JSON> ...``: Table 9 from
``bench/table9.py`` records."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

WRITERS = {  # subcommand -> (module with write(source, out) -> (markdown, what it wrote), the files that is)
    "table": ("analysis.table", lambda files: files),
    "paper": ("analysis.reproduction", lambda files: files),
    "sensitivity": ("analysis.sensitivity", lambda files: files),
    "latency": ("analysis.latency", lambda files: files),
    "claims": ("analysis.claims", lambda files: files),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="model × method × bits table of the recorded metrics")
    t.add_argument("runs_dir", type=Path, nargs="?")
    t.add_argument("--out", type=Path, default=None, help="folder for table.md/.csv/.tex (default: runs_dir)")
    t.add_argument(
        "--over",
        nargs="+",
        default=(),
        metavar="FIELD",
        help="config fields to average over (e.g. seed model.seed): runs differing only in them share a row "
        "with n, mean and standard error; without it every distinct run has its own row",
    )
    s = sub.add_parser("sensitivity", help="Table 4/5 and Figure 2 style plots of eval=sensitivity runs")
    s.add_argument("runs_dir", type=Path)
    s.add_argument("--out", type=Path, default=None, help="folder for the tables and figures (default: runs_dir)")
    pp = sub.add_parser(
        "paper", help="Tables 1-4 and RULER in the paper's layout with its numbers beside, and its claims checked"
    )
    pp.add_argument("runs_dir", type=Path, nargs="?")
    pp.add_argument(
        "--out", type=Path, default=None, help="folder for the tables and figures (default: runs_dir/paper)"
    )
    cl = sub.add_parser("claims", help="each claim of the paper checked on the runs: holds, does not hold, ...")
    cl.add_argument("runs_dir", type=Path)
    cl.add_argument("--out", type=Path, default=None, help="folder for claims.md/.csv (default: runs_dir/paper)")
    la = sub.add_parser("latency", help="Table 9 and a Figure 5b-style plot from bench/table9.py records")
    la.add_argument("records", type=Path, nargs="+", help="table9-<date>.json files written by bench/table9.py")
    la.add_argument("--out", type=Path, default=None, help="folder for table9.md/.csv/.png (default: runs/latency)")
    for p in (t, pp):  # runs from W&B instead of a folder: analysis.wandb_source
        p.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read the runs of a W&B project (cached in runs_dir, "
                       "default runs/wandb/ENTITY/PROJECT) instead of a folder of runs")  # fmt: skip
        p.add_argument("--tag", nargs="+", default=(), help="with --wandb: only runs with any of these tags")
        p.add_argument("--offline", action="store_true", help="with --wandb: the cached records, without asking W&B")
    args = ap.parse_args(argv)
    if getattr(args, "wandb", None):
        from analysis.wandb_source import source

        logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
        try:
            args.runs_dir = source(args.wandb, args.runs_dir, args.tag, args.offline)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif getattr(args, "runs_dir", "") is None:
        ap.error("give a folder of runs or --wandb ENTITY/PROJECT")
    if args.cmd != "latency" and not args.runs_dir.is_dir():
        print(f"error: {args.runs_dir} is not a folder of runs", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")  # damaged records are named
    module, files = WRITERS[args.cmd]
    extra = {"over": tuple(args.over)} if getattr(args, "over", ()) else {}
    try:
        md, written = importlib.import_module(module).write(
            getattr(args, "records", None) or args.runs_dir, args.out, **extra
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(md)
    print("\n(written: " + ", ".join(str(f) for f in files(written)) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
