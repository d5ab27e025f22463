"""The paper's result tables (Tables 1, 2 and RULER) from recorded evaluation runs.

Rows come from runs of ``eval=suite_a`` (Table 1 layout), ``eval=suite_b`` (Table 2) and
``eval=ruler`` (Figure 4's averages). Where the paper has the same row (same model, bits,
method, and its protection convention) its published value is printed beside ours. Missing
tasks are printed as ``n/a`` and keep the average empty, as the evaluation records them.
"""

from __future__ import annotations

from pathlib import Path

from analysis import paper_numbers as P
from analysis.table import METHOD_ORDER, _bits_key, _variant
from quantmla.tracking import read_runs

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
}


def _key(c: dict) -> tuple:
    bits = c["bits"]["name"].upper()
    if bits == "C16R16":  # the BF16 reference, whatever the method (fusion is exact)
        return c["model"]["name"], bits, "", False, ""
    protect = bool(c.get("protect", {}).get("enabled", False))
    variant = ", ".join(v for v in (_variant(c["method"]), "exact" if c.get("exact") else "") if v)
    return c["model"]["name"], bits, c["method"]["name"], protect, variant


def _order(k: tuple) -> tuple:
    model, bits, method, protect, variant = k
    m = METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)
    return model, _bits_key(bits), bits != "C16R16", m, protect, variant


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def suite_table(runs: list[dict], suite: str) -> str | None:
    cols = P.SUITE_A_COLUMNS if suite == "suite_a" else P.SUITE_B_COLUMNS
    paper = P.TABLE1 if suite == "suite_a" else P.TABLE2
    rows = {}
    for r in runs:
        m = r["metrics"]
        if r["config"].get("eval", {}).get("suite") != suite or "scores" not in m:
            continue
        values = dict(m["scores"]) | {k: m["averages"].get(k) for k in ("cs", "avg")}
        rows.setdefault(_key(r["config"]), [values.get(c) for c in cols])
    if not rows:
        return None
    head = ["model", "prec.", "method", "protect"] + [NAMES[c] for c in cols] + ["paper Avg."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in sorted(rows, key=_order):
        model, bits, method, protect, variant = k
        ref = P.paper_row(paper, model, bits, method, protect)
        name = "—" if bits == "C16R16" else method + (f" ({variant})" if variant else "")
        cells = [model, bits, name, "yes" if protect else "no"] + [_fmt(v) for v in rows[k]]
        lines.append("| " + " | ".join(cells + [_fmt(ref[-1]) if ref else ""]) + " |")
    return "\n".join(lines)


def ruler_table(runs: list[dict]) -> str | None:
    rows, tasks = {}, []
    for r in runs:
        if r["config"].get("eval", {}).get("name") != "ruler" or "mean" not in r["metrics"]:
            continue
        rows.setdefault(_key(r["config"]), r["metrics"]["mean"])
        tasks = sorted(set(tasks) | set(r["metrics"]["mean"]))
    if not rows:
        return None
    head = ["model", "prec.", "method", "protect"] + tasks + [f"paper {t}" for t in tasks if t in P.RULER_QUANTMLA]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in sorted(rows, key=_order):
        model, bits, method, protect, variant = k
        paper = model == "deepseek_v2_lite" and bits == "C4R4" and method == "quantmla" and protect
        ref = [_fmt(P.RULER_QUANTMLA[t]) if paper else "" for t in tasks if t in P.RULER_QUANTMLA]
        name = "—" if bits == "C16R16" else method + (f" ({variant})" if variant else "")
        lines.append(
            "| "
            + " | ".join([model, bits, name, "yes" if protect else "no"] + [_fmt(rows[k].get(t)) for t in tasks] + ref)
            + " |"
        )
    return "\n".join(lines)


def write(root: str | Path, out: str | Path | None = None) -> tuple[str, Path]:
    runs = read_runs(root)
    parts = []
    for title, table in (
        ("Table 1 — Suite A (%)", suite_table(runs, "suite_a")),
        ("Table 2 — Suite B (%)", suite_table(runs, "suite_b")),
        ("RULER — mean over lengths (%)", ruler_table(runs)),
    ):
        if table:
            parts.append(f"### {title}\n\n{table}")
    if not parts:
        raise ValueError(f"no finished suite_a, suite_b or ruler runs under {root}")
    md = "\n\n".join(parts)
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper_tables.md").write_text(md + "\n")
    return md, out / "paper_tables.md"
