"""The paper's claims checked on recorded runs: each one holds, does not hold, is not measurable on
these runs, or was not run, with our numbers beside the paper's (docs/reproduction.md).

    python -m analysis claims runs/smollm2_mla [--out DIR]

Every comparison follows the rule of :mod:`analysis.noise`: a difference counts only when it is
larger than both the noise floor of the rows compared and its standard error (their *threshold*).

- **RoPE more sensitive** (§2.2, Table 4): R_P/R_C > 1 in every cell (corpus × seed) of an
  ``eval=sensitivity`` run at the paper's matched cache NMSE.
- **C4R4 nearly lossless** (Table 1): QuantMLA at C4R4 (protected) within 0.5 point of BF16 on the
  Suite A average: holds when Δ > −0.5 + threshold, does not hold when Δ < −0.5 − threshold.
- **Method order at C4R4** (Table 1): RTN < SmoothQuant† < QuaRot† < QuantMLA, the paper's
  convention (baselines unprotected, QuantMLA protected); each neighbouring pair resolved in order.
- **QuantMLA's lead at C2R4** (Table 1): QuantMLA above the best baseline, resolved.
- **Each Table 3 step adds accuracy**: + content, + RoPE, + protection, each step resolved and > 0.
- **RULER at long contexts** (Figure 4): QuantMLA above the best baseline at C4R4, at the longest
  length measured (mean over the S-NIAH tasks).
- **Cache size** (§3.3, App. C.5): bytes per token and layer of the C4R4 page layout for a 512 + 64
  latent, and the compression against BF16 at 4K and 128K tokens with 4 sink and 128 recent tokens
  kept in BF16 beside their quantized copies: computed from :class:`quantmla.kernels.PageFormat`.

The Suite A average is over the Table 1 columns that every compared row has (offline, FDA, SWDE and
SQuAD-completion have no packaged copy): the columns used are named beside the numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from analysis import metrics as M
from analysis import noise as N
from analysis import paper as PT
from analysis import render
from analysis.metrics import Value
from analysis.sensitivity import PAPER_TABLE4, sensitivity_runs
from quantmla.evals.averages import SUITES
from quantmla.tracking import scan_runs

VERDICTS = ("holds", "does not hold", "not measurable", "not run")
BASELINES = ("rtn", "smoothquant", "quarot")
ORDER = (*BASELINES, "quantmla")


@dataclass
class Claim:
    name: str
    claim: str
    paper: str
    ours: str = ""
    verdict: str = "not run"
    note: str = ""


def _ci(c: N.Comparison) -> str:
    """Δ and the threshold it is compared with."""
    t = "no floor" if c.floor is None else "no SE" if c.se is None else f"threshold {c.threshold:.2f}"
    return f"Δ {c.delta:+.2f} ({t})"


# --- Suite A ---------------------------------------------------------------------------------


@dataclass
class Score:
    """One configuration's Suite A average over the shared columns, and its noise-group spread."""

    value: Value
    spread: float | None


def _avg(vals: dict[str, Value], cols: tuple[str, ...]) -> Value:
    vs = [vals.get(c, Value(None)) for c in cols]
    if not vs or any(v.value is None for v in vs):
        return Value(None)
    ses = [v.se for v in vs]
    se = None if any(s is None for s in ses) else math.sqrt(sum(s * s for s in ses)) / len(vs)
    return Value(sum(v.value for v in vs) / len(vs), se, digits=2)


def suite_rows(runs: list[dict]) -> dict[tuple, PT.Row]:
    """Table 1's rows by (model, bits, method, protect); BF16 under (model, 'C16R16', None, False)."""
    got = PT.suite_table(runs, "suite_a")
    out = {}
    if got is None:
        return out
    for r in got[3]:
        if r.keys["bits"] == "C16R16":
            key = (r.keys["model"], "C16R16", None, False)
        else:
            key = (r.keys["model"], r.keys["bits"], r.keys["method"], bool(r.keys["protect"]))
        if key not in out or (out[key].keys.get("variant") and not r.keys.get("variant")):
            out[key] = r  # a method's own settings first; else the one variant recorded
    return out


def off_recipe(rows: list[PT.Row]) -> str:
    """A note naming the settings of compared rows that are not their method's defaults."""
    v = sorted({f"{PT.METHODS.get(r.keys['method'], r.keys['method'])} {r.keys['variant']}" for r in rows
                if r.keys.get("variant")})  # fmt: skip
    return "settings off the recipe: " + "; ".join(v) if v else ""


