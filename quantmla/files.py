"""Files the harness writes and reads back: atomic writes, damaged files set aside, one writer at a time.

- :func:`write_atomic` and :func:`replacing` write through a temporary file of a unique name in
  the target's folder, then ``os.replace``: a reader sees the old file or the new one, never a
  part of one, and two writers of the same file never share a temporary file.
- :func:`set_aside` renames a file that failed its check when read back to
  ``<name>.corrupt-<UTC time>`` and says so in the log; the caller then recomputes what it held.
  Nothing damaged is deleted, and nothing damaged is used.
- :func:`one_writer` holds a lock file in a folder (a run's record, a cache entry) while one
  process computes what goes there; a second process waits and says what it waits for. The locks
  are ``flock`` locks, released by the kernel when their process dies, even by ``kill -9``.
  :func:`first_writer` holds the lock of one of several folders: the first that no other process
  holds, so that processes needing the same entries compute different ones at once.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

log = logging.getLogger("quantmla")

TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"


def _temp_for(path: Path) -> Path:
    """A new, empty file next to ``path`` that no other writer can have chosen (exclusive create)."""
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            tmp.open("xb").close()
            return tmp
        except FileExistsError:
            continue


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; it replaces ``path`` when the block
    ends without an exception and is removed otherwise."""
    path = Path(path)
    tmp = _temp_for(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    with replacing(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def remove_stale_temps(folder: Path) -> None:
    """Temporary files left in ``folder`` by a writer that was killed (call while holding its lock)."""
    for tmp in folder.glob(f".*{TEMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)


def set_aside(path: str | Path, why: str) -> Path:
    """Rename the damaged ``path`` to ``<name>.corrupt-<UTC time>`` and log it; returns the new path."""
    path = Path(path)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    dest = path.with_name(f"{path.name}.corrupt-{stamp}")
    try:
        os.rename(path, dest)
    except FileNotFoundError:  # another process set it aside first
        return dest
    log.warning("%s is damaged (%s): set aside as %s; it will be recomputed", path, why, dest.name)
    return dest


def reason(e: BaseException) -> str:
    """One line naming an exception, for the log."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@contextmanager
def one_writer(folder: str | Path, what: str) -> Iterator[bool]:
    """Hold ``folder``'s lock; yields whether this process had to wait for another one first."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / LOCK_NAME))
    waited = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for %s: another process is computing it (lock %s)", what, folder / LOCK_NAME)
        lock.acquire()
        waited = True
    try:
        yield waited
    finally:
        lock.release()


@contextmanager
def first_writer(folders: dict[Hashable, str | Path], what: Callable[[Hashable], str]) -> Iterator[Hashable]:
    """Hold the lock of one of ``folders`` (key -> folder) and yield its key: the first, in the dict's
    order, that no other process holds; when every one is held, wait for the first. A caller that
    holds no other lock meanwhile cannot deadlock with another doing the same."""
    from filelock import FileLock, Timeout

    if not folders:
        raise ValueError("first_writer needs at least one folder")
    for key, folder in folders.items():
        Path(folder).mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(Path(folder) / LOCK_NAME))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            yield key
        finally:
            lock.release()
        return
    key = next(iter(folders))
    with one_writer(folders[key], what(key)):
        yield key
