"""quantmla.export: the fused model as a plain Hugging Face checkpoint that loads without quantmla,
computes what the fused model computes, and (quantization off) what the original computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open

from quantmla import attention
from quantmla.cache import CacheSpec
from quantmla.export import RECORD, export
from quantmla.run import ConfigError, conf_dir
from quantmla.tracking import run_id

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog. Attention caches a latent per token, and a key."
# short calibration; large learning rates and the last step kept, so the transforms end far from identity
QUICK = [
    "calibration=quick",
    "calibration.seq_len=128",
    "calibration.train=4",
    "calibration.heldout=2",
    "logger=none",
]
FAR = [
    "method.steps=6",
    "method.val_every=3",
    "method.lr_rotation=0.3",
    "method.lr_content_scale=0.3",
    "method.lr_angle=0.5",
    "method.lr_rope_scale=0.3",
    "method.select=last",
]
MLA_WEIGHTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "q_proj")

# Loads each folder with transformers alone: quantmla, baselines and analysis cannot even be imported.
LOADER = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("quantmla", "baselines", "analysis"):
                raise ImportError(f"{name} may not be imported here")

    sys.meta_path.insert(0, Refuse())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folders, text, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    result = {}
    for d in folders:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ids = AutoTokenizer.from_pretrained(d)(text, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
        result[d] = {"ids": ids, "logits": logits, "class": type(model).__name__}
    assert not [m for m in sys.modules if m.split(".")[0] in ("quantmla", "baselines", "analysis")]
    result["quantmla_free"] = True
    torch.save(result, out)
    """
)


def _cfg(*overrides):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("run", overrides=list(overrides))


def load_elsewhere(folders: list[Path], tmp: Path) -> dict:
    """{folder: {ids, logits, class}} from a fresh Python that never imports quantmla."""
    out = tmp / "loaded.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps([str(f) for f in folders]), TEXT, str(out)],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    loaded = torch.load(out)
    assert loaded.pop("quantmla_free")
    return {Path(k): v for k, v in loaded.items()}


