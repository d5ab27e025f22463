"""Progress of the long steps (model build, calibration, evaluation).

On a terminal, :func:`bar` is a tqdm bar with its ETA. Where stderr is not a terminal (a log file, a
SLURM job, a pipe), it is a :class:`LogBar`: a line through the ``quantmla`` logger when the step
starts, one every :data:`EVERY_S` seconds with the count, the rate and the ETA, and one when it ends,
so a log shows how far a run got and how long it still needs (on stderr where logging is not set up).
``QUANTMLA_PROGRESS_EVERY`` sets the period in seconds.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger("quantmla")

EVERY_S = 30.0


def interactive() -> bool:
    """Whether progress goes to a terminal (a bar) rather than to a log (periodic lines)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


def every_s() -> float:
    try:
        return float(os.environ.get("QUANTMLA_PROGRESS_EVERY", EVERY_S))
    except ValueError:
        return EVERY_S


def bar(iterable=None, total: int | None = None, desc: str = "", unit: str = "it", enabled: bool = True, **kwargs):
    """A progress bar over ``iterable`` (or updated by hand up to ``total``): tqdm on a terminal, a
    :class:`LogBar` otherwise, nothing where ``enabled`` is false (a step inside another's bar)."""
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if interactive():
        return tqdm(iterable, total=total, desc=desc, unit=unit, **kwargs)
    return LogBar(iterable, total=total, desc=desc, unit=unit)


def _emit(line: str) -> None:
    if log.hasHandlers():
        log.info("%s", line)
    else:  # a script or notebook that set up no logging
        print(line, file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class LogBar:
    """tqdm's interface (iterate, ``update``, ``set_postfix``, ``close``, a context manager) as log lines."""

    def __init__(self, iterable=None, total: int | None = None, desc: str = "", unit: str = "it", every=None):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit = total, desc, unit
        self.every = every_s() if every is None else every
        self.n = 0
        self.postfix = ""
        self.closed = False
        self.start = self.last = time.monotonic()
        size = f" ({self.total} {unit})" if self.total is not None else ""
        _emit(f"{desc or 'progress'}: started{size}")

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update(1)
        self.close()

    def __len__(self):
        return self.total or 0

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        self.close(error)
        return False

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = dict(ordered_dict or {}) | kwargs
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            _emit(self.line(now))

    def line(self, now: float | None = None) -> str:
        """``desc: n/total unit (p%), elapsed, rate, ETA``, as the periodic lines read."""
        elapsed = (now or time.monotonic()) - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{_clock(elapsed)} elapsed")
        if rate > 0:
            parts.append(f"{rate:.3g} {self.unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{self.unit}")
            if self.total:
                parts.append(f"ETA {_clock(max(self.total - self.n, 0) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        return f"{self.desc or 'progress'}: " + ", ".join(parts)

    def close(self, error: BaseException | None = None) -> None:
        """The closing line: ``done`` with the count, or (the step raised ``error``) where it stopped."""
        if self.closed:
            return
        self.closed = True
        elapsed = _clock(time.monotonic() - self.start)
        if error is None:
            _emit(f"{self.desc or 'progress'}: done, {self.n} {self.unit} in {elapsed}")
        else:
            count = f"{self.n}/{self.total}" if self.total else str(self.n)
            _emit(f"{self.desc or 'progress'}: stopped at {count} {self.unit} after {elapsed} ({type(error).__name__})")
