"""A sweep through a real one-node SLURM cluster (Debian slurm-wlm + munge) started here."""

import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)

NEEDED = ("slurmctld", "slurmd", "sbatch", "munged", "sinfo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [c for c in NEEDED if not shutil.which(c) and not Path("/usr/sbin", c).exists()]
    if missing or os.geteuid() != 0:
        pytest.skip(f"needs root and Debian slurm-wlm + munge (missing: {', '.join(missing) or 'root'})")
    d = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname()
    (d / "state").mkdir()
    (d / "spool").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=quantmla-test",
                f"SlurmctldHost={host}",
                "AuthType=auth/munge",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SlurmUser=root",
                f"StateSaveLocation={d}/state",
                f"SlurmdSpoolDir={d}/spool",
                f"SlurmctldPidFile={d}/slurmctld.pid",
                f"SlurmdPidFile={d}/slurmd.pid",
                f"SlurmctldLogFile={d}/slurmctld.log",
                f"SlurmdLogFile={d}/slurmd.log",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
                "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            ]
        )
        + "\n"
    )
    env = os.environ | {"SLURM_CONF": str(conf)}
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
        if not Path("/etc/munge/munge.key").exists():
            subprocess.run(["mungekey", "-c"], check=True)
            shutil.chown("/etc/munge/munge.key", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([f"/usr/sbin/{daemon}", "-f", str(conf)], check=True, env=env)
    for _ in range(60):
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env).stdout
        if out.strip() == "idle":
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"SLURM did not come up: {(d / 'slurmctld.log').read_text()[-2000:]}")
    yield env
    for name in ("slurmd", "slurmctld"):
        pid = d / f"{name}.pid"
        if pid.exists():
            subprocess.run(["kill", pid.read_text().strip()])


def test_sweep_runs_as_slurm_jobs(slurm, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "quantmla.run",
            "-m",
            "hydra/launcher=slurm",
            "model=tiny",
            "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.timeout_min=10",
            "bits=c4r4,c2r4",
            "eval.seq_len=128",
            "eval.max_tokens=256",
            "logger=none",
            f"runs_dir={tmp_path}",
            "sweep=slurm",
        ],
        capture_output=True,
        text=True,
        env=slurm | {"PYTHONUNBUFFERED": "1"},
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    statuses = sorted((tmp_path / "slurm").glob("*/status"))
    assert [s.read_text().strip() for s in statuses] == ["done", "done"]
    logs = list((tmp_path / "slurm").glob(".hydra/*/.submitit/*/*_log.out"))
    assert len(logs) == 2, "each job must have run through sbatch"
    assert "| tiny | rtn | C2R4 |" in " ".join(r.stdout.split())


def _job_ids(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".hydra/*/.submitit/*") if p.name.isdigit())


def _responses(record: Path) -> int:
    db = record / "lm_eval_responses.sqlite"
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as c:
            return c.execute("SELECT count(*) FROM responses").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_timed_out_job_is_requeued_and_resumes_from_its_caches(slurm, tmp_path):
    """SLURM's time-limit warning (SIGUSR2, as --signal=USR2@signal_delay_s sends it; here by scancel
    once the transforms are stored and lm-eval has answered some requests) makes submitit requeue the
    job; the requeued attempt reuses the stored transforms and finishes the run."""
    cmd = [
        sys.executable, "-m", "quantmla.run", "-m", "hydra/launcher=slurm", "model=tiny",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=10",  # ≤ 10 min: submitit counts any SIGUSR2 as the time limit's
        "method=quantmla", "bits=c4r4", "profile=smoke", "eval=lm_eval", "eval.tasks=[arc_easy]",
        "eval.limit=24", "eval.batch_size=1", "logger=none", f"runs_dir={tmp_path}", "sweep=requeue",
    ]  # fmt: skip
    # batch 1: 97 batches, so the signal lands while the first attempt is still scoring
    env = slurm | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    root = tmp_path / "requeue"
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            records = [p.parent for p in root.glob("*/status")]
            if records and _responses(records[0]) >= 4:
                break
            time.sleep(0.05)  # a fast CPU scores the tiny model's 97 requests in well under a second
        else:
            pytest.fail(f"the job never reached lm-eval: {proc.communicate(timeout=60)[1][-3000:]}")
        (job,) = _job_ids(root)
        subprocess.run(["scancel", "--signal=USR2", job], check=True, env=env)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    (record,) = records
    assert (record / "status").read_text().strip() == "done"
    info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    assert "Restarts=1" in info, info
    log = "\n".join(p.read_text() for p in root.glob(f".hydra/*/.submitit/{job}/*_log.err"))
    assert "Caught signal SIGUSR2" in log and "this job is timed-out" in log, log[-3000:]
    assert f"JOB {job} ON" in log and "DUE TO JOB REQUEUE" in log, log[-3000:]
    # the progress lines of each attempt's lm-eval requests (not a terminal: quantmla.progress lines, not
    # lm-eval's bars): the second attempt asked the model only what the first had not answered
    out = "\n".join(p.read_text() for p in root.glob(f".hydra/*/.submitit/{job}/*_log.out"))
    asked = [int(n) for n in re.findall(r"lm-eval loglikelihood: started \((\d+) request", log + out)]
    assert len(set(asked)) >= 2 and min(asked) < max(asked), asked
    metrics = json.loads((record / "metrics.json").read_text())
    # the second attempt calibrated nothing: both paths' transforms are the first attempt's
    assert metrics["method"]["cached_C"] == 1 and metrics["method"]["cached_P"] == 1, metrics["method"]
    assert metrics["n_samples"]["arc_easy"]["effective"] == 24
    assert (record / "lm_eval_responses.sqlite").exists()  # the responses stay in the run's folder until removed
