"""The methods: RTN, SmoothQuant† and QuaRot† (``baselines/``) and QuantMLA
(:mod:`quantmla.methods.quantmla`), each registered with :mod:`quantmla.registry`, looked up here
by config class.

The BF16 reference is ``bits=c16r16``, whatever the method.
"""

from __future__ import annotations

import baselines  # noqa: F401  (registers RTN and the baselines)
from quantmla.methods import quantmla  # noqa: F401  (registers QuantMLA)
from quantmla.registry import Method, MethodConfig, MethodContext, register, registered

__all__ = ["Method", "MethodConfig", "MethodContext", "get", "names", "register"]


def names() -> list[str]:
    return sorted(c.name for c in registered())


def get(config: MethodConfig) -> Method:
    handler = registered().get(type(config))
    if handler is None:
        raise ValueError(f"no method registered for {type(config).__name__}; registered: {', '.join(names())}")
    return handler(config)
