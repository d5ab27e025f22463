"""Hydra callback: print the sweep's table when a multirun ends."""

from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback


class SweepTable(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        from analysis.table import write

        root = Path(config.runs_dir) / config.sweep
        if not root.exists():
            return
        md, out = write(root)
        print(f"\n{md}\n\n(table written to {out / 'table.md'} and {out / 'table.csv'})")
