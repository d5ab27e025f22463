"""scripts/reproduce: its arguments are checked before anything runs, and a spent budget stops it
with the command to continue (exit 3), before a run starts that it could not finish."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, tmp):
    env = os.environ | {"PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "scripts/reproduce", *args, "--runs-dir", str(tmp)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_unknown_step_and_argument_are_refused(tmp_path):
    r = _run("--only", "table9", tmp=tmp_path)
    assert r.returncode == 2 and "no step 'table9'" in r.stderr
    r = _run("--fast", tmp=tmp_path)
    assert r.returncode == 2 and "unknown argument --fast" in r.stderr
    for jobs in ("0", "two", "-1"):
        r = _run("--jobs", jobs, tmp=tmp_path)
        assert r.returncode == 2 and f"--jobs takes a positive number of runs at once, not '{jobs}'" in r.stderr
    assert not any(tmp_path.iterdir())


def test_a_spent_budget_stops_before_the_next_step(tmp_path):
    r = _run("--model", "tiny", "--budget", "1", tmp=tmp_path)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "budget spent before table4" in r.stdout and "run the same command again" in r.stdout
    assert not any(tmp_path.iterdir())  # no run was started


def test_an_unavailable_model_is_one_clear_error(tmp_path):
    r = _run("--model", "deepseek_v2_lite", tmp=tmp_path)
    assert r.returncode == 1 and "is not available offline" in r.stderr and "Traceback" not in r.stderr
    r = _run("--model", "nosuch", tmp=tmp_path)
    assert r.returncode == 1 and r.stderr.startswith("scripts/reproduce: no model 'nosuch' in conf/model/ (one of:")
