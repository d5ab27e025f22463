"""Configs compose, bad input stops early with one line, sweeps record and skip finished runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from fault_tools import broken_checkpoint
from hydra import compose, initialize_config_dir

from quantmla.run import ConfigError, conf_dir, group_options, plan
from quantmla.tracking import RunRecord, run_id

GROUPS = ("model", "method", "bits", "eval", "logger", "calibration")
OFFLINE_ONLY = "not available offline"


def _compose(*overrides):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("run", overrides=[*_tiny(overrides), *overrides])


def _all_options():
    for group in GROUPS:
        for option in group_options(group):
            yield group, option
    for option in group_options("experiment"):
        yield "experiment", option


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny model saved as a regular transformers checkpoint folder."""
    from quantmla.models.tiny import build

    d = tmp_path_factory.mktemp("tiny-ckpt")
    model, tok = build()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("group,option", list(_all_options()))
def test_every_config_composes_and_validates(group, option, tmp_path, tiny_folder):
    extra = [f"model.path={tiny_folder}"] if (group, option) == ("model", "local") else []
    if group == "experiment":  # paper tables name real checkpoints: validate them on tiny
        extra = ["model=tiny"]
    cfg = _compose(f"{group}={option}", f"runs_dir={tmp_path}", *extra)
    assert cfg is not None
    try:
        plan(cfg)
    except ConfigError as e:
        # the only acceptable refusals: the paper's checkpoints are not on this machine, and
        # the paper's RULER lengths (up to 32K) do not fit the 4K context of the tiny model
        context = "exceeds the model's context"
        expected = {"model": OFFLINE_ONLY, "eval": context, "experiment": context}
        assert group in expected and expected[group] in str(e), str(e)


def _tiny(args) -> list[str]:
    """The unit-test model unless the command line names one."""
    return [] if any(a.startswith("model=") for a in args) else ["model=tiny"]


def _cli(*args, cwd=None, timeout=300):
    env = os.environ | {"WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "quantmla.run", *args, *_tiny(args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _llama_folder(tmp_path):
    from transformers import LlamaConfig

    d = tmp_path / "llama"
    LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128).save_pretrained(d)
    (d / "model.safetensors").write_bytes(b"")
    return d


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,expect",
    [
        (["bits.name=c4"], "is not of the form CxRy"),
        (["bits.name=c5r4"], "content bits 5 is not supported"),
        (["bits.group=48"], "group size 48 does not divide the content latent width 128"),
        (["model=deepseek_v2_lite"], "is not available offline"),
        (["-m", "bits.name=c4r4,c6r4"], "content bits 6 is not supported"),
        (["-m", "bits=glob(c*r4)", "bits.group=48"], "group size 48 does not divide"),
        (["eval.seq_len=5000", "eval.max_tokens=5000"], "ppl seq_len 5000 exceeds the model's context (4096"),
        pytest.param(
            ["device=cuda"], "device=cuda: CUDA is not available", marks=pytest.mark.skipif(_cuda(), reason="has CUDA")
        ),
    ],
)
def test_bad_input_one_line_before_loading(args, expect, tmp_path):
    r = _cli(*args, f"runs_dir={tmp_path}", "logger=none", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], r.stderr
    assert not any(tmp_path.iterdir()), "nothing may start, no folder be made"


HYDRA_REFUSALS = [  # (overrides, lines of Hydra's own error text the user must see whole)
    (["model=nope"], ["In 'run': Could not find 'model/nope'", "Available options in 'model':", "\ttiny"]),
    (
        ["-m", "hydra/launcher=nosuch"],
        ["In 'hydra/config': Could not find 'hydra/launcher/nosuch'", "\tjoblib", "\tslurm"],
    ),
    (
        ["hydra.launcher.partition=gpu"],
        [
            "Could not override 'hydra.launcher.partition'.",
            "To append to your config use +hydra.launcher.partition=gpu",
            "Key 'partition' not in 'BasicLauncherConf'",
        ],
    ),
]


