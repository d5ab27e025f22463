"""The lm-eval responses of a run, kept so that a relaunched run does not ask the model again.

lm-eval's own response cache (``use_cache``) stores pickles: reading one back would run whatever
code a crafted file holds. This one stores JSON in SQLite, keyed by lm-eval's request hash, and
checks every value it reads back: a log-likelihood is ``[float, bool]``, a rolling log-likelihood
a float, a generation a string. A row that does not decode is asked again; a file that is not a
readable database is set aside (:func:`quantmla.files.set_aside`) and the run starts without
responses. :class:`ResponseCache` puts it in front of an lm-eval model class.
"""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import contextmanager
from pathlib import Path

from quantmla.files import reason, set_aside

KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
FILE = "lm_eval_responses.sqlite"  # in the run's folder; it stays there until removed


def _decode(kind: str, text: str):
    """The response stored as ``text``, or None if it is not one of ``kind``."""
    try:
        v = json.loads(text)
    except (TypeError, ValueError):
        return None
    if kind == "loglikelihood":
        ok = isinstance(v, list) and len(v) == 2 and _number(v[0]) and isinstance(v[1], bool)
        return (float(v[0]), v[1]) if ok else None
    if kind == "loglikelihood_rolling":
        return float(v) if _number(v) else None
    return v if isinstance(v, str) else None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


class ResponseStore:
    """One SQLite file of ``key -> JSON response`` rows."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = self._open()
        except sqlite3.DatabaseError as e:
            set_aside(self.path, reason(e))
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path))
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, kind TEXT, value TEXT)")
            db.execute("SELECT count(*) FROM responses").fetchone()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def get(self, kind: str, key: str):
        """The stored response, or None if there is none or it does not decode."""
        row = self.db.execute("SELECT kind, value FROM responses WHERE key = ?", (key,)).fetchone()
        if row is None or row[0] != kind:
            return None
        return _decode(kind, row[1])

    def put(self, kind: str, key: str, value) -> None:
        text = json.dumps(list(value) if isinstance(value, tuple) else value)
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?)", (key, kind, text))

    def close(self) -> None:
        self.db.close()


class _Hook:
    """lm-eval's cache hook: the model class hands over each response as soon as it has it."""

    def __init__(self, store: ResponseStore):
        self.store = store

    def add_partial(self, kind: str, args, value) -> None:
        from lm_eval.api.model import hash_args

        if kind in KINDS and value is not None:
            self.store.put(kind, hash_args(kind, args), value)


class ResponseCache:
    """Mixin for an lm-eval model class: requests answered before (by this run, in an earlier
    attempt) are read from :meth:`keep_responses`' file instead of asking the model."""

    responses: ResponseStore | None = None

    def keep_responses(self, path: str | Path) -> None:
        self.responses = ResponseStore(path)
        self.set_cache_hook(_Hook(self.responses))

    @contextmanager
    def responses_kept(self, work_dir: str | Path | None):
        """Within the block, every answer is kept in ``work_dir``'s :data:`FILE` as it comes, and
        read back from it when asked again: a relaunch of an interrupted run asks the model only
        what it had not answered. Without a ``work_dir`` (no run folder) nothing is kept."""
        if not work_dir:
            yield
            return
        self.keep_responses(Path(work_dir) / FILE)
        try:
            yield
        finally:
            self.responses.close()

    def loglikelihood(self, requests, *args, **kwargs):
        return self._through_cache("loglikelihood", requests, super().loglikelihood, *args, **kwargs)

    def loglikelihood_rolling(self, requests, *args, **kwargs):
        return self._through_cache("loglikelihood_rolling", requests, super().loglikelihood_rolling, *args, **kwargs)

    def generate_until(self, requests, *args, **kwargs):
        return self._through_cache("generate_until", requests, super().generate_until, *args, **kwargs)

    def _through_cache(self, kind: str, requests, compute, *args, **kwargs):
        if self.responses is None:
            return compute(requests, *args, **kwargs)
        from lm_eval.api.model import hash_args

        out, todo = [], []
        for i, req in enumerate(requests):
            sampled = kind == "generate_until" and req.args[1].get("do_sample", False)
            hit = None if sampled else self.responses.get(kind, hash_args(kind, req.args))
            out.append(hit)
            if hit is None:
                todo.append(i)
        if todo:
            fresh = compute([requests[i] for i in todo], *args, **kwargs)
            for i, value in zip(todo, fresh, strict=True):
                out[i] = value
                if not (kind == "generate_until" and requests[i].args[1].get("do_sample", False)):
                    self.responses.put(kind, hash_args(kind, requests[i].args), value)
        return out
