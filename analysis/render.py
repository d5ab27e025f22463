"""Writing tables and figures: markdown, CSV and LaTeX through pandas (``to_markdown`` needs
``tabulate``, ``Styler.to_latex`` needs ``jinja2``), figures as PNG and PDF with the legend outside
the axes and one distinct colour per series."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from quantmla.files import write_atomic  # noqa: E402


def number(v) -> str:
    """``value ± se`` of an :class:`analysis.metrics.Value` (``n/a`` when it has no value)."""
    if v.value is None or (isinstance(v.value, float) and math.isnan(v.value)):
        return "n/a"
    text = f"{v.value:.{v.digits}f}"
    if v.higher_better is not None and v.se is not None and not math.isnan(v.se):
        text += f" ± {v.se:.2g}"
    return text


def spread(x: float | None) -> str:
    return "not measured" if x is None else f"{x:.2g}"


def write_text(path: Path, text: str) -> list[Path]:
    write_atomic(path, text if text.endswith("\n") else text + "\n")
    return [path]


def csv(df: pd.DataFrame, path: Path) -> list[Path]:
    return write_text(path, df.to_csv(index=False))


def markdown(text: pd.DataFrame, bold: pd.DataFrame | None = None) -> str:
    """A pipe table of text cells (bold where ``bold`` is true), numbers left as formatted."""
    if bold is not None:
        text = text.copy()
        for c in text.columns:
            mask = bold[c].fillna(False).astype(bool) & (text[c] != "")
            text.loc[mask, c] = "**" + text.loc[mask, c] + "**"
    return text.to_markdown(index=False, disable_numparse=True)


def latex(text: pd.DataFrame, bold: pd.DataFrame | None = None, caption: str | None = None) -> str:
    """A booktabs-style tabular of text cells (LaTeX special characters escaped, bold where ``bold``)."""
    styler = text.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    if bold is not None:
        css = bold.reindex(columns=text.columns).fillna(False).astype(bool)
        # a frame of strings built directly: DataFrame.replace on booleans raises in pandas 3.0.x
        weights = pd.DataFrame(np.where(css.to_numpy(), "font-weight: bold;", ""), index=css.index, columns=css.columns)
        styler = styler.apply(lambda _: weights, axis=None)
    caption = caption and caption.replace("_", r"\_")  # captions are the tables' own titles
    return styler.to_latex(hrules=True, caption=caption, position="t", convert_css=True, environment="table")


def table(text: pd.DataFrame, bold: pd.DataFrame | None, stem: Path, notes: list[str], title: str = "") -> list[Path]:
    """``<stem>.md`` (the table with its notes as a list below) and ``<stem>.tex`` (the notes as comments)."""
    md = (f"### {title}\n\n" if title else "") + markdown(text, bold)
    if notes:
        md += "\n\n" + "\n".join(f"- {n}" for n in notes)
    tex = "".join(f"% {n}\n" for n in notes) + latex(text, bold, caption=title or None)
    return write_text(stem.with_suffix(".md"), md) + write_text(stem.with_suffix(".tex"), tex)


def colours(n: int) -> list:
    """``n`` distinct colours: tab10 up to ten series, tab20 up to twenty, then a spread of viridis."""
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("viridis")(i / (n - 1)) for i in range(n)]


def save(fig, stem: Path, legend_from=None, ncol: int = 2) -> list[Path]:
    """``<stem>.png`` and ``<stem>.pdf``; the legend of ``legend_from`` (an axes, or the figure's first)
    below the axes, never over the data."""
    axes = legend_from if legend_from is not None else fig.axes[0]
    handles, labels = axes.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=8, frameon=False)
    out = png_and_pdf(fig, stem, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return out


def png_and_pdf(fig, stem: Path, dpi: int, **kwargs) -> list[Path]:
    """``fig`` as ``<stem>.png`` and ``<stem>.pdf`` (the PDF without a creation date, so it is reproducible)."""
    out = []
    for ext in ("png", "pdf"):
        path = stem.with_suffix(f".{ext}")
        fig.savefig(path, dpi=dpi, metadata=None if ext == "png" else {"CreationDate": None}, **kwargs)
        out.append(path)
    return out
