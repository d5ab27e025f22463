"""The committed run records under runs/ regenerate the committed tables beside them.

A reviewer with a clone and no model or GPU reruns ``python -m analysis table runs/<model>/<sweep>``
and gets the same files. The records are copied first, so nothing rendered before can leak into
the comparison.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RUNS = Path(__file__).resolve().parents[1] / "runs"
RECORD = ("config.yaml", "metrics.json", "env.json", "status")
TEXT = (".md", ".csv", ".tex")
SWEEPS = sorted(p.parent for p in RUNS.glob("*/*/table.csv"))


def _records_only(src: Path, dst: Path) -> Path:
    """Copy the record files of every run under ``src`` (``<sweep>/<id>/``) into ``dst``."""
    for f in src.rglob("status"):
        run = f.parent
        out = dst / run.relative_to(src)
        out.mkdir(parents=True)
        for name in RECORD:
            if (run / name).exists():
                shutil.copy(run / name, out / name)
    return dst


def _analysis(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "analysis", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_runs_holds_committed_tables():
    assert SWEEPS, "no rendered sweep under runs/"
    for sweep in SWEEPS:
        assert len(list(sweep.glob("*/status"))) >= 2, sweep


@pytest.mark.parametrize("sweep", SWEEPS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_sweep_tables_regenerate_from_the_committed_records(sweep, tmp_path):
    records = _records_only(sweep, tmp_path / "records" / sweep.name)
    _analysis("table", str(records), "--out", str(tmp_path / "out"))
    committed = sorted(p for p in sweep.iterdir() if p.is_file() and p.suffix in TEXT)
    assert {p.name for p in committed} >= {"table.md", "table.csv"}
    for p in committed:
        assert (tmp_path / "out" / p.name).read_text() == p.read_text(), p.name
