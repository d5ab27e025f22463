"""Tables and figures of the dual-path sensitivity runs (``eval=sensitivity``, the paper's §2.2–2.3, App. B).

``python -m analysis sensitivity <runs-dir> [--out DIR]`` writes

- ``sensitivity.md`` and ``sensitivity.tex``: Table 4 (model-level responses, the paper's numbers
  beside where the model is one of the paper's), Table 5 (predictive check of the local model) and,
  for runs with ``eval.interventions``, Table 6 (equal-energy interventions); each table also as
  ``sensitivity_table{4,5,6}.csv``;
- ``sensitivity_layers.csv``: R_C, R_P (mean, min and max over cells) and r_ℓ per layer;
- ``sensitivity_local.csv``: every local point (T, A, O, G per path);
- ``sensitivity_responses.png``: Figure 2 style: R_C and R_P against the layer with the
  min–max envelope over cells; beside it the distribution of r_ℓ = R̄_P/R̄_C per model
  (median diamond, IQR whisker, dashed line at 1);
- ``sensitivity_atlas.png``: Figure 6 style: heat maps of the content and RoPE output NMSE
  at the matched cache NMSE and of their ratio, one row per model, one column per layer;
- ``sensitivity_breakdown_<model>.png``: the T/A/O breakdown per layer and the predictive checks;
- every figure also as PDF.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from hydra.experimental.callback import Callback
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, NullFormatter

from analysis import render
from quantmla.tracking import read_runs

PAPER_TABLE4 = {
    # the paper's Table 4: content response, RoPE response, RoPE/content ratio (cache NMSE 0.01)
    "deepseek_v2_lite": (0.620, 3.925, 6.331),
    "deepseek_v3_base": (0.452, 1.751, 3.871),
    "deepseek_r1": (0.494, 1.784, 3.611),
    "kimi_k2_instruct": (1.594, 3.095, 1.941),
    "longcat_flash_lite": (0.594, 4.077, 6.864),
    "glm_4_7_flash": (1.026, 2.462, 2.400),
}
PAPER_TABLE5 = {"deepseek_v2_lite": (0.9923, 0.1054), "glm_4_7_flash": (0.9614, 0.0727)}
# the paper's Table 6 (DeepSeek-V2-Lite layer 20, cache NMSE 1e-3): (content, RoPE) geometric-mean gain ratio
PAPER_TABLE6 = {"deepseek_v2_lite": {"sign": (1.048, 1.115), "permute": (5.918, 1.495), "isotropic": (6.007, 1.380)}}
CONTROL_NAMES = {
    "sign": "Independent sign randomization",
    "permute": "Whole-token permutation",
    "isotropic": "Isotropic direction",
}
COLORS = {"C": "tab:blue", "P": "tab:orange"}
NAMES = {"C": "content", "P": "RoPE"}


def sensitivity_runs(root: str | Path) -> list[dict]:
    """Finished ``eval=sensitivity`` runs under ``root``, each with a display ``label``."""
    out = []
    for r in read_runs(root):
        c = r["config"]
        if c.get("eval", {}).get("name") != "sensitivity" or "per_layer" not in r["metrics"]:
            continue
        label = c["model"]["name"]
        if c["method"]["name"] != "rtn" or c["bits"]["name"].lower() != "c16r16":
            label += f" ({c['method']['name']}, {c['bits']['name'].upper()})"
        out.append(r | {"label": label, "model": c["model"]["name"]})
    seen = [r["label"] for r in out]
    for r in out:  # same model twice (another seed or setting): tell them apart by run id
        if seen.count(r["label"]) > 1:
            r["label"] += f" [{Path(r['dir']).name}]"
    return sorted(out, key=lambda r: r["label"])


def _paper_protocol(run: dict, table: int) -> bool:
    """Whether ``run`` measured what the paper's Table ``table`` reports, so its numbers may stand
    beside the run's: Table 4 every layer at cache NMSE 0.01; Table 6 layer 20 at 1e-3."""
    e = run["config"].get("eval", {})
    if table == 4:
        return e.get("layers") is None and float(e.get("target_nmse", 0)) == 0.01
    points = {p["layer"] for p in run["metrics"].get("local_points", [])}
    return points == {20} and float(e.get("local_target_nmse", 0)) == 1e-3


