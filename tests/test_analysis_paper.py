"""Paper-layout tables from run records, with the published numbers beside matching rows."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis import paper_numbers as P
from quantmla.evals.averages import suite_report
from quantmla.tracking import RunRecord


def _record(root, model, bits, method, protect, results, seed=0, noise=None):
    cfg = {
        "model": {"name": model},
        "method": {"_target_": f"x.{method}", "name": method},
        "bits": {"name": bits},
        "protect": {"enabled": protect},
        "eval": {"name": "lm_eval", "suite": "suite_a"},
        "seed": seed,
    } | ({"noise": noise} if noise else {})
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


def _section(stdout: str, title: str) -> list[list[str]]:
    """The cells of the rows of one printed table (the header and rule left out)."""
    part = stdout.split(f"### {title}")[1].split("###")[0].split("\n## ")[0]  # the next table, or the claims
    lines = [x for x in part.splitlines() if x.startswith("|")][2:]
    return [[c.strip().strip("*") for c in x.split("|")[1:-1]] for x in lines]


def test_table1_layout_recomputes_the_paper_average(tmp_path):
    row = P.TABLE1[("deepseek_v2_lite", "C4R4", "quantmla")]
    _record(tmp_path, "deepseek_v2_lite", "c4r4", "quantmla", True, _results(row))
    # the same numbers under the other protection convention: no paper row beneath it
    _record(tmp_path, "deepseek_v2_lite", "c4r4", "quantmla", False, _results(row))
    bf16 = _results(P.TABLE1[("deepseek_v2_lite", "C16R16", None)])
    _record(tmp_path, "deepseek_v2_lite", "c16r16", "rtn", False, bf16)
    _record(tmp_path, "deepseek_v2_lite", "c16r16", "smoothquant", False, bf16)  # BF16 again: one row, said so
    r = subprocess.run(
        [sys.executable, "-m", "analysis", "paper", str(tmp_path / "t1")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    cells = _section(r.stdout, "Table 1 — Suite A (%)")
    # BF16 (2 runs, their spread is a noise floor of 0), its paper row; C4R4 unprotected; protected, its paper row
    assert [c[2] for c in cells] == ["—", "paper", "noise floor", "QuantMLA", "QuantMLA", "paper"]
    bf, bf_paper, floor, unprot, prot, prot_paper = cells
    assert bf[:6] == ["deepseek_v2_lite", "C16R16", "—", "", "paper", "2"] and floor[6] == "0"
    # the paper's per-task numbers, each one, beneath ours
    assert bf_paper[6:] == [f"{x:.2f}" for x in P.TABLE1[("deepseek_v2_lite", "C16R16", None)]]
    assert prot_paper[6:] == [f"{x:.2f}" for x in row]
    # our average (ten equal weights) equals the published Avg. to the paper's rounding (±0.01)
    for ours, paper in ((bf, 66.80), (prot, 66.54)):
        assert abs(float(ours[-1].split(" ± ")[0]) - paper) <= 0.011
    assert unprot[3] == "no" and prot[3] == "yes"
    table8 = _section(r.stdout, "Table 8 — Suite A commonsense tasks (%)")
    assert table8[-1][6:] == [f"{x:.2f}" for x in P.TABLE8[("deepseek_v2_lite", "C4R4", "quantmla")]]
    out = tmp_path / "t1" / "paper"
    for name in ("table1", "table8"):
        for ext in ("md", "csv", "tex", "png", "pdf"):
            assert (out / f"{name}.{ext}").stat().st_size > 0, (name, ext)
    assert (out / "paper_tables.md").exists() and (out / "details.csv").exists()


def test_missing_task_leaves_the_average_empty(tmp_path):
    res = _results(P.TABLE1[("moonlight_16b_a3b", "C4R4", "rtn")])
    del res["fda"]
    _record(tmp_path, "moonlight_16b_a3b", "c4r4", "rtn", False, res)
    r = subprocess.run(
        [sys.executable, "-m", "analysis", "paper", str(tmp_path / "t1")], capture_output=True, text=True
    )
    ours, paper = _section(r.stdout, "Table 1 — Suite A (%)")
    assert ours[9] == "n/a" and ours[12] == "n/a" and paper[12] == "72.46"


def test_no_runs_is_an_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "analysis", "paper", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: no finished")


def test_a_model_the_paper_does_not_report_gets_the_reference_models_row():
    """Beside a reproduction on another model stand the paper's DeepSeek-V2-Lite numbers; a model of
    the paper keeps its own; the paper's protection convention holds for both."""
    v2 = P.paper_row(P.TABLE1, "smollm2_mla", "C4R4", "rtn", False)
    assert P.paper_model(P.TABLE1, "smollm2_mla") == "deepseek_v2_lite"
    assert v2 == P.TABLE1[("deepseek_v2_lite", "C4R4", "rtn")] and v2[1] == 51.90  # the paper's Table 1 MMLU
    assert P.paper_row(P.TABLE1, "moonlight_16b_a3b", "C2R4", "quantmla", True)[-1] == 72.70
    assert P.paper_row(P.TABLE1, "smollm2_mla", "C4R4", "rtn", True) is None  # baselines unprotected
    assert P.paper_row(P.TABLE1, "smollm2_mla", "C16R16", "rtn", False)[-1] == 66.80


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


