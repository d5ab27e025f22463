"""Which numbers of a run record a table shows, by the kind of evaluation, with their standard errors.

- a suite (``eval=suite_a|suite_b``): the paper's average, CS (Suite A) and each task's score (%),
  standard errors from lm-eval's per-task ``*_stderr`` (an average's from its tasks', as independent);
- RULER: each task's mean over the lengths (%) and their average;
- other lm-eval runs: each requested task's metrics that lm-eval gives a standard error for;
- perplexity: ``ppl`` with its standard error over windows (and the per-window NLLs, for paired
  differences) and the number of tokens scored;
- anything else: the record's top-level numbers.

Every other number of the record (subtasks, sample counts, method diagnostics such as a chosen α)
is a *detail*: tables write them to a separate file, never among the compared columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantmla.evals.averages import COMMONSENSE, SUITES
from quantmla.evals.ruler import VARIANTS
from quantmla.tracking import numeric_metrics


@dataclass(frozen=True)
class Value:
    """One shown number: its standard error (None: not known), the per-item values it is the mean of
    (``log``: it is exp of their mean, as a perplexity) for paired differences, and which way is better
    (None: no direction, e.g. a count)."""

    value: float | None
    se: float | None = None
    items: tuple[float, ...] | None = None
    log: bool = False
    higher_better: bool | None = True
    digits: int = 4  # decimals shown


PCT = 2  # decimals of a percentage

LOWER_BETTER = ("perplexity", "bits_per_byte", "ppl", "nll")
SCORES = ("acc", "acc_norm", "exact_match", "contains", "f1", "em", "mcc", "pass@1", "math_verify", "bleu", "rouge")


def _num(x) -> float | None:
    return None if x is None or isinstance(x, bool) or (isinstance(x, float) and math.isnan(x)) else float(x)


def _stderr_key(metric: str) -> str:
    name, _, flt = metric.partition(",")
    return f"{name}_stderr,{flt}" if flt else f"{name}_stderr"


def _mean_se(ses: list[float | None], weights: list[float]) -> float | None:
    if any(s is None for s in ses):
        return None
    return math.sqrt(sum((w * s) ** 2 for w, s in zip(weights, ses)))


def suite(metrics: dict, name: str) -> dict[str, Value]:
    tasks = SUITES[name]
    results, scores = metrics.get("results", {}), metrics.get("scores", {})
    se = {t: _num(results.get(t, {}).get(_stderr_key(m))) for t, m in tasks.items()}
    se = {t: None if s is None else 100 * s for t, s in se.items()}
    avg = metrics.get("averages", {})
    n = len(tasks)
    out = {"avg": Value(_num(avg.get("avg")), _mean_se([se[t] for t in tasks], [1 / n] * n), digits=PCT)}
    if name == "suite_a":
        out["cs"] = Value(_num(avg.get("cs")), _mean_se([se[t] for t in COMMONSENSE], [1 / 5] * 5), digits=PCT)
    for t in tasks:
        out[t] = Value(_num(scores.get(t)), se[t] if _num(scores.get(t)) is not None else None, digits=PCT)
    return out


def ruler_se(metrics: dict, task: str, length) -> float | None:
    """A RULER task's standard error (a fraction) at one length: lm-eval's, from the record. A record
    made before the harness had lm-eval compute it has none; for a task whose samples each score 0 or 1
    (one value asked: :data:`quantmla.evals.ruler.VARIANTS`) it is then √(p(1 − p)/(n − 1)) from the
    score p and the samples per length n, which is what lm-eval's ``mean_stderr`` gives for such scores."""
    r = metrics.get("results", {}).get(task, {})
    se = _num(r.get(f"{length}_stderr,none"))
    if se is not None:
        return se
    p, n = _num(r.get(f"{length},none")), metrics.get("settings", {}).get("samples")
    v = VARIANTS.get(task)
    scored_0_or_1 = v is not None and v.n_values == 1 and v.n_queries == 1
    if not scored_0_or_1 or p is None or p < 0 or not n or n < 2:
        return None
    return math.sqrt(p * (1 - p) / (n - 1))


def ruler(metrics: dict) -> dict[str, Value]:
    lengths = [str(n) for n in metrics.get("settings", {}).get("lengths", [])]
    out = {}
    for task, mean in metrics["mean"].items():
        ses = [ruler_se(metrics, task, n) for n in lengths]
        w = [100 / len(lengths)] * len(lengths) if lengths else []
        out[task] = Value(_num(mean), _mean_se(ses, w) if ses else None, digits=PCT)
    if out:
        vals = [v.value for v in out.values()]
        ses = [v.se for v in out.values()]
        have = None if any(v is None for v in vals) else sum(vals) / len(vals)
        out = {"avg": Value(have, _mean_se(ses, [1 / len(vals)] * len(vals)), digits=PCT)} | out
    return out


def _direction(metric: str) -> bool | None:
    name = metric.partition(",")[0]
    if any(w in name for w in LOWER_BETTER):
        return False
    return True if name in SCORES or name.startswith(SCORES) else None


def lm_eval(metrics: dict, config: dict) -> dict[str, Value]:
    asked = [t if isinstance(t, str) else t.get("task") for t in (config.get("eval", {}).get("tasks") or [])]
    results = metrics.get("results", {})
    out = {}
    for task in [t for t in asked if t in results] or list(results):
        r = results[task]
        for metric, v in r.items():
            if "_stderr" in metric or _stderr_key(metric) not in r:
                continue
            name, _, flt = metric.partition(",")
            label = f"{task} {name}" + (f" ({flt})" if flt and flt != "none" else "")
            out[label] = Value(_num(v), _num(r.get(_stderr_key(metric))), higher_better=_direction(metric))
    return out


def perplexity(metrics: dict) -> dict[str, Value]:
    items = metrics.get("window_nll")
    se = _num(metrics.get("ppl_se"))
    if se is None and items and len(items) > 1:
        mean = sum(items) / len(items)
        sd = math.sqrt(sum((x - mean) ** 2 for x in items) / (len(items) - 1))
        se = metrics["ppl"] * sd / math.sqrt(len(items))
    out = {"ppl": Value(_num(metrics["ppl"]), se, tuple(items) if items else None, log=True, higher_better=False)}
    if "tokens" in metrics:  # the text scored, stated beside the perplexity
        out["tokens"] = Value(_num(metrics["tokens"]), higher_better=None, digits=0)
    return out


def main(metrics: dict, config: dict) -> dict[str, Value]:
    """The numbers a table compares for one run (see the module's doc)."""
    name = (config.get("eval") or {}).get("suite") or (metrics.get("settings") or {}).get("suite")
    if "scores" in metrics and name in SUITES:
        return suite(metrics, name)
    if "mean" in metrics and isinstance(metrics["mean"], dict):
        return ruler(metrics)
    if isinstance(metrics.get("results"), dict):
        return lm_eval(metrics, config)
    if "ppl" in metrics:
        return perplexity(metrics)
    return {
        k: Value(_num(v), higher_better=None)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


SHOWN = {"ppl", "ppl_se", "nll", "nll_se", "tokens", "averages/avg", "averages/cs"}


def details(metrics: dict) -> dict[str, float]:
    """Every number of the record that no table column shows (subtasks, counts, method diagnostics)."""
    flat = numeric_metrics(metrics)
    return {k: v for k, v in flat.items() if k not in SHOWN and not k.startswith("scores/")}


def higher(values: list[Value]) -> bool | None:
    """The direction shared by a column's values (None if any has none)."""
    dirs = {v.higher_better for v in values}
    return dirs.pop() if len(dirs) == 1 else None
