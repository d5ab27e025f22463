"""Evaluations: each is a validated config dataclass with ``check`` and ``run``.

``run(model, tokenizer, ctx)`` returns a flat-ish dict of metrics that lands in the run's
``metrics.json`` (and W&B). ``check`` raises ValueError with a one-line reason before any
model is loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar


@dataclass
class EvalContext:
    model_name: str = ""
    max_positions: int | None = None
    progress: bool = True
    extra: Any = None


@dataclass
class Eval:
    name: ClassVar[str] = ""

    def check(self) -> None:
        pass

    def run(self, model, tokenizer, ctx: EvalContext) -> dict:
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {"name": self.name} | asdict(self)