def model_table(runs: list[dict]) -> pd.DataFrame:
    rows = []
    for r in runs:
        m = r["metrics"]
        paper = PAPER_TABLE4.get(r["model"], (math.nan,) * 3) if _paper_protocol(r, 4) else (math.nan,) * 3
        rows.append(
            {
                "model": r["label"],
                "layers": m["layers"],
                "cells": len(m["cells"]),
                "content response": m["content_response"],
                "RoPE response": m["rope_response"],
                "RoPE/content": m["ratio"],
                "median r_l": m["layer_ratio_median"],
                "layers with r_l > 1": m["layers_rope_above_content"],
                "paper content": paper[0],
                "paper RoPE": paper[1],
                "paper ratio": paper[2],
            }
        )
    return pd.DataFrame(rows)


def local_table(runs: list[dict]) -> pd.DataFrame:
    rows = []
    for r in runs:
        loc = r["metrics"].get("local")
        if not loc or not loc.get("points"):
            continue
        paper = PAPER_TABLE5.get(r["model"], (math.nan, math.nan))
        rows.append(
            {
                "model": r["label"],
                "points": loc["points"],
                "Spearman": loc["spearman"],
                "median abs log err": loc["median_abs_log_error"],
                "MAE cache only": loc["mae_cache_only"],
                "MAE trace only": loc["mae_trace_only"],
                "MAE operator+allocation": loc["mae_operator_allocation"],
                "JVP vs finite Spearman": loc["jvp_finite_spearman"],
                "paper Spearman": paper[0],
                "paper median abs log err": paper[1],
            }
        )
    return pd.DataFrame(rows)


def intervention_table(runs: list[dict]) -> pd.DataFrame:
    """Table 6: one row per run and control, the geometric-mean gain ratios, and the paper's where
    the run followed its protocol (layer 20, cache NMSE 1e-3)."""
    rows = []
    for r in runs:
        iv = r["metrics"].get("interventions")
        if not iv or not iv.get("points"):
            continue
        paper = PAPER_TABLE6.get(r["model"], {}) if _paper_protocol(r, 6) else {}
        layers = sorted({p["layer"] for p in r["metrics"].get("local_points", [])})
        for k, name in CONTROL_NAMES.items():
            want = paper.get(k, (math.nan, math.nan))
            rows.append(
                {
                    "model": r["label"],
                    "error intervention": name,
                    "layers": ",".join(map(str, layers)),
                    "points": iv["points"],
                    "draws": iv["draws"],
                    "content": iv[f"{k}_C"],
                    "RoPE": iv[f"{k}_P"],
                    "paper content": want[0],
                    "paper RoPE": want[1],
                }
            )
    return pd.DataFrame(rows)


def layer_frame(runs: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"model": r["label"]} | row for r in runs for row in r["metrics"]["per_layer"]])


def local_frame(runs: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"model": r["label"]} | p for r in runs for p in r["metrics"].get("local_points", [])])


