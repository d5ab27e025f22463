"""``python -m analysis table``: distinct runs never share a row, averages say so, damaged records are
named and left out without stopping the table."""

import subprocess
import sys

import pytest

from analysis.table import frame, write
from quantmla.tracking import RunRecord


def _config(**over) -> dict:
    cfg = {
        "model": {"_target_": "quantmla.models.TinyModel", "name": "tiny", "seed": 0},
        "method": {"_target_": "baselines.rtn.RTNConfig", "name": "rtn"},
        "bits": {"name": "c4r4", "group": 64},
        "protect": {"enabled": True, "sink": 4, "recent": 128},
        "eval": {"_target_": "quantmla.evals.ppl.Perplexity", "name": "ppl", "seq_len": 256},
        "calibration": {"source": "wiki", "seq_len": 256},
        "seed": 0,
        "exact": False,
    }
    for key, value in over.items():  # "model__seed" -> cfg["model"]["seed"]
        *path, last = key.split("__")
        node = cfg
        for p in path:
            node = node[p]
        node[last] = value
    return cfg


def _record(root, metrics, sweep="s", **over):
    rec = RunRecord(root, sweep, _config(**over))
    rec.start()
    rec.finish(metrics)
    return rec


def test_runs_that_differ_anywhere_are_rows_of_their_own(tmp_path):
    """The hostile case: model.seed 0/1 × protect.recent 16/128 are four runs; the old table showed one row."""
    ppl = {(0, 16): 616.42, (0, 128): 617.33, (1, 16): 570.67, (1, 128): 575.06}
    for (seed, recent), v in ppl.items():
        _record(tmp_path, {"ppl": v}, model__seed=seed, protect__recent=recent)
    df = frame(tmp_path / "s")
    assert len(df) == 4
    assert list(df.columns) == ["model", "method", "bits", "protect", "model.seed", "protect.recent", "ppl"]
    got = {(r["model.seed"], r["protect.recent"]): r["ppl"] for _, r in df.iterrows()}
    assert got == ppl


@pytest.mark.parametrize(
    "field,values",
    [
        ("seed", (0, 1)),
        ("bits__group", (32, 64)),
        ("protect__sink", (0, 4)),
        ("calibration__seq_len", (256, 512)),
        ("eval__seq_len", (256, 512)),
        ("method__content_block", (None, 32)),
    ],
)
def test_every_config_field_keeps_runs_apart(tmp_path, field, values):
    for i, v in enumerate(values):
        _record(tmp_path, {"ppl": 10.0 + i}, **{field: v})
    df = frame(tmp_path / "s")
    assert sorted(df["ppl"]) == [10.0, 11.0]


def test_averaging_is_explicit_with_n_and_stderr(tmp_path):
    for seed, v in ((0, 10.0), (1, 12.0), (2, 14.0)):
        _record(tmp_path, {"ppl": v}, seed=seed)
    _record(tmp_path, {"ppl": 20.0}, seed=0, protect__recent=16)
    df = frame(tmp_path / "s", over=("seed",))
    row = df[df["protect.recent"] == 128].iloc[0]
    assert row["n"] == 3 and row["ppl"] == pytest.approx(12.0) and row["ppl_se"] == pytest.approx(2 / 3**0.5)
    md, _ = write(tmp_path / "s", over=("seed",))
    assert "Rows average runs that differ only in seed: n runs each" in md
    with pytest.raises(ValueError, match="no run has the config field 'nope'"):
        frame(tmp_path / "s", over=("nope",))


def test_cxry_case_is_one_configuration(tmp_path):
    """Records made before the case was normalised: the same computation, so one row with n = 2."""
    _record(tmp_path, {"ppl": 5.0}, bits__name="C4R4")
    _record(tmp_path, {"ppl": 5.0}, bits__name="c4r4")
    df = frame(tmp_path / "s")
    assert len(df) == 1 and df.iloc[0]["n"] == 2 and df.iloc[0]["bits"] == "C4R4"


def test_damaged_records_are_named_and_the_rest_is_tabled(tmp_path):
    good = _record(tmp_path, {"ppl": 1.0}, seed=0)
    bad = {name: _record(tmp_path, {"ppl": 2.0}, seed=i) for i, name in enumerate(("status", "metrics", "config"), 1)}
    (bad["status"].dir / "status").write_bytes(b"\xff\xfe\x00garbage")
    (bad["metrics"].dir / "metrics.json").write_text("")
    (bad["config"].dir / "config.yaml").unlink()
    missing_yaml = _record(tmp_path, {"ppl": 3.0}, seed=9)
    (missing_yaml.dir / "config.yaml").write_text("model: [unclosed")
    failed = RunRecord(tmp_path, "s", _config(seed=7))
    failed.start()
    failed.fail(RuntimeError("boom"))
    r = subprocess.run([sys.executable, "-m", "analysis", "table", str(tmp_path / "s")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"| {good.id} " not in r.stdout and "| 1.0000 |" in r.stdout
    assert "| 2.0000 |" not in r.stdout and "| 3.0000 |" not in r.stdout
    for rec, file, why in (
        (bad["status"], "status", "not UTF-8 text"),
        (bad["metrics"], "metrics.json", "empty"),
        (bad["config"], "config.yaml", "missing"),
        (missing_yaml, "config.yaml", "not YAML"),
    ):
        assert f"Damaged, not in the table: {rec.dir / file} ({why}" in r.stdout
    assert "Not finished, not in the table: 1 failed." in r.stdout
