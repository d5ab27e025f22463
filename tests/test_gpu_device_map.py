"""``model.device_map`` on one GPU: a ``max_memory`` cap sends part of the model into CPU memory, and the
harness's runs (RTN and QuantMLA at C4R4, perplexity) compute what they compute on the whole model on the GPU.

    python -m pytest -m gpu tests/test_gpu_device_map.py

Needs the project's dependencies (hydra-core, omegaconf) and its text data (the gensim wheel of
data-packages.txt) on the GPU machine.

The tolerances: a layer held in CPU memory is copied to the GPU unchanged for each forward and
computes there with the same kernels on the same shapes as a layer that lives there, so the two
models compute the same arithmetic; equality is expected, and the bounds (1e-5 relative on logits
and perplexity) only leave room for a library choosing another kernel for a freshly allocated
weight. A weight left unfused or stale in CPU memory would move the quantized logits by orders of
magnitude more. QuantMLA's calibration is compared the same way on the quantities it computes
before training; its trained objectives get 1e-3, the room float32 rounding noise can take over
60 optimizer steps, where a layer calibrated on wrong weights would differ at the percent level.
"""

import pytest
import torch
from hydra import compose, initialize_config_dir

from quantmla import placement
from quantmla.attention import latent_layers
from quantmla.evals import EvalContext
from quantmla.run import conf_dir, plan, prepare, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# float32, 36 MiB per decoder layer: under a 120 MiB cap the embedding and two layers stay on the GPU
# (accelerate keeps room there for one layer loaded from CPU memory); the other two layers, the final
# norm and the head live in CPU memory and are loaded onto the GPU for each forward.
SHAPE = ["model=tiny", "model.layers=4", "model.hidden=1024", "model.heads=16", "model.kv_lora_rank=512"]
CAPPED = ["model.device_map=auto", "model.max_memory={0:120MiB,cpu:4GiB}"]
WHOLE = ["device=cuda"]
EVAL = ["eval=ppl", "eval.seq_len=256", "eval.max_tokens=2048"]
QUANTMLA = ["method=quantmla", "calibration=quick", "method.steps=60", "method.val_every=20"]
RTOL = 1e-5


def _compose(runs_dir, *overrides):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose(
            "run",
            overrides=[*SHAPE, *EVAL, "bits=c4r4", "logger=none", f"runs_dir={runs_dir}", "sweep=gpu", *overrides],
        )


def _evaluate(cfg, ids):
    """The prepared model's logits on ``ids``, its perplexity metrics and what its method recorded."""
    p = plan(cfg)
    model, tok = prepare(p, cfg)
    where = placement.describe(model)
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.float().cpu()
    ctx = EvalContext(model_name=p.model.name, max_positions=model.config.max_position_embeddings, progress=False)
    metrics = p.eval.run(model, tok, ctx)
    del model
    torch.cuda.empty_cache()
    return logits, metrics, dict(p.method.info), where


def _ids():
    return torch.randint(3, 259, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()


def _same(a, b, rtol=RTOL):
    return abs(a - b) <= rtol * abs(b)


def test_a_capped_model_is_split_between_the_gpu_and_cpu_memory(tmp_path):
    cfg = _compose(tmp_path, *CAPPED)
    p = plan(cfg)
    model, _ = prepare(p, cfg)
    kinds = {"cpu" if d == "cpu" else torch.device(d).type for d in model.hf_device_map.values()}
    assert kinds == {"cuda", "cpu"}, model.hf_device_map
    layers = latent_layers(model)
    offloaded = [placement.offloaded(layer.kv_b_proj) for layer in layers]
    assert any(offloaded) and not all(offloaded), model.hf_device_map
    assert {placement.execution_device(layer) for layer in layers} == {torch.device("cuda", 0)}
    assert layers[offloaded.index(False)].kv_b_proj.weight.device == torch.device("cuda", 0)
    assert layers[offloaded.index(True)].kv_b_proj.weight.is_meta
    assert placement.execution_device(model) == torch.device("cuda", 0)  # where the inputs go


def test_rtn_run_with_layers_in_cpu_memory_equals_the_run_on_the_gpu(tmp_path):
    ids = _ids()
    capped, c_metrics, _, where = _evaluate(_compose(tmp_path / "capped", *CAPPED), ids)
    whole, w_metrics, _, _ = _evaluate(_compose(tmp_path / "whole", *WHOLE), ids)
    assert "cpu" in where
    assert (capped - whole).abs().max() <= RTOL * whole.abs().max()
    assert c_metrics["tokens"] == w_metrics["tokens"] and _same(c_metrics["ppl"], w_metrics["ppl"])
    # and through the command's own entry point, with its run record
    metrics = run(_compose(tmp_path / "record", *CAPPED))
    assert _same(metrics["ppl"], w_metrics["ppl"])
    (status,) = list((tmp_path / "record").rglob("status"))
    assert status.read_text().strip() == "done"


def test_quantmla_calibrated_and_fused_with_layers_in_cpu_memory(tmp_path):
    """QuantMLA calibrates on the capped model and fuses its transforms into the layers held in CPU memory.
    The whole model then reuses those transforms from the same cache (the model's fingerprint reads the
    offloaded weights, so both models have the same key) and must compute the same logits and
    perplexity; calibrated again from scratch on the whole model, QuantMLA finds the same objectives."""
    ids = _ids()
    capped, c_metrics, c_info, where = _evaluate(_compose(tmp_path / "a", *CAPPED, *QUANTMLA), ids)
    assert "cpu" in where
    assert c_info["cached_C"] == 0 and c_info["cached_P"] == 0
    assert c_info["fusion_nll_drift"] < 1e-4
    whole, w_metrics, w_info, _ = _evaluate(_compose(tmp_path / "a", *WHOLE, *QUANTMLA), ids)
    assert w_info["cached_C"] == 1 and w_info["cached_P"] == 1
    assert (capped - whole).abs().max() <= RTOL * whole.abs().max()
    assert _same(c_metrics["ppl"], w_metrics["ppl"])

    _, _, fresh, _ = _evaluate(_compose(tmp_path / "b", *WHOLE, *QUANTMLA), ids)
    assert fresh["cached_C"] == 0 and fresh["cached_P"] == 0
    for path in ("C", "P"):
        assert fresh[f"alpha_{path}"] == c_info[f"alpha_{path}"]
        assert _same(c_info[f"heldout_init_{path}"], fresh[f"heldout_init_{path}"])
        assert _same(c_info[f"heldout_{path}"], fresh[f"heldout_{path}"], rtol=1e-3)
