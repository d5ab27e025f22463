"""Run records from a W&B project: ``python -m analysis table|paper --wandb ENTITY/PROJECT [--tag T ...]``.

The runs that :class:`quantmla.tracking_wandb.WandbLogger` logged are read through W&B's public
API and written as record folders (``<cache>/<sweep>/<run-id>/config.yaml, metrics.json, status``:
the layout of ``runs/``) into a local cache; the tables are then made from that folder exactly as
from ``runs/``. A run becomes a record only if it finished and its summary says its record was
done; its config (the whole record config) must still give its run id. ``--offline`` (or no
reachable server) reads the cache as it was last fetched.

:func:`record_of` (a W&B run object → record files) and :func:`store` (records → cache folder) are
pure and need no server; :func:`api_runs` is the only function that talks to one.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quantmla.files import reason, write_atomic
from quantmla.tracking import run_id
from quantmla.tracking_wandb import RESERVED

log = logging.getLogger("quantmla")


@dataclass
class Record:
    sweep: str
    run: str
    config: dict
    metrics: dict


@dataclass
class Fetched:
    records: list[Record] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (W&B run id, why)


def _plain(x):
    """Nested plain dicts and lists from what the API hands back (its summary nests its own mappings)."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _config(raw: Mapping) -> dict:
    """A run's config as logged: without W&B's own keys, each value unwrapped where the API keeps
    it as ``{"value": ..., "desc": ...}`` (the shape of ``config.yaml`` in a W&B run's files)."""
    cfg = {k: v for k, v in _plain(raw).items() if not k.startswith("_")}
    wrapped = cfg and all(isinstance(v, dict) and "value" in v and set(v) <= {"value", "desc"} for v in cfg.values())
    return {k: v["value"] for k, v in cfg.items()} if wrapped else cfg


def _summary(run) -> dict:
    summary = getattr(run, "summary", None) or {}
    return _plain(getattr(summary, "_json_dict", summary))


def record_of(run) -> Record | str:
    """The record a W&B run holds (a public API ``Run``, or any object with its ``id``, ``state``,
    ``config`` and ``summary``), or why it holds none."""
    state = getattr(run, "state", None)
    if state != "finished":
        return f"state {state}, not finished"
    summary = _summary(run)
    if summary.get(f"{RESERVED}status") != "done":
        return "its record is not done (no record/status 'done' in the summary)"
    config = _config(getattr(run, "config", None) or {})
    rid, sweep = summary.get(f"{RESERVED}run"), summary.get(f"{RESERVED}sweep")
    if not rid or not sweep:
        return "no record/run or record/sweep in the summary: not logged by quantmla"
    if run_id(config) != rid:
        return f"its config gives run id {run_id(config)}, not {rid} (changed since it was logged?)"
    metrics = {k: v for k, v in summary.items() if not k.startswith("_") and not k.startswith(RESERVED)}
    return Record(sweep=str(sweep), run=str(rid), config=config, metrics=metrics)


def convert(runs: Iterable) -> Fetched:
    out = Fetched()
    for run in runs:
        got = record_of(run)
        if isinstance(got, Record):
            out.records.append(got)
        else:
            out.skipped.append((str(getattr(run, "id", "?")), got))
    return out


def store(records: list[Record], cache: str | Path) -> Path:
    """Write ``records`` as record folders under ``cache`` (the layout of ``runs/``), replacing
    what an earlier fetch left there; returns ``cache``."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    keep = {(r.sweep, r.run) for r in records}
    for status in cache.glob("*/*/status"):
        d = status.parent
        if (d.parent.name, d.name) not in keep:
            shutil.rmtree(d)
    for r in records:
        d = cache / r.sweep / r.run
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / "config.yaml", yaml.safe_dump(r.config, sort_keys=False))
        write_atomic(d / "metrics.json", json.dumps(r.metrics, indent=2))
        write_atomic(d / "status", "done\n")
    return cache


def api_runs(project: str, tags: tuple[str, ...] = ()):
    """The runs of ``ENTITY/PROJECT`` (with any of ``tags``) through W&B's public API (needs a server)."""
    import wandb

    filters = {"tags": {"$in": list(tags)}} if tags else {}
    return wandb.Api(timeout=60).runs(project, filters=filters)


def default_cache(project: str, tags: tuple[str, ...] = ()) -> Path:
    """``runs/wandb/<entity>/<project>`` (``.../tags-<a>+<b>`` when filtered by tags)."""
    base = Path("runs") / "wandb" / project
    return base / ("tags-" + "+".join(sorted(tags))) if tags else base


def source(project: str, cache: str | Path | None = None, tags=(), offline: bool = False) -> Path:
    """The folder of records to make tables from: fetched from W&B into ``cache``, or (``offline``,
    or when W&B cannot be reached) the cache as it is."""
    tags = tuple(tags)
    if project.count("/") != 1 or not all(project.split("/")):
        raise ValueError(f"--wandb takes ENTITY/PROJECT, got '{project}'")
    cache = Path(cache) if cache else default_cache(project, tags)
    if not offline:
        try:
            fetched = convert(api_runs(project, tags))
        except Exception as e:  # noqa: BLE001 - no network, no key, no such project: the cache is what there is
            if not any(cache.glob("*/*/status")):
                raise ValueError(f"cannot read {project} from W&B ({reason(e)}) and {cache} holds no records") from None
            log.warning(
                "cannot read %s from W&B (%s); using the records cached in %s",
                project,
                reason(e),
                cache,
            )
            return cache
        for wid, why in fetched.skipped:
            log.warning("W&B run %s left out: %s", wid, why)
        store(fetched.records, cache)
    elif not any(cache.glob("*/*/status")):
        raise ValueError(f"{cache} holds no records of {project}; fetch them once without --offline")
    return cache
