"""QuantMLA calibration mechanics: recipe defaults, schedule, cache reuse, Ctrl-C resume, bad
input before any optimisation, a reduced-budget run through the harness, the ablation sweep."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from mla_fixtures import installed, method_context
from omegaconf import OmegaConf
from safetensors import safe_open

from quantmla import methods, mla
from quantmla.data import CalibrationData, DataUnavailable
from quantmla.methods.quantmla import QuantMLAConfig
from quantmla.optim import Schedule, batch_indices
from quantmla.run import ConfigError, conf_dir, jobs_of, run, validate_argv


def test_defaults_are_the_papers_recipe():
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("run", overrides=["method=quantmla"])
    m, c = cfg.method, cfg.calibration
    assert (m.steps, m.warmup, m.grad_clip, m.val_every) == (300, 0.1, 1.0, 20)
    assert (m.lr_rotation, m.lr_content_scale, m.lr_angle, m.lr_rope_scale, m.anchor) == (3e-3, 1e-3, 1e-3, 1e-3, 1e-4)
    assert list(m.alphas) == [0.0, 0.125, 0.25, 0.5, 0.75, 1.0] and m.percentile == 99.9 and m.log_scale_clip == 2.0
    assert (m.content_objective, m.rope_objective, m.select) == ("output", "qk", "best")
    assert (c.seq_len, c.train, c.heldout, c.batch_size, c.seed, c.split) == (2048, 128, 32, 4, 0, "train")
    assert QuantMLAConfig(**{k: v for k, v in m.items() if k not in ("_target_", "name")}) == QuantMLAConfig()


def test_schedule_and_data_order():
    s = Schedule(steps=300, warmup=0.1)
    f = [s.lr_factor(k) for k in range(300)]
    assert s.warmup_steps == 30 and f[0] == pytest.approx(1 / 30) and f[29] == 1.0 and f[30] == 1.0
    assert all(a >= b for a, b in zip(f[30:], f[31:])) and f[-1] < 1e-3  # cosine down towards 0
    order = torch.cat([batch_indices(k, 4, 128, 0) for k in range(32)])
    assert sorted(order.tolist()) == list(range(128))  # 32 steps = one epoch, each window once
    assert torch.equal(batch_indices(40, 4, 128, 0), batch_indices(40, 4, 128, 0))
    assert not torch.equal(batch_indices(40, 4, 128, 0), batch_indices(40, 4, 128, 1))
    assert sorted(torch.cat([batch_indices(k, 3, 10, 0) for k in range(10)]).tolist()) == sorted(list(range(10)) * 3)


@pytest.mark.slow
def test_cache_reuse_and_resume_after_ctrl_c(tmp_path):
    model, tok, _ = installed("tiny")
    cfg = QuantMLAConfig(steps=6, val_every=2)
    ref = methods.get(cfg).calibrate(model, mla.adapters(model), method_context(tok, tmp_path / "a"))

    m = methods.get(cfg)

    def interrupt(step):
        if step == 3:
            raise KeyboardInterrupt

    m.on_step = interrupt
    with pytest.raises(KeyboardInterrupt):
        m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path / "b"))
    ckpt = list((tmp_path / "b").rglob("checkpoint.pt"))
    assert len(ckpt) == 1 and torch.load(ckpt[0], weights_only=True)["step"] == 3

    m = methods.get(cfg)
    seen = []
    m.on_step = seen.append
    state = m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path / "b"))
    assert seen == [4, 5, 6] + [1, 2, 3, 4, 5, 6]  # content resumed after step 3, then the RoPE path
    assert state.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(state[k], ref[k], atol=1e-6), k
    assert not list((tmp_path / "b").rglob("checkpoint.pt"))

    files = sorted((tmp_path / "b").rglob("transforms.safetensors"))
    assert len(files) == 2
    with safe_open(str(files[0]), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["method"])["steps"] == 6 and json.loads(meta["calibration"])["seq_len"] == 64
    assert json.loads((files[0].parent / "config.json").read_text())["result"]["history"][0][0] == 0

    m = methods.get(cfg)
    m.on_step = lambda step: pytest.fail("a cached calibration must not train")
    again = m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path / "b"))
    assert (m.info["cached_C"], m.info["cached_P"]) == (1, 1)
    assert all(torch.equal(again[k], state[k]) for k in state)

    m = methods.get(cfg)
    m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path / "b", bits="c2r4"))
    assert (m.info["cached_C"], m.info["cached_P"]) == (0, 1)  # C2 needs its own content path; RoPE is shared


@pytest.mark.slow
def test_ablation_switches_choose_the_paths(tmp_path):
    model, tok, _ = installed("tiny")
    m = methods.get(QuantMLAConfig(steps=2, val_every=1, paths={"rope": False}))
    state = m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path))
    assert {k.split(".")[1] for k in state} == {"R_C", "s_C"}
    m = methods.get(QuantMLAConfig(steps=2, val_every=1, paths={"content": False}))
    state = m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path))
    assert {k.split(".")[1] for k in state} == {"theta_P", "s_P"}
    assert m.info["cached_P"] == 0 and "cached_C" not in m.info


@pytest.mark.slow
def test_matmul_precision_holds_during_calibration_only_and_keys_the_transforms(tmp_path):
    """``matmul_precision`` is torch's float32 product precision while a path trains, the previous one
    after; a stored entry computed at another precision is not reused, and at ``highest`` (IEEE, what
    entries and runs made before the setting used) neither the entry's key nor the run's id names it."""
    from quantmla.tracking import run_id

    model, tok, _ = installed("tiny")
    torch.set_float32_matmul_precision("medium")
    try:
        for precision, reused in (("highest", None), ("high", 0), ("high", 1)):
            m = methods.get(QuantMLAConfig(steps=2, val_every=1, paths={"rope": False}, matmul_precision=precision))
            seen = []
            m.on_step = lambda step: seen.append(torch.get_float32_matmul_precision())
            m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path))
            assert seen == ([] if reused else [precision] * 2)
            assert torch.get_float32_matmul_precision() == "medium"
            if reused is not None:
                assert m.info["cached_C"] == reused
    finally:
        torch.set_float32_matmul_precision("highest")
    entries = {json.loads(f.read_text())["method"] for f in tmp_path.rglob("config.json")}
    assert len(entries) == 2  # highest and high: two entries
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("run", overrides=["method=quantmla", "bits=c4r4"]), resolve=True)
    assert cfg["method"]["matmul_precision"] == "highest"
    before = json.loads(json.dumps(cfg))
    del before["method"]["matmul_precision"]
    assert run_id(cfg) == run_id(before)
    cfg["method"]["matmul_precision"] = "high"
    assert run_id(cfg) != run_id(before)
    assert "matmul_precision 'tf32' is not one of highest, high, medium" in _plan_error("method.matmul_precision=tf32")


def _hold(*folders):
    """Hold the locks of ``folders`` from another thread until the returned event is set."""
    import threading

    from filelock import FileLock

    from quantmla.files import LOCK_NAME

    held, release = threading.Event(), threading.Event()

    def hold():
        locks = [FileLock(str(f / LOCK_NAME)) for f in folders]
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait(30)
        for lock in locks:
            lock.release()

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(10)
    return release


def test_first_writer_takes_a_free_folder_and_waits_only_when_all_are_held(tmp_path):
    import threading

    from filelock import FileLock, Timeout

    from quantmla.files import LOCK_NAME, first_writer

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    release_a = _hold(a)
    with first_writer({"a": a, "b": b}, str) as key:
        assert key == "b"
        with pytest.raises(Timeout):  # b is held while the block runs
            FileLock(str(b / LOCK_NAME)).acquire(timeout=0)
    release_a.set()
    release_both = _hold(a, b)
    threading.Timer(0.3, release_both.set).start()
    with first_writer({"a": a, "b": b}, str) as key:
        assert key == "a"  # every one held: it waited for the first


@pytest.mark.slow
def test_a_path_another_process_computes_is_waited_for_after_the_free_one(tmp_path):
    """While another holder computes the content entry, a calibration needing both paths trains the
    RoPE path first, then waits for the content entry (and, finding none stored, trains it)."""
    import threading

    model, tok, _ = installed("tiny")
    probe = methods.get(QuantMLAConfig(steps=2, val_every=1, paths={"rope": False}))
    probe.calibrate(model, mla.adapters(model), method_context(tok, tmp_path))
    content = probe.stored["C"]
    (content / "transforms.safetensors").unlink()  # gone: whoever takes the lock computes it
    release = _hold(content)
    m = methods.get(QuantMLAConfig(steps=2, val_every=1))
    done = threading.Event()
    t = threading.Thread(
        target=lambda: (m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path)), done.set())
    )
    t.start()
    try:
        for _ in range(600):  # the RoPE entry appears while the content lock is still held elsewhere
            if "P" in m.stored and (m.stored["P"] / "transforms.safetensors").exists():
                break
            t.join(0.1)
        assert (m.stored["P"] / "transforms.safetensors").exists() and not done.is_set()
        assert [k for k in m.info if k.startswith("step_")] == ["step_P"]
    finally:
        release.set()
    t.join(120)
    assert done.is_set() and (m.info["cached_C"], m.info["cached_P"]) == (0, 0)
    assert (content / "transforms.safetensors").exists()


def _plan_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate_argv(["model=tiny", "logger=none", "method=quantmla", "bits=c4r4", *overrides])
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_input_is_a_one_line_error_before_anything_heavy(tmp_path):
    assert "steps must be at least 1" in _plan_error("method.steps=0")
    assert "unknown ablation switch 'attention'" in _plan_error("+method.paths.attention=false")
    assert "protect.enabled" in _plan_error("+method.paths.protect=false")
    assert "unknown content_objective" in _plan_error("method.content_objective=kl")
    assert _plan_error(f"calibration.source={tmp_path / 'none.txt'}").startswith("no calibration data available")
    with pytest.raises(ValueError, match="steps must be at least 1"):
        QuantMLAConfig(steps=-3)


def test_missing_or_short_data_stops_before_any_optimisation(tmp_path):
    model, tok, _ = installed("tiny")
    short = tmp_path / "short.txt"
    short.write_text("Too short a text to hold one calibration window of 2048 bytes. " * 10)
    for cal, err, msg in [
        (CalibrationData(source=str(tmp_path / "gone")), DataUnavailable, "no calibration data available"),
        (CalibrationData(source=str(short)), ValueError, "sequence length 2048 is longer than the data"),
    ]:
        m = methods.get(QuantMLAConfig(steps=2))
        m.on_step = lambda step: pytest.fail("optimised despite bad data")
        with pytest.raises(err, match=msg):
            m.calibrate(model, mla.adapters(model), method_context(tok, tmp_path / "cache", calibration=cal))
        assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_reduced_budget_calibration_through_the_harness(tmp_path):
    common = [
        "model=tiny",
        "method=quantmla",
        "logger=none",
        f"runs_dir={tmp_path}",
        "model=tiny",
        "sweep=quantmla",
        "calibration=quick",
        "method.steps=4",
        "method.val_every=2",
        "calibration.seq_len=128",
        "calibration.train=4",
        "calibration.heldout=4",
        "eval.seq_len=128",
        "eval.max_tokens=512",
        "protect.enabled=false",
    ]
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        m4 = run(compose("run", overrides=[*common, "bits=c4r4"]))
        m2 = run(compose("run", overrides=[*common, "bits=c2r4"]))
    assert m4["ppl"] > 1 and m2["ppl"] > 1
    assert m4["method"]["cached_P"] == 0 and m2["method"]["cached_P"] == 1
    assert m4["method"]["fusion_nll_drift"] < 1e-4
    assert len(list((tmp_path / ".transforms" / "quantmla").glob("*/transforms.safetensors"))) == 3
    from analysis.table import frame

    df = frame(tmp_path / "quantmla")  # settings that differ from conf/method/quantmla.yaml label the rows
    assert sorted(df["bits"]) == ["C2R4", "C4R4"] and set(df["variant"]) == {"steps=4 val_every=2"}


@pytest.mark.slow
def test_table3_ablation_sweep_composes_the_papers_rows():
    validate_argv(["-m", "experiment=table3_ablation", "model=tiny", "logger=none"])  # every row is valid
    jobs = jobs_of(["experiment=table3_ablation", "model=tiny"])
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        rows = []
        for job in jobs:
            c = compose("run", overrides=job)
            paths = c.method.get("paths")
            rows.append((c.method.name, c.bits.name, bool(c.protect.enabled), None if paths is None else dict(paths)))
    both = {"content": True, "rope": True}
    assert rows == [
        ("rtn", "c16r16", True, None),  # one BF16 run whatever the protection (run.unquantized_reference)
        ("rtn", "c4r4", False, None),
        ("smoothquant", "c4r4", False, None),
        ("quarot", "c4r4", False, None),
        ("quantmla", "c4r4", False, {"content": True, "rope": False}),
        ("quantmla", "c4r4", False, both),
        ("quantmla", "c4r4", True, both),
    ]


def test_a_signal_during_an_update_saves_the_step_it_completes(tmp_path):
    """SIGINT arriving inside ``opt.step()`` is held until the update ends: the checkpoint holds the
    step just completed, not the one of the last validation (here step 0), and the parameters after it."""
    import os
    import signal

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from quantmla.optim import Schedule, train_path

    class Path1:  # one parameter vector pulled towards 1
        needs_outputs = False

        def __init__(self):
            self.w = torch.zeros(4, requires_grad=True)

        def param_groups(self):
            return [{"params": [self.w], "lr": 0.1}]

        def loss(self, lb, ste):
            return ((self.w - 1) ** 2).sum().reshape(1)

        def anchor(self):
            return self.w.sum() * 0

        def snapshot(self):
            return {"w": [self.w.detach().clone()]}

        def restore(self, snap):
            with torch.no_grad():
                self.w.copy_(snap["w"][0])

    class Bank:  # a teacher of 4 windows whose layers the path does not read
        batch_size = 2

        def __len__(self):
            return 4

        def layers(self, idx):
            yield None

        def __iter__(self):
            yield 2, iter([None])
            yield 2, iter([None])

    def interrupt_inside_step(opt, args, kwargs):
        if len(opt.state) and next(iter(opt.state.values()))["step"] == 2:  # the third update
            os.kill(os.getpid(), signal.SIGINT)

    path, ckpt = Path1(), tmp_path / "checkpoint.pt"
    handle = register_optimizer_step_pre_hook(interrupt_inside_step)
    try:
        with pytest.raises(KeyboardInterrupt):
            train_path(path, Bank(), Bank(), Schedule(steps=10, val_every=100), 0, ckpt, key="k", progress=False)
    finally:
        handle.remove()
    saved = torch.load(ckpt, weights_only=True)
    assert saved["step"] == 3
    assert torch.equal(saved["params"]["w"][0], path.w.detach())
    assert 0 < float(path.w[0]) < 1


def test_held_out_mean_adds_on_the_device_exactly_as_the_host_did():
    """Validation sums each layer's losses on the device and reads them once; the value is the host
    float64 sum of each layer's float32 total, added in the same order, to the last bit."""
    from quantmla.calibration import Teacher, heldout_mean

    model, _, _ = installed("tiny")
    ids = torch.randint(0, 200, (5, 24), generator=torch.Generator().manual_seed(0))

    def fn(lb):  # per-window losses of very different sizes, so the order of additions matters
        return {
            "a": lb.C.float().pow(2).mean(dim=(1, 2, 3)) * 1e3**lb.index,
            "b": lb.K_P.float().abs().amax(-1).sum((1, 2)),
        }

    got = heldout_mean(Teacher(model, ids, 2, outputs=False), fn, progress=False)
    sums, count = {}, 0
    for windows, layers in Teacher(model, ids, 2, outputs=False):
        layers = list(layers)
        for lb in layers:
            for k, v in fn(lb).items():
                sums[k] = sums.get(k, 0.0) + float(v.sum())
        count += windows * len(layers)
    assert got == {k: v / count for k, v in sums.items()}