def _text(df: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """The cells as text: floats to ``digits`` places, missing ones as a dash."""

    def cell(v):
        if isinstance(v, (float, np.floating)):
            return "–" if pd.isna(v) else f"{v:.{digits}f}"
        return str(v)

    return df.map(cell)


def _md(df: pd.DataFrame, digits: int = 3) -> str:
    return render.markdown(_text(df, digits))


def figure_responses(runs: list[dict], path: Path) -> list[Path]:
    """Figure 2 style: per-layer responses with envelopes (left), r_ℓ distributions (right)."""
    n = len(runs)
    fig = Figure(figsize=(11, 2.9 * n + 0.6), layout="constrained")
    gs = fig.add_gridspec(n, 2, width_ratios=[3.2, max(1.0, 0.45 * n + 0.6)])
    right = fig.add_subplot(gs[:, 1])
    for i, r in enumerate(runs):
        ax = fig.add_subplot(gs[i, 0])
        rows = r["metrics"]["per_layer"]
        x = [row["layer"] for row in rows]
        for b in "CP":
            y = [row[f"R_{b}"] for row in rows]
            lo, hi = [row[f"R_{b}_min"] for row in rows], [row[f"R_{b}_max"] for row in rows]
            ax.fill_between(x, lo, hi, color=COLORS[b], alpha=0.25, lw=0)
            mean = r["metrics"]["content_response" if b == "C" else "rope_response"]
            ax.plot(x, y, "o-", ms=3, color=COLORS[b], label=f"{NAMES[b]} $R_{b}$ (model {mean:.3g})")
        ax.set_yscale("log")
        ax.set_ylabel("response $R$ = NMSE$_{out}$/NMSE$_{cache}$")
        ax.set_title(
            f"{r['label']}: RoPE/content = {r['metrics']['ratio']:.3g} "
            f"({len(r['metrics']['cells'])} cells, cache NMSE {r['metrics']['target_nmse']:g})",
            fontsize=10,
        )
        ax.grid(alpha=0.3, which="both")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, loc="best")
        if i == n - 1:
            ax.set_xlabel("layer")
    rng = np.random.default_rng(0)
    for i, r in enumerate(runs):
        ratios = np.array([row["ratio"] for row in r["metrics"]["per_layer"]])
        q1, med, q3 = np.percentile(ratios, [25, 50, 75])
        right.scatter(i + rng.uniform(-0.15, 0.15, len(ratios)), ratios, s=10, color="0.55", alpha=0.7, lw=0)
        right.vlines(i, q1, q3, color="k", lw=2)
        right.scatter([i], [med], marker="D", s=55, color="tab:red", zorder=3)
    right.axhline(1.0, ls="--", color="k", lw=1)
    right.set_yscale("log")
    right.set_xticks(range(n), [r["label"] for r in runs], rotation=30, ha="right", fontsize=8)
    right.set_xlim(-0.6, n - 0.4)
    right.set_ylabel(r"layer ratio $r_\ell = \bar R_P / \bar R_C$")
    right.set_title("per-layer ratio\n(◆ median, bar IQR)", fontsize=10)
    right.grid(alpha=0.3, axis="y", which="both")
    return render.png_and_pdf(fig, path, dpi=130)


def atlas(runs: list[dict]) -> dict[str, np.ndarray]:
    """Figure 6's three maps, (models × layers) with NaN where a run has no such layer: the
    content and RoPE output NMSE at the matched cache NMSE and their ratio (RoPE / content)."""
    width = 1 + max(row["layer"] for r in runs for row in r["metrics"]["per_layer"])
    maps = {k: np.full((len(runs), width), np.nan) for k in ("C", "P", "ratio")}
    for i, r in enumerate(runs):
        for row in r["metrics"]["per_layer"]:
            j = row["layer"]
            maps["C"][i, j], maps["P"][i, j] = row["nmse_out_C"], row["nmse_out_P"]
            maps["ratio"][i, j] = row["nmse_out_P"] / row["nmse_out_C"] if row["nmse_out_C"] > 0 else np.nan
    return maps


