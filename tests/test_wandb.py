"""W&B as a home of run records: real wandb in offline mode, read back from its own log format.

The public API needs a W&B server, which tests cannot reach: the records are checked in the
offline run files that ``wandb sync`` uploads (tests/wandb_offline.py reads them), and the reader
is checked from run objects of the API's shape assembled from those files, through its cache and
``python -m analysis ... --wandb``, against the tables made from ``runs/``.
"""

import base64
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from wandb_offline import api_run, finished_records, of_type, offline_runs

from analysis import paper as paper_tables
from analysis import table as run_table
from analysis.wandb_source import Record, convert, record_of, source, store
from quantmla.evals.averages import suite_report
from quantmla.tracking import RunRecord
from quantmla.tracking_wandb import ARTIFACT_TYPE, WandbLogger, log_records, task_rows, wandb_id

UNAVAILABLE = {"fda": "no offline copy", "swde": "no offline copy", "squad_completion": "no offline copy"}


def _results(scale: float) -> dict:
    r = {t: {"acc_norm,none": 0.5 * scale, "acc_norm_stderr,none": 0.01} for t in ("hellaswag", "piqa", "arc_easy")}
    r["arc_challenge"] = {"acc_norm,none": 0.3 * scale, "acc_norm_stderr,none": None}
    r["winogrande"] = {"acc,none": 0.6 * scale}
    r["mmlu"] = {"acc,none": 0.4 * scale}
    r["gsm8k"] = {"exact_match,strict-match": 0.1 * scale}
    return r


def _suite_metrics(scale: float) -> dict:
    res = _results(scale)
    return {"results": res, "unavailable": UNAVAILABLE} | suite_report("suite_a", res, UNAVAILABLE)


def _cfg(method: str, bits: str, protect: bool, name="suite_a") -> dict:
    ev = {"name": "lm_eval", "suite": name} if name == "suite_a" else {"name": "ppl"}
    return {
        "model": {"name": "tiny"},
        "method": {"_target_": f"x.{method}", "name": method},
        "bits": {"name": bits},
        "protect": {"enabled": protect},
        "eval": ev,
        "profile": "smoke",
        "seed": 0,
    }


def _log(root: Path, sweep: str, cfg: dict, metrics: dict, ok: bool = True) -> RunRecord:
    """A run as quantmla.run records it, logged to W&B offline."""
    rec = RunRecord(root, sweep, cfg)
    logger = WandbLogger(project="quantmla-test", mode="offline", tags=["t"])
    rec.start()
    logger.start(rec, sweep)
    if ok:
        rec.finish(metrics)
        logger.log(metrics)
    else:
        rec.fail(RuntimeError("boom"))
    logger.finish(ok)
    return rec


def test_offline_run_holds_config_summary_table_and_artifact(tmp_path):
    metrics = _suite_metrics(1.0)
    assert metrics["averages"]["avg"] is None  # three tasks are missing: a null average
    rec = _log(tmp_path, "s", _cfg("rtn", "c4r4", False), metrics)
    (run_dir,) = offline_runs(rec.dir)
    recs = finished_records(run_dir)
    run = api_run(run_dir)
    assert run.id == wandb_id("s", rec.id) and run.state == "finished" and run.group == "s"
    assert {k: v["value"] for k, v in run.config.items() if k != "_wandb"} == rec.cfg
    # the summary is metrics.json as it is, nulls and their reasons included
    on_disk = json.loads((rec.dir / "metrics.json").read_text())
    assert {k: run.summary[k] for k in on_disk} == on_disk
    assert run.summary["averages"]["avg"] is None
    assert run.summary["averages"]["why_missing"] == UNAVAILABLE
    assert run.summary["record/run"] == rec.id and run.summary["record/status"] == "done"
    # the per-task table: a table file in the run's files, one row per task and metric
    ref = run.summary["record/tasks"]
    assert ref["_type"] == "table-file"
    table = json.loads((run_dir / "files" / ref["path"]).read_text())
    assert table["columns"] == ["section", "task", "metric", "value", "note"]
    n_numbers = sum(len(v) for v in metrics["results"].values()) + len(metrics["scores"])
    assert len(table["data"]) == n_numbers + 2 * len(UNAVAILABLE)
    assert ["results", "mmlu", "acc,none", 0.4, ""] in table["data"]
    assert ["results", "arc_challenge", "acc_norm_stderr,none", None, ""] in table["data"]
    assert ["missing", "fda", "", None, "no offline copy"] in table["data"]
    assert ["scores", "gsm8k", "score_pct", pytest.approx(10.0), ""] in table["data"]
    # the record folder as an artifact: every file of it, with its content's MD5
    (art,) = [a for a in of_type(recs, "artifact") if a.type == ARTIFACT_TYPE]
    assert art.name == f"record-{run.id}"
    files = {c.path: c.digest for c in art.manifest.contents}
    assert set(files) == {"config.yaml", "env.json", "metrics.json", "status"}
    for name, digest in files.items():
        assert base64.b64decode(digest) == hashlib.md5((rec.dir / name).read_bytes()).digest(), name


