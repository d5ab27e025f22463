"""Figure 4 from RULER records: every plotted point is the record's own score at that length, a
configuration run under a noise perturbation adds no line, and `analysis paper` writes the figure."""

import pandas as pd
from test_analysis_claims import ruler_record

from analysis import figure4
from analysis.reproduction import write

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")
LENGTHS = (4096, 8192)


def _score(method: str, task: int, length: int, perturbed: bool) -> float:
    """A distinct accuracy per configuration, task and length, so a misplaced point cannot match."""
    base = {"rtn": 0.60, "quarot": 0.70, "quantmla": 0.80}.get(method, 0.95)
    return base - 0.05 * task - (0.1 if length == 8192 else 0.0) - (0.03 if perturbed else 0.0)


def _record(root, bits, method, protect, noise=None):
    who = method if bits != "c16r16" else "bf16"
    res = {t: {} for t in TASKS}
    for i, t in enumerate(TASKS):
        for n in LENGTHS:
            res[t] |= {f"{n},none": _score(who, i, n, noise is not None), f"{n}_stderr,none": 0.01 + 0.001 * i}
    ruler_record(root, bits, method, protect, res, noise)


def test_points_are_the_records_scores_and_variants_add_no_line(tmp_path):
    _record(tmp_path, "c16r16", "rtn", False)
    for method in ("rtn", "quarot"):
        _record(tmp_path, "c4r4", method, False)
    _record(tmp_path, "c4r4", "rtn", False, noise={"perturb": "batch", "seed": 8})
    _record(tmp_path, "c4r4", "quantmla", True)
    files = figure4.write(tmp_path, tmp_path / "out")
    assert sorted(p.name for p in files) == ["figure4.csv", "figure4.pdf", "figure4.png"]
    df = pd.read_csv(tmp_path / "out" / "figure4.csv")
    assert len(df) == 4 * len(TASKS) * len(LENGTHS)  # BF16, RTN, QuaRot†, QuantMLA: the RTN variant is no line
    names = {"—": "bf16", "RTN": "rtn", "QuaRot†": "quarot", "QuantMLA": "quantmla"}
    for _, p in df.iterrows():
        i = TASKS.index(p["task"])
        assert abs(p["accuracy"] - 100 * _score(names[p["method"]], i, p["length"], False)) < 1e-9, p.to_dict()
        assert abs(p["se"] - 100 * (0.01 + 0.001 * i)) < 1e-9
    rtn = df[df["method"] == "RTN"]
    assert set(rtn["runs"]) == {2}  # the RTN line is the unperturbed run of a configuration run twice
    assert set(df.loc[df["method"] == "QuantMLA", "protect"]) == {"yes"}
    assert (tmp_path / "out" / "figure4.png").stat().st_size > 10_000
    assert (tmp_path / "out" / "figure4.pdf").read_bytes().startswith(b"%PDF")


def test_analysis_paper_writes_figure4_only_with_ruler_runs(tmp_path):
    _record(tmp_path / "with", "c16r16", "rtn", False)
    _record(tmp_path / "with", "c4r4", "quantmla", True)
    _, files = write(tmp_path / "with")
    assert {"figure4.png", "figure4.pdf", "figure4.csv", "ruler.md"} <= {p.name for p in files}
    assert figure4.write(tmp_path / "empty", tmp_path / "empty-out") == []
