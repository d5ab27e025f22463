"""Dual-path sensitivity analysis of MLA caches (the paper's §2.2–2.3, App. B).

- :mod:`~quantmla.sensitivity.probe`: one layer on one sequence; the matched-error protocol
  (INT4 error directions of one path rescaled to a target cache NMSE, post-``o_proj``
  output NMSE, R_C and R_P) and the local analysis G = T·A + O.
- :mod:`~quantmla.sensitivity.local`: the local amplification model for any differentiable
  map (JVP gain, Hutchinson operator statistics, exact reference for small cases).
- :mod:`~quantmla.sensitivity.interventions`: equal-energy controls of the error layout
  (independent signs, token permutation, isotropic direction) and their gain ratios.
- :mod:`~quantmla.sensitivity.aggregate`: per-layer and per-model aggregation (Table 4), the
  predictive check (Table 5) and the interventions' summary (Table 6).

``eval=sensitivity`` (:mod:`quantmla.evals.sensitivity`) runs all of it on a model; the
figures and tables come from ``python -m analysis sensitivity <runs-dir>``.
"""

from quantmla.sensitivity.aggregate import (
    GAMMA,
    cell_means,
    intervention_summary,
    model_summary,
    per_layer,
    predictor_check,
)
from quantmla.sensitivity.interventions import CONTROLS, gain_ratios, intervene
from quantmla.sensitivity.local import Decomposition, decompose, exact_decomposition, gain, nmse, rescale
from quantmla.sensitivity.probe import PATHS, LayerProbe, check_layers, frozen_copy, mla_layers, quantization_error

__all__ = [
    "CONTROLS",
    "GAMMA",
    "PATHS",
    "Decomposition",
    "LayerProbe",
    "cell_means",
    "check_layers",
    "decompose",
    "exact_decomposition",
    "frozen_copy",
    "gain",
    "gain_ratios",
    "intervene",
    "intervention_summary",
    "mla_layers",
    "model_summary",
    "nmse",
    "per_layer",
    "predictor_check",
    "quantization_error",
    "rescale",
]
