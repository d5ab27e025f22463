"""Types and ranges of the run config, checked before anything loads, and the config that names a run.

The top-level fields are typed by :class:`Settings`; the group nodes (model, method, eval,
calibration) by the dataclasses they instantiate. A value of another type is refused, never
converted: ``32.5`` for an integer, ``"false"`` (quoted) or ``maybe`` for a boolean. Unknown keys
are refused. What only spells the same computation differently is normalised before the run id
is made: the case of CxRy (``C4R4`` is ``c4r4``), an integer given for a float (``warmup=0``).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

GROUPS = ("model", "method", "bits", "eval", "logger", "calibration")


@dataclass
class Protect:
    enabled: bool = True
    sink: int = 4
    recent: int = 128


@dataclass
class Bits:
    name: str = "c16r16"
    group: int = 64


@dataclass
class Noise:
    """A repeat of a run under a change that should not change its result (:mod:`quantmla.noise`):
    ``perturb`` names the change, ``seed`` numbers the variant. ``none``/0 is the ordinary run."""

    perturb: str = "none"
    seed: int = 0


@dataclass
class Settings:
    """The run config's keys besides the instantiated groups (model, method, eval, logger, calibration)."""

    sweep: str = "main"
    runs_dir: str = "runs"
    seed: int = 0
    device: str = "auto"
    backend: str = "auto"
    exact: bool = False
    profile: str = "full"  # conf/profile/<name>.yaml: full, or smoke (a check on a small budget)
    protect: Protect = field(default_factory=Protect)
    bits: Bits = field(default_factory=Bits)
    noise: Noise = field(default_factory=Noise)


INSTANTIATED = ("model", "method", "eval", "logger", "calibration")
TOP_KEYS = {f.name for f in dataclasses.fields(Settings)} | set(INSTANTIATED)


def _kind(hint) -> str:
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(typing.get_origin(hint) or hint, getattr(hint, "__name__", str(hint)))


def check_value(where: str, value, hint):
    """``value`` if it has type ``hint`` (an int given for a float becomes a float); ValueError otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or isinstance(hint, str):
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for a in options:  # inside a union a number keeps its type (limit: 2 is a count, 0.5 a fraction)
            try:
                return _number(where, value) if a is float else check_value(where, value, a)
            except ValueError:
                continue
        raise ValueError(f"{where} must be {' or '.join(_kind(a) for a in args)}, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        quoted = " (unquoted)" if isinstance(value, str) and value.lower() in ("true", "false") else ""
        raise ValueError(f"{where} must be true or false{quoted}, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if hint is float:
        return float(_number(where, value))
    if hint is str:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # a name that YAML read as a number (sweep=2024)
        if isinstance(value, str):
            return value
        raise ValueError(f"{where} must be a string, got {value!r}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        return typed(where, value, hint)
    if (origin or hint) is list:
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return [check_value(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value)] if args else value
    if (origin or hint) is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        return value
    return value


def positive_int(value) -> bool:
    """Whether ``value`` is an integer of at least 1 (a boolean is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(where: str, value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise ValueError(f"{where} must be a number, got {value!r}")


def typed(where: str, values: dict, cls, ignore: tuple[str, ...] = ("_target_",)) -> dict:
    """``values`` checked against the fields of dataclass ``cls``: unknown keys refused, each value of its
    field's type. Returns the values normalised (see :func:`check_value`)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for k, v in values.items():
        key = f"{where}.{k}" if where else k
        if k in ignore:
            out[k] = v
        elif k not in names:
            raise ValueError(f"unknown key {key}; {where or 'the config'} takes: {', '.join(names)}")
        else:
            out[k] = check_value(key, v, hints[k])
    return out


def settings(cfg: dict) -> dict:
    """The top level of a resolved run config, checked and normalised (the groups it instantiates are
    checked by :func:`typed` against their own classes)."""
    unknown = sorted(set(cfg) - TOP_KEYS)
    if unknown:
        raise ValueError(f"unknown config key '{unknown[0]}'; the run config has: {', '.join(sorted(TOP_KEYS))}")
    top = {k: v for k, v in cfg.items() if k not in INSTANTIATED}
    out = typed("", top, Settings)
    for k in ("sweep", "runs_dir"):
        if k in out and not str(out[k]).strip():
            raise ValueError(f"{k} must not be empty")
    if "bits" in out:
        out["bits"]["name"] = str(out["bits"].get("name", "")).strip().lower()
    return out


def check_device(device: str) -> None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` that this machine has; ValueError (one line) otherwise."""
    import torch

    if device == "auto":
        return
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device '{device}' is not a device name (auto, cpu, cuda or cuda:N)") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device}: CUDA is not available on this machine (device=cpu or device=auto)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device={device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif d.type != "cpu":
        raise ValueError(f"device '{device}' is not supported (auto, cpu, cuda or cuda:N)")


def check_runs_dir(runs_dir: str, sweep: str) -> None:
    """The records' folder can be made and written here (a probe file in its nearest existing folder)."""
    target = Path(runs_dir) / sweep
    existing = target
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"runs_dir: {existing} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"runs_dir: cannot write in {existing} ({os.strerror(e.errno) if e.errno else e})") from None