def shared_columns(rows: list[PT.Row]) -> tuple[str, ...]:
    """The Suite A tasks every row scored (all ten: the paper's Avg., equal weights)."""
    return tuple(t for t in SUITES["suite_a"] if all(r.values.get(t, Value(None)).value is not None for r in rows))


def score(r: PT.Row, cols: tuple[str, ...]) -> Score:
    per_run = [_avg(M.main(x["metrics"], x["config"]), cols) for x in r.runs]
    return Score(_avg(r.values, cols), N.spread([v.value for v in per_run]))


def _floor(scores: list[Score]) -> float | None:
    have = [s.spread for s in scores if s.spread is not None]
    return max(have) if have else None


def floor(rows: dict, model: str, *bits: str) -> float | None:
    """The noise floor of the average: its largest spread over the noise groups of ``model`` at ``bits``."""
    chosen = [r for k, r in rows.items() if k[0] == model and k[1] in bits]
    return _floor([score(r, shared_columns(chosen)) for r in chosen]) if chosen else None


def _tasks(cols: tuple[str, ...]) -> str:
    return (
        "Avg. of all ten tasks"
        if len(cols) == len(SUITES["suite_a"])
        else f"Avg. of {len(cols)} tasks: " + ", ".join(cols)
    )


def _models(rows: dict) -> list[str]:
    return list(dict.fromkeys(k[0] for k in rows))


PAPER_NEAR = "DeepSeek-V2-Lite Avg. 66.54 vs BF16 66.80 (Δ −0.26); Moonlight 73.44 vs 73.57 (Δ −0.13)"
PAPER_ORDER = "DeepSeek-V2-Lite Avg. 61.02 < 63.44 < 64.67 < 66.54"
PAPER_LEAD = "DeepSeek-V2-Lite Avg. 64.42 vs SmoothQuant† 57.22 (+7.20); Moonlight 72.70 vs 61.86 (+10.84)"


def near_lossless(rows: dict) -> list[Claim]:
    out = []
    for model in _models(rows):
        bf16, q = rows.get((model, "C16R16", None, False)), rows.get((model, "C4R4", "quantmla", True))
        c = Claim("near-lossless", f"C4R4 QuantMLA within 0.5 point of BF16 ({model})", PAPER_NEAR)
        if bf16 is None or q is None:
            out.append(c)
            continue
        cols = shared_columns([bf16, q])
        a, b = score(q, cols), score(bf16, cols)
        cmp = N.compare(a.value, b.value, floor(rows, model, "C4R4", "C16R16"))
        c.note = off_recipe([bf16, q])
        c.ours = f"{a.value.value:.2f} vs BF16 {b.value.value:.2f}, {_ci(cmp)}; {_tasks(cols)}"
        t = cmp.threshold
        if t is None:
            c.verdict = "not measurable"
            c.note = "; ".join(x for x in ("no noise floor or standard error for these rows", c.note) if x)
        elif cmp.delta > -0.5 + t:
            c.verdict = "holds"
        elif cmp.delta < -0.5 - t:
            c.verdict = "does not hold"
        else:
            c.verdict = "not measurable"
            c.note = "; ".join(x for x in (f"the threshold ({t:.2f}) is too wide to place Δ against −0.5", c.note) if x)
        out.append(c)
    return out


def _pairs(chain: list[tuple[str, Score]], floor: float | None) -> tuple[str, list[str]]:
    """Verdict and one phrase per neighbouring pair of ``chain`` (claimed ascending)."""
    words, wrong, unresolved = [], False, False
    for (na, a), (nb, b) in zip(chain, chain[1:]):
        cmp = N.compare(b.value, a.value, floor)
        if cmp.resolved:
            ok = cmp.delta > 0
            wrong |= not ok
            words.append(f"{nb} {'>' if ok else '<'} {na} ({cmp.delta:+.2f})")
        else:
            unresolved = True
            words.append(f"{nb} ≈ {na} ({_ci(cmp)})")
    return ("does not hold" if wrong else "not measurable" if unresolved else "holds"), words


