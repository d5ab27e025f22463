"""The committed run records under runs/ regenerate the committed tables beside them.

A reviewer with a clone and no model or GPU reruns ``python -m analysis table runs/<model>/<sweep>``
and ``python -m analysis paper runs/<model>`` and gets the same files. The records are copied first,
so nothing rendered before can leak into the comparison.
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
PAPERS = sorted(p.parent for p in RUNS.glob("*/paper/claims.md"))


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


def test_runs_holds_a_rendered_reproduction():
    assert PAPERS, "no rendered reproduction (runs/<model>/paper/) under runs/"


@pytest.mark.slow
@pytest.mark.parametrize("paper", PAPERS, ids=lambda p: p.parent.name)
def test_paper_tables_figures_and_claims_regenerate_from_the_committed_records(paper, tmp_path):
    """Every table (markdown, CSV, LaTeX) byte for byte, every figure (PNG and PDF) again, the claims."""
    root = _records_only(paper.parent, tmp_path / paper.parent.name)
    _analysis("paper", str(root))
    committed = {p.name: p for p in paper.iterdir() if p.is_file()}
    made = {p.name: p for p in (root / "paper").iterdir() if p.is_file()}
    assert set(made) == set(committed)
    assert {"claims.md", "claims.csv"} <= set(committed) and any(n.endswith(".pdf") for n in committed)
    for name, p in committed.items():
        if p.suffix in TEXT:
            assert made[name].read_text() == p.read_text(), name
        else:
            assert made[name].stat().st_size > 1000, name


@pytest.mark.parametrize("row", ["bf16", "rtn"])
def test_the_experiment_file_still_names_its_committed_runs(row, tmp_path):
    """A key added to a config group since the runs were recorded keeps their ids (tracking.ADDED_DEFAULTS):
    the Table 3 row composed today is the committed record, so it is reused, not run again."""
    from hydra import compose, initialize_config_dir

    from quantmla.run import conf_dir, plan
    from quantmla.tracking import run_id

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose(
            "run", overrides=["experiment=table3_ablation", "model=smollm2_mla", f"+row={row}", f"runs_dir={tmp_path}"]
        )
    rid = run_id(plan(cfg).record)
    assert (RUNS / "smollm2_mla" / "table3_ablation" / rid / "metrics.json").exists(), rid
