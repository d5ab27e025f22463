"""The baselines sweep end to end: the CLI multirun records every run and prints the table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantmla.tracking import read_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_multirun_of_the_baselines_records_six_runs_and_prints_the_table(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "quantmla.run",
        "-m",
        "model=tiny",
        "method=rtn,smoothquant,quarot",
        "bits=c4r4,c2r4",
        "logger=none",
        "sweep=baselines",
        f"runs_dir={tmp_path}",
        "calibration=quick",
        "calibration.seq_len=128",
        "calibration.train=4",
        "calibration.heldout=4",
        "eval.seq_len=128",
        "eval.max_tokens=512",
        "protect.enabled=false",  # the paper's baseline rows are unprotected (Table 1 MMLU = Table 3's)
    ]
    env = os.environ | {"WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = read_runs(tmp_path / "baselines")
    got = sorted((r["config"]["method"]["name"], r["config"]["bits"]["name"]) for r in runs)
    assert got == sorted((m, b) for m in ("rtn", "smoothquant", "quarot") for b in ("c4r4", "c2r4"))
    ppl = {(r["config"]["method"]["name"], r["config"]["bits"]["name"]): r["metrics"]["ppl"] for r in runs}
    assert len(set(ppl.values())) == 6  # every run quantized its caches differently
    for r in runs:
        assert r["metrics"]["ppl"] > 1
        if r["config"]["method"]["name"] == "smoothquant":
            assert 0 < r["metrics"]["method"]["alpha_C"] <= 1
        if r["config"]["method"]["name"] == "quarot":
            assert r["metrics"]["method"]["online_rope_flops_per_token"] == 2 * (2 * 64 * 64 * (4 + 1))
    table = [line for line in p.stdout.splitlines() if re.match(r"\|\s*tiny\s*\|", line)]  # pandas pads cells
    assert len(table) == 6
    assert [line.split("|")[2].strip() for line in table] == ["rtn", "smoothquant", "quarot"] * 2
    assert (tmp_path / "baselines" / "table.md").exists()
