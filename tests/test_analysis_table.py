"""``python -m analysis table``: distinct runs never share a row, averages say so, damaged records are
named and left out without stopping the table."""

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from analysis.metrics import Value
from analysis.noise import compare
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
        *path, last = key.replace("___", "__!").split("__")
        last = last.replace("!", "_")
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
    cols = ["model", "method", "bits", "protect", "model.seed", "protect.recent", "ppl", "ppl_se", "ppl_noise"]
    assert list(df.columns) == cols
    assert df["ppl_se"].isna().all() and df["ppl_noise"].isna().all()  # no per-window record, no repeat
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


def _ppl_metrics(nll: list[float]) -> dict:
    mean = sum(nll) / len(nll)
    return {"ppl": math.exp(mean), "nll": mean, "tokens": 255 * len(nll), "windows": len(nll), "window_nll": nll}


def _paired_se(a: list[float], b: list[float]) -> float:
    """SE of ppl_a − ppl_b from the windows' NLL differences (delta method), computed here with numpy."""
    d = np.array(a) - np.array(b)
    return math.sqrt(math.exp(np.mean(a)) * math.exp(np.mean(b))) * d.std(ddof=1) / math.sqrt(len(d))


def test_a_difference_is_resolved_only_above_the_noise_floor_and_its_error(tmp_path):
    """Records with known spreads: RTN run three times (unperturbed, another backend, another batch size:
    ppl spread 0.05); three methods differ from it by 0.03 (inside the floor), 0.30 with window noise
    that makes SE(Δ) larger than Δ, and 0.30 with a small SE(Δ). Only the last is resolved."""
    rng = np.random.default_rng(0)
    base = list(2.3 + 0.2 * rng.standard_normal(16))
    ppl0 = math.exp(np.mean(base))

    def shifted(target: float, jitter: float) -> list[float]:
        noise = jitter * rng.standard_normal(16)
        noise -= noise.mean()
        return list(np.array(base) + math.log(target / ppl0) + noise)

    runs = {
        ("rtn", "none"): base,
        ("rtn", "backend"): shifted(ppl0 + 0.05, 0.0),
        ("rtn", "batch"): shifted(ppl0 + 0.02, 0.0),
        ("smoothquant", "none"): shifted(ppl0 + 0.03, 0.0001),
        ("quarot", "none"): shifted(ppl0 + 0.30, 0.3),
        ("quantmla", "none"): shifted(ppl0 + 0.30, 0.0005),
    }
    for (method, perturb), nll in runs.items():
        cfg = {"method__name": method, "method___target_": f"x.{method}"}
        if perturb != "none":
            cfg["noise"] = {"perturb": perturb, "seed": 0}
        _record(tmp_path, _ppl_metrics(nll), **cfg)
    md, _ = write(tmp_path / "s", tmp_path / "o")
    df = pd.read_csv(tmp_path / "o" / "table.csv")
    rtn = df[df["method"] == "rtn"].iloc[0]
    assert rtn["n"] == 3 and rtn["ppl"] == pytest.approx(ppl0)  # the unperturbed run's value, not the mean
    assert np.allclose(df["ppl_noise"], 0.05)  # one block: RTN's spread is every row's floor
    cmp = pd.read_csv(tmp_path / "o" / "comparisons.csv")
    cmp = cmp[cmp["a"] == "rtn C4R4 protected"].set_index("b")
    expect = {"smoothquant": False, "quarot": False, "quantmla": True}
    for method, resolved in expect.items():
        c = cmp.loc[f"{method} C4R4 protected"]
        se = _paired_se(base, runs[(method, "none")])
        assert c["se_delta"] == pytest.approx(se, rel=1e-9)
        assert c["threshold"] == pytest.approx(max(0.05, se), rel=1e-9)
        assert c["resolved"] == resolved == (abs(c["delta"]) > max(0.05, se)), method
    assert cmp.loc["quarot C4R4 protected", "se_delta"] > 0.3 > 0.05  # resolved by neither
    # bold: rtn is best (lowest ppl), smoothquant and quarot are not resolved from it, quantmla is
    bold = {line.split("|")[2].strip(): "**" in line for line in md.splitlines() if line.startswith("| tiny")}
    assert bold == {"rtn": True, "smoothquant": True, "quarot": True, "quantmla": False}
    assert "resolved only when |Δ| > max(noise floor, SE(Δ))" in md
    assert "Noise floor of tiny C4R4: measured on rtn C4R4 protected (3 runs)." in md


def test_repeated_runs_keep_their_windows_for_paired_differences(tmp_path):
    """RTN run twice unperturbed (none 0 and none 1, slightly different NLLs): its row is the mean of the
    two, and its difference from another method is still paired, over the window means of the repeats."""
    rng = np.random.default_rng(1)
    a0 = list(2.3 + 0.2 * rng.standard_normal(16))
    a1 = list(np.array(a0) + 1e-4 * rng.standard_normal(16))
    b = list(np.array(a0) + 0.01 + 0.002 * rng.standard_normal(16))
    for nll, seed in ((a0, 0), (a1, 1)):
        _record(tmp_path, _ppl_metrics(nll), noise={"perturb": "none", "seed": seed})
    _record(tmp_path, _ppl_metrics(b), method__name="quarot", method___target_="x.quarot")
    write(tmp_path / "s", tmp_path / "o")
    (c,) = pd.read_csv(tmp_path / "o" / "comparisons.csv").to_dict("records")
    mean = list((np.array(a0) + np.array(a1)) / 2)
    assert c["se_delta"] == pytest.approx(_paired_se(mean, b), rel=1e-6)
    assert c["se_delta"] < 0.01  # unpaired it would be about the ppl's own SE (~0.5)


def test_combined_standard_error_without_shared_items():
    """lm-eval rows keep no per-item scores: SE(Δ) = √(SE_A² + SE_B²); unknown SE or floor resolves nothing."""
    a, b = Value(60.0, 0.3), Value(59.0, 0.4)
    c = compare(a, b, 0.2)
    assert c.se == pytest.approx(0.5) and c.threshold == pytest.approx(0.5) and c.resolved
    assert not compare(a, b, 1.0).resolved  # inside the noise floor
    assert not compare(a, b, None).resolved  # no floor measured
    assert not compare(a, Value(59.0, None), 0.2).resolved  # no standard error


def test_noise_runs_keep_their_own_ids_and_the_ordinary_run_keeps_its_old_one():
    """noise none/0 is left out of the run id (earlier records keep theirs); a perturbed run is a run of its own."""
    from quantmla.tracking import run_id

    cfg = _config()
    assert run_id(cfg | {"noise": {"perturb": "none", "seed": 0}}) == run_id(cfg)
    assert run_id(cfg | {"noise": {"perturb": "batch", "seed": 0}}) != run_id(cfg)
