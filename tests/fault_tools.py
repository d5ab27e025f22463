"""Helpers of tests/test_faults.py: the harness's command line in processes that can be killed.

Each launch is a real process (``kill -9`` ends it like any other), forked from a server that has
imported the harness once (``multiprocessing``'s forkserver with tests/fault_server.py preloaded),
so a launch starts in a fraction of a second instead of the ~15 s a fresh interpreter takes to import
torch and transformers on a small machine.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

_CTX = None


def context():
    """The forkserver context, its server preloaded with the harness (started on first use)."""
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["fault_server", __name__])
    return _CTX


def _main(argv: list[str], cwd: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    os.environ.update({"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    sys.argv = ["quantmla.run", *argv]
    import torch

    torch.set_num_threads(1)  # launches run side by side on a small machine: no oversubscribed thread pools
    from quantmla.run import cli

    cli(argv)


class Launch:
    """One ``python -m quantmla.run <argv>`` in a process of its own; output in ``log``."""

    def __init__(self, argv: list[str], cwd: Path, log: Path):
        self.log = Path(log)
        self.started = time.monotonic()
        self.proc = context().Process(target=_main, args=(list(argv), str(cwd), str(log)))
        self.proc.start()

    def wait(self, timeout: float = 300) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
            raise TimeoutError(f"launch did not end in {timeout} s: {self.output()[-3000:]}")
        return self.proc.exitcode

    def kill(self, signum: int = 9) -> bool:
        """Send ``signum``; whether the process was still running to receive it."""
        if self.proc.exitcode is not None or not self.proc.is_alive():
            return False
        os.kill(self.proc.pid, signum)
        return True

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def hammer(path: str, text: str, n: int) -> None:
    """Write ``path`` ``n`` times through quantmla.files.write_atomic (the record writer)."""
    from quantmla.files import write_atomic

    for _ in range(n):
        write_atomic(path, text)


def broken_checkpoint(folder: Path, dest: Path) -> Path:
    """A copy of the checkpoint ``folder`` whose config gives the MLP a width its weights do not have:
    it passes every check made before loading (names, MLA attention) and fails when loaded."""
    import json
    import shutil

    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(cfg | {"intermediate_size": cfg["intermediate_size"] + 128}))
    return dest


def cpu_seconds() -> float:
    """CPU time of this process and of every launch so far (the server's own and its reaped children's)."""
    from multiprocessing import forkserver

    own = os.times()
    total = own.user + own.system
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    except (OSError, ValueError, IndexError):
        pass
    return total