def logits(model, tok, layer_spec: CacheSpec | None = None) -> torch.Tensor:
    """Logits of ``model`` on TEXT: native attention, or the harness's (unquantized) with ``layer_spec``."""
    ids = tok(TEXT, return_tensors="pt").input_ids
    if layer_spec is not None:
        attention.install(model, layer_spec)
    try:
        with torch.no_grad():
            return model(ids, use_cache=False).logits
    finally:
        attention.uninstall(model)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The tiny model exported with QuantMLA and RTN at C4R4 and QuaRot† at C4R16, the original saved
    beside them, and every folder loaded in a process without quantmla."""
    from quantmla.models.tiny import build

    root = tmp_path_factory.mktemp("export")
    runs = root / "runs"
    original = root / "original"
    model, tok = build()
    model.save_pretrained(original)
    tok.save_pretrained(original)
    made = {"original": (original, model, tok)}
    for name, extra in (
        ("quantmla", ["method=quantmla", "bits=c4r4", *FAR]),
        ("rtn", ["method=rtn", "bits=c4r4"]),
        ("quarot_c4r16", ["method=quarot", "bits.name=c4r16"]),
    ):
        cfg = _cfg("model=tiny", f"runs_dir={runs}", *QUICK, *extra)
        made[name] = export(cfg, root / name)
        made[name + ".cfg"] = cfg
    loaded = load_elsewhere([made[k][0] for k in ("original", "quantmla", "rtn", "quarot_c4r16")], root)
    return made, loaded, runs


def test_quantmla_export_loads_without_quantmla_and_computes_the_fused_model(exports):
    made, loaded, _ = exports
    folder, fused, tok = made["quantmla"]
    got = loaded[folder]
    assert got["class"] == "DeepseekV2ForCausalLM"
    assert torch.equal(got["ids"], tok(TEXT, return_tensors="pt").input_ids)  # the tokenizer came along
    assert not attention.latent_layers(fused)  # the native module tree was written
    native = logits(fused, tok)
    harness = logits(fused, tok, CacheSpec())  # the fused model as a C16R16 run computes it
    assert (got["logits"] - native).abs().max() < 1e-4
    assert (got["logits"] - harness).abs().max() < 1e-4


def test_fused_export_computes_the_original_with_other_weights(exports):
    """Fusion is exact with quantization off: the exported model's logits are the original's, while
    every MLA projection differs (and nothing else does)."""
    made, loaded, _ = exports
    original, folder = made["original"][0], made["quantmla"][0]
    assert (loaded[folder]["logits"] - loaded[original]["logits"]).abs().max() < 1e-4
    before, after = tensors(original), tensors(folder)
    assert set(after) == set(before)  # the original checkpoint's keys
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(any(w in k for w in MLA_WEIGHTS) for k in changed), changed
    for layer in range(2):
        for w in ("kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "q_proj.weight", "kv_a_layernorm.weight"):
            k = f"model.layers.{layer}.self_attn.{w}"
            assert (after[k] - before[k]).abs().max() > 1e-2 * before[k].abs().max(), k


def test_config_is_what_transformers_reads_unchanged(exports):
    made, _, _ = exports
    original, folder = made["original"][0], made["quantmla"][0]
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config == json.loads((original / "config.json").read_text())
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (folder / f).is_file(), f


def test_record_names_method_bits_run_and_stored_transforms(exports):
    made, _, runs = exports
    folder, cfg = made["quantmla"][0], made["quantmla.cfg"]
    rec = json.loads((folder / RECORD).read_text())
    from omegaconf import OmegaConf

    assert rec["method"]["name"] == "quantmla" and rec["method"]["steps"] == 6
    assert rec["bits"] == {"name": "c4r4", "content": 4, "rope": 4, "group": 64}
    assert rec["run_id"] == run_id(OmegaConf.to_container(cfg, resolve=True))
    assert rec["config"]["model"]["name"] == "tiny"
    assert set(rec["transforms"]) == {"C", "P"}
    for t in rec["transforms"].values():
        d = Path(t["dir"])
        assert d.parent == runs / ".transforms" / "quantmla" and d.name == t["key"]
        assert (d / "transforms.safetensors").is_file()
    assert rec["method_info"]["fusion_nll_drift"] < 1e-4


def test_export_again_reuses_the_stored_transforms(exports, tmp_path):
    made, _, _ = exports
    out, model, _ = export(made["quantmla.cfg"], tmp_path / "again")
    rec = json.loads((out / RECORD).read_text())
    assert rec["method_info"]["cached_C"] == 1 and rec["method_info"]["cached_P"] == 1
    first = tensors(made["quantmla"][0])
    assert all(torch.equal(v, first[k]) for k, v in tensors(out).items())


def test_rtn_export_gives_back_the_original_weights(exports):
    made, loaded, _ = exports
    before, after = tensors(made["original"][0]), tensors(made["rtn"][0])
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(loaded[made["rtn"][0]]["logits"], loaded[made["original"][0]]["logits"])
    assert json.loads((made["rtn"][0] / RECORD).read_text())["transforms"] == {}


def test_quarot_exports_when_its_rope_cache_is_not_quantized(exports):
    """C4R16: only the content Hadamard, fused offline; the export computes the original."""
    made, loaded, _ = exports
    original, folder = made["original"][0], made["quarot_c4r16"][0]
    assert (loaded[folder]["logits"] - loaded[original]["logits"]).abs().max() < 1e-4
    before, after = tensors(original), tensors(folder)
    k = "model.layers.0.self_attn.kv_b_proj.weight"
    assert not torch.equal(before[k], after[k])


def _cli(*args, cwd):
    """``python -m quantmla.export`` of this checkout (not of another installed copy), run from ``cwd``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"WANDB_MODE": "offline", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "quantmla.export", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


