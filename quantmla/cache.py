"""What the latent cache stores: the CxRy spec and the BF16 protection policy.

``CxRy`` = x-bit content latent ``C``, y-bit post-RoPE key ``K_P`` for every token
outside the protected set (the paper's naming); ``C16R16`` is the plain BF16 cache. Protection keeps
the first ``sink`` tokens and the ``recent`` most recent tokens in BF16 at evaluation time,
with the decode-faithful per-query rule (the paper leaves teacher-forced protection open; this
rule equals token-by-token decoding): query ``i`` sees key ``j`` in
BF16 iff ``j < sink`` or ``j > i - recent``.

``exact`` chooses how the attention core reads the quantized rows: by default as the paper's kernel
does, each reconstructed row ``s·(q − z)`` rounded to the cache dtype (BF16) first; with
``exact=True`` as the paper's eqs. 35-36 define them, unrounded (the decode kernel
:mod:`quantmla.kernels.exact_decode`, the teacher-forced kernel in float32). It changes nothing for
C16R16, which has no reconstruction.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from quantmla.quant import BITS, CxRy, qdq

_NAME = re.compile(r"^[cC](\d+)[rR](\d+)$")


@dataclass(frozen=True)
class CacheSpec(CxRy):
    content_bits: int = 16
    rope_bits: int = 16
    group: int = 64
    sink: int = 4
    recent: int = 128
    protect: bool = True
    exact: bool = False

    def __post_init__(self):
        for what, b in (("content bits", self.content_bits), ("RoPE bits", self.rope_bits)):
            if b not in BITS:
                raise ValueError(f"{what} {b} is not supported; choose from {', '.join(map(str, BITS))}")
        if self.group < 1:
            raise ValueError(f"group size must be positive, got {self.group}")
        if self.sink < 0 or self.recent < 1:
            raise ValueError(f"protection needs sink >= 0 and recent >= 1, got sink={self.sink} recent={self.recent}")

    @classmethod
    def parse(cls, name: str, **kw) -> CacheSpec:
        """``"c4r4"`` → CacheSpec(4, 4); raises a ValueError naming the accepted form."""
        m = _NAME.match(str(name).strip())
        if not m:
            raise ValueError(
                f"bits '{name}' is not of the form CxRy (x, y in {{{', '.join(map(str, BITS))}}}), e.g. c4r4, c2r4, c16r16"
            )
        return cls(content_bits=int(m.group(1)), rope_bits=int(m.group(2)), **kw)

    @property
    def protected(self) -> bool:
        return self.quantized and self.protect

    @property
    def exact_rows(self) -> bool:
        """Whether the core reads unrounded ``s·(q − z)`` rows (``exact`` on a quantized cache)."""
        return self.quantized and self.exact

    def check_dims(self, d_c: int, d_r: int) -> None:
        for what, d in (("content latent", d_c), ("RoPE key", d_r)):
            if d % self.group:
                raise ValueError(f"group size {self.group} does not divide the {what} width {d}")

    def qdq_content(self, C: torch.Tensor) -> torch.Tensor:
        """Simulated storage of C: BF16 scales, as the paper stores them."""
        return qdq(C, self.content_bits, self.group, scale_dtype=torch.bfloat16)

    def qdq_rope(self, K_P: torch.Tensor) -> torch.Tensor:
        """Simulated storage of K_P: FP32 scales."""
        return qdq(K_P, self.rope_bits, self.group, scale_dtype=torch.float32)

    def to_dict(self) -> dict:
        return asdict(self)


def protected_pairs(q_index: torch.Tensor, k_index: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Decode-faithful protection: bool (..., n, L), True where key j is BF16 for query i.

    ``q_index`` (..., n) and ``k_index`` (..., L) are token indices within the request.
    """
    k = k_index.unsqueeze(-2)
    q = q_index.unsqueeze(-1)
    return (k < sink) | (k > q - recent)


def protected_set(L: int, sink: int = 4, recent: int = 128) -> list[int]:
    """The paper's protected set P_L: the BF16 tokens of a cache of L tokens at decode time."""
    return sorted(set(range(min(sink, L))) | set(range(max(0, L - recent), L)))
