"""Every field the plan uses is checked for type and range before anything loads, and what only spells
one computation differently (CxRy's case) gives one run id; unknown keys are refused.

Each case is one line from ``validate_argv`` (the command line prints it and exits 2,
tests/test_run.py::test_bad_input_one_line_before_loading runs a few end to end)."""

import json
import os

import pytest
from hydra import compose, initialize_config_dir
from safetensors.torch import save_file
from test_run import HYDRA_REFUSALS

from quantmla.run import ConfigError, conf_dir, plan, validate_argv

BASE = ["model=tiny", "logger=none"]


def _error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate_argv([*BASE, *overrides])
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


def _plan(*overrides):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return plan(compose("run", overrides=[*BASE, *overrides]))


@pytest.mark.parametrize(
    "overrides,expect",
    [
        (["seed=abc"], "seed must be an integer, got 'abc'"),
        (["seed=1.5"], "seed must be an integer, got 1.5"),
        (["model.dtype=nosuch"], "unknown dtype 'nosuch'"),
        (["eval.seq_len=5000", "eval.max_tokens=5000"], "ppl seq_len 5000 exceeds the model's context (4096 tokens"),
        (["runs_dir="], "runs_dir must not be empty"),
        (["sweep="], "sweep must not be empty"),
        (["bits.group=32.5"], "bits.group must be an integer, got 32.5"),
        (["exact='false'"], "exact must be true or false (unquoted), got 'false'"),
        (["exact=maybe"], "exact must be true or false, got 'maybe'"),
        (["protect.enabled=maybe"], "protect.enabled must be true or false, got 'maybe'"),
        (["protect.recent=1e3"], "protect.recent must be an integer, got 1000.0"),
        (["+typo=1"], "unknown config key 'typo'"),
        (["+bits.typo=1"], "unknown key bits.typo; bits takes: name, group"),
        (
            ["+model.typo=1"],
            "unknown key model.typo; model takes: device_map, max_memory, offload_folder, name, seed, layers",
        ),
        (["method=quantmla", "method.warmup=abc"], "method.warmup must be a number, got 'abc'"),
        (["calibration.seq_len=64.5"], "calibration.seq_len must be an integer, got 64.5"),
        (["device=foo"], "device 'foo' is not a device name (auto, cpu, cuda or cuda:N)"),
        (["eval=suite_a", "eval.scoring_tokens=0"], "lm_eval scoring_tokens must be a positive integer or null, got 0"),
        (["eval=suite_a", "eval.share_prefix=0"], "lm_eval share_prefix must be a positive integer or null, got 0"),
        (["eval=lm_eval", "eval.share_prefix=64"], "lm_eval share_prefix needs scoring_tokens"),
    ],
)
def test_refused_before_loading_with_one_line(overrides, expect):
    assert expect in _error(*overrides)


@pytest.mark.parametrize(
    "overrides,lines",
    [
        *HYDRA_REFUSALS,
        (
            ["-m", "bits=glob(c*"],
            [
                "no viable alternative at input 'glob(c*'",
                "See https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details",
            ],
        ),
    ],
)
def test_what_hydra_refuses_keeps_hydras_whole_text(overrides, lines):
    with pytest.raises(ConfigError) as e:
        validate_argv([*BASE, *overrides])
    text = str(e.value).splitlines()
    for line in lines:
        assert line in text, str(e.value)


def test_glob_sweeps_expand_to_the_groups_options():
    """``glob()`` names a group's options as Hydra's sweeper does; every job is checked."""
    from quantmla.run import jobs_of

    jobs = jobs_of([*BASE, "bits=glob(c*r4)", "seed=1,2"])
    assert sorted(j[2:] for j in jobs) == [
        ["bits=c2r4", "seed=1"],
        ["bits=c2r4", "seed=2"],
        ["bits=c4r4", "seed=1"],
        ["bits=c4r4", "seed=2"],
    ]
    validate_argv(["-m", *BASE, "bits=glob(c*)"])
    msg = _error("-m", "bits=glob(c*r4)", "bits.group=48")  # the c2r4 and c4r4 jobs: both refuse a group of 48
    assert msg == "group size 48 does not divide the content latent width 128"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="this machine has CUDA")
