"""Run records (and, in :mod:`quantmla.tracking_wandb`, their W&B runs): the only modules that know about either.

Each run owns ``<runs_dir>/<sweep>/<run-id>/`` holding the resolved ``config.yaml``,
``metrics.json``, ``status`` (``running`` / ``done`` / ``failed`` / ``interrupted``, the
traceback in ``error.txt``) and ``env.json`` (library versions, git revision, host). The run id
is a hash of the resolved config without the fields that only say where and how to log, so
launching a sweep again skips the runs that finished and retries the others.

Files are written atomically (:mod:`quantmla.files`) and checked when read back: a record is
done only if its status says so, its ``metrics.json`` is a JSON object and its ``config.yaml``
is the config of its run id. A damaged file is set aside (``<name>.corrupt-<time>``) and the run
computed again. One process at a time computes a run: its folder's lock is held from the check
that it is not done to the end of the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import yaml

from quantmla.files import reason, remove_stale_temps, set_aside, write_atomic

log = logging.getLogger("quantmla")

LOG_KEYS = ("logger", "runs_dir", "sweep", "hydra")
"""Top-level config keys that do not change what a run computes."""

VERSIONED = ("torch", "transformers", "triton", "lm_eval", "hydra-core", "omegaconf", "wandb", "quantmla")


ADDED_DEFAULTS = {
    "exact": False,
    "profile": "full",
    "model.device_map": None,
    "model.max_memory": None,
    "model.offload_folder": None,
    "noise": {"perturb": "none", "seed": 0},
    "method.matmul_precision": "highest",
    "eval.generate_batch_size": None,
    "eval.scoring_tokens": None,
    "eval.share_prefix": None,
    "eval.decode_graphs": False,
}
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


def _str_keys(x):
    """``x`` with every mapping key a string (``model.max_memory`` mixes GPU indices and "cpu")."""
    if isinstance(x, dict):
        return {str(k): _str_keys(v) for k, v in x.items()}
    return [_str_keys(v) for v in x] if isinstance(x, list | tuple) else x


def run_id(cfg: dict) -> str:
    blob = json.dumps(_str_keys(identity(cfg)), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def devices() -> list[str]:
    """The accelerators this process sees (CUDA device names), or the CPU where there are none. Reads
    torch only if the process has imported it, so writing a record never loads it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"]


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
        "devices": devices(),
        "argv": sys.argv,
    }


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (``kill``, a scheduler's time limit). A kind of KeyboardInterrupt, so what
    Ctrl-C saves (a calibration's checkpoint, the record marked ``interrupted``) SIGTERM saves too."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(f"signal {signum}")
        self.signum = int(signum)


def exit_code(exc: KeyboardInterrupt) -> int:
    """The conventional exit status of a process ended by a signal: 128 + its number."""
    return 128 + getattr(exc, "signum", signal.SIGINT)


@contextmanager
def terminate_by_exception():
    """While the block runs in the main thread, SIGTERM raises :class:`Terminated` (where no other
    handler is installed), so it unwinds like Ctrl-C instead of killing the process on the spot."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return

    def on_term(signum, frame):
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def held_signals():
    """Hold SIGINT and SIGTERM while the block runs (in the main thread, where handlers live): one that
    arrives meanwhile is recorded and raised again, to the handler it was meant for, as the block
    ends, so a state the block changes in several steps (a calibration update: parameters,
    optimizer state, step) is never saved half changed. (Masking the signals would not do: the OS
    hands a process signal to any thread not masking it, such as torch's.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {}
    for s in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(s) is not None:  # None: a handler not set from Python, left in place
            before[s] = signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])


STATES = ("running", "done", "failed", "interrupted")


class Damaged(ValueError):
    """A record file that exists but does not hold what it should."""


def read_status(path: Path) -> str | None:
    """The state in a ``status`` file; None if there is none; Damaged if it is not one of STATES."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        state = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise Damaged("not UTF-8 text") from None
    if state not in STATES:
        raise Damaged(f"'{state[:40]}' is not one of {', '.join(STATES)}" if state else "empty")
    return state


def _read_text(path: Path) -> str:
    """A file's UTF-8 text; Damaged when it is missing or not text."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise Damaged("missing") from None
    except UnicodeDecodeError:
        raise Damaged("not UTF-8 text") from None


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; Damaged (with what is wrong) otherwise."""
    text = _read_text(path)
    if not text.strip():
        raise Damaged("empty")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise Damaged(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise Damaged(f"holds a {type(value).__name__}, not an object")
    return value


def read_config(path: Path) -> dict:
    """A run's ``config.yaml``: a YAML mapping; Damaged otherwise."""
    text = _read_text(path)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise Damaged(f"not YAML ({reason(e)})") from None
    if not isinstance(value, dict):
        raise Damaged("empty" if value is None else f"holds a {type(value).__name__}, not a mapping")
    return value


@dataclass
class Inspection:
    """What a record folder holds, read and checked: its state, config and metrics (when done), and
    ``damaged``: file name -> what is wrong with it."""

    status: str | None = None
    config: dict | None = None
    metrics: dict | None = None
    damaged: dict[str, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status == "done" and self.metrics is not None and self.config is not None


def check_record(d: Path, expected_id: str | None = None) -> Inspection:
    """Read and check the record in folder ``d``; ``expected_id``: the run id its config must have."""
    out = Inspection()
    try:
        out.status = read_status(d / "status")
    except Damaged as e:
        out.damaged["status"] = str(e)
    if out.status is None and not out.damaged:
        return out
    try:
        config = read_config(d / "config.yaml")
        if expected_id is not None and run_id(config) != expected_id:
            raise Damaged(f"holds the config of run {run_id(config)}, not of {expected_id}")
        out.config = config
    except Damaged as e:
        out.damaged["config.yaml"] = str(e)
    if out.status == "done":
        try:
            out.metrics = read_json_object(d / "metrics.json")
        except Damaged as e:
            out.damaged["metrics.json"] = str(e)
    return out


class RunRecord:
    def __init__(self, runs_dir: str | Path, sweep: str, cfg: dict):
        self.cfg = cfg
        self.id = run_id(cfg)
        self.dir = Path(runs_dir) / sweep / self.id

    def inspect(self) -> Inspection:
        return check_record(self.dir, self.id)

    @property
    def status(self) -> str | None:
        return self.inspect().status

    @property
    def done(self) -> bool:
        return self.inspect().done

    def metrics(self) -> dict:
        found = self.inspect()
        if not found.done:
            raise Damaged(f"run {self.id} is not done: {found.damaged or found.status}")
        return found.metrics

    def start(self) -> None:
        """Begin (again) in the record's folder; call while holding its lock (:func:`quantmla.files.one_writer`).
        Damaged files are set aside, a failed attempt's leftovers removed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.dir)
        for name, why in self.inspect().damaged.items():
            set_aside(self.dir / name, why)
        for stale in ("metrics.json", "error.txt"):
            (self.dir / stale).unlink(missing_ok=True)
        write_atomic(self.dir / "config.yaml", yaml.safe_dump(self.cfg, sort_keys=False))
        env = environment() | {"started": datetime.now(UTC).isoformat()}
        write_atomic(self.dir / "env.json", json.dumps(env, indent=2))
        write_atomic(self.dir / "status", "running\n")

    def finish(self, metrics: dict) -> None:
        write_atomic(self.dir / "metrics.json", json.dumps(metrics, indent=2, default=float))
        write_atomic(self.dir / "status", "done\n")

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
            write_atomic(self.dir / "status", "interrupted\n")
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                raise Terminated(signum)

        signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def fail(self, exc: BaseException) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # SystemExit mid-run: an exit asked from outside the computation (submitit's requeue on a time limit)
        state = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        write_atomic(self.dir / "error.txt", tb)
        write_atomic(self.dir / "status", f"{state}\n")


@dataclass
class Scan:
    """The records under a folder: ``runs`` (done, readable: dir, config, metrics), ``damaged``
    (``(file, what is wrong)``) and ``unfinished`` (state -> how many records are in it)."""

    runs: list[dict] = field(default_factory=list)
    damaged: list[tuple[Path, str]] = field(default_factory=list)
    unfinished: dict[str, int] = field(default_factory=dict)


def scan_runs(root: str | Path) -> Scan:
    """Every record under ``root`` (recursively), each read and checked."""
    out = Scan()
    for status in sorted(Path(root).rglob("status")):
        d = status.parent
        found = check_record(d)
        out.damaged += [(d / name, why) for name, why in found.damaged.items()]
        if found.done:
            out.runs.append({"dir": str(d), "config": found.config, "metrics": found.metrics})
        elif found.status and found.status != "done":
            out.unfinished[found.status] = out.unfinished.get(found.status, 0) + 1
    return out


def read_runs(root: str | Path) -> list[dict]:
    """Every finished, readable run under ``root`` (recursively): its config, metrics and folder.
    Damaged records are left out, each named in a warning."""
    scan = scan_runs(root)
    for path, why in scan.damaged:
        log.warning("%s is damaged (%s): run left out", path, why)
    return scan.runs


class NullLogger:
    """``logger=none``: nothing leaves the run folder."""

    def start(self, record: RunRecord, sweep: str) -> None:
        pass

    def log(self, metrics: dict) -> None:
        pass

    def finish(self, ok: bool) -> None:
        pass


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
