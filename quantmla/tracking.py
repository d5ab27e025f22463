"""Run records and W&B: the only module that knows about either.

Each run owns ``<runs_dir>/<sweep>/<run-id>/`` holding the resolved ``config.yaml``,
``metrics.json``, ``status`` (``running`` / ``done`` / ``failed`` / ``interrupted``, the
traceback in ``error.txt``) and ``env.json`` (library versions, git revision, host). The run id
is a hash of the resolved config without the fields that only say where and how to log, so
launching a sweep again skips the runs that finished and retries the others. Files are
written atomically: a crash never leaves a half-written record marked done.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import yaml

LOG_KEYS = ("logger", "runs_dir", "sweep", "hydra")
"""Top-level config keys that do not change what a run computes."""

VERSIONED = ("torch", "transformers", "triton", "lm_eval", "hydra-core", "omegaconf", "wandb", "quantmla")


ADDED_DEFAULTS = {"exact": False, "model.device_map": None, "model.max_memory": None, "model.offload_folder": None}
"""Keys (dotted for nested ones) added after runs were first recorded, with the value every earlier run
had: left out of the id at that value, so those runs keep their ids (and are not run again)."""


def identity(cfg: dict) -> dict:
    out = {k: v for k, v in cfg.items() if k not in LOG_KEYS}
    for key, default in ADDED_DEFAULTS.items():
        out = _without(out, key, default)
    return out


def _without(cfg: dict, key: str, default) -> dict:
    """``cfg`` without the dotted ``key`` where it holds ``default`` (a copy; ``cfg`` is not changed)."""
    head, _, rest = key.partition(".")
    if head not in cfg:
        return cfg
    if rest:
        return cfg | {head: _without(cfg[head], rest, default)} if isinstance(cfg[head], dict) else cfg
    return {k: v for k, v in cfg.items() if k != head} if cfg[head] == default else cfg


def run_id(cfg: dict) -> str:
    blob = json.dumps(identity(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def environment() -> dict:
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev, dirty = "", ""
    return {
        "versions": versions,
        "python": sys.version.split()[0],
        "git_revision": rev or None,
        "git_dirty": bool(dirty),
        "host": platform.node(),
        "argv": sys.argv,
    }


class Terminated(BaseException):
    """SIGTERM arrived during a run (``kill``, a scheduler's time limit)."""


class RunRecord:
    def __init__(self, runs_dir: str | Path, sweep: str, cfg: dict):
        self.cfg = cfg
        self.id = run_id(cfg)
        self.dir = Path(runs_dir) / sweep / self.id

    @property
    def status(self) -> str | None:
        p = self.dir / "status"
        return p.read_text().strip() if p.exists() else None

    @property
    def done(self) -> bool:
        return self.status == "done" and (self.dir / "metrics.json").exists()

    def metrics(self) -> dict:
        return json.loads((self.dir / "metrics.json").read_text())

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in ("metrics.json", "error.txt"):
            (self.dir / stale).unlink(missing_ok=True)
        _write(self.dir / "config.yaml", yaml.safe_dump(self.cfg, sort_keys=False))
        env = environment() | {"started": datetime.now(UTC).isoformat()}
        _write(self.dir / "env.json", json.dumps(env, indent=2))
        _write(self.dir / "status", "running\n")

    def finish(self, metrics: dict) -> None:
        _write(self.dir / "metrics.json", json.dumps(metrics, indent=2, default=float))
        _write(self.dir / "status", "done\n")

    @contextmanager
    def watch_signals(self):
        """Record SIGTERM as ``interrupted``, then let the previous handler decide.

        With the default handler the run stops through a :class:`Terminated` exception (so
        ``fail`` keeps the traceback); a handler installed by a launcher (submitit's, which
        ignores SIGTERM) runs as before, and a run that goes on and finishes is marked done.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            _write(self.dir / "status", "interrupted\n")
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise Terminated(f"signal {signum}")

        signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def fail(self, exc: BaseException) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        state = "interrupted" if isinstance(exc, (KeyboardInterrupt, Terminated)) else "failed"
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        _write(self.dir / "error.txt", tb)
        _write(self.dir / "status", f"{state}\n")


def read_runs(root: str | Path) -> list[dict]:
    """Every finished run under ``root`` (recursively): its config, metrics and folder."""
    out = []
    for status in sorted(Path(root).rglob("status")):
        d = status.parent
        if status.read_text().strip() != "done" or not (d / "metrics.json").exists():
            continue
        out.append(
            {
                "dir": str(d),
                "config": yaml.safe_load((d / "config.yaml").read_text()),
                "metrics": json.loads((d / "metrics.json").read_text()),
            }
        )
    return out


class NullLogger:
    """``logger=none``: nothing leaves the run folder."""

    def start(self, record: RunRecord, sweep: str) -> None:
        pass

    def log(self, metrics: dict) -> None:
        pass

    def finish(self, ok: bool) -> None:
        pass


class WandbLogger:
    """W&B with the run's whole config and its metrics.

    ``mode``: ``auto`` logs online when an API key is configured (``WANDB_API_KEY`` or a
    ``wandb login``) and offline otherwise; ``online``, ``offline`` and ``disabled`` force it.
    Offline runs land in the run folder (``wandb/``) and sync later with ``wandb sync``.
    """

    def __init__(self, project: str = "quantmla", entity: str | None = None, mode: str = "auto", tags=()):
        if mode not in ("auto", "online", "offline", "disabled"):
            raise ValueError(f"wandb mode '{mode}' is not one of auto, online, offline, disabled")
        self.project, self.entity, self.mode, self.tags = project, entity, mode, list(tags or ())
        self.run = None

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        if os.environ.get("WANDB_MODE"):
            return os.environ["WANDB_MODE"]
        if os.environ.get("WANDB_API_KEY"):
            return "online"
        netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        return "online" if netrc.exists() and "api.wandb.ai" in netrc.read_text() else "offline"

    def start(self, record: RunRecord, sweep: str) -> None:
        import wandb

        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.resolved_mode(),
            dir=str(record.dir),
            name=record.id,
            id=f"{sweep}-{record.id}-{datetime.now(UTC):%Y%m%d%H%M%S}",
            group=sweep,
            tags=self.tags,
            config=record.cfg,
            reinit="finish_previous",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: dict) -> None:
        if self.run is not None:
            flat = numeric_metrics(metrics)
            self.run.log(flat)
            self.run.summary.update(flat)

    def finish(self, ok: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if ok else 1)
            self.run = None


def numeric_metrics(d: dict) -> dict:
    """``{"a/b": number}`` for every int or float (not bool) in nested metrics."""
    return {k: v for k, v in _flatten(d).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out
