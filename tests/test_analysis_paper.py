"""Paper-layout tables from run records, with the published numbers beside matching rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import paper_numbers as P
from quantmla.evals.averages import suite_report
from quantmla.tracking import RunRecord


def _record(root, model, bits, method, protect, results, seed=0):
    cfg = {
        "model": {"name": model},
        "method": {"_target_": f"x.{method}", "name": method},
        "bits": {"name": bits},
        "protect": {"enabled": protect},
        "eval": {"name": "lm_eval", "suite": "suite_a"},
        "seed": seed,
    }
    rec = RunRecord(root, "t1", cfg)
    rec.start()
    rec.finish({"results": results} | suite_report("suite_a", results, {"fda": "no offline copy"}))


def _results(row):
    """lm-eval results that reproduce one published Table 1 row (fractions, lm-eval metric names)."""
    cs, mmlu, gsm8k, fda, swde, squad, _ = row
    r = {t: {"acc_norm,none": cs / 100} for t in ("hellaswag", "piqa", "arc_easy", "arc_challenge")}
    r["winogrande"] = {"acc,none": cs / 100}
    r["mmlu"] = {"acc,none": mmlu / 100}
    r["gsm8k"] = {"exact_match,strict-match": gsm8k / 100}
    r["fda"] = {"contains,none": fda / 100}
    r["swde"] = {"contains,none": swde / 100}
    r["squad_completion"] = {"contains,none": squad / 100}
    return r


def test_table1_layout_recomputes_the_paper_average(tmp_path):
    row = P.TABLE1[("deepseek_v2_lite", "C4R4", "quantmla")]
    _record(tmp_path, "deepseek_v2_lite", "c4r4", "quantmla", True, _results(row))
    # the same numbers under the other protection convention: no paper value beside it
    _record(tmp_path, "deepseek_v2_lite", "c4r4", "quantmla", False, _results(row), seed=1)
    bf16 = _results(P.TABLE1[("deepseek_v2_lite", "C16R16", None)])
    _record(tmp_path, "deepseek_v2_lite", "c16r16", "rtn", False, bf16)
    _record(tmp_path, "deepseek_v2_lite", "c16r16", "smoothquant", False, bf16)  # BF16 again: one row, said so
    r = subprocess.run(
        [sys.executable, "-m", "analysis", "paper", str(tmp_path / "t1")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("| deepseek_v2_lite")]
    assert len(lines) == 3
    bf, unprot, prot = lines
    assert bf.startswith("| deepseek_v2_lite | C16R16 | — (mean of 2) | no | 69.76 | 57.90 | 36.92 |")
    # our average (ten equal weights) equals the published Avg. to the paper's rounding (±0.01)
    for line, paper in ((bf, 66.80), (prot, 66.54)):
        ours, printed = (float(c) for c in line.split("|")[-3:-1])
        assert printed == paper and abs(ours - paper) <= 0.011
    assert unprot.endswith("| 66.54 |  |")
    assert (tmp_path / "t1" / "paper_tables.md").exists()


def test_missing_task_leaves_the_average_empty(tmp_path):
    res = _results(P.TABLE1[("moonlight_16b_a3b", "C4R4", "rtn")])
    del res["fda"]
    _record(tmp_path, "moonlight_16b_a3b", "c4r4", "rtn", False, res)
    r = subprocess.run(
        [sys.executable, "-m", "analysis", "paper", str(tmp_path / "t1")], capture_output=True, text=True
    )
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("| moonlight")]
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[7] == "n/a" and cells[10] == "n/a" and cells[11] == "72.46"


def test_no_runs_is_an_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "analysis", "paper", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: no finished")


def test_table9_transcription_agrees_with_its_own_deltas_and_the_papers_summary():
    """Each Δ of Table 9 recomputed from its two latencies (rounded to 0.01 µs in the paper), and the
    paper's summary of the table (App. F.1): between −7.42 % and +4.29 %, within 0.5 % from 64K up."""
    assert {b for b, _ in P.TABLE9} == {8, 32} and len(P.TABLE9) == 20
    for (b, n), (bf16, c4r4, delta) in P.TABLE9.items():
        assert abs((c4r4 / bf16 - 1) * 100 - delta) < 0.02, (b, n)
        if n >= 1 << 16:
            assert abs(delta) < 0.5, (b, n)
    deltas = [d for _, _, d in P.TABLE9.values()]
    assert (min(deltas), max(deltas)) == (-7.42, 4.29)


@pytest.mark.slow
def test_table9_benchmark_says_it_needs_a_gpu():
    """bench/table9.py (the paper's App. F.1 protocol) stops with one clear line on a machine without CUDA."""
    r = subprocess.run(
        [sys.executable, "bench/table9.py", "--quick"],
        cwd=Path(__file__).resolve().parents[1], env=os.environ | {"CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 1 and r.stderr.strip().endswith("bench/table9.py needs a CUDA GPU"), r.stderr[-2000:]


@pytest.mark.slow
def test_latency_table_and_figure_from_the_committed_table9_records(tmp_path):
    """``python -m analysis latency`` on the H200 records in bench/results: one row per (batch, N),
    each record's Δ equal to its own mean latencies' ratio, the paper's numbers beside, a figure;
    and a clear error (exit 2) for a record of another benchmark."""
    from analysis.__main__ import main

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    records = [results / "table9-20261201-063453.json", results / "table9-20261201-063424.json"]
    assert main(["latency", *map(str, records), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "table9.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| 8 |") or ln.startswith("| 32 |")]
    assert len(rows) == 22  # batch 8 and 32, N = 1K ... 1M
    for path, col in zip(records, (2, 3)):
        for r in json.loads(path.read_text())["rows"]:
            assert r["delta_pct"] == pytest.approx((r["c4r4_us"] / r["c16r16_us"] - 1) * 100)
            n = f"{r['N'] >> 20}M" if r["N"] >= 1 << 20 else f"{r['N'] >> 10}K"
            (row,) = [x for x in rows if x.startswith(f"| {r['B']} | {n} |")]
            assert row.split("|")[1 + col].strip() == f"{r['delta_pct']:+.2f}"
    assert "| 32 | 1M | +7.11 | -7.21 | 33701.48 | 33609.17 | -0.27 |" in rows
    assert (tmp_path / "table9.png").stat().st_size > 10_000
    assert main(["latency", str(results / "decode-20261203-132456.json"), "--out", str(tmp_path)]) == 2
