"""The paper's averages, checked against the paper's own tables (Tables 1, 2 and 8)."""

import pytest

from quantmla.evals import averages

# Table 8 (commonsense) and Table 1 (the rest), DeepSeek-V2-Lite and Moonlight rows.
TABLE_1 = [
    # HellaSwag, PIQA, ARC-E, ARC-C, WinoGrande | CS | MMLU, GSM8K, FDA, SWDE, SQuAD | Avg
    ((77.76, 79.87, 74.28, 46.16, 70.72), 69.76, (57.90, 36.92, 78.13, 89.20, 57.10), 66.80),
    ((75.20, 78.45, 70.03, 44.71, 67.48), 67.17, (51.90, 16.98, 65.06, 84.88, 55.50), 61.02),
    ((77.82, 80.36, 74.16, 46.42, 70.48), 69.85, (57.29, 37.91, 60.44, 84.52, 54.79), 64.42),
    ((78.28, 80.79, 82.53, 58.02, 71.98), 74.32, (69.97, 74.53, 78.40, 90.10, 51.07), 73.57),
    ((67.37, 75.52, 67.63, 42.24, 60.85), 62.72, (56.16, 27.37, 25.50, 72.73, 35.36), 53.07),
]

# Table 2: GPQA-D, MMLU, GSM8K, MATH500, AIME25, HumanEval, LiveCodeBench | Avg
TABLE_2 = [
    ((46.46, 80.77, 71.72, 57.40, 70.00, 73.78, 49.67), 64.26),
    ((42.42, 76.38, 68.01, 48.00, 40.00, 39.02, 32.70), 49.50),
    ((44.95, 80.57, 68.84, 56.80, 60.00, 71.34, 49.00), 61.64),
    ((42.93, 72.09, 83.85, 56.40, 63.33, 36.59, 32.04), 55.32),
    ((39.39, 71.50, 82.94, 55.00, 46.67, 34.15, 30.33), 51.43),
]


def _results(suite, values):
    return {t: {m: v / 100} for (t, m), v in zip(averages.SUITES[suite].items(), values)}


@pytest.mark.parametrize("cs_tasks,cs,rest,avg", TABLE_1)
def test_suite_a_reproduces_table_1(cs_tasks, cs, rest, avg):
    rep = averages.suite_report("suite_a", _results("suite_a", cs_tasks + rest))
    assert rep["averages"]["cs"] == pytest.approx(cs, abs=0.01)
    assert rep["averages"]["avg"] == pytest.approx(avg, abs=0.01)
    assert rep["averages"]["missing"] == []


@pytest.mark.parametrize("values,avg", TABLE_2)
def test_suite_b_reproduces_table_2(values, avg):
    rep = averages.suite_report("suite_b", _results("suite_b", values))
    assert rep["averages"]["avg"] == pytest.approx(avg, abs=0.01)


def test_missing_tasks_null_the_average_and_are_named():
    cs_tasks, cs, rest, _ = TABLE_1[0]
    results = _results("suite_a", cs_tasks + rest)
    for t in ("fda", "swde"):
        del results[t]
    rep = averages.suite_report("suite_a", results, {"fda": "no offline copy"})
    a = rep["averages"]
    assert a["cs"] == pytest.approx(cs, abs=0.01)
    assert a["avg"] is None and a["missing"] == ["fda", "swde"]
    assert a["why_missing"] == {"fda": "no offline copy", "swde": "not evaluated"}
    kept = [v for v in cs_tasks + rest]
    del kept[7:9]
    assert a["avg_over_available"] == pytest.approx(sum(kept) / 8)
    assert rep["scores"]["fda"] is None


def test_ruler_means_over_lengths():
    r = {"niah_single_1": {"4096,none": 1.0, "8192,none": 0.5}, "niah_single_2": {"4096,none": 1.0}}
    m = averages.ruler_means(r, [4096, 8192])
    assert m == {"niah_single_1": 75.0, "niah_single_2": None}
