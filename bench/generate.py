"""End-to-end greedy generation through the paged latent cache on one GPU: time per new token.

    python bench/generate.py                          # DeepSeek-V2-Lite-like shapes, 27 layers
    python bench/generate.py --layers 4 --new 32      # a quick look
    python bench/generate.py --exact                  # also C4R4 and C2R4 with exact=True (the exact kernels)
    python bench/generate.py --profile                # also where the host's time goes (cProfile)
    python bench/generate.py --graphs                 # also each format through quantmla.generate.greedy
                                                      # (the decode step replayed as one CUDA graph)

A randomly initialised DeepseekV2 model (hidden 2048, 16 heads, d_c 512, d_r 64, dense MLPs,
no hub) generates ``--new`` tokens for ``--batch`` prompts of ``--prompt`` tokens with
``model.generate``: natively (transformers' own attention and DynamicCache, BF16) and through
the harness (``quantmla.attention.install`` + ``new_cache``) for each format. Per-token decode
time is (t(new) − t(1)) / (new − 1), the median of ``--repeats`` runs after a warm-up, so the
prompt's prefill drops out. It also counts the host synchronisations per decode step
(``torch.cuda.set_sync_debug_mode``): each one stalls the host until the GPU has drained its
queue, so the launches of the next layers can no longer run ahead. Writes
``generate-<date>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import run_meta, write_record  # noqa: E402

from quantmla import attention  # noqa: E402
from quantmla.cache import CacheSpec  # noqa: E402
from quantmla.generate import greedy  # noqa: E402
from quantmla.models.tiny import lite_config  # noqa: E402

DEV = torch.device("cuda")


def build(layers: int, hidden: int, heads: int, vocab: int, seed: int = 0):
    config = lite_config(layers=layers, hidden=hidden, heads=heads, vocab_size=vocab)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def generate(model, ids, new: int, paged: bool, graphs: bool = False):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
    if paged:
        kw[attention.cache_keyword()] = attention.new_cache(model, ids.shape[0], ids.shape[1] + new)
    if graphs:
        kw["custom_generate"] = greedy
    with torch.no_grad():
        return model.generate(ids, **kw)


def timed(model, ids, new: int, paged: bool, graphs: bool = False) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    generate(model, ids, new, paged, graphs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def syncs(model, ids, new: int, paged: bool, graphs: bool = False) -> int:
    """Synchronising CUDA calls the host makes during one ``generate`` of ``new`` tokens."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate(model, ids, new, paged, graphs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def measure(model, ids, new: int, paged: bool, repeats: int, graphs: bool = False) -> dict:
    generate(model, ids, 4, paged, graphs)  # compile and warm up
    one = statistics.median(timed(model, ids, 1, paged, graphs) for _ in range(repeats))
    full = statistics.median(timed(model, ids, new, paged, graphs) for _ in range(repeats))
    per_step = (syncs(model, ids, 9, paged, graphs) - syncs(model, ids, 1, paged, graphs)) / 8
    ms = (full - one) / (new - 1)
    row = {"prefill_ms": one, "total_ms": full, "decode_ms_per_token": ms, "syncs_per_decode_step": per_step}
    if graphs:  # the tokens against generate's own loop over the same cache (the split plan may round apart)
        a, b = generate(model, ids, new, paged), generate(model, ids, new, paged, graphs)
        row["same_tokens_as_generate"] = float((a == b).float().mean())
    return row


def profile(model, ids, new: int, paged: bool, top: int = 30) -> str:
    """The host's time in one ``generate`` of ``new`` tokens by function (cProfile, own time first):
    where a decode step that the host bounds spends it."""
    import cProfile
    import io
    import pstats

    generate(model, ids, 4, paged)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    generate(model, ids, new, paged)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="c16r16,c4r4,c2r4", help="harness formats (CxRy), comma-separated")
    ap.add_argument("--exact", action="store_true", help="also each quantized format with exact=True")
    ap.add_argument("--profile", action="store_true", help="also print each row's host profile (cProfile)")
    ap.add_argument("--no-native", action="store_true", help="skip transformers' own attention")
    ap.add_argument("--graphs", action="store_true", help="also each format through quantmla.generate.greedy")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/generate.py needs a CUDA GPU")
    if args.new < 2:
        sys.exit("--new must be at least 2 (decode time is the difference to a one-token run)")
    specs = [CacheSpec.parse(f) for f in args.formats.split(",") if f.strip()]
    if args.exact:
        specs += [CacheSpec.parse(s.name, exact=True) for s in specs if s.quantized]
    stamp = datetime.datetime.now(datetime.UTC)
    props = torch.cuda.get_device_properties(DEV)
    meta = run_meta(props, stamp, "python bench/generate.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    meta["timing"] = "wall clock of model.generate, median of repeats after a warm-up, synchronised"
    meta["transformers"] = transformers.__version__
    meta["shape"] = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "batch", "prompt", "new")}
    model = build(args.layers, args.hidden, args.heads, args.vocab)
    ids = torch.randint(
        3, args.vocab, (args.batch, args.prompt), device=DEV, generator=torch.Generator(DEV).manual_seed(1)
    )
    rows = {}
    if not args.no_native:
        rows["native"] = measure(model, ids, args.new, False, args.repeats)
        print("native", rows["native"], flush=True)
        if args.profile:
            print(profile(model, ids, args.new, False), flush=True)
    for spec in specs:
        attention.install(model, spec)
        name = spec.name + ("_exact" if spec.exact else "")
        rows[name] = measure(model, ids, args.new, True, args.repeats)
        print(name, rows[name], flush=True)
        if args.profile:
            print(profile(model, ids, args.new, True), flush=True)
        if args.graphs:
            rows[name + "_graphs"] = measure(model, ids, args.new, True, args.repeats, graphs=True)
            print(name + "_graphs", rows[name + "_graphs"], flush=True)
        attention.uninstall(model)
    meta["rows"] = rows
    write_record(meta, "generate", stamp, args.out)


if __name__ == "__main__":
    main()
