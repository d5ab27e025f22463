"""``model.device_map``: a model spread by accelerate, with layers offloaded and computing on another
device than the one that holds their weights, computes what the same model on one device computes.

On a CPU-only machine accelerate offloads to disk (execution device ``cpu``); the harness meets the
same thing as with CPU offload on a GPU: weights on ``meta`` between forwards, loaded by a hook.
"""

import gc
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from quantmla import placement
from quantmla.attention import install, latent_layers, new_cache
from quantmla.cache import CacheSpec
from quantmla.calibration import model_fingerprint
from quantmla.mla import adapters
from quantmla.models.tiny import build, tiny_config
from quantmla.placement import Placement
from quantmla.run import ConfigError, conf_dir, group_options, plan, run
from quantmla.sensitivity import LayerProbe, frozen_copy
from quantmla.tracking import run_id
from quantmla.transforms import LayerTransform, cayley, fuse, hadamard

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)

CONFIG = tiny_config(layers=4)  # 2.3 MiB per decoder layer in float32
BUDGET = {"cpu": "5MiB"}  # the embedding and two layers in memory, the other two on disk


def _compose(*overrides):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("run", overrides=["model=tiny", "logger=none", *overrides])


def spread(tmp_path, seed: int = 0):
    """The 4-layer tiny model spread over CPU memory and disk, and the same model left whole."""
    whole, tok = build(CONFIG, seed=seed)
    model, _ = build(CONFIG, seed=seed)
    placement.dispatch(model, Placement(device_map="auto", max_memory=BUDGET, offload_folder=str(tmp_path)))
    return model, whole, tok


def offloaded_layers(model) -> list[bool]:
    return [placement.offloaded(layer.kv_b_proj) for layer in latent_layers(model)]


# ----- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,expect",
    [
        (["model.device_map=everywhere"], "model.device_map 'everywhere' is not one of: null, auto"),
        (["model.device_map=auto", "model.max_memory={0:lots}"], "model.max_memory['0'] = 'lots' is not a size"),
        (["model.device_map=auto", "model.max_memory={0:-5}"], "is not a size"),
        (["model.device_map=auto", "model.max_memory={gpu:1GiB}"], "key 'gpu' is neither a GPU index"),
        (["model.max_memory={cpu:1GiB}"], "place a model spread by model.device_map=auto"),
        (["model.offload_folder=/tmp/x"], "place a model spread by model.device_map=auto"),
        (["model.device_map=auto", "device=cpu"], "spreads the model over the GPUs: leave device=auto"),
    ],
)
def test_bad_placement_is_refused_before_loading(overrides, expect):
    with pytest.raises(ConfigError) as e:
        plan(_compose(*overrides))
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_placement_config_is_normalised():
    p = plan(_compose("model.device_map=auto", "model.max_memory={0:20GiB,1:10GiB,CPU:200GiB}"))
    assert p.model.device_map == "auto"
    assert p.model.max_memory == {0: "20GiB", 1: "10GiB", "cpu": "200GiB"}
    assert placement.memory_budget({"cuda:1": 1024, "0": "1GB"}) == {1: 1024, 0: "1GB"}


def test_every_model_config_has_the_placement_keys_at_their_defaults():
    for option in group_options("model"):
        cfg = _compose(f"model={option}")
        assert (cfg.model.device_map, cfg.model.max_memory, cfg.model.offload_folder) == (None, None, None), option


def test_run_id_of_a_run_without_placement_is_kept():
    cfg = {"model": {"name": "tiny"}, "bits": {"name": "c4r4"}}
    unset = {"model": {"name": "tiny", "device_map": None, "max_memory": None, "offload_folder": None}}
    assert run_id(cfg | unset) == run_id(cfg)
    assert run_id(cfg | {"model": {"name": "tiny", "device_map": "auto"}}) != run_id(cfg)


def test_a_budget_of_gpu_indices_and_cpu_memory_has_a_run_id():
    # the normalised budget mixes int and str keys, which json.dumps(sort_keys=True) cannot order
    p = plan(_compose("model.device_map=auto", "model.max_memory={0:20GiB,cpu:200GiB}"))
    rid = p.run_record().id
    other = plan(_compose("model.device_map=auto", "model.max_memory={0:10GiB,cpu:200GiB}")).run_record().id
    assert len(rid) == 12 and rid != other


def test_a_bad_placement_stops_the_command_line_with_one_line(tmp_path):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [sys.executable, "-m", "quantmla.run", "model=tiny", "model.device_map=auto", "model.max_memory={0:lots}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.max_memory['0']"), r.stderr


