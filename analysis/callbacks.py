"""Hydra callback: when a multirun ends, print the sweep's table and every job that failed.

Each job of the launch leaves ``job.json`` in its Hydra folder (``quantmla.run``): its run, and for
a failed job the error. The table covers the whole sweep folder (what finished, in this launch
or an earlier one); the failures listed are this launch's, and any of them makes the exit status 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback


def job_results(sweep_dir: Path) -> list[dict]:
    """The ``job.json`` of every job of one launch; one that does not read is reported as failed."""
    out = []
    for f in sorted(sweep_dir.glob("*/job.json"), key=lambda f: (len(f.parent.name), f.parent.name)):
        try:
            result = json.loads(f.read_text())
            if not isinstance(result, dict) or "status" not in result:
                raise ValueError("no status")
        except (OSError, ValueError) as e:
            result = {"status": "failed", "error": f"{f} does not read ({e})", "overrides": [], "dir": str(f.parent)}
        out.append(result)
    return out


class SweepTable(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        from analysis.table import write

        root = Path(config.runs_dir) / config.sweep
        if root.exists():
            md, files = write(root)
            print(f"\n{md}\n\n(written: {', '.join(str(f) for f in files)})")
        results = job_results(Path(config.hydra.sweep.dir))
        failed = [r for r in results if r["status"] == "failed"]
        if failed:
            print(f"\n{len(failed)} of {len(results)} jobs failed:", file=sys.stderr)
            for r in failed:
                where = f" (traceback: {Path(r['dir']) / 'error.txt'})" if r.get("run") else ""
                print(f"  {' '.join(r['overrides'])}: {r['error']}{where}", file=sys.stderr)
            raise SystemExit(1)
