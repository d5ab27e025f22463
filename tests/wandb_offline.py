"""What an offline W&B run folder holds, read independently of the code that wrote it.

A ``run-<id>.wandb`` file is a LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB blocks of
records, each with a CRC-32 of its type byte and data, split FULL / FIRST / MIDDLE / LAST) of
``wandb_internal_pb2.Record`` protobufs, W&B's own message classes. ``wandb sync`` uploads exactly
these records. :func:`api_run` assembles them the way the server shows a run to the public API.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list[pb.Record]:
    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B log"
    out, buf, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        if kind == 0 and n == 0:
            break
        chunk = data[pos : pos + n]
        pos += n
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{path}: bad checksum"
        buf = chunk if kind in (FULL, FIRST) else buf + chunk
        if kind in (FULL, LAST):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
    return out


def finished_records(run_dir: Path, timeout: float = 60.0) -> list[pb.Record]:
    """The records of an offline run folder once its log ends with the run's exit record (W&B's
    service writes the file on its own schedule, after ``finish()`` has returned)."""
    deadline = time.monotonic() + timeout
    while True:
        files = list(Path(run_dir).glob("run-*.wandb"))
        recs = records(files[0]) if files else []
        if of_type(recs, "exit") or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def of_type(recs: list[pb.Record], kind: str) -> list:
    return [getattr(r, kind) for r in recs if r.WhichOneof("record_type") == kind]


def _apply(target: dict, item) -> None:
    keys = list(item.nested_key) or [item.key]
    d = target
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = json.loads(item.value_json)


def offline_runs(record_dir: Path) -> list[Path]:
    return sorted((Path(record_dir) / "wandb").glob("offline-run-*"))


def api_run(run_dir: Path) -> SimpleNamespace:
    """The run as the public API shows it once the folder is synced: ``id``, ``state``, ``config``
    (each value as ``{"value": ...}``, as the API's raw config keeps it) and ``summary``."""
    recs = finished_records(run_dir)
    run = of_type(recs, "run")[0]
    config, summary = {}, {}
    for item in run.config.update:
        _apply(config, item)
    for c in of_type(recs, "config"):
        for item in c.update:
            _apply(config, item)
    for s in of_type(recs, "summary"):
        for item in s.update:
            _apply(summary, item)
    exits = of_type(recs, "exit")
    state = "finished" if exits and exits[-1].exit_code == 0 else "failed" if exits else "running"
    return SimpleNamespace(
        id=run.run_id,
        state=state,
        group=run.run_group,
        tags=list(run.tags),
        config={k: {"value": v, "desc": None} for k, v in config.items()},
        summary=summary,
    )
