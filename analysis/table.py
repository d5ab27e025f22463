"""model × method × bits tables of recorded runs: markdown, CSV and LaTeX, with standard errors, the
noise floor and which differences it resolves.

Rows never merge different runs: every config field that differs between the runs of the table
gets a column (method settings are summed up in ``variant``), and a row holds one configuration.
Runs that differ only in ``noise`` (:mod:`quantmla.noise`: the same configuration under an other
attention backend, batch size, evaluation order or calibration seed) are that configuration's noise
group: the row shows its unperturbed run (the mean of them, if repeated) and the group's spread
(max − min) is the noise floor of the row's comparison block. Runs that differ in nothing but the
fields named in ``over`` (e.g. seeds) share a row: it shows their mean, how many they are (``n``)
and the standard error of that mean, and the table says so.

The columns are chosen for the kind of evaluation (:mod:`analysis.metrics`): suite averages and
tasks, RULER tasks, perplexity and its token count; every other number of the records goes to
``details.csv``. Rows that compare (same model, bits, evaluation and settings; another method,
method setting or protection) form a block; in each metric the best row of a block and every row
whose difference from it is not resolved (:mod:`analysis.noise`) are bold, and ``comparisons.csv``
lists every pair with its Δ, noise floor, SE(Δ) and whether it is resolved. Rows scored off the
paper's protocol (a quick profile, limited items, shortened prompts, small calibration banks) say
so in ``profile``. Records that cannot be read are named below the table and left out; so are runs
that have not finished.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path

import pandas as pd
import yaml

from analysis import metrics as M
from analysis import noise as N
from analysis import render
from quantmla.tracking import identity, scan_runs

METHOD_ORDER = ("rtn", "smoothquant", "quarot", "quantmla")
KEYS = ("model", "method", "bits", "protect")
SHOWN = ("model.name", "method.name", "bits.name", "protect.enabled", "exact")
"""Config fields the fixed columns already show."""
BLOCK_FREE = ("method", "variant", "protect")
"""What may differ between the rows of one comparison block."""


def _nested(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_nested(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_fields(cfg: dict) -> dict:
    """A run's config as ``{"a.b": value}`` without the logging and noise fields, CxRy in one case."""
    flat = {k: v for k, v in _nested(identity(cfg)).items() if k not in N.FIELDS}
    flat["bits.name"] = str(flat.get("bits.name", "")).lower()
    flat.setdefault("exact", False)
    return flat


def _same(v) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def differing(fields: list[dict], skip=()) -> list[str]:
    """The fields whose value is not the same in every run (a field some runs lack counts)."""
    keys = sorted(set().union(*fields)) if fields else []
    return [k for k in keys if k not in skip and len({_same(f.get(k)) for f in fields}) > 1]


def _variant(method: dict) -> str:
    """The method settings of a run that differ from its conf/method/<name>.yaml (e.g. an ablation switch)."""
    default = _method_defaults(method.get("name"))
    if default is None:
        return ""
    got = _nested(method)
    return " ".join(f"{k}={got[k]}" for k in sorted(got) if k not in ("_target_", "name") and default.get(k) != got[k])


@cache
def _method_defaults(name) -> dict | None:
    path = _conf() / "method" / f"{name}.yaml"
    return _nested(yaml.safe_load(path.read_text()) or {}) if path.exists() else None


@lru_cache(maxsize=1)
def _conf() -> Path:
    from quantmla.run import conf_dir

    return conf_dir()


@lru_cache(maxsize=1)
def paper_calibration() -> dict:
    """The paper's calibration banks (conf/calibration/paper.yaml)."""
    return yaml.safe_load((_conf() / "calibration" / "paper.yaml").read_text())


def profile(cfg: dict, metrics: dict) -> str:
    """How a run departs from the paper's protocol, in a few words ("" where it does not)."""
    ev, notes = cfg.get("eval") or {}, []
    if ev.get("profile") == "quick":
        notes.append("quick eval")
    if ev.get("limit") is not None:
        notes.append(f"limit {ev['limit']:g}/task")
    if ev.get("max_length"):
        notes.append(f"prompts ≤ {ev['max_length']} tok")
    cal, paper = metrics.get("calibration"), paper_calibration()
    if isinstance(cal, dict) and any(
        cal.get(k) != paper.get(k) for k in ("source", "split", "seq_len", "train", "heldout")
    ):
        notes.append(f"calibration {cal.get('train')}+{cal.get('heldout')}×{cal.get('seq_len')} {cal.get('source')}")
    return ", ".join(notes)


