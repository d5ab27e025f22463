"""Aggregation of the sensitivity measurements (the paper's App. B.1 and B.3).

Per sequence and layer, each path has a response R_b = NMSE_out / NMSE_cache. Within a cell
(one dataset and one seed) the sequences' R are averaged; the layer's R̄_b is the mean over
cells, its envelope the min and max over cells. The layer ratio is r_ℓ = R̄_P / R̄_C. The
model's content and RoPE responses are the means of R̄_C and R̄_P over layers, and the model
ratio is RoPE response / content response (not the mean of r_ℓ).

The predictive check (the paper's App. B.3) compares the frozen predictor
log(G_P/G_C) ≈ log(T_P/T_C) + log(A_P/A_C) + γ with the measured gain ratio. The controlled
interventions (Table 6) are summarised per control and path as the geometric mean of the
gain ratios over every point and draw.
"""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import fmean, median

from quantmla.sensitivity.interventions import CONTROLS, geometric_mean

GAMMA = -0.0749614410
"""The predictor's offset, fitted by the paper on DeepSeek-V2-Lite and frozen (the paper's eq. 20)."""


def _group(rows, key):
    out = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return out


def cell_means(records: list[dict]) -> list[dict]:
    """One row per (dataset, seed, layer): the mean over that cell's sequences."""
    rows = []
    for (ds, seed, layer), rs in sorted(_group(records, lambda r: (r["dataset"], r["seed"], r["layer"])).items()):
        row = {"dataset": ds, "seed": seed, "layer": layer, "sequences": len(rs)}
        for b in ("C", "P"):
            for k in ("R", "nmse_out", "nmse_cache"):
                row[f"{k}_{b}"] = fmean(r[f"{k}_{b}"] for r in rs)
        rows.append(row)
    return rows


def per_layer(cells: list[dict]) -> list[dict]:
    """One row per layer: R̄_C, R̄_P (means over cells), their min/max over cells, r_ℓ."""
    rows = []
    for layer, rs in sorted(_group(cells, lambda r: r["layer"]).items()):
        row = {"layer": layer, "cells": len(rs)}
        for b in ("C", "P"):
            vals = [r[f"R_{b}"] for r in rs]
            row[f"R_{b}"] = fmean(vals)
            row[f"R_{b}_min"], row[f"R_{b}_max"] = min(vals), max(vals)
            row[f"nmse_out_{b}"] = fmean(r[f"nmse_out_{b}"] for r in rs)
        row["ratio"] = row["R_P"] / row["R_C"] if row["R_C"] > 0 else math.inf
        rows.append(row)
    return rows


def model_summary(layers: list[dict]) -> dict:
    """Table 4's three numbers from the per-layer rows, plus the spread of r_ℓ."""
    content = fmean(r["R_C"] for r in layers)
    rope = fmean(r["R_P"] for r in layers)
    ratios = sorted(r["ratio"] for r in layers)
    return {
        "content_response": content,
        "rope_response": rope,
        "ratio": rope / content if content > 0 else math.inf,
        "layer_ratio_median": median(ratios),
        "layer_ratio_min": ratios[0],
        "layer_ratio_max": ratios[-1],
        "layers_rope_above_content": sum(r > 1 for r in ratios),
        "layers": len(layers),
    }


def ranks(v: list[float]) -> list[float]:
    """Ranks (1-based), ties get their average rank."""
    order = sorted(range(len(v)), key=lambda i: v[i])
    out = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or len(a) < 2:
        return math.nan
    ra, rb = ranks(a), ranks(b)
    ma, mb = fmean(ra), fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else math.nan


def predictor_check(points: list[dict], gamma: float = GAMMA) -> dict:
    """The paper's Table 5 over the local points (each with T_b, A_b, G_b, G_finite_b for b = C, P).

    The measured quantity is log(G_P/G_C) from the finite-perturbation gains; the JVP gains
    are compared with them separately.
    """
    ok = [p for p in points if all(p[f"{k}_{b}"] > 0 for k in ("T", "A", "G_finite") for b in "CP")]
    if not ok:
        return {"points": 0}
    measured = [math.log(p["G_finite_P"] / p["G_finite_C"]) for p in ok]
    trace = [math.log(p["T_P"] / p["T_C"]) + gamma for p in ok]
    full = [t + math.log(p["A_P"] / p["A_C"]) for t, p in zip(trace, ok)]
    err = [abs(f - m) for f, m in zip(full, measured)]
    jvp = [p[f"G_{b}"] for p in ok for b in "CP"]
    fin = [p[f"G_finite_{b}"] for p in ok for b in "CP"]
    out = {
        "points": len(ok),
        "gamma": gamma,
        "spearman": spearman(full, measured),
        "median_abs_log_error": median(err),
        "mae_cache_only": fmean(abs(gamma - m) for m in measured),
        "mae_trace_only": fmean(abs(t - m) for t, m in zip(trace, measured)),
        "mae_operator_allocation": fmean(err),
        "jvp_finite_spearman": spearman(jvp, fin),
    }
    for b in "CP":
        lg = [abs(math.log(p[f"nmse_pred_{b}"] / p[f"nmse_out_{b}"])) for p in ok if p[f"nmse_out_{b}"] > 0]
        out[f"nmse_pred_median_abs_log_error_{b}"] = median(lg) if lg else math.nan
    return out


def intervention_summary(points: list[dict]) -> dict:
    """Table 6 over the points that carry interventions (``iv_G_b`` and ``iv_<control>_b``).

    ``<control>_<b>``: the geometric-mean gain ratio over all points and draws (every point has
    the same number of draws, so this is the geometric mean of the points' own geometric
    means). ``permute_median_rise_<b>``: the median over points of the permuted gain
    (G · its geometric-mean ratio) over the median of the original gains.
    """
    ok = [p for p in points if all(f"iv_{k}_{b}" in p for k in ("G", *CONTROLS) for b in "CP")]
    out: dict = {"points": len(ok)}
    if not ok:
        return out
    for b in "CP":
        for k in CONTROLS:
            out[f"{k}_{b}"] = geometric_mean(p[f"iv_{k}_{b}"] for p in ok)
        G = [p[f"iv_G_{b}"] for p in ok]
        out[f"permute_median_rise_{b}"] = median(g * p[f"iv_permute_{b}"] for g, p in zip(G, ok)) / median(G)
    return out
