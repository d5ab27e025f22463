"""The paper's scores and averages (its Tables 1 and 2), in one place for evaluation and analysis.

Scores are percentages of one lm-eval metric per task. Suite A: "CS" is the mean of the five
commonsense tasks and "avg" weights all ten tasks equally, i.e. (5·CS + MMLU + GSM8K + FDA +
SWDE + SQuAD) / 10. Suite B: "avg" is the mean of its seven tasks. RULER: each variant's score
averaged over its lengths. An average with a missing task is null and names what is missing;
``avg_over_available`` is the mean of what was measured, kept under its own name.

Pure Python: analysis imports it without torch or lm-eval.
"""

from __future__ import annotations

import math

COMMONSENSE = ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")

# lm-eval task -> the metric the paper reports (lm-eval's "<metric>,<filter>" key)
SUITE_A = {
    "hellaswag": "acc_norm,none",
    "piqa": "acc_norm,none",
    "arc_easy": "acc_norm,none",
    "arc_challenge": "acc_norm,none",
    "winogrande": "acc,none",
    "mmlu": "acc,none",
    "gsm8k": "exact_match,strict-match",
    "fda": "contains,none",
    "swde": "contains,none",
    "squad_completion": "contains,none",
}

# GPQA-Diamond, MMLU, GSM8K, MATH500, AIME25, HumanEval, LiveCodeBench (v6; no lm-eval task)
SUITE_B = {
    "gpqa_diamond_zeroshot": "acc,none",
    "mmlu": "acc,none",
    "gsm8k": "exact_match,strict-match",
    "minerva_math500": "math_verify,none",
    "aime25": "exact_match,none",
    "humaneval": "pass@1,create_test",
    "livecodebench": "pass@1",
}

SUITES = {"suite_a": SUITE_A, "suite_b": SUITE_B}


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def scores(suite: str, results: dict) -> dict[str, float | None]:
    """Percent score of every task of ``suite`` found in lm-eval ``results`` (null when absent)."""
    out = {}
    for task, metric in SUITES[suite].items():
        v = results.get(task, {}).get(metric)
        out[task] = None if v is None or (isinstance(v, float) and math.isnan(v)) else 100.0 * float(v)
    return out


def _average(values: dict[str, float | None], names) -> dict:
    missing = [n for n in names if values.get(n) is None]
    have = [values[n] for n in names if values.get(n) is not None]
    return {
        "value": None if missing else _mean(have),
        "over_available": _mean(have) if have else None,
        "missing": missing,
    }


def suite_a(s: dict[str, float | None]) -> dict:
    cs = _average(s, COMMONSENSE)
    avg = _average(s, tuple(SUITE_A))
    return {
        "cs": cs["value"],
        "avg": avg["value"],
        "avg_over_available": avg["over_available"],
        "missing": avg["missing"],
    }


def suite_b(s: dict[str, float | None]) -> dict:
    avg = _average(s, tuple(SUITE_B))
    return {"avg": avg["value"], "avg_over_available": avg["over_available"], "missing": avg["missing"]}


def suite_report(suite: str, results: dict, unavailable: dict | None = None) -> dict:
    """``scores`` (%) and ``averages`` of ``suite`` from lm-eval results; missing tasks say why."""
    s = scores(suite, results)
    avg = suite_a(s) if suite == "suite_a" else suite_b(s)
    unavailable = unavailable or {}
    avg["why_missing"] = {t: unavailable.get(t, "not evaluated") for t in avg["missing"]}
    return {"scores": s, "averages": avg}


def ruler_means(results: dict, lengths) -> dict[str, float | None]:
    """Per RULER task, the mean score (%) over ``lengths`` (null if a length has no score)."""
    out = {}
    for task, r in results.items():
        vals = [r.get(f"{n},none") for n in lengths]
        ok = all(v is not None and v >= 0 for v in vals)
        out[task] = 100.0 * _mean(vals) if ok and vals else None
    return out
