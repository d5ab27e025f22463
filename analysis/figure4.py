"""Figure 4: RULER needle-in-a-haystack accuracy against context length (the paper's §7.6), one panel
per task (S-NIAH-1/2/3), one line per configuration of ours (BF16 dashed), ± standard error.

The paper plots its per-length numbers and prints only QuantMLA's averages over the lengths; those
are in the RULER table beside ours (:mod:`analysis.paper`). A configuration run more than once
(noise-floor variants) is drawn from its unperturbed run, as the claims read it; ``figure4.csv``
holds every plotted point with the number of runs of its configuration.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import metrics as M
from analysis import noise as N
from analysis import paper as PT
from analysis import render
from quantmla.tracking import scan_runs

TASKS = {"niah_single_1": "S-NIAH-1", "niah_single_2": "S-NIAH-2", "niah_single_3": "S-NIAH-3"}


def _kilo(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def points(runs: list[dict]) -> pd.DataFrame:
    """One row per configuration, task and length: accuracy (%) and its standard error."""
    got = PT.ruler_table(runs)
    if got is None:
        return pd.DataFrame()
    out = []
    for r in got[3]:
        run = next((x for x in r.runs if N.unperturbed(x["config"])), r.runs[0])
        lengths = run["metrics"].get("settings", {}).get("lengths", [])
        for task, res in run["metrics"].get("results", {}).items():
            for n in lengths:
                v, se = res.get(f"{n},none"), M.ruler_se(run["metrics"], task, n)
                out.append(
                    PT.row_keys(r)
                    | {
                        "task": task,
                        "length": int(n),
                        "accuracy": None if v is None or v < 0 else 100 * v,
                        "se": None if se is None else 100 * se,
                    }
                )
    return pd.DataFrame(out)


def write(root: str | Path, out: str | Path) -> list[Path]:
    """``figure4.png``, ``figure4.pdf`` and ``figure4.csv`` in ``out`` from the RULER runs under ``root``;
    nothing without them."""
    df = points(scan_runs(root).runs)
    if df.empty:
        return []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in TASKS if t in set(df["task"])] + sorted(set(df["task"]) - set(TASKS))
    config = ["model", "prec.", "method", "protect"]
    configs = list(dict.fromkeys(df[config].itertuples(index=False, name=None)))
    colour = dict(zip(configs, render.colours(len(configs))))  # one colour per configuration in every panel
    fig, axes = render.plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks) + 0.6, 3.4), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        here = df[df["task"] == task]
        for key, sel in here.groupby(config, sort=False):
            model, prec, method, protect = key
            sel = sel.sort_values("length")
            bf16 = prec == "C16R16"
            label = f"{model} BF16" if bf16 else f"{model} {prec} {method}" + (" protected" if protect == "yes" else "")
            ax.errorbar(
                sel["length"],
                sel["accuracy"],
                yerr=sel["se"].fillna(0.0),
                color="black" if bf16 else colour[key],
                ls="--" if bf16 else "-",
                marker="o",
                ms=3,
                lw=1,
                capsize=2,
                label=label,
            )
        lengths = sorted(set(here["length"]))
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_kilo(n) for n in lengths])
        ax.minorticks_off()
        ax.set(title=TASKS.get(task, task), xlabel="context length (tokens)")
        ax.grid(lw=0.3)
    axes[0][0].set_ylabel("accuracy (%)")
    files = render.save(fig, out / "figure4", legend_from=axes[0][0], ncol=3)
    return files + render.csv(df, out / "figure4.csv")