def _bits_key(name: str) -> tuple:
    c, r = name.lower().lstrip("c").split("r")
    return (-int(c), -int(r))


@dataclass
class Row:
    """One configuration (or the mean of several, ``over``): its shown values, noise group and block."""

    keys: dict
    runs: list[dict]
    values: dict[str, M.Value]
    spread: dict[str, float | None]
    n: int
    profile: str = ""
    block: str = ""
    floor: dict[str, float | None] = field(default_factory=dict)
    best: dict[str, bool] = field(default_factory=dict)  # best, or not resolved from the best

    @property
    def label(self) -> str:
        k = self.keys
        parts = [k["method"] + (f" ({k['variant']})" if k.get("variant") else ""), k["bits"]]
        parts += ["protected" if k["protect"] else "unprotected"] if k["bits"] != "C16R16" else []
        parts += [f"{c}={v}" for c, v in k.items() if c not in (*KEYS, "variant", "exact", "model")]
        return " ".join(str(p) for p in parts)


def _mean_value(values: list[M.Value]) -> M.Value:
    have = [v for v in values if v.value is not None]
    if not have:
        return values[0]
    if len(have) == 1:
        return have[0]
    ses = [v.se for v in have]
    se = None if any(s is None for s in ses) else sum(ses) / len(ses)
    items = None  # repeats scored on the same items keep them, averaged item by item, for paired differences
    if all(v.items for v in have) and len({len(v.items) for v in have}) == 1:
        items = tuple(sum(xs) / len(xs) for xs in zip(*(v.items for v in have)))
    return M.Value(
        sum(v.value for v in have) / len(have), se, items, have[0].log, have[0].higher_better, have[0].digits
    )


def _configuration(runs: list[dict]) -> tuple[dict[str, M.Value], dict[str, float | None]]:
    """A noise group's shown values (its unperturbed runs', averaged) and spread per metric."""
    per_run = [M.main(r["metrics"], r["config"]) for r in runs]
    plain = [v for r, v in zip(runs, per_run) if N.unperturbed(r["config"])] or per_run
    names = list(dict.fromkeys(k for v in per_run for k in v))
    values = {k: _mean_value([v[k] for v in plain if k in v]) for k in names if any(k in v for v in plain)}
    spread = {k: N.spread([v[k].value for v in per_run if k in v]) for k in names}
    return values, spread


def seeds(r: Row, scale: dict[str, float] | None = None) -> tuple[int, dict[str, M.Value]]:
    """(number of calibration seeds, each metric's mean over them ± its standard error) of row ``r``:
    its unperturbed runs are seed 0 (the paper's downstream results, App. C), each ``noise.perturb=seed``
    variant another seed (repeats of one seed averaged first); SE = sample SD / √n. ``(0, {})``
    without a seed variant. ``scale`` multiplies metrics (e.g. a fraction into %), keyed by name."""
    by_seed: dict[str, list[dict[str, M.Value]]] = {}
    for x in r.runs:
        noise = x["config"].get("noise") or {}
        seed = "0" if N.unperturbed(x["config"]) else f"seed {noise.get('seed', 0)}"
        if seed == "0" or noise.get("perturb") == "seed":
            by_seed.setdefault(seed, []).append(M.main(x["metrics"], x["config"]))
    if len(by_seed) < 2 or "0" not in by_seed:
        return 0, {}
    out = {}
    for k in dict.fromkeys(k for vs in by_seed.values() for v in vs for k in v):
        per_seed = []
        for vs in by_seed.values():
            got = [v[k].value for v in vs if k in v and v[k].value is not None]
            per_seed.append(sum(got) / len(got) if got else None)
        if any(x is None for x in per_seed):
            continue
        f = (scale or {}).get(k, 1.0)
        out[k] = _mean_se([f * x for x in per_seed], next(v[k] for vs in by_seed.values() for v in vs if k in v))
    return len(by_seed), out


