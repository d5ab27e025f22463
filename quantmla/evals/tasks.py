"""lm-eval's task index, shared by validation and evaluation.

Building lm-eval's ``TaskManager`` scans every task YAML it ships (10–20 s on a small CPU),
so it is built once per process.
"""

from __future__ import annotations

import difflib
from functools import lru_cache


@lru_cache(maxsize=1)
def task_manager():
    """lm-eval's own task index (every task it ships, nothing added)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def entry(name: str):
    return task_manager().task_index.get(name)


def unknown_task_message(name: str) -> str:
    close = difflib.get_close_matches(name, task_manager().all_tasks, n=5, cutoff=0.75)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return f"unknown lm-eval task '{name}'{hint}; list lm-eval's tasks with `lm-eval ls tasks`"


def leaves(name: str, _seen: frozenset = frozenset()) -> list[str]:
    """Leaf task names of a task, tag or group of lm-eval's index (a leaf gives itself)."""
    e = entry(name)
    if e is None or name in _seen:
        return []
    kind = e.kind.name
    if kind in ("TASK", "PY_TASK"):
        return [name]
    seen = _seen | {name}
    if kind == "TAG":
        return sorted(t for t in e.tags if t not in seen)
    out = []
    for member in (e.cfg or {}).get("task", []) or []:
        child = member if isinstance(member, str) else member.get("task") or member.get("group")
        if isinstance(child, str):
            out += leaves(child, seen)
    return out
