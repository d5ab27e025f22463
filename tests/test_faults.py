"""Fault injection on the tiny model: nothing lost, nothing merged, nothing run from a file on disk.

- two identical sweeps launched at once (jobs in other orders): every run computed once, the
  transforms they share learned once, each launch in its own Hydra folder;
- ``kill -9`` at random points of a sweep, again and again, then a last launch: every run done,
  with the metrics of the undisturbed sweep, one table row each;
- damaged records and caches (truncated metrics, undecodable status, empty config, corrupt and
  truncated transforms, a checkpoint that runs ``os.system`` when unpickled): each set aside,
  named in the log, recomputed, and the code never run;
- SIGTERM and SIGINT during training: the checkpoint holds the step reached, exit 143 and 130;
- a multirun with failing jobs: every failure listed, the table of the rest written, exit 1;
- two processes writing one status file 1,000 times each; lm-eval response caches damaged.

Launches fork from a server that imported the harness once (tests/fault_tools.py). The module
prints how many faults it injected and what it checked afterwards. ``FAULT_SEED`` fixes the
kill times (the seed used is printed).
"""

import json
import os
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from fault_tools import Launch, broken_checkpoint, context, cpu_seconds, hammer

from quantmla.tracking import scan_runs

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)

FAULTS: Counter = Counter()
CHECKED: Counter = Counter()
SEED = int(os.environ.get("FAULT_SEED", time.time_ns() % 100_000))


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    start = time.monotonic()
    yield
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(FAULTS.items()))
    line = (
        f"test_faults: {sum(FAULTS.values())} faults injected ({kinds}) in {time.monotonic() - start:.0f} s "
        f"({cpu_seconds():.0f} CPU-seconds), "
        f"FAULT_SEED={SEED}; afterwards {CHECKED['runs']} run records checked: "
        f"{CHECKED['lost']} lost, {CHECKED['merged']} merged, {CHECKED['twice']} computed twice"
    )
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n" + line)


# ----- the sweep under test ------------------------------------------------------------------------------
def _small(cal: Path) -> list[str]:
    return [
        "model=tiny", "logger=none", "method=quantmla", "eval.source=news", "eval.seq_len=64", "eval.max_tokens=128",
        f"calibration.source={cal}", "calibration.seq_len=64", "calibration.train=4", "calibration.heldout=2",
        "calibration.batch_size=2", "method.steps=100", "method.val_every=10", "method.alphas=[0.0]",
    ]  # fmt: skip


# four runs; C4R4 and C2R4 share the RoPE transforms, the two recent values share everything
SWEEP_A = ["-m", "bits=c4r4,c2r4", "protect.recent=16,128"]
SWEEP_B = ["-m", "protect.recent=128,16", "bits=c2r4,c4r4"]  # the same runs, in another order
SWEEP_K = ["-m", "bits=c4r4,c2r4"]  # two of them (recent 128): fewer jobs to compose at each relaunch


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from quantmla import data

    d = tmp_path_factory.mktemp("faults")
    (d / "cal.txt").write_text("\n\n".join(data.wiki_split("train")[:2]))
    context()  # start the server before any timing
    Launch(["--help"], d, d / "warmup.log").wait()
    return d


def _launch(work: Path, runs: Path, extra: list[str], log: str) -> Launch:
    flags = [a for a in extra if a.startswith("-")]  # Hydra reads its flags before the overrides
    overrides = [a for a in extra if not a.startswith("-")]
    return Launch([*flags, *_small(work / "cal.txt"), f"runs_dir={runs}", *overrides], work, work / log)


def _metrics(runs: Path) -> dict[str, dict]:
    return {Path(r["dir"]).name: r["metrics"] for r in scan_runs(runs / "main").runs}


def _runs_started(text: str) -> list[str]:
    return re.findall(r"\] - run ([0-9a-f]{12}) →", text)


def _check_records(runs: Path, expected: dict[str, dict], n: int = 4) -> dict[str, dict]:
    """Every run done and readable, none damaged, one table row each; metrics equal ``expected``."""
    from analysis.table import frame

    scan = scan_runs(runs / "main")
    got = {Path(r["dir"]).name: r["metrics"] for r in scan.runs}
    CHECKED["runs"] += n
    CHECKED["lost"] += n - len(got)
    assert len(got) == n and not scan.damaged and not scan.unfinished, (got.keys(), scan)
    rows = len(frame(runs / "main"))
    CHECKED["merged"] += n - rows
    assert rows == n
    for rid, m in got.items():
        assert m["ppl"] == pytest.approx(expected[rid]["ppl"], rel=1e-6), rid
    left = [f for d in (runs / "main", runs / ".transforms") for f in d.rglob(".*.tmp") if ".hydra" not in f.parts]
    assert not [f for f in left if f.parent != runs / "main"], f"a killed writer's temporary files were left: {left}"
    return got


