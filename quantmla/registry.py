"""The method registry: a method is a validated config dataclass plus a handler.

A handler turns a model whose MLA layers run through :class:`~quantmla.attention.LatentAttention`
(unquantized while it works) into the model the method evaluates: ``calibrate`` derives or
learns transforms from data, ``fuse`` folds them into the weights offline. Each method module
(``baselines/`` for RTN, SmoothQuant† and QuaRot†; :mod:`quantmla.methods.quantmla`) imports this
module and registers its handler by config class; :mod:`quantmla.methods` imports them all and
looks a config's handler up. This module imports no method.

The BF16 reference is ``bits=c16r16``, whatever the method.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from quantmla.cache import CacheSpec
from quantmla.data import CalibrationData
from quantmla.mla import MLA


@dataclass
class MethodConfig:
    name: ClassVar[str] = ""

    def to_dict(self) -> dict:
        return {"name": self.name} | asdict(self)


@dataclass
class MethodContext:
    """What a handler may use besides the model."""

    spec: CacheSpec
    tokenizer: Any = None
    model_name: str = ""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cache_dir: Path = Path("runs/.transforms")
    calibration: CalibrationData = field(default_factory=CalibrationData)
    progress: bool = True


class Method:
    needs_data: ClassVar[bool] = False
    """True if ``calibrate`` reads calibration text (checked before any model is loaded)."""

    def __init__(self, config: MethodConfig):
        self.config = config
        self.info: dict = {}  # numbers worth recording with the run (chosen α, losses, costs)
        self.stored: dict[str, Path] = {}  # folder of the stored transforms each path used (methods that store them)

    def check(self, spec: CacheSpec) -> None:
        """Raise ValueError for a config this method cannot run, before anything heavy."""

    def check_dims(self, d_c: int, d_r: int) -> None:
        """Raise ValueError if the method cannot transform latents of these widths."""

    def online_work(self, spec: CacheSpec) -> str | None:
        """What the method computes at inference besides the fused weights, in words; None when its
        whole transform folds into the weights (the fused model is then a plain checkpoint)."""
        return None

    def calibrate(self, model, adapters: list[MLA], ctx: MethodContext) -> dict:
        return {}

    def fuse(self, model, adapters: list[MLA], transforms: dict, ctx: MethodContext) -> None:
        pass

    def apply(self, model, adapters: list[MLA], ctx: MethodContext) -> dict:
        transforms = self.calibrate(model, adapters, ctx)
        self.fuse(model, adapters, transforms, ctx)
        return transforms


_REGISTRY: dict[type[MethodConfig], type[Method]] = {}


def register(config_cls: type[MethodConfig]):
    """Class decorator registering a handler for ``config_cls``."""

    def wrap(handler: type[Method]) -> type[Method]:
        if not config_cls.name:
            raise ValueError(f"{config_cls.__name__} needs a class attribute 'name'")
        _REGISTRY[config_cls] = handler
        return handler

    return wrap


def registered() -> dict[type[MethodConfig], type[Method]]:
    """Config class -> handler of every method registered so far."""
    return dict(_REGISTRY)
