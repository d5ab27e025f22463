"""Time QuantMLA calibration of a whole model (default: the embedded SmolLM2-MLA) at each float32
matmul precision, in one process on one GPU.

The run config's model and calibration banks (the paper's: 128 train + 32 held-out windows of 2048
tokens, batch 4), both paths at ``--bits``, ``--steps`` updates per path with validation every
``--val-every``, nothing read from or written to the transform store. For each precision in
``--precisions`` (``highest``: IEEE float32, the default; ``high``: TF32 products) the script
calibrates from scratch and records the median time per optimizer step of each path (steps with a
validation excluded) and its host synchronisations (``torch.cuda.set_sync_debug_mode``; each
one stalls the host until the GPU's queue drains), the mean cost of one validation, the time before the first content step
(statistics and the α-grid) and the whole calibration; then the held-out objectives (L_C, L_P) of
the transforms it learned, evaluated at ``highest`` for every precision, so that the precisions are
compared on one scale.

    python bench/calibrate.py [--model smollm2_mla] [--bits c4r4] [--steps 40] [--precisions highest,high]
    python bench/calibrate.py --quick      # the tiny model, small banks: checks the script on a CPU

Writes ``calibrate-<date>.json`` to ``--out`` (default ``bench/results``) and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from quantmla import attention, mla, placement  # noqa: E402
from quantmla.cache import CacheSpec  # noqa: E402
from quantmla.calibration import matmul_precision, transform_objectives  # noqa: E402
from quantmla.methods import MethodContext  # noqa: E402
from quantmla.methods.quantmla import QuantMLA  # noqa: E402
from quantmla.run import conf_dir, plan  # noqa: E402
from quantmla.transforms import from_state  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def calibrate_once(p, model, tokenizer, precision: str, steps: int, cache_dir: Path) -> dict:
    """One calibration from scratch at ``precision``: timings per path and the learned state."""
    cfg = p.method.config
    method = QuantMLA(dataclasses.replace(cfg, matmul_precision=precision, cache=False))
    stamps: list[float] = []
    marks: list[int] = []  # warnings caught so far, at each stamp

    def on_step(step: int) -> None:
        marks.append(len(caught))
        _sync()
        stamps.append(time.perf_counter())

    method.on_step = on_step
    ctx = MethodContext(
        spec=p.spec,
        tokenizer=tokenizer,
        model_name=p.model.name,
        device=placement.execution_device(model),
        cache_dir=cache_dir,
        calibration=p.calibration,
        progress=False,
    )
    _sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")  # each host synchronisation becomes a warning, counted per step
        try:
            t0 = time.perf_counter()
            state = method.calibrate(model, mla.adapters(model), ctx)
            _sync()
            wall = time.perf_counter() - t0
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")
    is_sync = [int("synchroniz" in str(w.message)) for w in caught]
    per_path = {}
    val_every = cfg.val_every
    for name, part in (("content", slice(None, steps)), ("rope", slice(steps, None))):
        chunk, at = stamps[part], marks[part]
        gaps = [b - a for a, b in zip(chunk, chunk[1:])]  # gap i: update i + 2 (1-based), with its validation if due
        plain = [g for i, g in enumerate(gaps) if (i + 2) % val_every != 0]
        with_val = [g for i, g in enumerate(gaps) if (i + 2) % val_every == 0]
        syncs = [sum(is_sync[a:b]) for i, (a, b) in enumerate(zip(at, at[1:])) if (i + 2) % val_every != 0]
        per_path[name] = {
            "median_step_s": statistics.median(plain) if plain else None,
            "syncs_per_step": statistics.median(syncs) if syncs else None,
            "validation_s": statistics.fmean(with_val) - statistics.median(plain) if with_val and plain else None,
            "path_s": chunk[-1] - chunk[0] if chunk else None,
        }
    return {
        "calibration_s": wall,
        "before_first_step_s": stamps[0] - t0 if stamps else None,
        "per_path": per_path,
        "info": method.info,
        "state": state,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_mla", help="a conf/model option (default: smollm2_mla)")
    ap.add_argument("--bits", default="c4r4", help="cache format whose paths are calibrated (default: c4r4)")
    ap.add_argument("--steps", type=int, default=40, help="updates per path (the paper: 300)")
    ap.add_argument("--val-every", type=int, default=20, help="validation interval (the paper: 20)")
    ap.add_argument("--precisions", default="highest,high", help="comma-separated float32 matmul precisions")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the record")
    ap.add_argument("--quick", action="store_true", help="model=tiny, small banks, 4 steps: checks the script")
    args = ap.parse_args()
    if args.quick:
        args.model, args.steps, args.val_every = "tiny", 4, 2
    elif not torch.cuda.is_available():
        sys.exit("bench/calibrate.py: no CUDA GPU here; --quick checks the script on a CPU")
    overrides = [
        f"model={args.model}",
        "method=quantmla",
        f"bits={args.bits}",
        f"method.steps={args.steps}",
        f"method.val_every={args.val_every}",
        "logger=none",
    ]
    if args.quick:
        overrides += ["calibration=quick", "calibration.seq_len=64", "calibration.train=4", "calibration.heldout=4"]
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        p = plan(compose("run", overrides=overrides))

    t0 = time.perf_counter()
    model, tokenizer = p.model.load(p.cfg.device)
    attention.install(model, CacheSpec(group=p.spec.group), backend=p.backend)
    load_s = time.perf_counter() - t0
    _, heldout = p.calibration.banks(tokenizer)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            torch.manual_seed(0)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            row = calibrate_once(p, model, tokenizer, precision, args.steps, Path(tmp) / precision)
            transforms = from_state(row.pop("state"), len(mla.adapters(model)))
            with matmul_precision("highest"):
                row["heldout_highest"] = transform_objectives(
                    model, heldout, p.calibration.batch_size, transforms, p.spec
                )
            row["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            rows[precision] = row
            print(
                f"{precision}: calibrated in {row['calibration_s']:.1f} s, held-out {row['heldout_highest']}",
                flush=True,
            )
    base = rows.get("highest")
    ratios = {
        f"{k}/highest": {
            path: base["per_path"][path]["median_step_s"] / r["per_path"][path]["median_step_s"]
            for path in ("content", "rope")
            if base["per_path"][path]["median_step_s"] and r["per_path"][path]["median_step_s"]
        }
        for k, r in rows.items()
        if base is not None and k != "highest"
    }
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "command": "python bench/calibrate.py " + " ".join(sys.argv[1:]),
        "model": p.model.name,
        "bits": args.bits,
        "calibration": p.calibration.to_dict(),
        "steps_per_path": args.steps,
        "val_every": args.val_every,
        "load_s": load_s,
        "precisions": rows,
        "speedup_per_step": ratios,
    }
    text = json.dumps(result, indent=1, default=float)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"calibrate-{datetime.now(UTC):%Y%m%d-%H%M%S}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