def method_order(rows: dict) -> list[Claim]:
    out = []
    for model in _models(rows):
        c = Claim("order-c4r4", f"RTN < SmoothQuant† < QuaRot† < QuantMLA at C4R4 ({model})", PAPER_ORDER)
        chosen = [rows.get((model, "C4R4", m, m == "quantmla")) for m in ORDER]
        if any(r is None for r in chosen):
            out.append(c)
            continue
        cols = shared_columns(chosen)
        scores = [score(r, cols) for r in chosen]
        names = [PT.METHODS[m] for m in ORDER]
        c.verdict, words = _pairs(list(zip(names, scores)), floor(rows, model, "C4R4"))
        c.ours = "; ".join(words) + f" (Avg. {' / '.join(f'{s.value.value:.2f}' for s in scores)}; {_tasks(cols)})"
        same = [rows.get((model, "C4R4", m, True)) for m in ORDER]
        if all(r is not None for r in same):  # the fair comparison: every method protected
            ss = [score(r, cols) for r in same]
            v, w = _pairs(list(zip(names, ss)), floor(rows, model, "C4R4"))
            avg = " / ".join(f"{s.value.value:.2f}" for s in ss)
            c.note = f"all protected: {v} ({'; '.join(w)}; Avg. {avg})"
        c.note = "; ".join(x for x in (c.note, off_recipe(chosen)) if x)
        out.append(c)
    return out


def c2r4_lead(rows: dict) -> list[Claim]:
    out = []
    for model in _models(rows):
        c = Claim("lead-c2r4", f"QuantMLA leads every baseline widely at C2R4 ({model})", PAPER_LEAD)
        q = rows.get((model, "C2R4", "quantmla", True))
        base = [(m, rows.get((model, "C2R4", m, False))) for m in BASELINES]
        if q is None or any(r is None for _, r in base):
            out.append(c)
            continue
        cols, sq, best, cmp = _over_best(rows, model, q, base)
        c.ours = f"{sq.value.value:.2f} vs {PT.METHODS[best[0]]} {best[1].value.value:.2f}, {_ci(cmp)}; {_tasks(cols)}"
        c.verdict = ("holds" if cmp.delta > 0 else "does not hold") if cmp.resolved else "not measurable"
        c.note = "; ".join(x for x in (_lead_protected(rows, model, q), off_recipe([q] + [r for _, r in base])) if x)
        out.append(c)
    return out


def _over_best(rows: dict, model: str, q: PT.Row, base: list[tuple[str, PT.Row]]):
    """(columns, QuantMLA's score, (best baseline, its score), the comparison) of ``q`` against the
    best of ``base`` at C2R4, over the columns all of them have."""
    cols = shared_columns([q] + [r for _, r in base])
    bs = {m: score(r, cols) for m, r in base}
    best = max(bs, key=lambda m: bs[m].value.value)
    sq = score(q, cols)
    return cols, sq, (best, bs[best]), N.compare(sq.value, bs[best].value, floor(rows, model, "C2R4"))


def _lead_protected(rows: dict, model: str, q: PT.Row) -> str:
    """QuantMLA's C2R4 lead over the best baseline that is protected too (the paper's convention
    protects QuantMLA only, so part of its lead may be protection), naming the baselines not run so."""
    same = [(m, rows.get((model, "C2R4", m, True))) for m in BASELINES]
    have = [(m, r) for m, r in same if r is not None]
    if not have:
        return ""
    _, _, (best, bs), cmp = _over_best(rows, model, q, have)
    said = "lead" if cmp.resolved and cmp.delta > 0 else "behind" if cmp.resolved else "no resolved lead"
    missing = [PT.METHODS[m] for m, r in same if r is None]
    return f"over the baselines protected too: {said} (vs {PT.METHODS[best]} {bs.value.value:.2f}, {_ci(cmp)})" + (
        f"; {', '.join(missing)} protected not run" if missing else ""
    )


# --- Table 3, RULER, sensitivity, cache size ---------------------------------------------------


MMLU_CHANCE = 25.0  # four answer choices


def _at_chance(value: float | None, se: float | None) -> bool:
    """A score (%) within two standard errors of MMLU's chance level."""
    return value is not None and se is not None and abs(value - MMLU_CHANCE) <= 2 * se


