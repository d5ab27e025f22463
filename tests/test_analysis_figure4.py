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
    # the lengths the means are over are said, beside the paper's
    assert (
        "- Lengths: ours smollm2_mla 4K, 8K (up to each model's context); the paper's means are over 4K, 8K, 16K and 32K."
        in (tmp_path / "with" / "paper" / "ruler.md").read_text()
    )
    assert figure4.write(tmp_path / "empty", tmp_path / "empty-out") == []


def test_a_record_without_lm_evals_standard_error_gets_the_one_of_its_0_or_1_scores():
    from statistics import stdev

    from analysis.metrics import ruler, ruler_se

    answers = [1.0] * 301 + [0.0] * 199  # 500 samples at one length, each scored 0 or 1
    p, n = sum(answers) / len(answers), len(answers)
    res = {t: {"4096,none": p} for t in ("niah_single_3", "niah_multikey_1", "niah_multivalue")}
    res["niah_single_1"] = {"4096,none": p, "4096_stderr,none": 0.02}
    m = {"results": res, "mean": {t: 100 * p for t in res}, "settings": {"lengths": [4096], "samples": n}}
    sample_se = stdev(answers) / n**0.5  # lm-eval's mean_stderr over the per-sample scores
    assert abs(ruler_se(m, "niah_single_3", 4096) - sample_se) < 1e-12
    assert abs(ruler_se(m, "niah_multikey_1", 4096) - sample_se) < 1e-12  # four keys, one value asked
    assert ruler_se(m, "niah_multivalue", 4096) is None  # four values: partial scores, not derivable
    assert ruler_se(m, "niah_single_1", 4096) == 0.02  # the record's own is kept
    assert ruler_se(m | {"settings": {"lengths": [4096]}}, "niah_single_3", 4096) is None  # no sample count
    shown = ruler(m)
    assert abs(shown["niah_single_3"].se - 100 * sample_se) < 1e-9 and shown["niah_multivalue"].se is None
