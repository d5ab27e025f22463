"""The paper's result tables (Tables 1, 2 and RULER) from recorded evaluation runs.

Rows come from runs of ``eval=suite_a`` (Table 1 layout), ``eval=suite_b`` (Table 2) and
``eval=ruler`` (Figure 4's averages). Where the paper has the same row (same model, bits,
method, and its protection convention) its published value is printed beside ours. Missing
tasks are printed as ``n/a`` and keep the average empty, as the evaluation records them.
"""

from __future__ import annotations

from pathlib import Path

from analysis import paper_numbers as P
from analysis.table import METHOD_ORDER, SHOWN, _bits_key, _variant, config_fields, differing, profile_note
from quantmla.files import write_atomic
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


def _rows(runs: list[dict], values) -> dict[tuple, list]:
    """Row key -> the mean of ``values(run)`` over the runs of that row; every config field that
    differs between the runs (and that the key does not show) joins the key's variant."""
    fields = [config_fields(r["config"]) for r in runs]
    extra = [k for k in differing(fields, skip=SHOWN) if not k.startswith("method.")]
    groups: dict[tuple, list] = {}
    for r, f in zip(runs, fields):
        model, bits, method, protect, variant = _key(r["config"])
        more = " ".join(f"{k}={f.get(k)}" for k in extra if not (bits == "C16R16" and k.startswith("protect.")))
        groups.setdefault((model, bits, method, protect, ", ".join(v for v in (variant, more) if v)), []).append(
            values(r)
        )
    return {k: _mean(v) for k, v in groups.items()}


def _mean(rows: list) -> tuple[int, list | dict]:
    """(how many, their mean): of lists (table columns) or dicts (RULER tasks); None stays None."""
    first = rows[0]
    keys = range(len(first)) if isinstance(first, list) else list(first)
    out = {}
    for k in keys:
        got = [r[k] for r in rows if (r[k] if isinstance(r, list) else r.get(k)) is not None]
        out[k] = sum(got) / len(got) if got and len(got) == len(rows) else None
    return len(rows), [out[k] for k in keys] if isinstance(first, list) else out


def _name(bits: str, method: str, variant: str, n: int) -> str:
    name = "—" if bits == "C16R16" else method
    notes = [variant] if variant and bits != "C16R16" else []
    notes += [f"mean of {n}"] if n > 1 else []
    return name + (f" ({'; '.join(notes)})" if notes else "")


def _order(k: tuple) -> tuple:
    model, bits, method, protect, variant = k
    m = METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)
    return model, _bits_key(bits), bits != "C16R16", m, protect, variant


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def suite_table(runs: list[dict], suite: str) -> str | None:
    cols = P.SUITE_A_COLUMNS if suite == "suite_a" else P.SUITE_B_COLUMNS
    paper = P.TABLE1 if suite == "suite_a" else P.TABLE2
    runs = [r for r in runs if r["config"].get("eval", {}).get("suite") == suite and "scores" in r["metrics"]]
    if not runs:
        return None

    def values(r):
        m = r["metrics"]
        got = dict(m["scores"]) | {k: m["averages"].get(k) for k in ("cs", "avg")}
        return [got.get(c) for c in cols]

    rows = _rows(runs, values)
    head = ["model", "prec.", "method", "protect"] + [NAMES[c] for c in cols] + ["paper Avg."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in sorted(rows, key=_order):
        model, bits, method, protect, variant = k
        n, row = rows[k]
        ref = P.paper_row(paper, model, bits, method, protect)
        name = _name(bits, method, variant, n)
        cells = [model, bits, name, "yes" if protect else "no"] + [_fmt(v) for v in row]
        lines.append("| " + " | ".join(cells + [_fmt(ref[-1]) if ref else ""]) + " |")
    return "\n".join(lines)


def ruler_table(runs: list[dict]) -> str | None:
    runs = [r for r in runs if r["config"].get("eval", {}).get("name") == "ruler" and "mean" in r["metrics"]]
    if not runs:
        return None
    tasks = sorted(set().union(*(r["metrics"]["mean"] for r in runs)))
    rows = _rows(runs, lambda r: {t: r["metrics"]["mean"].get(t) for t in tasks})
    head = ["model", "prec.", "method", "protect"] + tasks + [f"paper {t}" for t in tasks if t in P.RULER_QUANTMLA]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in sorted(rows, key=_order):
        model, bits, method, protect, variant = k
        n, row = rows[k]
        paper = model == "deepseek_v2_lite" and bits == "C4R4" and method == "quantmla" and protect
        ref = [_fmt(P.RULER_QUANTMLA[t]) if paper else "" for t in tasks if t in P.RULER_QUANTMLA]
        name = _name(bits, method, variant, n)
        lines.append(
            "| "
            + " | ".join([model, bits, name, "yes" if protect else "no"] + [_fmt(row.get(t)) for t in tasks] + ref)
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
    md = "\n\n".join(parts) + (f"\n\n- {profile_note(runs)}" if profile_note(runs) else "")
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "paper_tables.md", md + "\n")
    return md, out / "paper_tables.md"
