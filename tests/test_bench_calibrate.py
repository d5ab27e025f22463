"""bench/calibrate.py runs end to end (on the tiny model with --quick) and writes its record."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_calibration_benchmark_records_each_precision(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "calibrate.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # the script finds the checkout itself
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (record,) = tmp_path.glob("calibrate-*.json")
    r = json.loads(record.read_text())
    assert r["model"] == "tiny" and r["steps_per_path"] == 4 and set(r["precisions"]) == {"highest", "high"}
    for row in r["precisions"].values():
        assert row["info"]["cached_C"] == 0 and row["info"]["cached_P"] == 0  # calibrated, not read back
        for path in ("content", "rope"):
            assert row["per_path"][path]["median_step_s"] > 0 and row["per_path"][path]["syncs_per_step"] >= 0
        assert set(row["heldout_highest"]) == {"L_C", "L_P"}
        assert all(math.isfinite(v) and 0 < v < 1 for v in row["heldout_highest"].values())
    # at IEEE float32 the re-evaluated objective is the one the calibration selected its step by
    row = r["precisions"]["highest"]
    assert row["heldout_highest"]["L_C"] == pytest.approx(row["info"]["heldout_C"], rel=1e-4)
    assert row["heldout_highest"]["L_P"] == pytest.approx(row["info"]["heldout_P"], rel=1e-4)
    assert set(r["speedup_per_step"]) == {"high/highest"}