def test_cuda_without_cuda_says_so():
    assert _error("device=cuda") == "device=cuda: CUDA is not available on this machine (device=cpu or device=auto)"
    assert "CUDA is not available" in _error("device=cuda:1")


def test_runs_dir_must_be_a_writable_folder(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert _error(f"runs_dir={afile}") == f"runs_dir: {afile} is not a folder"
    assert _error(f"runs_dir={afile}/below") == f"runs_dir: {afile} is not a folder"
    if os.geteuid() == 0:  # root writes through permission bits: a read-only file system instead
        readonly = "/sys/quantmla-runs"
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        readonly = str(tmp_path / "ro" / "runs")
    assert "runs_dir: cannot write in" in _error(f"runs_dir={readonly}")
    assert not list(tmp_path.rglob("status"))
    validate_argv([*BASE, f"runs_dir={tmp_path / 'new' / 'folder'}"])  # a folder still to make is fine
    assert not (tmp_path / "new").exists()  # and checking made nothing


def test_calibration_text_too_short_is_refused_before_loading(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A text of a few hundred bytes. " * 10)
    msg = _error("method=quantmla", "bits=c4r4", f"calibration.source={short}", "calibration=quick")
    assert msg.startswith(f"calibration text '{short}' (train) is too short: 16 + 8 windows of 256 tokens need 6144")
    validate_argv([*BASE, "method=rtn", f"calibration.source={short}"])  # RTN reads none


def test_weights_of_another_model_under_an_mla_config_are_refused(tmp_path):
    """A Llama checkpoint with a DeepseekV2 config beside it: the tensor names in the safetensors
    header say what the weights are, before transformers would initialise MLA at random."""
    import torch

    from quantmla.models.tiny import tiny_config

    d = tmp_path / "llama-weights"
    d.mkdir()
    tiny_config().save_pretrained(d)
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"]
    save_file({n: torch.zeros(4, 4) for n in names}, str(d / "model.safetensors"))
    msg = _error("model=local", f"model.path={d}")
    assert "have no MLA attention (kv_a_proj_with_mqa) (attention tensors: k_proj, o_proj, q_proj, v_proj)" in msg
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}")
    assert "is not a readable safetensors file" in _error("model=local", f"model.path={d}")


@pytest.mark.slow
def test_one_computation_one_run_id():
    """CxRy in either case, an int for a float: the same computation, the same run (and record)."""
    a = _plan("bits.name=C4R4").run_record().id
    assert a == _plan("bits.name=c4r4").run_record().id == _plan("bits=c4r4").run_record().id
    assert _plan("bits.name=C4R4").record["bits"]["name"] == "c4r4"
    q = _plan("method=quantmla", "bits=c4r4", "method.warmup=0").record
    assert q["method"]["warmup"] == 0.0 and isinstance(q["method"]["warmup"], float)
    assert (
        _plan("method=quantmla", "bits=c4r4", "method.warmup=0").run_record().id
        == _plan("method=quantmla", "bits=c4r4", "method.warmup=0.0").run_record().id
    )
    assert _plan("seed=1").run_record().id != _plan("seed=0").run_record().id


@pytest.mark.slow
def test_shipped_configs_keep_their_run_ids():
    """The checks normalise nothing a shipped config already spells one way: records made before
    them are found (and skipped) by the same ids."""
    from omegaconf import OmegaConf

    from quantmla.tracking import run_id

    for overrides in (
        [],
        ["method=quantmla", "bits=c2r4"],
        ["eval=suite_a_quick"],
        ["bits=c4r4", "protect.recent=16", "exact=true"],  # (at C16R16 both are normalised away)
    ):
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("run", overrides=[*BASE, *overrides])
        assert plan(cfg).run_record().id == run_id(OmegaConf.to_container(cfg, resolve=True))
    assert json.dumps(_plan().record["protect"]) == '{"enabled": true, "sink": 4, "recent": 128}'