def ablation(runs: list[dict]) -> list[Claim]:
    got = PT.table3(runs)
    paper = "MMLU 51.90 → 53.12 → 56.31 → 57.95 (+1.22, +3.19, +1.64; DeepSeek-V2-Lite)"
    if got is None:
        return [Claim("table3-steps", "Each Table 3 step adds accuracy", paper)]
    data = got[2]
    out = []
    for model, d in data.groupby("model", sort=False):
        c = Claim("table3-steps", f"Each Table 3 step adds accuracy ({model})", paper)
        bf16 = d[d["configuration"] == "BF16"]
        d = d[d["configuration"].isin(PT.STEPS[1:])]
        variants = list(dict.fromkeys(d["variant"]))
        chosen = "" if "" in variants else variants[0] if len(variants) == 1 else None
        d = d[d["variant"] == chosen]
        c.note = f"settings off the recipe: QuantMLA {chosen}" if chosen else ""
        words, wrong, unresolved = [], False, False
        if len(d) == len(PT.STEPS) - 1 and not d["step_delta"].isna().any():
            for _, s in d.iterrows():
                name = {PT.STEPS[1]: "content", PT.STEPS[2]: "RoPE", PT.STEPS[3]: "protection"}[s["configuration"]]
                if s["step_resolved"]:
                    wrong |= s["step_delta"] <= 0
                    words.append(f"+{name} {s['step_delta']:+.2f}")
                else:
                    unresolved = True
                    words.append(f"+{name} {s['step_delta']:+.2f} (not resolved)")
        steps = "MMLU steps: " + ", ".join(words) if words else ""
        v, se = (bf16["mmlu"].iloc[0], bf16["mmlu_se"].iloc[0]) if len(bf16) else (None, None)
        if _at_chance(v, se):
            c.verdict = "not measurable"
            chance = f"BF16 MMLU {v:.2f} ± {se:.2f}, at chance ({MMLU_CHANCE:.0f} %)"
            c.ours = "; ".join(x for x in (steps, chance) if x)
            why = "the unquantized model scores at chance, so no quantized step can add measurable accuracy"
            c.note = "; ".join(x for x in (c.note, why) if x)
        elif words:
            c.ours = steps
            c.verdict = "does not hold" if wrong else "not measurable" if unresolved else "holds"
        out.append(c)
    return out


def _ruler_at(run: dict, length: int) -> Value:
    """Mean over the S-NIAH tasks of one run at one length (%), with its standard error."""
    res = run["metrics"].get("results", {})
    vals = [r.get(f"{length},none") for r in res.values()]
    ses = [M.ruler_se(run["metrics"], task, length) for task in res]
    if not vals or any(v is None or v < 0 for v in vals):
        return Value(None)
    se = None if any(s is None for s in ses) else 100 * math.sqrt(sum(s * s for s in ses)) / len(ses)
    return Value(100 * sum(vals) / len(vals), se, digits=2)


def _ruler_score(r: PT.Row, length: int) -> Score:
    per_run = [_ruler_at(x, length) for x in r.runs]
    plain = [v for x, v in zip(r.runs, per_run) if N.unperturbed(x["config"])] or per_run
    return Score(plain[0], N.spread([v.value for v in per_run]))


def ruler(runs: list[dict]) -> list[Claim]:
    paper = "S-NIAH-3 87.20 vs the best baseline 79.80 (mean over 4K–32K); ahead at every length"
    got = PT.ruler_table(runs)
    if got is None:
        return [Claim("ruler-long", "QuantMLA ahead of the baselines on RULER at long contexts", paper)]
    out = []
    rows = {(r.keys["model"], r.keys["bits"], r.keys["method"], bool(r.keys["protect"])): r for r in got[3]}
    for model in dict.fromkeys(k[0] for k in rows):
        c = Claim("ruler-long", f"QuantMLA ahead of the baselines on RULER at long contexts ({model})", paper)
        q = rows.get((model, "C4R4", "quantmla", True))
        base = {m: rows.get((model, "C4R4", m, False)) for m in BASELINES}
        if q is None or any(r is None for r in base.values()):
            wanted = {"QuantMLA protected": q} | {f"{PT.METHODS[m]} unprotected": r for m, r in base.items()}
            c.note = f"C4R4 rows not run: {', '.join(k for k, r in wanted.items() if r is None)}"
            out.append(c)
            continue
        length = max(q.runs[0]["metrics"].get("settings", {}).get("lengths") or [0])

        sq, bs = _ruler_score(q, length), {m: _ruler_score(r, length) for m, r in base.items()}
        if sq.value.value is None or any(s.value.value is None for s in bs.values()):
            out.append(c)
            continue
        best = max(bs, key=lambda m: bs[m].value.value)
        cmp = N.compare(sq.value, bs[best].value, _floor([sq, *bs.values()]))
        c.ours = (
            f"at {length} tokens: {sq.value.value:.2f} vs {PT.METHODS[best]} {bs[best].value.value:.2f}, {_ci(cmp)}"
        )
        c.verdict = ("holds" if cmp.delta > 0 else "does not hold") if cmp.resolved else "not measurable"
        c.note = f"longest length the model allows: {length}"
        out.append(c)
    return out