@pytest.mark.parametrize(
    "args,lines",
    [*HYDRA_REFUSALS, (["bits=c3r8"], ["In 'run': Could not find 'bits/c3r8'", "\tc16r16", "\tc2r4", "\tc4r4"])],
)
def test_what_hydra_refuses_is_reported_by_hydra_whole(args, lines, tmp_path):
    r = _cli(*args, f"runs_dir={tmp_path}", "logger=none", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    err = r.stderr.splitlines()
    for line in lines:
        assert line in err, r.stderr
    assert "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace." in err
    assert not any(tmp_path.iterdir())


def test_hydra_flags_work(tmp_path):
    """Every standard Hydra flag reaches Hydra: help, the composed config, shell completion."""
    r = _cli("--help", cwd=tmp_path)
    assert r.returncode == 0 and "== Configuration groups ==" in r.stdout and "model: " in r.stdout, r.stderr
    r = _cli("--cfg", "job", "bits=c4r4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load(r.stdout)
    assert job["model"]["name"] == "tiny" and job["bits"]["name"] == "c4r4" and "hydra" not in job
    r = _cli("--cfg", "hydra", cwd=tmp_path)
    assert r.returncode == 0 and "quantmla.run.CheckConfig" in r.stdout, r.stderr
    r = _cli("-sc", "install=bash", cwd=tmp_path)
    assert r.returncode == 0 and "hydra_bash_completion()" in r.stdout, r.stderr
    r = _cli("--info", "defaults", cwd=tmp_path)
    assert r.returncode == 0 and "model/tiny" in r.stdout, r.stderr
    assert not any(tmp_path.iterdir())


def test_completion_query_lists_group_options(tmp_path):
    """What the installed completion asks when the user presses tab after ``quantmla-run bits=``."""
    env = {"COMP_LINE": "quantmla-run bits=", "COMP_POINT": str(len("quantmla-run bits="))}
    r = subprocess.run(
        [sys.executable, "-m", "quantmla.run", "-sc", "query=bash"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=os.environ | env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert {"bits=c16r16", "bits=c2r4", "bits=c4r4"} <= set(r.stdout.split())


def test_glob_sweep_runs_every_matching_option(tmp_path):
    args = ["-m", "bits=glob([c4*,c2*])", "eval.seq_len=128", "eval.max_tokens=256", f"runs_dir={tmp_path}"]
    r = _cli(*args, "logger=none", "sweep=glob", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    bits = sorted(yaml.safe_load(p.read_text())["bits"]["name"] for p in (tmp_path / "glob").glob("*/config.yaml"))
    assert bits == ["c2r4", "c4r4"]
    assert all(s.read_text().strip() == "done" for s in (tmp_path / "glob").glob("*/status"))


@pytest.mark.slow
def test_model_without_mla_is_refused(tmp_path):
    d = _llama_folder(tmp_path)
    r = _cli("model=local", f"model.path={d}", f"runs_dir={tmp_path}", "logger=none", cwd=tmp_path)
    assert r.returncode == 2
    assert "has no MLA attention" in r.stderr and "llama" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_local_checkpoint_runs(tiny_folder, tmp_path):
    r = _cli(
        "model=local",
        f"model.path={tiny_folder}",
        "bits=c4r4",
        "eval.seq_len=128",
        "eval.max_tokens=256",
        f"runs_dir={tmp_path}",
        "logger=none",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (metrics,) = list(tmp_path.rglob("metrics.json"))
    assert json.loads(metrics.read_text())["tokens"] == 2 * 127


@pytest.mark.slow
def test_failed_run_is_recorded_failed_not_done(tmp_path, tiny_folder):
    broken = broken_checkpoint(tiny_folder, tmp_path / "broken")
    r = _cli("model=local", f"model.path={broken}", f"runs_dir={tmp_path}", "logger=none", cwd=tmp_path)
    assert r.returncode != 0
    (status,) = list(tmp_path.rglob("status"))
    assert status.read_text().strip() == "failed"
    assert "size mismatch" in (status.parent / "error.txt").read_text() or "mismatch" in r.stderr
    assert not (status.parent / "metrics.json").exists()


def test_run_id_ignores_logging_fields():
    cfg = {"model": {"name": "tiny"}, "bits": {"name": "c4r4"}, "logger": {"mode": "auto"}, "sweep": "a"}
    other = cfg | {"logger": None, "sweep": "b", "runs_dir": "/x"}
    assert run_id(cfg) == run_id(other)
    assert run_id(cfg) != run_id(cfg | {"bits": {"name": "c2r4"}})


def test_run_id_of_a_run_without_exact_is_kept():
    """``exact`` came after runs were recorded: at its default the id is the one the config had
    without the key (a sweep launched again skips those runs); ``exact=true`` is another run."""
    cfg = {"model": {"name": "tiny"}, "bits": {"name": "c4r4"}}
    assert run_id(cfg | {"exact": False}) == run_id(cfg)
    assert run_id(cfg | {"exact": True}) != run_id(cfg)


@pytest.mark.slow
def test_exact_is_planned_for_any_model():
    """``exact=true`` runs on every model and device: where the exact decode kernel does not take
    a shape (the embedded model's d_c 384, the tiny model's 4 heads), the core falls back to the
    torch reference of the same function (tests/test_kernels_decode.py), so the plan accepts it."""
    for model in ("smollm2_mla", "tiny"):
        p = plan(_compose(f"model={model}", "bits=c4r4", "exact=true", "device=cpu"))
        assert p.spec.exact and p.spec.exact_rows


def test_interrupted_run_is_marked(tmp_path):
    rec = RunRecord(tmp_path, "s", {"a": 1})
    rec.start()
    assert rec.status == "running"
    rec.fail(KeyboardInterrupt())
    assert rec.status == "interrupted" and not rec.done


@pytest.mark.slow
def test_main_sweep_records_skips_and_prints_table(tmp_path):
    """The README's main job on a reduced budget: three runs, W&B offline, table, then all skipped."""
    args = [
        "-m",
        "method=rtn",
        "bits=c16r16,c4r4,c2r4",
        "eval.seq_len=256",
        "eval.max_tokens=1024",
        f"runs_dir={tmp_path}",
        "sweep=readme",
    ]
    r = _cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted((tmp_path / "readme").glob("*/status"))
    assert len(runs) == 3 and all(s.read_text().strip() == "done" for s in runs)
    for s in runs:
        d = s.parent
        m = json.loads((d / "metrics.json").read_text())
        assert m["ppl"] > 1 and m["tokens"] == 4 * 255
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        assert cfg["model"]["name"] == "tiny" and cfg["method"]["name"] == "rtn"
        env = json.loads((d / "env.json").read_text())
        assert env["versions"]["torch"] and "git_revision" in env
        if torch.cuda.is_available():  # the devices the process saw
            assert env["devices"] == [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        else:
            assert len(env["devices"]) == 1 and env["devices"][0].startswith("cpu: ")
        assert list(d.glob("wandb/offline-run-*/run-*.wandb")), "W&B offline log missing"
    table, out = (" ".join(t.split()) for t in ((tmp_path / "readme" / "table.md").read_text(), r.stdout))
    for b in ("C16R16", "C4R4", "C2R4"):
        assert f"| tiny | rtn | {b} |" in table and f"| {b} |" in out
    assert (tmp_path / "readme" / "table.csv").exists()
    again = _cli(*args, cwd=tmp_path)
    assert again.returncode == 0
    assert (again.stdout + again.stderr).count("skip ") == 3


@pytest.mark.slow
def test_parallel_jobs_share_one_bf16_run(tmp_path):
    """A sweep through Hydra's joblib launcher (``scripts/reproduce --jobs``): two methods × C16R16,
    C4R4 as two processes at once. The two C16R16 jobs are one run (same id) written once, the one
    waiting for the other; every record is done and the sweep's table follows."""
    args = ["-m", "method=rtn,quarot", "bits=c16r16,c4r4", "eval.seq_len=256", "eval.max_tokens=1024",
            f"runs_dir={tmp_path}", "sweep=jobs", "logger=none", "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2"]  # fmt: skip
    r = _cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    status = sorted((tmp_path / "jobs").glob("*/status"))
    assert len(status) == 3 and all(s.read_text().strip() == "done" for s in status)
    log = r.stdout + r.stderr
    assert log.count("] - run ") == 3 and log.count("skip ") == 1, log[-3000:]
    assert "| C16R16 |" in (tmp_path / "jobs" / "table.md").read_text()


def test_analysis_cli(tmp_path):
    rec = RunRecord(tmp_path, "s", {"model": {"name": "m"}, "method": {"name": "rtn"}, "bits": {"name": "c4r4"}})
    rec.start()
    rec.finish({"ppl": 12.5})
    r = subprocess.run(
        [sys.executable, "-m", "analysis", "table", str(tmp_path / "s"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "| m | rtn | C4R4 | False | 12.5000 |" in " ".join(r.stdout.split())
    assert Path(tmp_path / "o" / "table.csv").read_text().startswith("model,method,bits,protect,ppl")


@pytest.mark.slow
def test_sigterm_marks_the_run_interrupted(tmp_path):
    """A killed run (scheduler time limit, kill) is recorded as interrupted, with the reason."""
    import signal
    import time

    env = os.environ | {"WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    args = ["model=tiny", "eval.seq_len=512", "eval.max_tokens=1000000", f"runs_dir={tmp_path}", "logger=none"]
    p = subprocess.Popen(
        [sys.executable, "-m", "quantmla.run", *args, *_tiny(args)],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.rglob("status")):
        time.sleep(0.2)
    time.sleep(3)  # well inside the evaluation
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    (status,) = list(tmp_path.rglob("status"))
    assert p.returncode == 128 + signal.SIGTERM  # the conventional status of a process ended by SIGTERM
    assert status.read_text().strip() == "interrupted"
    assert "Terminated" in (status.parent / "error.txt").read_text()


def test_a_killed_sessions_cache_is_removed_by_the_next(tmp_path):
    from conftest import CACHE_PREFIX, remove_stale_caches

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{CACHE_PREFIX}{int(dead.stdout)}-abc"
    live = tmp_path / f"{CACHE_PREFIX}{os.getpid()}-def"
    other = tmp_path / "quantmla-cache-notapid"
    for d in (stale, live, other):
        (d / "smollm2-mla-x").mkdir(parents=True)
    assert remove_stale_caches(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
