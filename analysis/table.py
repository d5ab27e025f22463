"""model × method × bits tables of recorded metrics (markdown and CSV)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from quantmla.tracking import numeric_metrics, read_runs

METHOD_ORDER = ("rtn", "smoothquant", "quarot", "quantmla")
KEYS = ("model", "method", "bits", "protect")
SKIP = {"tokens", "windows"}


def _nested(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_nested(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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


def frame(root: str | Path) -> pd.DataFrame:
    """One row per (model, method, bits, protect) with every numeric metric of its runs (apart by
    method variant and by ``exact`` where runs differ in them)."""
    runs = read_runs(root)
    evals = {r["config"].get("eval", {}).get("name", "eval") for r in runs}
    rows = []
    for r in runs:
        c = r["config"]
        quantized = c["bits"]["name"].lower() != "c16r16"
        row = {
            "model": c["model"]["name"],
            "method": c["method"]["name"],
            "variant": _variant(c["method"]),
            "bits": c["bits"]["name"].upper(),
            "protect": bool(c.get("protect", {}).get("enabled", False)) and quantized,
            "exact": bool(c.get("exact", False)) and quantized,
        }
        ename = c.get("eval", {}).get("name", "eval")
        for k, v in numeric_metrics(r["metrics"]).items():
            if k in SKIP:
                continue
            row[k if len(evals) == 1 else f"{ename}/{k}"] = v
        rows.append(row)
    if not rows:
        return pd.DataFrame(columns=list(KEYS))
    keys = list(KEYS[:2]) + ["variant"] + list(KEYS[2:]) + ["exact"]  # runs with other settings stay apart
    df = pd.DataFrame(rows).groupby(keys, sort=False, dropna=False).first().reset_index()
    for extra in ("variant", "exact"):  # shown only where some run has one
        if not df[extra].astype(bool).any():
            df = df.drop(columns=[extra])
    df["_m"] = df["method"].map(lambda m: METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER))
    df["_b"] = df["bits"].map(_bits_key)
    df = df.sort_values(["model", "_b", "_m", "method", "protect"]).drop(columns=["_m", "_b"])
    return df.reset_index(drop=True)


def markdown(df: pd.DataFrame, digits: int = 4) -> str:
    def cell(v):
        if isinstance(v, float):
            return "" if pd.isna(v) else f"{v:.{digits}g}" if abs(v) >= 1e4 else f"{v:.{digits}f}"
        return str(v)

    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def write(root: str | Path, out: str | Path | None = None) -> tuple[str, Path]:
    """Render the table of ``root``; write ``table.md`` and ``table.csv`` into ``out`` (default ``root``)."""
    df = frame(root)
    out = Path(out or root)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(df)
    (out / "table.md").write_text(md + "\n")
    df.to_csv(out / "table.csv", index=False)
    return md, out