def rows(runs: list[dict], over: tuple[str, ...] = ()) -> list[Row]:
    """The table's rows in order (see the module's doc)."""
    fields = [config_fields(r["config"]) for r in runs]
    for k in over:
        if not any(k in f for f in fields):
            raise ValueError(f"no run has the config field '{k}' to average over")
    extra = [k for k in differing(fields, skip=SHOWN + over) if not k.startswith("method.")]
    groups: dict[str, list] = {}
    for r, f in zip(runs, fields):
        groups.setdefault(_same(f), []).append((r, f))
    configs: dict[str, list] = {}
    for members in groups.values():
        f = members[0][1]
        configs.setdefault(_same({k: v for k, v in f.items() if k not in over}), []).append(members)
    out = []
    for members_list in configs.values():
        r0, f0 = members_list[0][0]
        c = r0["config"]
        quantized = f0["bits.name"] != "c16r16"
        keys = {
            "model": c["model"]["name"],
            "method": c["method"]["name"],
            "variant": _variant(c["method"]),
            "bits": f0["bits.name"].upper(),
            "protect": bool(c.get("protect", {}).get("enabled", False)) and quantized,
            "exact": bool(c.get("exact", False)) and quantized,
        } | {k: _cell(f0.get(k)) for k in extra}
        per_config = [_configuration([r for r, _ in members]) for members in members_list]
        all_runs = [r for members in members_list for r, _ in members]
        if len(per_config) == 1:
            values, spread = per_config[0]
            n = len(all_runs)
        else:  # averaged over `over`: the mean of the configurations and its standard error
            names = list(dict.fromkeys(k for v, _ in per_config for k in v))
            values, spread = {}, {}
            for k in names:
                got = [v[k].value for v, _ in per_config if k in v and v[k].value is not None]
                first = next(v[k] for v, _ in per_config if k in v)
                values[k] = _mean_se(got, first)
                spreads = [s[k] for _, s in per_config if s.get(k) is not None]
                spread[k] = max(spreads) if spreads else None
            n = len(per_config)
        profiles = dict.fromkeys(profile(r["config"], r["metrics"]) for r in all_runs)
        out.append(Row(keys, all_runs, values, spread, n, "; ".join(p for p in profiles if p)))
    for r in out:
        r.block = _same({k: v for k, v in r.keys.items() if k not in BLOCK_FREE})
    out.sort(key=lambda r: _order(r, extra))
    mark(out)
    return out


