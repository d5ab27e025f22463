"""RTN (the paper's App. D.2): quantize the native caches C = uΓ and post-RoPE K_P as they are."""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.registry import Method, MethodConfig, register


@dataclass
class RTNConfig(MethodConfig):
    name = "rtn"


@register(RTNConfig)
class RTN(Method):
    """No transform: the quantizer alone."""