def _run_dir(work: Path, runs: Path, overrides: list[str]) -> Path:
    """The record folder a launch with ``overrides`` (and the small settings) computes."""
    from hydra import compose, initialize_config_dir

    from quantmla.run import conf_dir, plan

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("run", overrides=[*_small(work / "cal.txt"), f"runs_dir={runs}", *overrides])
    return plan(cfg).run_record().dir


@pytest.fixture(scope="module")
def reference(work):
    """Two identical sweeps launched at once (jobs in other orders), in a fresh folder.

    The run both sweeps take second (C4R4, 128 recent) is locked here, as another process computing it
    would, until both launches say they wait for it: each then meets the other at it, however fast
    their first jobs were on the machine."""
    from filelock import FileLock

    from quantmla.files import LOCK_NAME

    runs = work / "concurrent"
    held = _run_dir(work, runs, ["bits=c4r4", "protect.recent=128"])
    held.mkdir(parents=True)
    lock = FileLock(str(held / LOCK_NAME))
    lock.acquire()
    start = time.monotonic()
    a, b = _launch(work, runs, SWEEP_A, "a.log"), _launch(work, runs, SWEEP_B, "b.log")
    try:
        waiting = f"waiting for run {held.name}"
        while time.monotonic() - start < 300 and a.proc.is_alive() and b.proc.is_alive():
            if waiting in a.output() and waiting in b.output():
                break
            time.sleep(0.1)
    finally:
        lock.release()
    codes = a.wait(), b.wait()
    FAULTS["concurrent launches"] += 2
    logs = (a.output(), b.output())
    return SimpleNamespace(runs=runs, codes=codes, logs=logs, held=held.name, seconds=time.monotonic() - start)


def test_concurrent_identical_sweeps_compute_each_run_once(reference):
    assert reference.codes == (0, 0), reference.logs[0][-3000:] + reference.logs[1][-3000:]
    started = [_runs_started(log) for log in reference.logs]
    every = started[0] + started[1]
    CHECKED["twice"] += len(every) - len(set(every))
    assert len(every) == len(set(every)) == 4, started  # each run computed by one launch only
    got = _check_records(reference.runs, _metrics(reference.runs))
    assert set(every) == set(got)
    both = "".join(reference.logs)
    assert both.count("QuantMLA RoPE path step 100/100") == 1  # the shared RoPE transforms learned once
    assert both.count("QuantMLA content path step 100/100") == 2  # C4 and C2
    for log in reference.logs:  # each said what it waited for; the one that did not compute it skipped it
        assert f"waiting for run {reference.held}" in log, log[-3000:]
    assert f"skip {reference.held} (done by another process while this one waited)" in both
    assert len(list((reference.runs / "main" / ".hydra").iterdir())) == 2  # a Hydra folder per launch


def _launched(launch: Launch) -> float:
    """Wait until ``launch`` has composed its jobs (Hydra's "Launching" line) or ended; the time then."""
    while "Launching" not in launch.output() and launch.proc.is_alive():
        time.sleep(0.02)
    return time.monotonic()


@pytest.fixture(scope="module")
def killed(work):
    """A two-job sweep killed with SIGKILL at random points, relaunched each time, then once more.

    Kill times are fractions of the sweep's own work, measured first on an undisturbed launch in
    another folder (the time from "Launching" to its end): at most 0.3 of it after "Launching", so
    the first three launches die mid-sweep on a fast machine as on a slow one."""
    timing = _launch(work, work / "timing", SWEEP_K, "timing.log")
    start = _launched(timing)
    assert timing.wait() == 0, timing.output()[-3000:]
    work_s, compose_s = time.monotonic() - start, start - timing.started
    runs, rng, kills, i = work / "killed", random.Random(SEED), 0, 0
    while kills < 4 and i < 10:
        launch = _launch(work, runs, SWEEP_K, f"kill{i}.log")
        if rng.random() < 0.8:  # most kills while the jobs run: training, checkpoints, transforms, records
            _launched(launch)
            time.sleep(rng.uniform(0.02, 0.3) * work_s)
        else:  # the others while the launch still validates and composes its jobs
            time.sleep(rng.uniform(0.0, 1.0) * compose_s)
        kills += launch.kill(signal.SIGKILL)
        launch.wait()
        i += 1
    FAULTS["kill -9"] += kills
    last = _launch(work, runs, SWEEP_K, "last.log")
    return SimpleNamespace(runs=runs, kills=kills, code=last.wait(), log=last.output(), work_s=work_s)


def test_kill_9_at_random_points_loses_and_merges_nothing(killed, reference):
    assert killed.kills >= 3, f"{killed.kills} kills landed before the sweep ended ({killed.work_s:.1f} s of work)"
    assert killed.code == 0, killed.log[-3000:]
    _check_records(killed.runs, _metrics(reference.runs), n=2)


