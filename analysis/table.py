"""model × method × bits tables of recorded metrics (markdown and CSV).

Rows never merge different runs: every config field that differs between the runs of the table
gets a column (method settings are summed up in ``variant``), and a row holds one run. Only runs
that differ in nothing but the fields named in ``over`` (e.g. seeds), or that are the same
configuration recorded twice, share a row: it then shows their mean, how many they are (``n``) and
the standard error of the mean (``<metric>_se``), and the table says so. Records that cannot be
read are named below the table and left out; so are runs that have not finished.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import yaml

from quantmla.files import write_atomic
from quantmla.tracking import identity, numeric_metrics, scan_runs

METHOD_ORDER = ("rtn", "smoothquant", "quarot", "quantmla")
KEYS = ("model", "method", "bits", "protect")
SKIP = {"tokens", "windows"}
SHOWN = ("model.name", "method.name", "bits.name", "protect.enabled", "exact")
"""Config fields the fixed columns already show."""


def _nested(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_nested(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_fields(cfg: dict) -> dict:
    """A run's config as ``{"a.b": value}`` without the logging fields, CxRy in one case."""
    flat = _nested(identity(cfg))
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
    from quantmla.run import conf_dir

    path = conf_dir() / "method" / f"{method.get('name')}.yaml"
    if not path.exists():
        return ""
    default = _nested(yaml.safe_load(path.read_text()) or {})
    got = _nested(method)
    return " ".join(f"{k}={got[k]}" for k in sorted(got) if k not in ("_target_", "name") and default.get(k) != got[k])


def _bits_key(name: str) -> tuple:
    c, r = name.lower().lstrip("c").split("r")
    return (-int(c), -int(r))


def frame(root: str | Path, over: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per distinct run configuration under ``root`` (see the module's doc); ``over``: the
    config fields (``seed``, ``model.seed``) over which runs that differ in nothing else are averaged."""
    return _frame(scan_runs(root).runs, tuple(over))


def _frame(runs: list[dict], over: tuple[str, ...]) -> pd.DataFrame:
    fields = [config_fields(r["config"]) for r in runs]
    for k in over:
        if not any(k in f for f in fields):
            raise ValueError(f"no run has the config field '{k}' to average over")
    evals = {r["config"].get("eval", {}).get("name", "eval") for r in runs}
    extra = [k for k in differing(fields, skip=SHOWN + over) if not k.startswith("method.")]
    rows = []
    for r, f in zip(runs, fields):
        c = r["config"]
        quantized = f["bits.name"] != "c16r16"
        row = {
            "model": c["model"]["name"],
            "method": c["method"]["name"],
            "variant": _variant(c["method"]),
            "bits": f["bits.name"].upper(),
            "protect": bool(c.get("protect", {}).get("enabled", False)) and quantized,
            "exact": bool(c.get("exact", False)) and quantized,
        }
        row |= {k: _cell(f.get(k)) for k in extra}
        row["_group"] = _same({k: v for k, v in f.items() if k not in over})
        row["run"] = Path(r["dir"]).name
        ename = c.get("eval", {}).get("name", "eval")
        for k, v in numeric_metrics(r["metrics"]).items():
            if k not in SKIP:
                row[k if len(evals) == 1 else f"{ename}/{k}"] = v
        rows.append(row)
    keys = ["model", "method", "variant", "bits", "protect", "exact", *extra]
    if not rows:
        return pd.DataFrame(columns=list(KEYS))
    df = pd.DataFrame(rows)
    metrics = [c for c in df.columns if c not in keys and c not in ("_group", "run")]
    if over or df["_group"].duplicated().any():
        df = _aggregate(df, keys, metrics)
    df = df.drop(columns=["_group"])
    if not df.duplicated(subset=keys).any():  # the config columns tell every row apart
        df = df.drop(columns=["run"])
    for col in ("variant", "exact"):  # shown only where some run has one
        if not df[col].astype(bool).any():
            df = df.drop(columns=[col])
    df["_m"] = df["method"].map(lambda m: METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER))
    df["_b"] = df["bits"].map(_bits_key)
    order = ["model", "_b", "_m", "method", "protect"]
    for i, k in enumerate(extra):
        df[f"_x{i}"] = df[k].map(_sort_key)
        order.append(f"_x{i}")
    df = df.sort_values(order).drop(columns=[c for c in df.columns if c.startswith("_")])
    return df.reset_index(drop=True)


def _aggregate(df: pd.DataFrame, keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per ``_group``: the mean of each metric, ``n`` and the standard error ``<metric>_se``."""
    out = []
    for _, g in df.groupby("_group", sort=False):
        row = {k: g[k].iloc[0] for k in keys} | {"_group": g["_group"].iloc[0], "n": len(g)}
        row["run"] = " ".join(g["run"])
        for m in metrics:
            v = g[m].dropna()
            row[m] = v.mean() if len(v) else math.nan
            row[f"{m}_se"] = v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else math.nan
        out.append(row)
    return pd.DataFrame(out)


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


def notes(df: pd.DataFrame, over: tuple[str, ...], scan) -> list[str]:
    """What a reader must know besides the rows: averaged runs, damaged and unfinished records."""
    out = []
    if "n" in df.columns:
        what = f"runs that differ only in {', '.join(over)}" if over else "runs of the same configuration"
        out.append(f"Rows average {what}: n runs each, metric = mean, metric_se = standard error of the mean.")
    smoke = profile_note(scan.runs)
    if smoke:
        out.append(smoke)
    if scan.unfinished:
        states = ", ".join(f"{n} {state}" for state, n in sorted(scan.unfinished.items()))
        out.append(f"Not finished, not in the table: {states}.")
    for path, why in scan.damaged:
        out.append(f"Damaged, not in the table: {path} ({why}).")
    return out


def markdown(df: pd.DataFrame, digits: int = 4) -> str:
    def cell(v):
        if isinstance(v, float):
            return "" if pd.isna(v) else f"{v:.{digits}g}" if abs(v) >= 1e4 else f"{v:.{digits}f}"
        return str(v)

    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def write(root: str | Path, out: str | Path | None = None, over: tuple[str, ...] = ()) -> tuple[str, Path]:
    """Render the table of ``root``; write ``table.md`` and ``table.csv`` into ``out`` (default ``root``)."""
    scan = scan_runs(root)
    df = _frame(scan.runs, tuple(over))
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(df)
    lines = notes(df, tuple(over), scan)
    if lines:
        md += "\n\n" + "\n".join(f"- {line}" for line in lines)
    write_atomic(out / "table.md", md + "\n")
    write_atomic(out / "table.csv", df.to_csv(index=False))
    return md, out
