"""A sweep through a real one-node SLURM cluster (Debian slurm-wlm + munge) started here."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