def test_damaged_records_and_caches_are_set_aside_and_recomputed(work, killed, reference):
    """The killed sweep's folder, once complete, damaged in every artifact a relaunch reads back."""
    runs = killed.runs
    records = {}
    for rid in _metrics(runs):
        cfg = yaml.safe_load((runs / "main" / rid / "config.yaml").read_text())
        records[cfg["bits"]["name"]] = runs / "main" / rid
    r1, r2 = records["c4r4"], records["c2r4"]
    m = (r1 / "metrics.json").read_bytes()
    (r1 / "metrics.json").write_bytes(m[: len(m) // 2])  # truncated, status still done
    (r2 / "status").write_bytes(b"\xff\x00\xfe")  # undecodable
    (r2 / "config.yaml").write_text("")  # empty
    entries = {}  # "C4", "P4", "C2" -> the transforms entry's folder
    for f in runs.rglob("transforms.safetensors"):
        meta = json.loads((f.parent / "config.json").read_text())
        entries[meta["path"] + meta["bits"]] = f.parent
    (entries["C4"] / "transforms.safetensors").write_bytes(os.urandom(4096))  # corrupt
    t = (entries["P4"] / "transforms.safetensors").read_bytes()
    (entries["P4"] / "transforms.safetensors").write_bytes(t[: len(t) // 3])  # truncated
    marker = work / "pwned"
    _plant_malicious_checkpoint(entries["P4"] / "checkpoint.pt", marker)
    FAULTS["truncated files"] += 2
    FAULTS["corrupt files"] += 3
    FAULTS["malicious checkpoints"] += 1

    again = _launch(work, runs, SWEEP_K, "damaged.log")
    assert again.wait() == 0, again.output()[-3000:]
    log = again.output()
    assert not marker.exists(), "the crafted checkpoint's code ran"
    assert sorted(_runs_started(log)) == sorted([r1.name, r2.name])
    assert "QuantMLA C path: reusing" in log  # C2 was intact: reused, not learned again
    for folder, name, why in (
        (r1, "metrics.json", "not JSON"),
        (r2, "status", "not UTF-8 text"),
        (r2, "config.yaml", "empty"),
        (entries["C4"], "transforms.safetensors", ""),
        (entries["P4"], "transforms.safetensors", ""),
        (entries["P4"], "checkpoint.pt", "refused: it holds an object (posix.system)"),
    ):
        assert f"{folder / name} is damaged ({why}" in log, (name, log[-4000:])
        assert len(list(folder.glob(f"{name}.corrupt-*"))) == 1, name
    _check_records(runs, _metrics(reference.runs), n=2)


def _plant_malicious_checkpoint(path: Path, marker: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"key": "x", "step": 3, "params": Payload()}, path)


def test_the_planted_checkpoint_runs_code_under_plain_unpickling(tmp_path):
    """What the harness refuses is really dangerous: ``weights_only=False`` runs it."""
    marker = tmp_path / "ran"
    _plant_malicious_checkpoint(tmp_path / "checkpoint.pt", marker)
    torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert marker.exists()


def test_sigterm_and_sigint_save_the_training_checkpoint(work):
    runs = work / "signals"
    # More steps than any machine runs before the signal, and no validation checkpoint among them:
    # checkpoints at step 0, then on signals only (at 400 steps a fast machine finished the resumed run).
    total = 100_000
    long = ["bits=c4r4", f"method.steps={total}", f"method.val_every={total}"]
    steps = []
    for signum, log in ((signal.SIGTERM, "term.log"), (signal.SIGINT, "int.log")):
        launch = _launch(work, runs, long, log)
        deadline = time.monotonic() + 120

        def training() -> bool:  # the step-0 checkpoint written, or the one of the last launch resumed
            return "resuming from step" in launch.output() if steps else bool(list(runs.rglob("checkpoint.pt")))

        while not training() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # inside the training loop
        assert launch.kill(signum)
        assert launch.wait() == 128 + signum, launch.output()[-3000:]
        FAULTS[signal.Signals(signum).name] += 1
        (ckpt,) = runs.rglob("checkpoint.pt")
        steps.append(torch.load(ckpt, weights_only=True)["step"])
        (status,) = runs.rglob("status")
        assert status.read_text().strip() == "interrupted"
    assert 0 < steps[0] < steps[1] < total, steps  # each signal saved the step it reached


def test_a_multirun_with_failures_lists_them_all_and_tables_the_rest(work, tmp_path):
    from quantmla.models.tiny import build

    good = tmp_path / "good"
    model, tok = build()
    model.save_pretrained(good)
    tok.save_pretrained(good)
    bad = [broken_checkpoint(good, tmp_path / f"broken{i}") for i in (1, 2)]
    runs = tmp_path / "runs"
    argv = ["-m", "model=local", f"model.path={good},{bad[0]},{bad[1]}", "logger=none", "eval.source=news"]
    launch = Launch([*argv, "eval.seq_len=64", "eval.max_tokens=128", f"runs_dir={runs}"], tmp_path, tmp_path / "m.log")
    assert launch.wait() == 1
    out = launch.output()
    FAULTS["failing jobs"] += 2
    assert "2 of 3 jobs failed:" in out
    for b in bad:
        assert f"model.path={b} logger=none" in out and "RuntimeError: You set `ignore_mismatched_sizes`" in out
    assert " ".join(out.split()).count("| local | rtn | C16R16 |") == 1  # the table of what finished
    scan = scan_runs(runs)
    assert len(scan.runs) == 1 and scan.unfinished == {"failed": 2}


def test_two_writers_of_one_status_file_never_collide(tmp_path):
    """Every record file used one temporary name: two processes writing it raced (os.replace found
    the other's file gone, 467 and 570 times in 5,000 writes)."""
    target = tmp_path / "status"
    procs = [context().Process(target=hammer, args=(str(target), f"{s}\n", 1000)) for s in ("running", "done")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    FAULTS["concurrent writers"] += 2
    assert [p.exitcode for p in procs] == [0, 0]
    assert target.read_text() in ("running\n", "done\n") and not list(tmp_path.glob(".*.tmp"))


# ----- the lm-eval response cache ------------------------------------------------------------------------
def _fake_lm():
    from lm_eval.api.model import LM

    from quantmla.evals.responses import ResponseCache

    class Model(LM):
        def __init__(self):
            super().__init__()
            self.asked = 0

        def loglikelihood(self, requests, disable_tqdm=False):
            self.asked += len(requests)
            return [(-float(len(r.args[1])), True) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            return [-1.0 for _ in requests]

        def generate_until(self, requests, disable_tqdm=False):
            return ["out" for _ in requests]

    class Cached(ResponseCache, Model):
        pass

    return Cached()


def test_lm_eval_responses_are_checked_when_read_back(tmp_path, caplog):
    import sqlite3

    reqs = [SimpleNamespace(args=("context", "x" * i)) for i in range(1, 5)]
    path = tmp_path / "lm_eval_responses.sqlite"
    first = _fake_lm()
    first.keep_responses(path)
    want = first.loglikelihood(reqs)
    first.responses.close()
    again = _fake_lm()
    again.keep_responses(path)
    assert again.loglikelihood(reqs) == want and again.asked == 0  # all four from the file
    with again.responses.db:  # a row that is not JSON, and one holding a pickle
        rows = again.responses.db.execute("SELECT key FROM responses ORDER BY key").fetchall()
        again.responses.db.execute("UPDATE responses SET value = 'not json' WHERE key = ?", rows[0])
        again.responses.db.execute(
            "UPDATE responses SET value = ? WHERE key = ?", (b"\x80\x04cos\nsystem\n.", rows[1][0])
        )
    again.responses.close()
    FAULTS["damaged cache rows"] += 2
    third = _fake_lm()
    third.keep_responses(path)
    assert third.loglikelihood(reqs) == want and third.asked == 2  # the two damaged ones asked again
    third.responses.close()
    path.write_bytes(os.urandom(8192))  # not a database at all
    for f in tmp_path.glob("lm_eval_responses.sqlite-*"):
        f.unlink()  # its WAL files
    FAULTS["corrupt files"] += 1
    fourth = _fake_lm()
    fourth.keep_responses(path)
    assert fourth.loglikelihood(reqs) == want and fourth.asked == 4
    assert len(list(tmp_path.glob("lm_eval_responses.sqlite.corrupt-*"))) == 1
    assert isinstance(fourth.responses.db, sqlite3.Connection)


def test_an_unreadable_eval_mirror_is_set_aside_and_built_again(tmp_path, monkeypatch):
    from quantmla.evals import mirrors

    built = []

    def build(root):  # the real build takes a minute: only its product matters here
        root.mkdir(parents=True)
        (root / "manifest.json").write_text(json.dumps({"tasks": {}, "datasets": {}}))
        built.append(root)

    monkeypatch.setenv("QUANTMLA_CACHE", str(tmp_path))
    monkeypatch.setattr(mirrors, "_build", build)
    root = mirrors.folder()
    (root / "manifest.json").write_text('{"tasks": {"hellasw')  # truncated
    FAULTS["truncated files"] += 1
    assert mirrors.folder() == root and len(built) == 2
    assert json.loads((root / "manifest.json").read_text())["tasks"] == {}
    assert len(list(root.parent.glob(f"{root.name}.corrupt-*"))) == 1
