"""Teacher-forced (prefill / log-likelihood) attention of the core on one GPU: C16R16 vs C4R4 vs C2R4.

    python bench/prefill.py                 # default shapes, the kernel's default tiles
    python bench/prefill.py --tune          # also time candidate tiles per format and shape
    python bench/prefill.py --exact         # also C4R4 and C2R4 with config exact (unrounded stored rows)
    python bench/prefill.py --exact --tune c4r4_exact,c2r4_exact

Each request holds ``n`` tokens and asks all ``n`` queries (a prompt's prefill, or a
log-likelihood evaluation), 16 heads, d_c 512, d_r 64, sink 4 and recent 128 for the
low-bit formats (the per-pair rule: quantized keys outside the protected window). Reports
median ms (``triton.testing.do_bench``, after warm-up) and the useful TFLOP/s of the causal
products, 2·B·H·(n²/2)·(576 + 512)/t. Writes ``prefill-<date>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import run_meta, write_record  # noqa: E402

from quantmla import kernels  # noqa: E402
from quantmla.kernels import (  # noqa: E402
    PAGE,
    PagedLayer,
    PageFormat,
    triton_prefill,  # noqa: E402
)

DEV = torch.device("cuda")
FORMATS = {"c16r16": (16, 16), "c4r4": (4, 4), "c2r4": (2, 4)}
SINK, RECENT, TAU = 4, 128, 576**-0.5
CANDIDATES = [
    dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
    for m, n, w, s in itertools.product((32, 64), (16, 32, 64), (4, 8), (2,))
]
EXACT_CANDIDATES = [
    dict(block_m=m, block_n=n, num_warps=w, num_stages=2, exact=True)
    for m, n, w in itertools.product((16, 32), (16, 32), (4, 8))
]


def inputs(bits, B: int, H: int, n: int, gen):
    fmt = PageFormat(*bits, d_c=512, d_r=64, dtype=torch.bfloat16)
    C = torch.randn(B, n, 512, generator=gen, device=DEV).to(torch.bfloat16)
    K = torch.randn(B, n, 64, generator=gen, device=DEV).to(torch.bfloat16)
    q = torch.randn(B, H, n, 512, generator=gen, device=DEV) * 0.3
    qp = torch.randn(B, H, n, 64, generator=gen, device=DEV) * 0.3
    lens = torch.full((B,), n, dtype=torch.int64, device=DEV)
    layer = bt = None
    if fmt.quantized:
        per = -(-n // PAGE)
        layer = PagedLayer(fmt, B * per, DEV, batch=B, sink=SINK, recent=RECENT)
        bt = torch.randperm(B * per, generator=gen, device=DEV).view(B, per).to(torch.int32)
        req = torch.arange(B, device=DEV).repeat_interleave(n).to(torch.int32)
        pos = torch.arange(n, device=DEV).repeat(B)
        kernels.write(layer, bt, C.reshape(-1, 512), K.reshape(-1, 64), req, pos, lens)
    return q, qp, C, K, lens, layer, bt


def time_one(args, config) -> float | None:
    q, qp, C, K, lens, layer, bt = args
    fn = lambda: kernels.prefill(q, qp, C, K, lens, lens, TAU, SINK, RECENT, layer, bt, "triton", config=config)  # noqa: E731
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a candidate the device cannot run (shared memory) is skipped
        print(f"  {config}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return None
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8:512,1:4096,1:16384", help="B:n pairs (16 heads)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tune", nargs="?", const="all", help="time candidate tiles per format and shape "
                    "(or only for the formats named, e.g. --tune c4r4_exact,c2r4_exact)")  # fmt: skip
    ap.add_argument("--exact", action="store_true", help="also the quantized formats with config exact")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/prefill.py needs a CUDA GPU")
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    stamp = datetime.datetime.now(datetime.UTC)
    meta = run_meta(
        torch.cuda.get_device_properties(DEV),
        stamp,
        "python bench/prefill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    meta["timing"] = "triton.testing.do_bench median (warm-up 25 ms, 100 ms of repeats)"
    rows = []
    H = args.heads
    for B, n in shapes:
        flops = 2 * B * H * (n * n / 2) * (576 + 512)
        row = {"H": H, "B": B, "n": n}
        timed_formats = [(name, bits, False) for name, bits in FORMATS.items()]
        if args.exact:
            timed_formats += [(f"{name}_exact", bits, True) for name, bits in FORMATS.items() if bits != (16, 16)]
        for name, bits, exact in timed_formats:
            data = inputs(bits, B, H, n, torch.Generator(DEV).manual_seed(B * n))
            fmt = data[5].fmt if data[5] else PageFormat(*bits, d_c=512, d_r=64, dtype=torch.bfloat16)
            default = triton_prefill.default_config(H, n, fmt, data[5] is not None, exact)
            ms = time_one(data, {"exact": True} if exact else None)
            row[f"{name}_ms"], row[f"{name}_TFLOPs"], row[f"{name}_config"] = ms, flops / ms / 1e9, default
            print(
                f"H={H} B={B} n={n} {name} default {default}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True
            )
            if args.tune and (args.tune == "all" or name in args.tune.split(",")):
                timed = [(time_one(data, c), c) for c in (EXACT_CANDIDATES if exact else CANDIDATES)]
                timed = sorted(((t, c) for t, c in timed if t is not None), key=lambda tc: tc[0])
                row[f"{name}_tuned"] = [dict(c, ms=t) for t, c in timed]
                for t, c in timed[:3]:
                    print(f"    {c}: {t:.3f} ms", flush=True)
            del data
        rows.append(row)
    meta["rows"] = rows
    write_record(meta, "prefill", stamp, args.out)


if __name__ == "__main__":
    main()
