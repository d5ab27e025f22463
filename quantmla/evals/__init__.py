"""Evaluations: each is a validated config dataclass with ``check`` and ``run``.

``run(model, tokenizer, ctx)`` returns a flat-ish dict of metrics that lands in the run's
``metrics.json`` (and W&B). ``check`` raises ValueError with a one-line reason before any
model is loaded; ``check_model`` does the same for what depends on the model's config
(e.g. a context length).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class EvalContext:
    model_name: str = ""
    max_positions: int | None = None
    progress: bool = True
    extra: Any = None
    work_dir: str | None = None  # the run's folder: state that lets an interrupted run resume


@dataclass
class Eval:
    name: ClassVar[str] = ""

    def check(self) -> None:
        pass

    def check_model(self, config) -> None:
        """Validate against the model's transformers config (read without weights)."""

    def run(self, model, tokenizer, ctx: EvalContext) -> dict:
        raise NotImplementedError

    def summary(self, metrics: dict) -> dict:
        """The headline numbers of ``metrics``, for the line that reports a finished run: its top-level
        numbers, else the numbers one level down (``key/sub``)."""
        top = {k: v for k, v in metrics.items() if _number(v)}
        if top:
            return top
        return {f"{k}/{s}": x for k, v in metrics.items() if isinstance(v, dict) for s, x in v.items() if _number(x)}

    def to_dict(self) -> dict:
        return {"name": self.name} | asdict(self)
