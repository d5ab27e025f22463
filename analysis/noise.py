"""When is a difference between two table rows resolved? (docs/noise.md)

Two rows A and B of one comparison block (same model, precision, evaluation and settings; they differ
in method, its settings, or protection) differ by Δ = A − B in a metric. Their difference is
*resolved* when

    |Δ| > max(noise floor, SE(Δ))

- noise floor: the largest spread (max − min) of the metric among the noise groups of the block: the
  runs of one configuration repeated under changes that should not change the result
  (``noise.perturb``: attention backend, batch size, evaluation order, calibration seed; see
  :mod:`quantmla.noise`). A block with no configuration run at least twice has no floor, and none
  of its differences is resolved.
- SE(Δ): the standard error of the difference. Where both rows keep per-item values of the same
  items (perplexity: each window's NLL) it is the paired one, sd(d_i)/√n over the items' differences
  (for a perplexity, times √(ppl_A·ppl_B), the delta method); otherwise √(SE_A² + SE_B²) from each
  row's own standard error (lm-eval's per-task stderr), which ignores the pairing and so overstates
  it. Unknown when a row has no standard error: the difference is then not resolved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from analysis.metrics import Value

FIELDS = ("noise.perturb", "noise.seed")
"""Config fields that tell noise-floor runs of one configuration apart (never a table's columns)."""


def unperturbed(cfg: dict) -> bool:
    """The run computes the configuration as asked (``noise.perturb`` none, any repeat)."""
    return (cfg.get("noise") or {}).get("perturb", "none") == "none"


def spread(values: list[float | None]) -> float | None:
    """max − min of the values measured (None for fewer than two)."""
    have = [v for v in values if v is not None and not math.isnan(v)]
    return max(have) - min(have) if len(have) > 1 else None


def diff_se(a: Value, b: Value) -> float | None:
    """SE of a.value − b.value: paired over shared items where both have them, else from each SE."""
    if a.items and b.items and len(a.items) == len(b.items) and len(a.items) > 1 and a.log == b.log:
        d = [x - y for x, y in zip(a.items, b.items)]
        mean = sum(d) / len(d)
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
        return se * math.sqrt(a.value * b.value) if a.log else se
    if a.se is None or b.se is None or math.isnan(a.se) or math.isnan(b.se):
        return None
    return math.hypot(a.se, b.se)


@dataclass(frozen=True)
class Comparison:
    delta: float
    floor: float | None
    se: float | None

    @property
    def threshold(self) -> float | None:
        return None if self.floor is None or self.se is None else max(self.floor, self.se)

    @property
    def resolved(self) -> bool:
        return self.threshold is not None and abs(self.delta) > self.threshold


def compare(a: Value, b: Value, floor: float | None) -> Comparison | None:
    """A against B under the block's noise floor; None where either value is missing."""
    if a.value is None or b.value is None:
        return None
    return Comparison(a.value - b.value, floor, diff_se(a, b))


RULE = (
    "A difference Δ between two rows of a block is resolved only when |Δ| > max(noise floor, SE(Δ)); "
    "noise floor: the largest spread (max − min) of the metric over the runs of one configuration of the "
    "block repeated under perturbations that should not change it (attention backend, batch size, "
    "evaluation order, calibration seed); SE(Δ): paired over the same windows for perplexity, "
    "√(SE_A² + SE_B²) from the per-task standard errors otherwise. Without a measured floor nothing is resolved."
)