def test_without_a_gpu_device_map_auto_needs_a_cpu_budget():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ValueError, match="found no GPU"):
        Placement(device_map="auto").budget()
    with pytest.raises(ValueError, match="names GPU 0"):
        Placement(device_map="auto", max_memory={0: "1GiB"}).budget()


def test_a_model_that_does_not_fit_is_refused_without_an_offload_folder():
    model, _ = build(CONFIG)
    with pytest.raises(ValueError, match="does not fit in model.max_memory.*model.offload_folder"):
        placement.dispatch(model, Placement(device_map="auto", max_memory=BUDGET))


# ----- the spread model computes what the whole one computes -------------------------------------
def test_spread_model_gives_the_same_quantized_logits(tmp_path):
    model, whole, _ = spread(tmp_path)
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    ids = torch.randint(3, 259, (2, 200), generator=torch.Generator().manual_seed(1))
    for m in (model, whole):
        install(m, CacheSpec.parse("c4r4"))
    where = offloaded_layers(model)
    assert any(where) and not all(where)
    assert model.model.layers[-1].self_attn.kv_b_proj.weight.is_meta
    with torch.no_grad():
        assert torch.equal(model(ids).logits, whole(ids).logits)


def test_transforms_are_fused_into_offloaded_weights(tmp_path):
    """Every kind of fusion (content rotation and scale, RoPE pairs, online post-RoPE map) on layers
    that live on disk: the weights stay offloaded, their store holds the fused values, and the
    quantized logits equal those of the same model fused on one device, even after a second fusion
    (which writes over the values already in the store)."""
    model, whole, _ = spread(tmp_path)
    g = torch.Generator().manual_seed(2)
    d_c, d_r = CONFIG.kv_lora_rank, CONFIG.qk_rope_head_dim
    transforms = [
        LayerTransform(
            R_C=cayley(0.1 * torch.randn(d_c, d_c, generator=g)),
            s_C=torch.exp(0.3 * torch.randn(d_c, generator=g)),
            theta_P=torch.randn(d_r // 2, generator=g),
            s_P=torch.exp(0.3 * torch.randn(d_r // 2, generator=g)),
            H_P=hadamard(d_r) if i % 2 else None,
        )
        for i in range(CONFIG.num_hidden_layers)
    ]
    ids = torch.randint(3, 259, (2, 150), generator=torch.Generator().manual_seed(3))
    for m in (model, whole):
        install(m, CacheSpec())
        for _ in range(2):
            for mla, t in zip(adapters(m), transforms):
                fuse(mla, t)
    with torch.no_grad():
        assert (model(ids).logits - whole(ids).logits).abs().max() <= 1e-5
    for name, p in whole.named_parameters():  # the store holds what the whole model holds
        layer = model.get_submodule(name.rpartition(".")[0])
        with placement.loaded(layer):
            assert torch.equal(getattr(layer, name.rpartition(".")[2]), p), name
    assert model.model.layers[-1].self_attn.kv_b_proj.weight.is_meta
    for m in (model, whole):
        for layer in latent_layers(m):
            layer.spec = CacheSpec.parse("c4r4")
    with torch.no_grad():
        assert (model(ids).logits - whole(ids).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("store", ["disk", "cpu_offload"])
def test_a_weight_written_while_offloaded_is_what_the_next_forward_loads(store, tmp_path):
    """A write outside any forward reaches the offload store itself (on a GPU the loaded copy of a weight
    is a different tensor from the one in CPU memory): accelerate's loader for disk offload (a new entry
    in its memory first, then that entry overwritten) and the plain CPU dict of ``cpu_offload``."""
    from accelerate import cpu_offload

    if store == "disk":
        model, _, _ = spread(tmp_path)
    else:
        model, _ = build(CONFIG)
        cpu_offload(model, execution_device="cpu")
    lin = model.model.layers[-1].self_attn.o_proj
    x = torch.randn(3, lin.in_features)
    for seed in (7, 8):
        w = torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(seed))
        placement.write(lin, "weight", w)
        assert lin.weight.is_meta
        with torch.no_grad():
            assert torch.equal(lin(x), x @ w.T)
        with placement.loaded(lin):
            assert torch.equal(lin.weight, w)


def test_a_checkpoint_spread_by_from_pretrained(tmp_path):
    """A checkpoint folder (the path of hub models and the embedded one) is placed by transformers'
    ``from_pretrained(device_map="auto", max_memory=...)``: disk-offloaded weights are read from the
    checkpoint's own files, and fused weights go to memory, never into those files."""
    from quantmla.models import PretrainedModel

    whole, tok = build(CONFIG)
    whole.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    files = {f: f.read_bytes() for f in (tmp_path / "ckpt").glob("*.safetensors")}
    spec = dict(name="local", path=str(tmp_path / "ckpt"), dtype="float32", device_map="auto", max_memory=BUDGET)
    with pytest.raises(ValueError, match="does not fit in model.max_memory"):
        PretrainedModel(**spec).load()
    model, _ = PretrainedModel(**spec, offload_folder=str(tmp_path / "offload")).load()
    assert "disk" in model.hf_device_map.values()
    t = LayerTransform(s_C=torch.linspace(0.5, 2.0, CONFIG.kv_lora_rank), theta_P=torch.linspace(0, 3, 32))
    for m in (model, whole):
        install(m, CacheSpec.parse("c4r4"))
        for mla in adapters(m):
            fuse(mla, t)
    assert any(offloaded_layers(model))
    ids = torch.randint(3, 259, (2, 150), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert (model(ids).logits - whole(ids).logits).abs().max() <= 1e-5
    assert all(f.read_bytes() == data for f, data in files.items())


def test_fingerprint_reads_offloaded_weights(tmp_path):
    model, whole, _ = spread(tmp_path)
    assert model_fingerprint(model, "tiny") == model_fingerprint(whole, "tiny")


def test_generation_through_the_paged_cache(tmp_path):
    """Prefill then token-by-token decode through the paged low-bit cache, layer by layer on the devices
    the layers compute on."""
    model, whole, _ = spread(tmp_path)
    ids = torch.randint(3, 259, (2, 40), generator=torch.Generator().manual_seed(5))
    out = []
    for m in (model, whole):
        install(m, CacheSpec.parse("c4r4", sink=4, recent=8))
        cache = new_cache(m, 2, 40)
        with torch.no_grad():
            steps = [m(ids[:, :30], past_key_values=cache, use_cache=True).logits]
            steps += [m(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits for i in range(30, 40)]
        out.append(torch.cat(steps, 1))
    assert torch.equal(out[0], out[1])


def test_sensitivity_probe_of_an_offloaded_layer(tmp_path):
    model, whole, _ = spread(tmp_path)
    ids = torch.randint(3, 259, (1, 64), generator=torch.Generator().manual_seed(6))
    probes = []
    for m in (model, whole):
        install(m, CacheSpec())
        layer = latent_layers(m)[-1]
        with torch.no_grad():
            hidden = m.model.embed_tokens(ids)  # any input: the probe only needs the layer
            pe = m.model.rotary_emb(hidden, torch.arange(64).unsqueeze(0))
        twin = frozen_copy(layer, torch.float64)
        assert not any(hasattr(t, "_hf_hook") for t in twin.modules())
        assert all(p.device.type == "cpu" and p.dtype == torch.float64 for p in twin.parameters())
        probes.append(LayerProbe(twin, hidden, pe))
    assert placement.offloaded(latent_layers(model)[-1].kv_b_proj)
    assert probes[0].response("P", 1e-2) == probes[1].response("P", 1e-2)


@pytest.mark.slow
def test_a_run_with_layers_on_disk_equals_the_run_on_one_device(tmp_path):
    """The whole harness (QuantMLA calibrated on both paths, fused, C4R4 perplexity) with two of the four
    layers offloaded to disk: the same metrics as the same run on one device, bit for bit on the CPU."""
    common = [
        "model.layers=4",
        "method=quantmla",
        "method.steps=2",
        "method.val_every=1",
        "method.alphas=[0,0.5]",
        "calibration=quick",
        "calibration.seq_len=64",
        "calibration.train=4",
        "calibration.heldout=2",
        "bits=c4r4",
        "eval.seq_len=128",
        "eval.max_tokens=256",
    ]
    spread_run = run(
        _compose(
            *common,
            "model.device_map=auto",
            "model.max_memory={cpu:5MiB}",
            f"model.offload_folder={tmp_path / 'offload'}",
            f"runs_dir={tmp_path / 'a'}",
        )
    )
    whole_run = run(_compose(*common, f"runs_dir={tmp_path / 'b'}"))
    assert spread_run["method"]["cached_C"] == 0 and spread_run["method"]["fusion_nll_drift"] < 1e-4
    assert spread_run == whole_run
    gc.collect()
    assert not any((tmp_path / "offload").iterdir())  # the offloaded copy goes with the model