@pytest.mark.parametrize(
    "args,expect",
    [
        (["method=quarot", "bits=c4r4"], "cannot be exported as a plain checkpoint: QuaRot† rotates q_pe and k_pe"),
        (["bits.name=c5r4"], "content bits 5 is not supported"),
        (["bits=c4r4,c2r4"], "an export writes one model"),
        (["-m", "bits=c4r4"], "unknown option '-m'"),
        (["out=taken"], "exists and is not an earlier export"),
    ],
)
def test_bad_input_one_line_before_loading(args, expect, tmp_path, monkeypatch, capsys):
    from quantmla.export import main
    from quantmla.models import TinyModel

    def no_load(self, device="auto"):
        raise AssertionError("the model may not be loaded")

    monkeypatch.setattr(TinyModel, "load", no_load)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    args = [*args] if any(a.startswith("model=") for a in args) else ["model=tiny", *args]
    assert main([*args, f"runs_dir={tmp_path / 'runs'}", "logger=none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
    assert not (tmp_path / "runs").exists(), "nothing may be written"
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_an_unknown_group_option_is_refused_with_hydras_text(tmp_path, monkeypatch, capsys):
    from quantmla.export import main

    monkeypatch.chdir(tmp_path)
    assert main(["model=nope", f"runs_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "error: In 'run': Could not find 'model/nope'" and "Available options in 'model':" in err, err
    assert "\ttiny" in err and not (tmp_path / "runs").exists()


def test_cli_refuses_in_one_line_and_prints_help(tmp_path):
    r = _cli("model=tiny", "method=quarot", "bits=c2r4", f"runs_dir={tmp_path}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: method quarot at c2r4 cannot be exported as a plain checkpoint: QuaRot† rotates q_pe and k_pe by H_P "
        "after RoPE at every step (online: H_P does not commute with RoPE)"
    ], r.stderr
    r = _cli("--help", cwd=tmp_path)
    assert r.returncode == 0 and "out=DIR" in r.stdout, r.stderr


def test_an_online_map_found_after_calibration_is_refused(tmp_path, monkeypatch):
    """A method that does not declare its online work is still caught on the model, before writing."""
    from baselines.quarot import QuaRot

    monkeypatch.setattr(QuaRot, "online_work", lambda self, spec: None)
    cfg = _cfg("model=tiny", "method=quarot", "bits=c4r4", f"runs_dir={tmp_path}", *QUICK)
    with pytest.raises(ConfigError, match="online post-RoPE map on the attention of layers 0, 1"):
        export(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_default_folder(tmp_path):
    from omegaconf import OmegaConf

    from quantmla.export import default_out

    cfg = _cfg("model=tiny", "method=rtn", "bits=c4r4", f"runs_dir={tmp_path}", *QUICK)
    rid = run_id(OmegaConf.to_container(cfg, resolve=True))
    assert default_out(cfg) == tmp_path / "exports" / f"tiny-rtn-c4r4-{rid}"


@pytest.mark.slow
def test_embedded_model_export(tmp_path):
    """smollm2_mla at C4R4 through QuantMLA: the original checkpoint's keys, loaded without quantmla,
    the fused model's logits and the original's."""
    from quantmla.models.embedded import EmbeddedModel

    short = ["method.steps=3", "method.val_every=3"]
    cfg = _cfg("model=smollm2_mla", "method=quantmla", "bits=c4r4", f"runs_dir={tmp_path}", *QUICK, *short)
    folder, fused, tok = export(cfg, tmp_path / "smollm2")
    source = EmbeddedModel().folder()
    assert set(tensors(folder)) == set(tensors(source))
    loaded = load_elsewhere([folder, source], tmp_path)
    assert loaded[folder]["class"] == "DeepseekV2ForCausalLM"
    assert (loaded[folder]["logits"] - logits(fused, tok)).abs().max() < 1e-3
    assert (loaded[folder]["logits"] - loaded[source]["logits"]).abs().max() < 1e-3
