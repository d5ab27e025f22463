"""Progress where stderr is not a terminal: periodic lines with an ETA in the log, and a run's record
leads to that log."""

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from quantmla import progress

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(
    r"(?P<desc>[^:]+): (?P<n>\d+)/(?P<total>\d+) (?P<unit>\w+) \((?P<pct>\d+)%\), (?P<elapsed>[\d:]+) elapsed, "
    r"[\d.e+]+ (?:s/\w+|\w+/s)(?:, ETA (?P<eta>[\d:]+))?"
)


def _seconds(clock: str) -> int:
    out = 0
    for part in clock.split(":"):
        out = 60 * out + int(part)
    return out


def test_log_bar_lines_count_and_estimate(caplog, monkeypatch):
    monkeypatch.setenv("QUANTMLA_PROGRESS_EVERY", "0")
    with caplog.at_level(logging.INFO, logger="quantmla"):
        bar = progress.LogBar(range(4), desc="steps", unit="step")
        for _ in bar:
            time.sleep(0.01)
    lines = caplog.messages
    assert lines[0] == "steps: started (4 step)"
    counts = [int(m["n"]) for m in map(LINE.match, lines[1:-1])]
    assert counts == [1, 2, 3, 4]
    assert re.fullmatch(r"steps: done, 4 step in 00:00", lines[-1])

    # the ETA is the time the remaining steps take at the rate so far
    bar = progress.LogBar(total=10, desc="calibration", unit="step", every=3600)
    bar.n, now = 5, bar.start + 100
    m = LINE.match(bar.line(now))
    assert m and (m["n"], m["total"], m["pct"]) == ("5", "10", "50")
    assert _seconds(m["elapsed"]) == 100 and _seconds(m["eta"]) == 100
    bar.set_postfix(loss="0.5")
    assert bar.line(now).endswith(", loss=0.5")


def test_log_bar_is_quiet_between_periods(caplog):
    with caplog.at_level(logging.INFO, logger="quantmla"):
        bar = progress.LogBar(total=1000, desc="quiet", every=3600)
        for _ in range(1000):
            bar.update(1)
        bar.close()
        bar.close()
    assert caplog.messages == ["quiet: started (1000 it)", "quiet: done, 1000 it in 00:00"]


def test_bar_is_tqdm_on_a_terminal_and_nothing_when_disabled(monkeypatch):
    from tqdm.auto import tqdm

    assert isinstance(progress.bar(range(3), enabled=False), tqdm)
    assert progress.bar(range(3), enabled=False).disable
    monkeypatch.setattr(progress, "interactive", lambda: True)
    b = progress.bar(range(3), desc="x")
    assert isinstance(b, tqdm) and not b.disable
    b.close()


def test_a_run_logs_periodic_lines_and_its_record_points_to_the_log(tmp_path):
    """A real run with stderr to a pipe: calibration and evaluation report their counts and ETA as log
    lines, and ``<run>/log`` leads to the Hydra log that holds them."""
    env = os.environ | {
        "QUANTMLA_PROGRESS_EVERY": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    r = subprocess.run(
        [
            sys.executable, "-m", "quantmla.run", "model=tiny", "method=smoothquant", "calibration=quick",
            "bits=c4r4", "eval.seq_len=128", "eval.max_tokens=512", "eval.batch_size=1", "logger=none",
            f"runs_dir={tmp_path}",
        ],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (metrics,) = tmp_path.rglob("metrics.json")
    run_dir = metrics.parent
    link = run_dir / "log"
    assert link.is_symlink() and link.resolve().suffix == ".log"
    text = link.read_text()
    assert f"run {run_dir.name} → " in text and f"done {run_dir.name}: {{'ppl': " in text
    ppl = [m for m in map(LINE.search, text.splitlines()) if m and m["desc"].endswith("ppl")]
    assert [int(m["n"]) for m in ppl] == [1, 2, 3, 4] and all(m["total"] == "4" for m in ppl)
    assert all(m["eta"] is not None for m in ppl) and ppl[-1]["eta"] == "00:00"
    assert "ppl: started (4 batch)" in text and "ppl: done, 4 batch in " in text
    assert "statistics: started" in text and "statistics: done" in text  # calibration
    assert "\r" not in text and "\r" not in r.stderr  # no carriage-return bars in a log
    assert json.loads(metrics.read_text())["tokens"] == 4 * 127
