"""``python -m analysis paper <runs-dir>``: everything the paper's reproduction renders from a folder of
runs, into ``<runs-dir>/paper`` (or ``--out``): Tables 1–3 and RULER in the paper's layout
(:mod:`analysis.paper`), Figure 4's accuracy against context length (:mod:`analysis.figure4`),
Table 4–6 and their figures from the sensitivity runs (:mod:`analysis.sensitivity`, files
``sensitivity*``) and the claims with their verdicts
(:mod:`analysis.claims`). Each part is written when the runs it needs exist."""

from __future__ import annotations

from pathlib import Path

from analysis import claims, figure4, paper, sensitivity


def write(root: str | Path, out: str | Path | None = None) -> tuple[str, list[Path]]:
    out = Path(out) if out else Path(root) / "paper"
    sensitive = sensitivity.sensitivity_runs(root)
    md, files = paper.write(root, out, required=not sensitive)
    parts = [md] if md else []
    files += figure4.write(root, out)
    if sensitive:
        md, written = sensitivity.write(root, out)
        parts.append(md)
        files += written
    md, written = claims.write(root, out)
    return "\n\n".join([*parts, md]), files + written