def test_relaunched_run_resumes_the_same_wandb_run(tmp_path):
    cfg, metrics = _cfg("rtn", "c4r4", False), _suite_metrics(1.0)
    first = _log(tmp_path, "s", cfg, metrics, ok=False)
    assert first.status == "failed"
    second = _log(tmp_path, "s", cfg, metrics)
    assert second.dir == first.dir and second.done
    runs = [finished_records(d) for d in offline_runs(second.dir)]
    assert len(runs) == 2  # one offline folder per attempt, both of one W&B run that `wandb sync` joins
    ids = {of_type(r, "run")[0].run_id for r in runs}
    assert ids == {wandb_id("s", second.id)}
    assert all(of_type(r, "run")[0].resume for r in runs)
    states = [api_run(d).state for d in offline_runs(second.dir)]
    assert sorted(states) == ["failed", "finished"]


def test_records_made_without_wandb_get_the_run_it_would_have_logged(tmp_path):
    """A record of ``logger=none`` logged afterwards: the W&B run a live run logs (config, summary,
    artifact; read back as the same record), marked as logged from the record; a record with a W&B
    log, an unfinished one and a second pass are left alone."""
    cfg, metrics = _cfg("rtn", "c4r4", False) | {"sweep": "s"}, _suite_metrics(1.0)
    plain = RunRecord(tmp_path, "s", cfg)
    plain.start()
    plain.finish(metrics)
    live = _log(tmp_path, "s", _cfg("quarot", "c4r4", False) | {"sweep": "s"}, _suite_metrics(0.9))
    failed = RunRecord(tmp_path, "s", _cfg("smoothquant", "c4r4", False) | {"sweep": "s"})
    failed.start()
    failed.fail(RuntimeError("boom"))
    moved = tmp_path / "elsewhere" / plain.id  # a copy whose folder no longer names its sweep
    shutil.copytree(plain.dir, moved)
    assert offline_runs(plain.dir) == [] and len(offline_runs(live.dir)) == 1

    got = log_records(tmp_path, project="quantmla-test", mode="offline", say=lambda _: None)
    assert got == {
        plain.dir: "logged",
        live.dir: "has a W&B log",
        moved: f"not in <sweep>/<run id> (s/{plain.id}), left alone",
    }
    (run_dir,) = offline_runs(plain.dir)
    run = api_run(run_dir)
    assert run.id == wandb_id("s", plain.id) and run.state == "finished" and run.group == "s"
    assert {k: v["value"] for k, v in run.config.items() if k != "_wandb"} == cfg
    assert run.summary["record/status"] == "done" and run.summary["record/logged_from"] == "record"
    back = record_of(run)
    assert (back.sweep, back.run, back.config, back.metrics) == ("s", plain.id, cfg, metrics)
    (art,) = [a for a in of_type(finished_records(run_dir), "artifact") if a.type == ARTIFACT_TYPE]
    assert {c.path for c in art.manifest.contents} == {"config.yaml", "env.json", "metrics.json", "status"}
    assert offline_runs(failed.dir) == [] and len(offline_runs(live.dir)) == 1

    again = subprocess.run(
        [sys.executable, "-m", "quantmla.tracking_wandb", str(tmp_path), "--mode", "offline"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines()[-1] == "2 has a W&B log, 1 left alone"
    assert len(offline_runs(plain.dir)) == 1


def test_wandb_id_is_stable_and_safe():
    assert wandb_id("table1 methods/x", "0123456789ab") == "table1_methods_x-0123456789ab"
    assert wandb_id("s", "0123456789ab") == wandb_id("s", "0123456789ab")
    assert len(wandb_id("x" * 200, "0123456789ab")) == 48 + 13


def test_task_rows_cover_ruler_means_and_skip_non_numbers():
    rows = task_rows({"results": {"niah": {"4096,none": 0.5, "alias": "x"}}, "mean": {"niah": 50.0}, "ppl": 3.0})
    assert rows == [["results", "niah", "4096,none", 0.5, ""], ["results", "niah", "alias", None, ""],
                    ["mean", "niah", "mean_pct", 50.0, ""]]  # fmt: skip
    assert task_rows({"ppl": 3.0, "nll": 1.1}) == []


def _api_shaped(cfg: dict, metrics: dict, rid: str, state="finished", status="done", wrapped=True):
    config = {k: {"value": v, "desc": None} for k, v in cfg.items()} if wrapped else dict(cfg)
    summary = metrics | {"record/run": rid, "record/sweep": "s", "record/status": status, "_runtime": 3}
    return SimpleNamespace(id=f"s-{rid}", state=state, config=config | {"_wandb": {"value": {}}}, summary=summary)


def test_record_of_api_run_objects():
    cfg, metrics = _cfg("rtn", "c4r4", False), _suite_metrics(1.0)
    rid = RunRecord("/nonexistent", "s", cfg).id
    for wrapped in (True, False):
        got = record_of(_api_shaped(cfg, metrics, rid, wrapped=wrapped))
        assert isinstance(got, Record)
        assert (got.sweep, got.run, got.config, got.metrics) == ("s", rid, cfg, metrics)
    assert "not finished" in record_of(_api_shaped(cfg, metrics, rid, state="running"))
    assert "not done" in record_of(_api_shaped(cfg, metrics, rid, status="running"))
    changed = _api_shaped(cfg | {"seed": 1}, metrics, rid)
    assert "not " + rid in record_of(changed)
    got = convert([_api_shaped(cfg, metrics, rid), _api_shaped(cfg, metrics, rid, state="crashed")])
    assert len(got.records) == 1 and got.skipped == [(f"s-{rid}", "state crashed, not finished")]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Runs of two evaluations recorded in runs/ and logged offline: (runs folder, API-shaped runs)."""
    root = tmp_path_factory.mktemp("runs")
    recs = [
        _log(root, "t1", _cfg("rtn", "c16r16", True), _suite_metrics(1.0)),
        _log(root, "t1", _cfg("rtn", "c4r4", False), _suite_metrics(0.9)),
        _log(root, "t1", _cfg("quantmla", "c4r4", True), _suite_metrics(0.95)),
        _log(root, "t1", _cfg("rtn", "c2r4", False, name="ppl"), {"ppl": 14.5, "nll": 2.67, "tokens": 10}),
    ]
    _log(root, "failed", _cfg("quarot", "c4r4", False), {}, ok=False)  # no record, in runs/ or in W&B
    runs = [
        api_run(d)
        for r in [*recs, RunRecord(root, "failed", _cfg("quarot", "c4r4", False))]
        for d in offline_runs(r.dir)
    ]
    return root, runs


def test_tables_from_the_wandb_cache_equal_tables_from_runs(logged, tmp_path):
    root, runs = logged
    fetched = convert(runs)
    assert len(fetched.records) == 4 and len(fetched.skipped) == 1
    cache = store(fetched.records, tmp_path / "cache")
    md_runs, _ = run_table.write(root / "t1", tmp_path / "a")
    md_cache, _ = run_table.write(cache / "t1", tmp_path / "b")
    assert md_cache == md_runs and "C2R4" in md_runs and "profile=smoke" in md_runs
    paper_runs, _ = paper_tables.write(root / "t1", tmp_path / "c")
    paper_cache, _ = paper_tables.write(cache / "t1", tmp_path / "d")
    assert paper_cache == paper_runs and "n/a" in paper_runs  # the null averages stay null
    # a later fetch that no longer returns a run removes its record from the cache
    store(fetched.records[:2], cache)
    assert len(list(cache.glob("*/*/status"))) == 2


def _cli(*args, cwd):
    r = subprocess.run([sys.executable, "-m", "analysis", *args], capture_output=True, text=True, cwd=cwd)
    return r.returncode, r.stdout.split("\n(written:")[0], r.stderr


def _body(text: str) -> list[str]:
    """A table's printed lines without its heading, which names the folder it was read from."""
    return [line for line in text.splitlines() if not line.startswith("### Runs under")]


def test_analysis_cli_reads_the_cache_offline(logged, tmp_path):
    root, runs = logged
    cache = tmp_path / "cache"
    store(convert(runs).records, cache)
    for cmd in ("table", "paper"):
        rc, from_runs, err = _cli(cmd, str(root / "t1"), "--out", str(tmp_path / "o1"), cwd=tmp_path)
        assert rc == 0, err
        rc, from_wandb, err = _cli(cmd, str(cache), "--wandb", "ent/proj", "--offline", "--out", str(tmp_path / "o2"),
                                   cwd=tmp_path)  # fmt: skip
        assert rc == 0, err
        assert _body(from_wandb) == _body(from_runs)
    # no server here (no API key): the cache is read, and the reader says so
    rc, out, err = _cli("table", str(cache), "--wandb", "ent/proj", cwd=tmp_path)
    assert rc == 0 and "cannot read ent/proj from W&B" in err and "| tiny " in out
    rc, _, err = _cli("table", "--wandb", "ent/proj", "--offline", cwd=tmp_path)
    assert rc == 2 and "runs/wandb/ent/proj holds no records" in err
    with pytest.raises(ValueError, match="ENTITY/PROJECT"):
        source("just-a-project", tmp_path, offline=True)
