"""Table 9 and a Figure 5b-style plot from ``bench/table9.py`` records, beside the paper's numbers.

``python -m analysis latency bench/results/table9-<date>.json [...] [--out DIR]`` (default
``runs/latency``) reads one or more records (e.g. the default P·V and ``--pv bf16``), prints Table 9 in the paper's layout with
one Δ column per record, and draws latency and Δ against context length for batch 8 and 32, with
the paper's (App. F.1: a 78-SM Hopper GPU against FlashMLA) dashed.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analysis import render  # noqa: E402
from analysis.paper_numbers import TABLE9, context_label  # noqa: E402

KEYS = ("B", "N", "c16r16_us", "c4r4_us", "delta_pct")


def load(path: str | Path) -> dict:
    """One ``bench/table9.py`` record; a clear error for anything else."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON record ({e})") from None
    rows = rec.get("rows") if isinstance(rec, dict) else None
    if not rows or not all(isinstance(r, dict) and all(k in r for k in KEYS) for r in rows):
        raise ValueError(f"{path}: not a bench/table9.py record (needs rows with {', '.join(KEYS)})")
    rec["label"] = f"{rec.get('gpu', '?')}, P·V {rec.get('pv', 'default')} ({path.stem})"
    return rec


def frame(records: list[dict]) -> pd.DataFrame:
    """One row per (batch, N) and record: our latencies and Δ, the paper's where it has the point."""
    out = []
    for rec in records:
        for r in rec["rows"]:
            paper = TABLE9.get((r["B"], r["N"]), (None, None, None))
            out.append(
                {
                    "record": rec["label"],
                    "B": r["B"],
                    "N": r["N"],
                    "bf16_us": r["c16r16_us"],
                    "c4r4_us": r["c4r4_us"],
                    "delta_pct": r["delta_pct"],
                    "paper_bf16_us": paper[0],
                    "paper_c4r4_us": paper[1],
                    "paper_delta_pct": paper[2],
                }
            )
    return pd.DataFrame(out)


def table(df: pd.DataFrame) -> str:
    """Table 9's layout: per (batch, N), each record's Δ and the paper's BF16, C4R4 and Δ."""
    labels = list(dict.fromkeys(df["record"]))
    head = (
        "| batch | N | "
        + " | ".join(f"Δ (%), {lab}" for lab in labels)
        + " | paper BF16 (µs) | paper C4R4 (µs) | paper Δ (%) |"
    )
    lines = [head, "|" + "---|" * (len(labels) + 5)]
    for (b, n), g in df.groupby(["B", "N"], sort=True):
        deltas = [g.loc[g["record"] == lab, "delta_pct"] for lab in labels]
        cells = [f"{d.iloc[0]:+.2f}" if len(d) else "—" for d in deltas]
        p = TABLE9.get((b, n))
        paper = [f"{p[0]:.2f}", f"{p[1]:.2f}", f"{p[2]:+.2f}"] if p else ["—"] * 3
        lines.append(f"| {b} | {context_label(n)} | " + " | ".join(cells + paper) + " |")
    return "\n".join(lines) + "\n"


def figure(df: pd.DataFrame, stem: Path) -> list[Path]:
    """:func:`draw` saved as ``<stem>.png`` and ``<stem>.pdf``."""
    fig = draw(df)
    out = []
    for ext in ("png", "pdf"):
        fig.savefig(stem.with_suffix(f".{ext}"), dpi=120, bbox_inches="tight")
        out.append(stem.with_suffix(f".{ext}"))
    plt.close(fig)
    return out


def draw(df: pd.DataFrame):
    """Latency (top) and Δ (bottom) against N, one column per batch; the paper's dashed. Every series
    has its own colour (render.colours) and the legend sits below the axes."""
    batches = sorted(df["B"].unique())
    records = list(dict.fromkeys(df["record"]))
    colour = dict(zip(["BF16"] + records, render.colours(len(records) + 1)))
    fig, ax = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 7), sharex=True, squeeze=False)
    paper = pd.DataFrame([(b, n, *v) for (b, n), v in TABLE9.items()], columns=["B", "N", "bf16", "c4r4", "delta"])
    for j, b in enumerate(batches):
        top, bottom = ax[0, j], ax[1, j]
        p = paper[paper["B"] == b].sort_values("N")
        top.plot(p["N"], p["bf16"], "k--", lw=1, label="paper BF16")
        top.plot(p["N"], p["c4r4"], ":", c="gray", lw=1.2, label="paper C4R4")
        bottom.plot(p["N"], p["delta"], "k--", lw=1, label="paper Δ")
        for i, label in enumerate(records):
            g = df[(df["B"] == b) & (df["record"] == label)].sort_values("N")
            if i == 0:
                top.plot(g["N"], g["bf16_us"], "o-", c=colour["BF16"], ms=3, label=f"BF16, {label}")
            top.plot(g["N"], g["c4r4_us"], "s-", c=colour[label], ms=3, label=f"C4R4, {label}")
            bottom.plot(g["N"], g["delta_pct"], "s-", c=colour[label], ms=3, label=f"Δ, {label}")
        top.set(xscale="log", yscale="log", ylabel="latency (µs)", title=f"batch {b}, 16 heads")
        bottom.axhline(0, c="gray", lw=0.5)
        bottom.set(xscale="log", xlabel="context N (tokens)", ylabel="Δ = C4R4 / BF16 − 1 (%)")
        bottom.set_xticks(sorted(df["N"].unique()), [context_label(n) for n in sorted(df["N"].unique())], minor=False)
        bottom.tick_params(axis="x", labelrotation=45)
    fig.tight_layout()
    handles, labels = ax[0, 0].get_legend_handles_labels()
    more = [(h, lab) for h, lab in zip(*ax[1, 0].get_legend_handles_labels()) if lab == "paper Δ"]
    fig.legend(
        handles + [h for h, _ in more], labels + [lab for _, lab in more],
        loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8, frameon=False,
    )  # fmt: skip
    return fig


def write(paths: list[str | Path], out: str | Path | None = None) -> tuple[str, list[Path]]:
    records = [load(p) for p in paths]
    out = Path(out) if out else Path("runs/latency")
    out.mkdir(parents=True, exist_ok=True)
    df = frame(records)
    md = "# Table 9's protocol: decode latency, C4R4 against BF16\n\n" + table(df)
    files = [out / "table9.md", out / "table9.csv", *figure(df, out / "table9")]
    files[0].write_text(md)
    df.to_csv(files[1], index=False)
    return md, files
