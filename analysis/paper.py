"""The paper's result tables from recorded runs, its published numbers beside ours, written as
markdown, CSV and LaTeX, with figures as PNG and PDF.

- Table 1 (``eval=suite_a``): CS, MMLU, GSM8K, FDA, SWDE, SQuAD, Avg.; Table 8: CS per task;
- Table 2 (``eval=suite_b``): the seven tasks and their average;
- Table 3 (lm-eval runs with MMLU and no suite, ``experiment=table3_ablation``): the cumulative ablation
  at C4R4, each step's gain and whether the noise floor resolves it;
- RULER (``eval=ruler``): each task's mean over the lengths (Figure 4's averages).

Each of our rows is followed by the paper's row for the same model, precision and method under the
paper's protection convention (baselines unprotected, QuantMLA protected), task by task. Cells are
value ± standard error; in each block (same model and precision) the best quantized row and those not
resolved from it are bold (:mod:`analysis.noise`), and a noise-floor row follows where one was
measured. Rows scored off the paper's protocol say how in ``profile``. Missing tasks are ``n/a`` and
keep the average empty, as the evaluation records them.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import noise as N
from analysis import paper_numbers as P
from analysis import render
from analysis.metrics import Value
from analysis.table import BLOCK_FREE, Row, _same, blocks, comparisons, details, mark, notes, rows, seeds
from quantmla.tracking import scan_runs

NAMES = {
    "cs": "CS",
    "mmlu": "MMLU",
    "gsm8k": "GSM8K",
    "fda": "FDA",
    "swde": "SWDE",
    "squad_completion": "SQuAD",
    "gpqa_diamond_zeroshot": "GPQA-D",
    "minerva_math500": "MATH500",
    "aime25": "AIME25",
    "humaneval": "HumanEval",
    "livecodebench": "LCB",
    "avg": "Avg.",
    "hellaswag": "HellaSwag",
    "piqa": "PIQA",
    "arc_easy": "ARC-E",
    "arc_challenge": "ARC-C",
    "winogrande": "WinoGrande",
}
METHODS = {"rtn": "RTN", "smoothquant": "SmoothQuant†", "quarot": "QuaRot†", "quantmla": "QuantMLA"}
KEYS = ["model", "prec.", "method", "protect", "profile", "runs"]
SEEDS = "{n} calibration seeds: mean ± SE"
SEEDS_NOTE = (
    "Rows calibrated with several seeds (noise.perturb=seed) show seed 0, as the paper's downstream results do "
    "(App. C); the line beneath gives the mean over the seeds ± its standard error (sample SD / √n). "
    "The seeds' spread is part of the block's noise floor."
)


def _as_bf16(run: dict) -> dict:
    """A C16R16 run is the BF16 reference whatever its method (fusion is exact up to round-off)."""
    c = run["config"]
    if str(c.get("bits", {}).get("name", "")).lower() != "c16r16":
        return run
    return run | {"config": c | {"method": {"name": "—"}, "protect": (c.get("protect") or {}) | {"enabled": False}}}


def _method(r: Row) -> str:
    if r.keys["bits"] == "C16R16":
        return "—"
    name = METHODS.get(r.keys["method"], r.keys["method"])
    more = [r.keys["variant"]] if r.keys.get("variant") else []
    more += [
        f"{c}={v}" for c, v in r.keys.items() if c not in ("model", "method", "variant", "bits", "protect", "exact")
    ]
    return name + (f" ({'; '.join(more)})" if more else "")


def row_keys(r: Row) -> dict:
    """The key columns of a row in the paper's tables (model, precision, method, protection, profile, runs)."""
    quantized = r.keys["bits"] != "C16R16"
    return {
        "model": r.keys["model"],
        "prec.": r.keys["bits"],
        "method": _method(r),
        "protect": ("yes" if r.keys["protect"] else "no") if quantized else "",
        "profile": r.profile or "paper",
        "runs": str(r.n),
    }


def _paper(table: dict, r: Row, cols: tuple[str, ...], order: tuple[str, ...]):
    """(model, the paper's values of ``cols``) for row ``r`` (the table's columns are ``order``), or None."""
    ref = P.paper_row(table, r.keys["model"], r.keys["bits"], r.keys["method"], r.keys["protect"])
    if ref is None or r.keys.get("variant"):
        return None
    return P.paper_model(table, r.keys["model"]), [ref[order.index(c)] if c in order else None for c in cols]