def _mean_se(xs: list[float], like: M.Value) -> M.Value:
    """The mean of ``xs`` ± its standard error (sample SD / √n; none for one value), shown as ``like``."""
    mean = sum(xs) / len(xs) if xs else None
    se = _sd(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    return M.Value(mean, se, None, like.log, like.higher_better, like.digits)


def _sd(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _order(r: Row, extra: list[str]) -> tuple:
    k = r.keys
    m = METHOD_ORDER.index(k["method"]) if k["method"] in METHOD_ORDER else len(METHOD_ORDER)
    return (
        k["model"],
        _bits_key(k["bits"]),
        *(_sort_key(k[x]) for x in extra),
        m,
        k["method"],
        k["protect"],
        k["variant"],
    )


def blocks(rs: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rs:
        out.setdefault(r.block, []).append(r)
    return out


def mark(rs: list[Row]) -> None:
    """Set each row's block noise floor and which of its values are the block's best or not resolved from it."""
    for block in blocks(rs).values():
        names = list(dict.fromkeys(k for r in block for k in r.values))
        for k in names:
            floors = [r.spread.get(k) for r in block if r.spread.get(k) is not None]
            floor = max(floors) if floors else None
            for r in block:
                r.floor[k] = floor
            have = [r for r in block if k in r.values and r.values[k].value is not None]
            up = M.higher([r.values[k] for r in have])
            if up is None or len(have) < 2:
                continue
            best = (max if up else min)(have, key=lambda r: r.values[k].value)
            for r in have:
                c = N.compare(r.values[k], best.values[k], floor)
                r.best[k] = r is best or not c.resolved


def comparisons(rs: list[Row]) -> pd.DataFrame:
    """Every pair of rows of every block, per compared metric: Δ, noise floor, SE(Δ), resolved."""
    out = []
    for block in blocks(rs).values():
        for i, a in enumerate(block):
            for b in block[i + 1 :]:
                for k, va in a.values.items():
                    if k not in b.values or va.higher_better is None:
                        continue
                    c = N.compare(va, b.values[k], a.floor.get(k))
                    if c is None:
                        continue
                    out.append(
                        {
                            "model": a.keys["model"],
                            "a": a.label,
                            "b": b.label,
                            "metric": k,
                            "value_a": va.value,
                            "value_b": b.values[k].value,
                            "delta": c.delta,
                            "noise_floor": c.floor,
                            "se_delta": c.se,
                            "threshold": c.threshold,
                            "resolved": c.resolved,
                        }
                    )
    return pd.DataFrame(out)


def frame(root: str | Path, over: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per distinct run configuration under ``root`` (see the module's doc): the config columns,
    then per metric its value, ``<metric>_se``, ``<metric>_noise`` (the block's noise floor) and
    ``<metric>_tied`` (best of its block or not resolved from it)."""
    return _frame(rows(scan_runs(root).runs, tuple(over)))


def _frame(rs: list[Row]) -> pd.DataFrame:
    if not rs:
        return pd.DataFrame(columns=list(KEYS))
    df = pd.DataFrame([_record(r) for r in rs])
    keys = [c for c in rs[0].keys]
    if not df.duplicated(subset=keys).any():  # the config columns tell every row apart
        df = df.drop(columns=["run"])
    for col in ("variant", "exact", "profile"):  # shown only where some row has one
        if not df[col].astype(bool).any():
            df = df.drop(columns=[col])
    if (df["n"] == 1).all():
        df = df.drop(columns=["n"])
    empty = [c for c in df.columns if c.endswith("_tied") and df[c].isna().all()]
    return df.drop(columns=empty).reset_index(drop=True)


def _record(r: Row) -> dict:
    out = dict(r.keys) | {"profile": r.profile, "n": r.n, "run": " ".join(Path(x["dir"]).name for x in r.runs)}
    for k, v in r.values.items():
        out[k] = v.value
        if v.higher_better is not None:
            out[f"{k}_se"] = v.se
            out[f"{k}_noise"] = r.floor.get(k)
            out[f"{k}_tied"] = r.best.get(k)
    return out


def details(rs: list[Row]) -> pd.DataFrame:
    """Every number of every record that the table does not show, one per line."""
    out = []
    for r in rs:
        for run in r.runs:
            noise = run["config"].get("noise") or {}
            for k, v in M.details(run["metrics"]).items():
                out.append(
                    {"run": Path(run["dir"]).name, "row": f"{r.keys['model']} {r.label}"}
                    | {"noise": f"{noise.get('perturb', 'none')} {noise.get('seed', 0)}", "metric": k, "value": v}
                )
    return pd.DataFrame(out, columns=["run", "row", "noise", "metric", "value"])


def _cell(v):
    return _same(v) if isinstance(v, (list, dict)) else v


def _sort_key(v) -> tuple:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v))


def profile_note(runs: list[dict]) -> str:
    """A line naming the profiles other than ``full`` the runs were made with (conf/profile/), or ''."""
    profiles = sorted({str(r["config"].get("profile", "full")) for r in runs} - {"full"})
    if not profiles:
        return ""
    return (
        f"Made with profile={', '.join(profiles)} (a check on a small budget): not comparable to the paper's numbers."
    )


def notes(rs: list[Row], over: tuple[str, ...], scan) -> list[str]:
    """What a reader must know besides the rows: the rule, averaged runs, damaged and unfinished records."""
    out = []
    if any(v.higher_better is not None for r in rs for v in r.values.values()):
        out.append(
            "value ± standard error; **bold**: the best row of its block in that column, or not resolved from it. "
            + N.RULE
        )
        out += _floor_notes(rs)
    if over and any(r.n > 1 for r in rs):
        out.append(
            f"Rows average runs that differ only in {', '.join(over)}: n runs each, metric = mean, "
            "metric_se = standard error of the mean."
        )
    elif any(r.n > 1 for r in rs):
        out.append(
            "Rows of n > 1 runs: the same configuration, repeated or perturbed (noise floor); value = unperturbed mean."
        )
    if any(r.profile for r in rs):
        out.append(
            "profile: how a row departs from the paper's protocol (quick eval, item limit, prompt cut, calibration banks)."
        )
    if scan is not None:
        smoke = profile_note(scan.runs)
        if smoke:
            out.append(smoke)
        if scan.unfinished:
            states = ", ".join(f"{n} {state}" for state, n in sorted(scan.unfinished.items()))
            out.append(f"Not finished, not in the table: {states}.")
        for path, why in scan.damaged:
            out.append(f"Damaged, not in the table: {path} ({why}).")
    return out


def _floor_notes(rs: list[Row]) -> list[str]:
    out = []
    for block in blocks(rs).values():
        measured = [r for r in block if any(s is not None for s in r.spread.values())]
        k0 = block[0].keys
        bits = {r.keys["bits"] for r in block}  # Table 3's block holds the BF16 row beside the C4R4 ones
        where = (
            k0["model"]
            + (f" {k0['bits']}" if len(bits) == 1 else "")
            + "".join(f" {c}={v}" for c, v in k0.items() if c not in (*KEYS, *BLOCK_FREE, "exact"))
        )
        if measured:
            out.append(
                f"Noise floor of {where}: measured on " + "; ".join(f"{r.label} ({r.n} runs)" for r in measured) + "."
            )
        elif len(block) > 1:
            out.append(f"Noise floor of {where}: not measured (no configuration run twice): no difference is resolved.")
    return out


def display(rs: list[Row]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(cells as text, bold mask): the rows, and under each block a noise-floor row where one is known."""
    df = _frame(rs)
    keys = [c for c in df.columns if c in rs[0].keys or c in ("profile", "n", "run")]
    metrics = [k for k in dict.fromkeys(k for r in rs for k in r.values) if k in df.columns]
    compared = [k for k in metrics if any(r.values[k].higher_better is not None for r in rs if k in r.values)]
    text, bold = [], []
    for block in blocks(rs).values():
        for r in block:
            row = {c: _text(v) for c, v in _record(r).items() if c in keys}
            row |= {k: render.number(r.values[k]) if k in r.values else "" for k in metrics}
            text.append(row)
            bold.append({c: bool(r.best.get(c)) for c in row})
        floors = {k: block[0].floor.get(k) for k in compared}
        if any(f is not None for f in floors.values()):
            row = {c: "" for c in keys} | {"method": "noise floor"} | {k: "" for k in metrics}
            row |= {k: render.spread(f) for k, f in floors.items()}
            text.append(row)
            bold.append({c: False for c in row})
    return pd.DataFrame(text, columns=keys + metrics), pd.DataFrame(bold, columns=keys + metrics)


def _text(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return str(v)


def write(root: str | Path, out: str | Path | None = None, over: tuple[str, ...] = ()) -> tuple[str, list[Path]]:
    """Render the table of ``root`` into ``out`` (default ``root``): table.md/.csv/.tex, comparisons.csv
    and details.csv (the numbers the table leaves out)."""
    scan = scan_runs(root)
    rs = rows(scan.runs, tuple(over))
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    lines = notes(rs, tuple(over), scan)
    if not rs:
        md = "(no finished runs)" + "".join(f"\n- {x}" for x in lines)
        return md, render.write_text(out / "table.md", md)
    text, bold = display(rs)
    files = render.table(text, bold, out / "table", lines, title=f"Runs under {Path(root).name}")
    files += render.csv(_frame(rs), out / "table.csv")
    files += render.csv(comparisons(rs), out / "comparisons.csv")
    files += render.csv(details(rs), out / "details.csv")
    return (out / "table.md").read_text().rstrip("\n"), files