def figure_atlas(runs: list[dict], path: Path) -> list[Path]:
    """Figure 6 style: heat maps of NMSE_out (content, RoPE) and their ratio over every model and layer."""
    maps = atlas(runs)
    n, width = maps["C"].shape
    targets = {r["metrics"]["target_nmse"] for r in runs}
    at = f"cache NMSE {targets.pop():g}" if len(targets) == 1 else "each run's cache NMSE"
    fig = Figure(figsize=(min(max(6.5, 4 + 0.22 * width), 22), 3 * (0.9 + 0.32 * n)), layout="constrained")
    axs = fig.subplots(3, 1, sharex=True)
    outs = np.concatenate([maps["C"].ravel(), maps["P"].ravel()])
    outs = outs[np.isfinite(outs) & (outs > 0)]
    shared = LogNorm(vmin=outs.min(), vmax=outs.max()) if len(outs) else None
    ratio = maps["ratio"][np.isfinite(maps["ratio"]) & (maps["ratio"] > 0)]
    span = float(np.abs(np.log10(ratio)).max()) if len(ratio) else 1.0
    span = max(span, 0.1)
    panels = [
        ("C", f"content NMSE$_{{out}}$ at {at}", "viridis", shared),
        ("P", f"RoPE NMSE$_{{out}}$ at {at}", "viridis", shared),
        ("ratio", "RoPE / content (1 = equal)", "RdBu_r", LogNorm(vmin=10**-span, vmax=10**span)),
    ]
    for ax, (k, title, cmap, norm) in zip(axs, panels):
        im = ax.imshow(np.ma.masked_invalid(maps[k]), aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_yticks(range(n), [r["label"] for r in runs], fontsize=8)
        ax.set_title(title, fontsize=10)
        cb = fig.colorbar(im, ax=ax, pad=0.01)
        cb.ax.yaxis.set_minor_formatter(NullFormatter())  # minor labels of a log bar collide
        if k == "ratio":  # powers of two read better than decades for a ratio
            ticks = [2.0**i for i in range(-8, 9) if norm.vmin <= 2.0**i <= norm.vmax]
            cb.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    axs[-1].set_xlabel("layer")
    axs[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return render.png_and_pdf(fig, path, dpi=130)


def figure_breakdown(run: dict, path: Path) -> list[Path]:
    """The local model per layer (means over points): T, A, O/G, G vs T·A; and the predictive checks."""
    pts = pd.DataFrame(run["metrics"]["local_points"])
    by = pts.groupby("layer").mean(numeric_only=True)
    fig = Figure(figsize=(13, 7.5), layout="constrained")
    axs = fig.subplots(2, 3)
    loc = run["metrics"]["local"]
    fig.suptitle(
        f"{run['label']}: local model G = T·A + O at cache NMSE {loc['target_nmse']:g} "
        f"({loc['points']} points, {int(pts['probes_C'].iloc[0])} probes per path)",
        fontsize=11,
    )
    for b in "CP":
        kw = {"color": COLORS[b], "ms": 3}
        axs[0, 0].plot(by.index, by[f"T_{b}"], "o-", label=NAMES[b], **kw)
        axs[0, 1].plot(by.index, by[f"A_{b}"], "o-", label=NAMES[b], **kw)
        axs[0, 2].plot(by.index, by[f"O_{b}"] / by[f"G_{b}"], "o-", label=NAMES[b], **kw)
        axs[1, 0].plot(by.index, by[f"G_{b}"], "o-", label=f"$G_{b}$ (JVP)", **kw)
        axs[1, 0].plot(by.index, by[f"T_{b}"] * by[f"A_{b}"], "--", color=COLORS[b], label=f"$T_{b} A_{b}$")
        axs[1, 1].scatter(pts[f"nmse_pred_{b}"], pts[f"nmse_out_{b}"], s=12, color=COLORS[b], label=NAMES[b])
    axs[0, 0].set(title="operator sensitivity $T_b$ = tr(H)/D", yscale="log", xlabel="layer")
    axs[0, 1].set(title="error allocation $A_b$", xlabel="layer")
    axs[0, 1].axhline(1.0, ls="--", color="k", lw=1)
    axs[0, 2].set(title="directional coupling $O_b / G_b$", xlabel="layer")
    axs[0, 2].axhline(0.0, ls="--", color="k", lw=1)
    axs[1, 0].set(title="gain $G_b$ and $T_b A_b$", yscale="log", xlabel="layer")
    ax = axs[1, 1]
    both = np.concatenate([pts[f"nmse_{k}_{b}"].to_numpy() for k in ("pred", "out") for b in "CP"])
    lim = (both.min() / 1.5, both.max() * 1.5)
    ax.plot(lim, lim, "k--", lw=1)
    ax.set(
        xscale="log", yscale="log", xlim=lim, ylim=lim, title="first-order NMSE$_{out}$ vs measured", xlabel="predicted"
    )
    ax.set_ylabel("measured")
    ax = axs[1, 2]
    measured = np.log(pts["G_finite_P"] / pts["G_finite_C"])
    trace = np.log(pts["T_P"] / pts["T_C"]) + loc["gamma"]
    full = trace + np.log(pts["A_P"] / pts["A_C"])
    ax.scatter(
        full,
        measured,
        s=14,
        color="tab:green",
        label=f"operator + allocation (MAE {loc['mae_operator_allocation']:.3f})",
    )
    ax.scatter(
        trace, measured, s=10, color="0.6", marker="x", label=f"operator trace only (MAE {loc['mae_trace_only']:.3f})"
    )
    lo, hi = float(min(full.min(), trace.min(), measured.min())), float(max(full.max(), trace.max(), measured.max()))
    pad = 0.1 * (hi - lo + 1e-9)
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k--", lw=1)
    ax.axhline(loc["gamma"], color="0.8", lw=1, label=f"cache error only γ (MAE {loc['mae_cache_only']:.3f})")
    ax.set(
        title=f"frozen predictor: Spearman {loc['spearman']:.3f}",
        xlabel=r"predicted $\log(G_P/G_C)$",
        ylabel=r"measured $\log(G_P/G_C)$",
    )
    for a in axs.flat:
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=7)
    axs[1, 1].xaxis.set_minor_formatter(NullFormatter())  # minor labels of a log-log scatter collide
    axs[1, 1].yaxis.set_minor_formatter(NullFormatter())
    for a in list(axs[0]) + [axs[1, 0]]:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    return render.png_and_pdf(fig, path, dpi=130)


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label).strip("_")