def sensitivity(root: str | Path) -> list[Claim]:
    paper = "R_P/R_C 1.94–6.86 over six models (Table 4; DeepSeek-V2-Lite 6.33)"
    rs = [r for r in sensitivity_runs(root) if float(r["config"]["eval"].get("target_nmse", 0)) == 0.01]
    if not rs:
        return [Claim("rope-sensitivity", "The RoPE path is more sensitive than the content path", paper)]
    out = []
    for r in rs:
        m = r["metrics"]
        c = Claim("rope-sensitivity", f"The RoPE path is more sensitive than the content path ({r['label']})", paper)
        cells = {}
        for row in m["per_cell"]:
            cells.setdefault((row["dataset"], row["seed"]), []).append(row)
        ratios = [sum(x["R_P"] for x in v) / sum(x["R_C"] for x in v) for v in cells.values()]
        c.ours = (
            f"R_P/R_C {m['ratio']:.2f} (cells {min(ratios):.2f}–{max(ratios):.2f}); "
            f"r_ℓ > 1 in {m['layers_rope_above_content']} of {m['layers']} layers"
        )
        c.verdict = "holds" if min(ratios) > 1 else "does not hold" if max(ratios) < 1 else "not measurable"
        if r["model"] in PAPER_TABLE4:
            c.note = f"paper for this model: {PAPER_TABLE4[r['model']][2]:.2f}"
        out.append(c)
    return out


def cache_sizes(d_c: int = 512, d_r: int = 64, sink: int = 4, recent: int = 128) -> Claim:
    """C4R4's bytes per token and layer and its compression against BF16 at 4K and 128K tokens, from
    the page layout (:meth:`quantmla.kernels.PageFormat.request_bytes`, the paper's eq. 40: pages, the
    8-byte reverse map per page and the BF16 protection buffer)."""
    import torch

    from quantmla.cache import CacheSpec
    from quantmla.kernels import PageFormat

    q, bf16 = (PageFormat.from_spec(CacheSpec.parse(b), d_c, d_r, torch.bfloat16) for b in ("c4r4", "c16r16"))

    def ratio(n):
        return bf16.request_bytes(n) / q.request_bytes(n, sink, recent)

    r4, r128 = ratio(4096), ratio(131072)
    c = Claim(
        "cache-size",
        "C4R4 stores 320 B per token and layer; 3.22× smaller than BF16 at 4K, 3.59× at 128K",
        "320 B; 3.22× at 4K; 3.59× at 128K",
        f"{q.bytes_per_token} B (BF16 {bf16.bytes_per_token} B); {r4:.2f}× at 4K; {r128:.2f}× at 128K",
    )
    same = q.bytes_per_token == 320 and (round(r4, 2), round(r128, 2)) == (3.22, 3.59)
    c.verdict = "holds" if same else "does not hold"
    c.note = f"computed from the page layout for d_c {d_c}, d_r {d_r}, {sink} sink + {recent} recent tokens"
    return c


def check(root: str | Path) -> list[Claim]:
    """Every claim, in the order of the reproduction page."""
    runs = scan_runs(root).runs
    rows = suite_rows(runs)
    suite = []
    for build, name, text, paper in (
        (near_lossless, "near-lossless", "C4R4 QuantMLA within 0.5 point of BF16", PAPER_NEAR),
        (method_order, "order-c4r4", "RTN < SmoothQuant† < QuaRot† < QuantMLA at C4R4", PAPER_ORDER),
        (c2r4_lead, "lead-c2r4", "QuantMLA leads every baseline widely at C2R4", PAPER_LEAD),
    ):
        suite += build(rows) or [Claim(name, text, paper)]  # no Suite A runs: not run
    return sensitivity(root) + suite + ablation(runs) + ruler(runs) + [cache_sizes()]


def write(root: str | Path, out: str | Path | None = None) -> tuple[str, list[Path]]:
    """``claims.md`` and ``claims.csv`` in ``out`` (default ``<root>/paper``)."""
    claims = check(root)
    out = Path(out) if out else Path(root) / "paper"
    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame([asdict(c) for c in claims])
    text = df.drop(columns="name").rename(columns=str.capitalize)
    md = "\n".join(
        [
            "## The paper's claims on these runs",
            "",
            render.markdown(text),
            "",
            "Verdicts: " + ", ".join(VERDICTS) + ". " + N.RULE,
        ]
    )
    files = render.write_text(out / "claims.md", md) + render.csv(df, out / "claims.csv")
    return md, files