def _mmlu_record(root, bits, method, protect, acc, paths=None, noise=None, se=1.0):
    """A Table 3 row's record: MMLU ``acc`` (%) with standard error ``se`` (points)."""
    cfg = {
        "model": {"name": "deepseek_v2_lite"},
        "method": {"_target_": f"x.{method}", "name": method} | ({"paths": paths} if paths else {}),
        "bits": {"name": bits},
        "protect": {"enabled": protect},
        "eval": {"name": "lm_eval", "tasks": [{"task": "mmlu", "num_fewshot": 5}], "suite": None},
    } | ({"noise": noise} if noise else {})
    rec = RunRecord(root, "t3", cfg)
    rec.start()
    rec.finish({"results": {"mmlu": {"acc,none": acc / 100, "acc_stderr,none": se / 100}}})


def test_table3_steps_are_resolved_by_the_noise_floor_and_their_errors(tmp_path):
    """Table 3 from its seven rows (the paper's numbers as our scores): each cumulative step's gain, the
    paper's beside it, and resolved only when |Δ| > max(noise floor, SE(Δ)): with per-row SE 1.0 pt and
    a floor of 0.5 pt (RTN under another batch size), SE(Δ) = √2 pt: +1.22 is not resolved, +3.19 and
    +1.64 are."""
    T = P.TABLE3
    _mmlu_record(tmp_path, "c16r16", "rtn", False, T["BF16"])
    _mmlu_record(tmp_path, "c4r4", "rtn", False, T["RTN"])
    _mmlu_record(tmp_path, "c4r4", "rtn", False, T["RTN"] - 0.5, noise={"perturb": "batch", "seed": 0})
    _mmlu_record(tmp_path, "c4r4", "smoothquant", False, T["SmoothQuant†"])
    _mmlu_record(tmp_path, "c4r4", "quarot", False, T["QuaRot†"])
    steps = ("+ content-path transform", "+ RoPE-path transform", "+ BF16 protection (full QuantMLA)")
    for label, rope, protect in zip(steps, (False, True, True), (False, False, True)):
        _mmlu_record(tmp_path, "c4r4", "quantmla", protect, T[label], paths={"content": True, "rope": rope})
    r = subprocess.run(
        [sys.executable, "-m", "analysis", "paper", str(tmp_path / "t3"), "--out", str(tmp_path / "o")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cells = _section(r.stdout, "Table 3 — ablation at C4R4, MMLU 5-shot (%)")
    got = {c[1]: c for c in cells}
    assert [c[1] for c in cells] == ["BF16", "RTN", "SmoothQuant†", "QuaRot†", *steps, "noise floor"]
    for label, paper in T.items():
        assert got[label][5].split(" ± ")[0] == f"{paper:.2f}" and got[label][8] == f"{paper:.2f}"
    assert got["RTN"][4] == "2"  # the ordinary run and its noise-floor run
    assert got["noise floor"][5] == "0.5"
    step = {label: (got[label][6], got[label][7], got[label][9]) for label in steps}
    assert step == {
        "+ content-path transform": ("+1.22", "no", "+1.22"),
        "+ RoPE-path transform": ("+3.19", "yes", "+3.19"),
        "+ BF16 protection (full QuantMLA)": ("+1.64", "yes", "+1.64"),
    }
    data = pd.read_csv(tmp_path / "o" / "table3.csv")
    first = data[data["configuration"] == "+ content-path transform"].iloc[0]
    assert first["step_threshold"] == pytest.approx(math.sqrt(2) * 1.0) and first["noise_floor"] == pytest.approx(0.5)
    assert (tmp_path / "o" / "table3.tex").read_text().count("\\\\") >= 9


def test_calibrated_rows_give_the_mean_and_standard_error_over_their_seeds(tmp_path):
    """A configuration calibrated with seeds 0, 1, 2 (``noise.perturb=seed``, seeds 1 and 2 scoring
    +0.5 and −1.0 points on every task) shows seed 0, as the paper does, and beneath it the mean over
    the seeds −0.17 points away ± SD/√3 = 0.441; a run under another batch size is no seed."""
    row = P.TABLE1[("deepseek_v2_lite", "C4R4", "quantmla")]
    _record(tmp_path, "deepseek_v2_lite", "c4r4", "quantmla", True, _results(row))
    for k, shift in enumerate((0.5, -1.0)):
        _record(tmp_path, "deepseek_v2_lite", "c4r4", "quantmla", True, _results([x + shift for x in row]),
                noise={"perturb": "seed", "seed": k})  # fmt: skip
    rtn = P.TABLE1[("deepseek_v2_lite", "C4R4", "rtn")]
    _record(tmp_path, "deepseek_v2_lite", "c4r4", "rtn", False, _results(rtn))
    _record(tmp_path, "deepseek_v2_lite", "c4r4", "rtn", False, _results(rtn), noise={"perturb": "batch", "seed": 8})
    T = P.TABLE3
    for shift, noise in ((0.0, None), (0.3, {"perturb": "seed", "seed": 0}), (-0.3, {"perturb": "seed", "seed": 1})):
        _mmlu_record(tmp_path, "c4r4", "quantmla", True, T["+ BF16 protection (full QuantMLA)"] + shift,
                     paths={"content": True, "rope": True}, noise=noise)  # fmt: skip
    _mmlu_record(tmp_path, "c4r4", "rtn", False, T["RTN"])
    _mmlu_record(tmp_path, "c4r4", "rtn", False, T["RTN"], noise={"perturb": "batch", "seed": 8})
    r = subprocess.run(
        [sys.executable, "-m", "analysis", "paper", str(tmp_path), "--out", str(tmp_path / "o")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    seeds = [x - row[0] for x in (row[0], row[0] + 0.5, row[0] - 1.0)]
    se = math.sqrt(sum((x - sum(seeds) / 3) ** 2 for x in seeds) / 2 / 3)
    assert se == pytest.approx(0.441, abs=1e-3)
    cells = _section(r.stdout, "Table 1 — Suite A (%)")
    seeds_line = "3 calibration seeds: mean ± SE"
    assert [c[2] for c in cells] == ["RTN", "paper", "QuantMLA", seeds_line, "paper", "noise floor"]
    ours, over = cells[2], cells[3]
    assert ours[6].split(" ± ")[0] == f"{row[0]:.2f}" and ours[5] == "3"  # seed 0, three runs
    assert over[6] == f"{row[0] + sum(seeds) / 3:.2f} ± {se:.2g}"  # CS
    assert over[7] == f"{row[1] + sum(seeds) / 3:.2f} ± {se:.2g}"  # MMLU
    assert cells[5][6] == "1.5"  # the seeds' spread is the block's floor
    data = pd.read_csv(tmp_path / "o" / "table1.csv")
    q = data[data["method"] == "QuantMLA"].iloc[0]
    assert q["seeds"] == 3 and q["CS seeds"] == pytest.approx(row[0] - 1 / 6) and q["CS seeds se"] == pytest.approx(se)
    assert math.isnan(data[data["method"] == "RTN"].iloc[0]["seeds"])
    assert "show seed 0, as the paper's downstream results do" in r.stdout
    t3 = {c[1]: c for c in _section(r.stdout, "Table 3 — ablation at C4R4, MMLU 5-shot (%)")}
    assert t3[seeds_line][5] == f"{T['+ BF16 protection (full QuantMLA)']:.2f} ± 0.17"
    assert list(t3) == ["RTN", "+ BF16 protection (full QuantMLA)", seeds_line, "noise floor"]
    t3data = pd.read_csv(tmp_path / "o" / "table3.csv").set_index("configuration")
    assert t3data.loc["+ BF16 protection (full QuantMLA)", "mmlu_seeds_se"] == pytest.approx(0.3 / math.sqrt(3))


DATA = Path(__file__).resolve().parent / "data"


def test_tables_regenerate_from_the_committed_records(tmp_path):
    """tests/data/runs holds records of real tiny-model runs (tests/data/make_runs.sh): Suite A on the
    quick profile, Table 3's ablation on MMLU, perplexity of every method with RTN's noise floor.
    Regenerating the tables and the claims from them gives the committed tests/data/rendered files,
    in seconds, with no model loaded: neither transformers, nor lm-eval, nor Triton is imported (the
    cache-size claim reads the page layout, which needs torch only)."""
    script = (
        "import sys, time; t = time.time(); from analysis.__main__ import main; "
        f"assert main(['paper', {str(DATA / 'runs')!r}, '--out', {str(tmp_path / 'paper')!r}]) == 0; "
        f"assert main(['table', {str(DATA / 'runs' / 'ppl')!r}, '--out', {str(tmp_path / 'table')!r}]) == 0; "
        "heavy = [m for m in ('transformers', 'lm_eval', 'triton', 'quantmla.models') if m in sys.modules]; "
        "print(','.join(heavy) or '-', round(time.time() - t, 1), file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded, seconds = r.stderr.split()[-2:]
    assert loaded == "-" and float(seconds) < 60
    for kind in ("paper", "table"):
        expected = sorted(p.name for p in (DATA / "rendered" / kind).iterdir())
        assert expected, kind
        for name in expected:
            assert (tmp_path / kind / name).read_text() == (DATA / "rendered" / kind / name).read_text(), name
    # what a reviewer pastes: the suites' tasks and averages, no subtask columns, marked quick rows
    table1 = (tmp_path / "paper" / "table1.md").read_text()
    head = next(line for line in table1.splitlines() if line.startswith("| model"))
    assert len(head.split("|")) - 2 == 13 and "mmlu_" not in table1
    assert "quick eval, limit 2/task" in table1 and "noise floor" in table1
    details = pd.read_csv(tmp_path / "paper" / "details.csv")
    assert details["metric"].str.startswith("subtasks/mmlu_").any()
    for name in ("table1", "table8", "table3"):
        assert (tmp_path / "paper" / f"{name}.pdf").read_bytes().startswith(b"%PDF")
        assert (tmp_path / "paper" / f"{name}.png").stat().st_size > 10_000
    ppl = pd.read_csv(tmp_path / "table" / "table.csv")
    assert set(ppl["method"]) == {"rtn", "smoothquant", "quarot", "quantmla"} and ppl["ppl_noise"].notna().all()
    assert "method/" not in (tmp_path / "table" / "table.md").read_text()  # diagnostics go to details.csv
    assert pd.read_csv(tmp_path / "table" / "details.csv")["metric"].str.startswith("method/").any()


def test_ten_series_get_ten_colours_and_the_legend_stays_off_the_data(tmp_path):
    """The Table 9 plot with ten records: eleven distinct colours (BF16 and each record's C4R4), the legend
    below the axes in both PNG and PDF."""
    from analysis import latency, render

    for n in (10, 11, 20):
        assert len(set(render.colours(n))) == n
    base = json.loads((Path(__file__).resolve().parents[1] / "bench/results/table9-20261201-063453.json").read_text())
    paths = []
    for i in range(10):
        rec = base | {"rows": [r | {"delta_pct": r["delta_pct"] + i} for r in base["rows"]]}
        paths.append(tmp_path / f"table9-{i}.json")
        paths[-1].write_text(json.dumps(rec))
    _, files = latency.write(paths, tmp_path / "out")
    assert [f.suffix for f in files] == [".md", ".csv", ".png", ".pdf"]
    fig = latency.draw(latency.frame([latency.load(p) for p in paths]))
    fig.canvas.draw()
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 2 + 1 + 10 + 1  # paper BF16/C4R4, our BF16, ten C4R4, paper Δ
    assert legend.get_window_extent().y1 < min(a.get_window_extent().y0 for a in fig.axes)
    colours = {tuple(line.get_color()) for a in fig.axes for line in a.get_lines() if line.get_marker() in ("o", "s")}
    assert len(colours) == 11