def write(root: str | Path, out: str | Path | None = None) -> tuple[str, list[Path]]:
    """Render every table and figure of the sensitivity runs under ``root`` into ``out`` (default ``root``)."""
    runs = sensitivity_runs(root)
    if not runs:
        raise ValueError(f"no finished sensitivity runs (eval=sensitivity) under {root}")
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    tables = [
        ("Model-level responses at matched cache NMSE (Table 4)", "sensitivity_table4", model_table(runs)),
        ("Local model G = T·A + O: predictive check (Table 5)", "sensitivity_table5", local_table(runs)),
        (
            "Equal-energy error interventions: geometric-mean gain ratio, new / original (Table 6)",
            "sensitivity_table6",
            intervention_table(runs),
        ),
    ]
    tables = [t for t in tables if len(t[2])]
    md = "\n\n".join(f"## {title}\n\n{_md(df)}" for title, _, df in tables)
    tex = "\n".join(render.latex(_text(df), caption=title) for title, _, df in tables)
    files += render.write_text(out / "sensitivity.md", md)
    files += render.write_text(out / "sensitivity.tex", tex)
    for _, stem, df in tables:
        files += render.csv(df, out / f"{stem}.csv")
    files += render.csv(layer_frame(runs), out / "sensitivity_layers.csv")
    lf = local_frame(runs)
    if len(lf):
        files += render.csv(lf, out / "sensitivity_local.csv")
    files += figure_responses(runs, out / "sensitivity_responses.png")
    files += figure_atlas(runs, out / "sensitivity_atlas.png")
    for r in runs:
        if r["metrics"].get("local_points"):
            files += figure_breakdown(r, out / f"sensitivity_breakdown_{_slug(r['label'])}.png")
    return md, files


class SensitivityReport(Callback):
    """Hydra callback of ``experiment=table4_sensitivity`` and ``table6_interventions``: render the
    tables and figures when the runs end."""

    def _render(self, config) -> None:
        root = Path(config.runs_dir) / config.sweep
        try:
            md, files = write(root)
        except ValueError as e:  # nothing finished (every job failed): say so, do not mask the jobs' errors
            print(f"sensitivity report: {e}")
            return
        print(f"\n{md}\n\n(sensitivity tables and figures: {', '.join(str(f) for f in files)})")

    def on_multirun_end(self, config, **kwargs) -> None:
        self._render(config)

    def on_run_end(self, config, **kwargs) -> None:
        self._render(config)
