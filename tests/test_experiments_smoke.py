"""Every experiment file (conf/experiment/) run end to end under profile=smoke on the tiny model, and
the BF16 reference computed once per sweep whatever the methods.

Each experiment runs as the multirun its file sets up (its eval, its sweep, its end-of-sweep
tables), with the sweep narrowed on the command line to the quantized QuantMLA job where there is
one (the paper's sweeps are up to 16 jobs; every job of every full sweep is composed and validated
under the same profile by the first test instead).
"""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from quantmla.run import group_options, validate_argv

EXPERIMENTS = group_options("experiment")
NARROW = {  # the command line's keys win over the experiment's sweep (Hydra's basic sweeper)
    "table1_methods": ["method=quantmla", "bits=c4r4", "protect.enabled=true"],
    "table2_reasoning": ["method=rtn", "bits=c2r4", "protect.enabled=false"],
    "table3_ablation": ["+row=quantmla"],
    "figure4_ruler": ["+row=quantmla"],
}


def _sweep(*args, cwd, timeout=900):
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "quantmla.run", "-m", "model=tiny", "logger=none", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def _records(root):
    return {p.parent.name: p.parent for p in root.glob("*/*/status")}


def test_every_experiment_has_a_smoke_profile_for_every_job(tmp_path):
    assert set(NARROW) | {"table4_sensitivity", "table6_interventions", "noise_floor"} == set(EXPERIMENTS)
    for name in EXPERIMENTS:
        validate_argv(["-m", f"experiment={name}", "profile=smoke", "model=tiny", f"runs_dir={tmp_path}"])


@pytest.mark.slow  # 14-38 s each on two idle CPU cores (2026-12-04)
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_runs_end_to_end_under_the_smoke_profile(name, tmp_path):
    r = _sweep(f"experiment={name}", "profile=smoke", f"runs_dir={tmp_path}", *NARROW.get(name, []), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    records = _records(tmp_path)
    assert records, "no record written"
    for d in records.values():
        assert (d / "status").read_text().strip() == "done", (d / "error.txt").read_text()[-2000:]
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        assert cfg["profile"] == "smoke" and cfg["sweep"] == name
        metrics = json.loads((d / "metrics.json").read_text())
        assert metrics
        if cfg["eval"]["name"] == "lm_eval":  # one item per task (per subject for MMLU)
            assert cfg["eval"]["limit"] == 1 and cfg["eval"]["profile"] == "smoke"
            for task, n in metrics["n_samples"].items():
                assert 1 <= n["effective"] <= 57, (task, n)
        if cfg["method"]["name"] == "quantmla":
            assert cfg["method"]["steps"] == 4 and cfg["calibration"]["train"] == 4
    assert "profile=smoke" in r.stdout  # the sweep's table says what budget it was made on


def test_c16r16_is_computed_once_for_every_method_of_a_sweep(tmp_path):
    r = _sweep("method=rtn,quantmla", "bits=c16r16,c4r4", "protect.enabled=false,true", "eval=ppl",
               "profile=smoke", f"runs_dir={tmp_path}", "sweep=bf16", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    out = r.stdout + r.stderr
    assert len(re.findall(r"\] - run [0-9a-f]{12} ", out)) == 5  # 2 methods × 2 protections quantized + BF16
    assert len(re.findall(r"\] - skip [0-9a-f]{12} \(done\)", out)) == 3  # the other C16R16 jobs
    assert "method quantmla has no effect on an unquantized cache; recorded as rtn" in out
    configs = [yaml.safe_load((d / "config.yaml").read_text()) for d in _records(tmp_path).values()]
    assert sorted(c["bits"]["name"] for c in configs) == ["c16r16"] + ["c4r4"] * 4
    (ref,) = [c for c in configs if c["bits"]["name"] == "c16r16"]
    assert ref["method"] == {"_target_": "baselines.rtn.RTNConfig", "name": "rtn"} and ref["exact"] is False
    table = "\n".join(" ".join(line.split()) for line in r.stdout.splitlines())  # cells without their padding
    assert len(re.findall(r"^\| tiny \| rtn \|.*\| C16R16 \|", table, re.M)) == 1  # one row in the sweep's table
    assert table.count("| C16R16 |") == 1
