"""experiment=table4_sensitivity end to end on `tiny`: run records, per-layer table, figures."""

import csv
import json
import math
import subprocess
import sys

import pytest
from matplotlib.image import imread


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    cmd = [sys.executable, "-m", "quantmla.run", "-m", "experiment=table4_sensitivity", "model=tiny"]
    cmd += ["logger=none", f"runs_dir={runs}", "eval.seq_len=64", "eval.sequences=2", "eval.seeds=[0,1]"]
    cmd += ["eval.probes=8", "eval.probe_batch=8", "eval.local_layers=[0,1]", "eval.interventions=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return runs / "table4_sensitivity", out.stdout


@pytest.mark.slow
def test_run_record_holds_per_layer_metrics(sweep):
    root, _ = sweep
    (metrics_file,) = root.glob("*/metrics.json")
    m = json.loads(metrics_file.read_text())
    assert (metrics_file.parent / "status").read_text().strip() == "done"
    assert m["layers"] == 2 and len(m["per_layer"]) == 2 and len(m["cells"]) == 4
    assert m["ratio"] == pytest.approx(m["rope_response"] / m["content_response"])
    assert m["local"]["points"] == 2 * 4  # layers × cells × 1 sequence
    for row in m["per_layer"]:
        assert row["R_C"] > 0 and row["R_P"] > 0
        assert row["ratio"] == pytest.approx(row["R_P"] / row["R_C"])


def test_tables_and_figures_are_written(sweep):
    root, stdout = sweep
    m = json.loads(next(root.glob("*/metrics.json")).read_text())
    md = (root / "sensitivity.md").read_text()
    assert "Table 4" in md and "Table 5" in md and "Table 6" in md
    assert f"{m['interventions']['permute_C']:.3f}" in md and "Whole-token permutation" in md
    assert f"{m['ratio']:.3f}" in md and f"{m['content_response']:.3f}" in md
    rows = list(csv.DictReader((root / "sensitivity_layers.csv").open()))
    assert [int(r["layer"]) for r in rows] == [0, 1]
    for r, want in zip(rows, m["per_layer"]):
        assert float(r["R_C"]) == pytest.approx(want["R_C"]) and float(r["R_P"]) == pytest.approx(want["R_P"])
    for name in ("sensitivity_responses.png", "sensitivity_breakdown_tiny.png", "sensitivity_atlas.png"):
        img = imread(root / name)
        assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600
        assert img[..., :3].std() > 0.05  # something is drawn
    assert "sensitivity_responses.png" in stdout


@pytest.mark.slow
def test_analysis_cli_renders_again(sweep, tmp_path):
    root, _ = sweep
    out = subprocess.run(
        [sys.executable, "-m", "analysis", "sensitivity", str(root), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "sensitivity_responses.png").exists() and (tmp_path / "sensitivity_local.csv").exists()
    assert (tmp_path / "sensitivity_atlas.png").exists()
    empty = subprocess.run(
        [sys.executable, "-m", "analysis", "sensitivity", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert empty.returncode == 2 and "no finished sensitivity runs" in empty.stderr


def test_atlas_maps_hold_every_layer_of_every_run(sweep):
    from analysis.sensitivity import atlas, sensitivity_runs

    root, _ = sweep
    runs = sensitivity_runs(root)
    maps = atlas(
        runs + [runs[0] | {"metrics": runs[0]["metrics"] | {"per_layer": runs[0]["metrics"]["per_layer"][:1]}}]
    )
    assert maps["C"].shape == (2, 2) and math.isnan(maps["C"][1, 1])  # a run with fewer layers is padded
    for row in runs[0]["metrics"]["per_layer"]:
        j = row["layer"]
        assert maps["C"][0, j] == row["nmse_out_C"] and maps["P"][0, j] == row["nmse_out_P"]
        assert maps["ratio"][0, j] == pytest.approx(row["R_P"] / row["R_C"])  # same cache NMSE on both paths


def test_table6_experiment_is_the_papers_protocol():
    from hydra import compose, initialize_config_dir

    from quantmla.run import conf_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("run", overrides=["experiment=table6_interventions"])
    e = cfg.eval
    assert cfg.model.name == "deepseek_v2_lite" and list(e.layers) == [20] and list(e.local_layers) == [20]
    assert len(e.datasets) * len(e.seeds) * e.sequences == 4  # {WikiText, C4} × 2 seeds
    assert e.local_target_nmse == 1e-3 and e.interventions == 32 and e.seq_len == 512


def test_paper_numbers_stand_only_beside_runs_of_the_papers_protocol():
    from analysis.sensitivity import intervention_table, model_table

    iv = {f"{k}_{b}": 2.0 for k in ("sign", "permute", "isotropic") for b in "CP"} | {"points": 1, "draws": 4}

    def run(layers, target, local_layer, local_target):
        return {
            "label": "deepseek_v2_lite",
            "model": "deepseek_v2_lite",
            "config": {"eval": {"layers": layers, "target_nmse": target, "local_target_nmse": local_target}},
            "metrics": {
                "layers": 1,
                "cells": ["wiki/0"],
                "content_response": 1.0,
                "rope_response": 2.0,
                "ratio": 2.0,
                "layer_ratio_median": 2.0,
                "layers_rope_above_content": 1,
                "local_points": [{"layer": local_layer}],
                "interventions": iv,
            },
        }

    paper = run(None, 0.01, 20, 1e-3)
    assert model_table([paper])["paper ratio"].iloc[0] == 6.331
    assert intervention_table([paper])["paper content"].tolist() == [1.048, 5.918, 6.007]
    for other in (run([20], 0.01, 20, 1e-3), run(None, 0.001, 20, 1e-3)):  # not every layer, or another NMSE
        assert math.isnan(model_table([other])["paper ratio"].iloc[0])
    for other in (run(None, 0.01, 5, 1e-3), run(None, 0.01, 20, 1e-2)):  # another layer, or another NMSE
        t = intervention_table([other])
        assert t["paper content"].isna().all() and t["content"].tolist() == [2.0] * 3
        assert t["layers"].iloc[0] == str(other["metrics"]["local_points"][0]["layer"])