def layout(rs: list[Row], cols: tuple[str, ...], paper) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(text, bold, numbers) of a paper table: each of our rows, the paper's beneath it (``paper(r)``:
    the paper's model and values, or None), and each block's noise floor."""
    heads = [NAMES.get(c, c) for c in cols]
    text, bold, data = [], [], []
    for block in blocks(rs).values():
        for r in block:
            keys = row_keys(r)
            text.append(keys | {h: render.number(r.values[c]) if c in r.values else "n/a" for c, h in zip(cols, heads)})
            bold.append({h: bool(r.best.get(c)) for c, h in zip(cols, heads)})
            source, ref = paper(r) or (None, None)
            row = keys | {"source": "ours", "paper model": source}
            for j, (c, h) in enumerate(zip(cols, heads)):
                v = r.values.get(c, Value(None))
                row |= {h: v.value, f"{h} se": v.se, f"{h} noise": r.floor.get(c), f"{h} tied": r.best.get(c)}
                row[f"{h} paper"] = ref[j] if ref else None
            n_seeds, over_seeds = seeds(r)
            if n_seeds:
                row |= {"seeds": n_seeds}
                for c, h in zip(cols, heads):
                    v = over_seeds.get(c, Value(None))
                    row |= {f"{h} seeds": v.value, f"{h} seeds se": v.se}
                text.append(
                    dict.fromkeys(KEYS, "")
                    | {"method": SEEDS.format(n=n_seeds)}
                    | {h: render.number(over_seeds[c]) if c in over_seeds else "n/a" for c, h in zip(cols, heads)}
                )
                bold.append({})
            data.append(row)
            if ref:
                label = "paper" if source == r.keys["model"] else f"paper ({source})"
                text.append(dict.fromkeys(KEYS, "") | {"method": label} | {h: _fmt(x) for h, x in zip(heads, ref)})
                bold.append({})
        floors = [block[0].floor.get(c) for c in cols]
        if any(f is not None for f in floors):
            text.append(
                dict.fromkeys(KEYS, "") | {"method": "noise floor"} | dict(zip(heads, map(render.spread, floors)))
            )
            bold.append({})
    cols_out = KEYS + heads
    return (
        pd.DataFrame(text, columns=cols_out).fillna(""),
        pd.DataFrame(bold, columns=cols_out).fillna(False),
        pd.DataFrame(data),
    )


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _prepared(runs: list[dict]) -> list[Row]:
    rs = rows([_as_bf16(r) for r in runs])
    mark(rs)
    return rs


def suite_table(runs: list[dict], suite: str, breakdown: bool = False):
    """Table 1 (Suite A), 8 (``breakdown``: Suite A's commonsense tasks) or 2 (Suite B)."""
    chosen = [r for r in runs if (r["config"].get("eval") or {}).get("suite") == suite and "scores" in r["metrics"]]
    if not chosen:
        return None
    if suite == "suite_b":
        cols, table, order = P.SUITE_B_COLUMNS, P.TABLE2, P.SUITE_B_COLUMNS
    elif breakdown:
        cols, table, order = P.TABLE8_COLUMNS, P.TABLE8, P.TABLE8_COLUMNS
    else:
        cols, table, order = P.SUITE_A_COLUMNS, P.TABLE1, P.SUITE_A_COLUMNS
    rs = _prepared(chosen)
    text, bold, data = layout(rs, cols, lambda r: _paper(table, r, cols, order))
    if breakdown:
        text = text.rename(columns={"CS": "Avg. (CS)"})
        bold = bold.rename(columns={"CS": "Avg. (CS)"})
    return text, bold, data, rs, cols


def ruler_table(runs: list[dict]):
    chosen = [r for r in runs if isinstance(r["metrics"].get("mean"), dict)]
    if not chosen:
        return None
    rs = _prepared(chosen)
    tasks = tuple(dict.fromkeys(k for r in rs for k in r.values if k != "avg")) + ("avg",)

    def paper(r):
        k = r.keys
        ours = (k["bits"], k["method"], k["protect"]) == ("C4R4", "quantmla", True)
        return (P.REFERENCE, [P.RULER_QUANTMLA.get(t) for t in tasks]) if ours and not k.get("variant") else None

    text, bold, data = layout(rs, tasks, paper)
    return text, bold, data, rs, tasks


STEPS = ("RTN", "+ content-path transform", "+ RoPE-path transform", "+ BF16 protection (full QuantMLA)")


def table3_label(r: Row) -> str | None:
    """The paper's Table 3 row that run configuration ``r`` is, or None."""
    k, method = r.keys, r.runs[0]["config"]["method"]
    if k["bits"] == "C16R16":
        return "BF16"
    if k["bits"] != "C4R4":
        return None
    paths = method.get("paths") or {}
    if k["method"] in ("rtn", "smoothquant", "quarot") and not k["protect"]:
        return METHODS[k["method"]]
    if k["method"] == "quantmla" and paths.get("content", True):
        if not paths.get("rope", True):
            return None if k["protect"] else STEPS[1]
        return STEPS[3] if k["protect"] else STEPS[2]
    return None


def table3(runs: list[dict]):
    """Table 3: MMLU (%) of the ablation rows, each cumulative step's gain and whether it is resolved."""
    chosen = [
        r
        for r in runs
        if not (r["config"].get("eval") or {}).get("suite") and "mmlu" in (r["metrics"].get("results") or {})
    ]
    rs = [r for r in _prepared(chosen) if table3_label(r)]
    if not rs:
        return None
    for r in rs:  # the row's label says which paths it transforms; lm-eval's fraction as the paper's percentage
        r.keys["variant"] = " ".join(x for x in r.keys.get("variant", "").split() if not x.startswith("paths."))
        v = r.values.get("mmlu acc", Value(None))
        r.values = {"mmlu": Value(*(None if x is None else 100 * x for x in (v.value, v.se)), digits=2)}
        r.spread = {"mmlu": None if r.spread.get("mmlu acc") is None else 100 * r.spread["mmlu acc"]}
    for r in rs:  # one comparison block per model: BF16 and every C4R4 row of the ablation
        r.block = _same({k: v for k, v in r.keys.items() if k not in (*BLOCK_FREE, "bits")})
        r.floor, r.best = {}, {}
    mark(rs)
    order = ("BF16", "RTN", "SmoothQuant†", "QuaRot†", *STEPS[1:])
    text, data = [], []
    for block in blocks(rs).values():
        by = sorted(block, key=lambda r: (order.index(table3_label(r)), r.keys.get("variant", "")))
        prev = {}
        for r in by:
            label, v = table3_label(r), r.values["mmlu"]
            step = STEPS.index(label) if label in STEPS else None
            before = prev.get(step - 1) if step else None
            c = N.compare(v, before.values["mmlu"], r.floor["mmlu"]) if before is not None else None
            paper = None if r.keys.get("variant") else P.TABLE3.get(label)  # Table 3 has P.REFERENCE only
            paper_step = paper - P.TABLE3[STEPS[step - 1]] if paper is not None and step else None
            keys = row_keys(r)
            text.append(
                {
                    "model": keys["model"],
                    "configuration": label + (f" ({r.keys['variant']})" if r.keys.get("variant") else ""),
                }
                | {k: keys[k] for k in ("prec.", "profile", "runs")}
                | {
                    "MMLU (%)": render.number(v),
                    "step Δ": "" if c is None else f"{c.delta:+.2f}",
                    "resolved": "" if c is None else ("yes" if c.resolved else "no"),
                    f"paper ({P.REFERENCE})": _fmt(paper) if paper is not None else "",
                    "paper step Δ": "" if paper_step is None else f"{paper_step:+.2f}",
                }
            )
            data.append(
                {"model": keys["model"], "configuration": label, "variant": r.keys.get("variant", "")}
                | {
                    "profile": keys["profile"],
                    "runs": r.n,
                    "mmlu": v.value,
                    "mmlu_se": v.se,
                    "noise_floor": r.floor["mmlu"],
                }
                | {"step_delta": None if c is None else c.delta, "step_threshold": None if c is None else c.threshold}
                | {"step_resolved": None if c is None else c.resolved, "paper": paper}
            )
            n_seeds, over_seeds = seeds(r, {"mmlu acc": 100.0})
            if n_seeds:
                v = over_seeds.get("mmlu acc", Value(None))
                v = Value(v.value, v.se, digits=2)  # a percentage, as the row's
                data[-1] |= {"seeds": n_seeds, "mmlu_seeds": v.value, "mmlu_seeds_se": v.se}
                text.append({"model": "", "configuration": SEEDS.format(n=n_seeds), "MMLU (%)": render.number(v)})
            if step is not None:
                prev[step] = r
        floor = by[0].floor.get("mmlu")
        text.append({"model": "", "configuration": "noise floor", "MMLU (%)": render.spread(floor)})
    text = pd.DataFrame(text).fillna("")
    return text, None, pd.DataFrame(data), rs, ("mmlu",)


TABLES = (
    ("table1", "Table 1 — Suite A (%)", lambda runs: suite_table(runs, "suite_a")),
    ("table8", "Table 8 — Suite A commonsense tasks (%)", lambda runs: suite_table(runs, "suite_a", breakdown=True)),
    ("table2", "Table 2 — Suite B (%)", lambda runs: suite_table(runs, "suite_b")),
    ("table3", "Table 3 — ablation at C4R4, MMLU 5-shot (%)", table3),
    ("ruler", "RULER — mean over lengths (%)", ruler_table),
)


def figure(rs: list[Row], cols: tuple[str, ...], title: str, stem: Path) -> list[Path]:
    """Grouped bars per column, one colour per row of ours, ± standard error; the legend below the axes."""
    fig, ax = render.plt.subplots(figsize=(max(6.0, 1.2 * len(cols) + 2), 3.8))
    colours = render.colours(len(rs))
    width = 0.8 / max(len(rs), 1)
    for i, (r, colour) in enumerate(zip(rs, colours)):
        xs = [j + (i - (len(rs) - 1) / 2) * width for j in range(len(cols))]
        ys = [r.values[c].value if c in r.values and r.values[c].value is not None else float("nan") for c in cols]
        es = [r.values[c].se if c in r.values and r.values[c].se is not None else 0.0 for c in cols]
        label = f"{r.keys['model']} {r.keys['bits']} {_method(r)}" + (" protected" if r.keys["protect"] else "")
        ax.bar(xs, ys, width, yerr=es, color=colour, label=label, capsize=2, error_kw={"lw": 0.8})
    ax.set_xticks(range(len(cols)), [NAMES.get(c, c) for c in cols])
    ax.set(ylabel="score (%)", title=title)
    ax.grid(axis="y", lw=0.3)
    return render.save(fig, stem, ncol=2)


def write(root: str | Path, out: str | Path | None = None, required: bool = True) -> tuple[str, list[Path]]:
    """Every table the runs under ``root`` can fill, into ``out`` (default ``<root>/paper``):
    ``<table>.md/.csv/.tex`` and ``<table>.png/.pdf``, ``paper_tables.md`` (all of them),
    ``comparisons.csv`` and ``details.csv``. No table to fill is an error, or (``required`` false)
    nothing written."""
    scan = scan_runs(root)
    out = Path(out) if out else Path(root) / "paper"
    out.mkdir(parents=True, exist_ok=True)
    parts, files, every = [], [], []
    for name, title, build in TABLES:
        got = build(scan.runs)
        if got is None:
            continue
        text, bold, data, rs, cols = got
        lines = _notes(name, rs, scan)
        files += render.table(text, bold, out / name, lines, title=title)
        files += render.csv(data, out / f"{name}.csv")
        files += figure(rs, cols, title, out / name)
        parts.append((out / f"{name}.md").read_text().rstrip("\n"))
        every += rs
    if not parts:
        if not required:
            return "", []
        raise ValueError(f"no finished suite_a, suite_b, MMLU or ruler runs under {root}")
    files += render.csv(comparisons(_unique(every)), out / "comparisons.csv")
    files += render.csv(details(_unique(every)), out / "details.csv")
    md = "\n\n".join(parts)
    files += render.write_text(out / "paper_tables.md", md)
    return md, files


def _unique(rs: list[Row]) -> list[Row]:
    seen, out = set(), []
    for r in rs:
        key = tuple(sorted(x["dir"] for x in r.runs)) + (r.block,)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _notes(name: str, rs: list[Row], scan) -> list[str]:
    lines = notes(rs, (), scan)
    if any(seeds(r)[0] for r in rs):
        lines.append(SEEDS_NOTE)
    if name != "table3":
        lines.insert(
            1,
            "Each of our rows is followed by the paper's (its protection convention: baselines unprotected, QuantMLA protected); "
            f"for a model the paper does not report, by its {P.REFERENCE} row, labelled so.",
        )
    else:
        lines[0] = lines[0].split("it. ", 1)[-1]  # no bold in this table: the steps say what is resolved
        lines.insert(
            1,
            "step Δ: the gain over the previous cumulative step (RTN → + content → + RoPE → + protection); "
            "resolved: |step Δ| > max(noise floor, SE(Δ)).",
        )
    if name == "ruler":
        lines.append(_ruler_lengths(rs))
    return lines


def _ruler_lengths(rs: list[Row]) -> str:
    """Which lengths each model's means are over: a run stops before loading at a length beyond the
    model's context, so a small model's means cover fewer lengths than the paper's."""
    per_model: dict[str, set[int]] = {}
    for r in rs:
        for x in r.runs:
            per_model.setdefault(r.keys["model"], set()).update(x["metrics"].get("settings", {}).get("lengths", []))
    ours = "; ".join(f"{m} {', '.join(f'{n // 1024}K' for n in sorted(ns))}" for m, ns in per_model.items())
    return f"Lengths: ours {ours} (up to each model's context); the paper's means are over 4K, 8K, 16K and 32K."
