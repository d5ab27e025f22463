"""Check and time the register-fed 16-head C4R4 decode (``quantmla/kernels/mma_decode.py``) on the H200.

    python bench/mma16_check.py [--out bench/results]

First against the float32 reference (ragged, short, split and 9-head cases; the bar is the one
of a BF16 P, 1e-2, next to the Triton kernel's error with a BF16 P), then timed beside the
Triton kernels in one run (``bench/decode.py``'s timing: CUDA-graph replays, L2 flushed, medians
of ``do_bench``), with split counts and register caps swept, and at H=16, B=32, L=32K with each
stage left out in turn (``ablate``: 1 no P·V, 2 no exchange between warps, 3 no score product;
those outputs are wrong by design). Writes ``mma16-<date>.json`` with the rows.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import importlib  # noqa: E402
import os  # noqa: E402

import kernels_helpers as kh  # noqa: E402
import torch  # noqa: E402
from decode import DEV, TAU, Shape, run_meta, time_calls, write_record  # noqa: E402

from quantmla.kernels import reference as ref  # noqa: E402
from quantmla.kernels import triton_decode  # noqa: E402
from quantmla.kernels.layout import PageFormat  # noqa: E402

if os.environ.get("MMA_MODULE"):  # a variant of the kernel: MMA_MODULE=path/to/file.py (its folder goes on sys.path)
    _variant = Path(os.environ["MMA_MODULE"])
    sys.path.insert(0, str(_variant.parent))
    mma_decode = importlib.import_module(_variant.stem)
else:
    from quantmla.kernels import mma_decode


def run(layer, bt, lens, q, qp, tau, nsplit, max_len=None, out=None, maxnreg=None, ablate=0):
    """The kernel through ``split_work`` and the Triton kernel's LSE merge (``ablate``, ``maxnreg``: timing only)."""
    B, H, _ = q.shape
    splits, per = triton_decode.split_work(layer, max_len or int(lens.max()), 64, nsplit)
    o, lse = out if out is not None else (torch.empty(B, H, 512, device=q.device), torch.empty(B, H, device=q.device))
    op, lsep = triton_decode.partials(o, lse, splits)
    mma_decode.decode(layer, bt, lens, q, qp, op, lsep, tau, splits, per, maxnreg, ablate)
    triton_decode.merge(op, lsep, o, lse)
    return o, lse


def check() -> list[dict]:
    rows = []
    cases = [(16, [300, 70, 1, 131], 1), (16, [300, 70, 1, 131], 3), (16, [3000, 5000, 133], 1),
             (16, [3000, 5000, 133], 7), (9, [700, 64], 2), (16, [8192], 16), (16, [129, 132, 200], 2)]  # fmt: skip
    for H, lengths, splits in cases:
        gen = torch.Generator().manual_seed(H + len(lengths) + splits)
        layer, bt, lens, _, _ = kh.filled_layer(PageFormat(4, 4, 512), lengths, gen)
        q = (torch.randn(len(lengths), H, 512, generator=gen) * 0.5).to(kh.DEVICE).to(torch.bfloat16)
        qp = torch.randn(len(lengths), H, 64, generator=gen).to(kh.DEVICE).to(torch.bfloat16)
        o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5)
        o, lse = run(layer, bt, lens, q, qp, 576**-0.5, splits)
        o_t, _ = triton_decode.decode(layer, bt, lens, q, qp, 576**-0.5, {"pv_split": False})
        row = dict(H=H, lengths=lengths, splits=splits, rel_o=kh.rel(o, o_ref), rel_lse=kh.rel(lse, lse_ref),
                   rel_o_triton_bf16_p=kh.rel(o_t, o_ref))  # fmt: skip
        row["ok"] = bool(row["rel_o"] < 1e-2 and row["rel_lse"] < 1e-3 and not torch.isnan(o).any())
        print(row, flush=True)
        rows.append(row)
    return rows


def bench(shapes, ablate_shape) -> list[dict]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for H, B, L in shapes:
        sh = Shape(H, B, L, gen, l2, formats={"c16r16": (16, 16), "c4r4": (4, 4)})
        row = dict(H=H, B=B, L=L, c16r16_ms=sh.time("c16r16", {}), c4r4_triton_ms=sh.time("c4r4", {}))
        # the same precision as this kernel's: P as one BF16 tile (the 16-head default is the hi/lo pair)
        row["c16r16_bf16_p_ms"] = sh.time("c16r16", dict(pv_split=False))
        row["c4r4_triton_bf16_p_ms"] = sh.time("c4r4", dict(pv_split=False, mma16=False))
        layer, tables = sh.layers["c4r4"], sh.tables["c4r4"]
        s0 = triton_decode.default_config(B, H, L, layer, layer.pool.device, {})["num_splits"]
        out = (torch.empty(B, H, 512, device=DEV), torch.empty(B, H, device=DEV))
        tries = {}
        for mr in (None, 128):
            for ns in sorted({s0, s0 * 3 // 2, s0 * 2}):
                calls = [functools.partial(run, layer, t, sh.lengths, sh.q, sh.qp, TAU, ns, L, out, mr) for t in tables]
                tries[f"splits={ns},maxnreg={mr}"] = time_calls(calls)
        best = min(tries, key=tries.get)
        row.update(c4r4_mma_ms=tries[best], c4r4_mma_config=best, c4r4_mma_tries=tries)
        if (H, B, L) == ablate_shape:
            ns = int(best.split(",")[0].split("=")[1])
            mr = None if best.endswith("None") else int(best.split("=")[-1])
            for ab in (1, 2, 3):
                calls = [
                    functools.partial(run, layer, t, sh.lengths, sh.q, sh.qp, TAU, ns, L, out, mr, ab) for t in tables
                ]
                row[f"c4r4_mma_ablate{ab}_ms"] = time_calls(calls)
            # every tile on one page, which then stays in L1: the time without DRAM latency or traffic
            one = [torch.zeros_like(t) for t in tables]
            calls = [functools.partial(run, layer, t, sh.lengths, sh.q, sh.qp, TAU, ns, L, out, mr) for t in one]
            row["c4r4_mma_one_page_ms"] = time_calls(calls)
            cfg = dict(max_len=L)
            calls = [
                functools.partial(triton_decode.decode, layer, t, sh.lengths, sh.q, sh.qp, TAU, cfg, out) for t in one
            ]
            row["c4r4_triton_one_page_ms"] = time_calls(calls)
        c16 = row["c16r16_ms"]
        print(f"H={H} B={B} L={L}: c16r16 {c16:.4f} ms (P in BF16 {row['c16r16_bf16_p_ms']:.4f}), "
              f"c4r4 Triton {row['c4r4_triton_ms']:.4f} ({c16 / row['c4r4_triton_ms']:.2f}x; P in BF16 "
              f"{row['c4r4_triton_bf16_p_ms']:.4f}), c4r4 register-fed {row['c4r4_mma_ms']:.4f} "
              f"({c16 / row['c4r4_mma_ms']:.2f}x, {best})", flush=True)  # fmt: skip
        if (H, B, L) == ablate_shape:
            print(
                "  ablations (ms): "
                + ", ".join(f"{k[5:]}={v:.4f}" for k, v in row.items() if "ablate" in k or "one_page" in k)
            )
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="time H=16, B=32, L=32K only")
    args = ap.parse_args(argv)
    stamp = datetime.datetime.now(datetime.UTC)
    meta = run_meta(
        torch.cuda.get_device_properties(0),
        stamp,
        "python bench/mma16_check.py" + (" --quick" if args.quick else ""),
    )
    print(meta, flush=True)
    meta["check"] = check()
    if not all(r["ok"] for r in meta["check"]):
        write_record(meta, "mma16", stamp, args.out)
        raise SystemExit("the register-fed kernel misses the reference")
    shapes = [(16, 32, 32768)] if args.quick else [(16, 32, 8192), (16, 32, 32768), (16, 1, 131072), (16, 128, 32768)]
    meta["rows"] = bench(shapes, (16, 32, 32768))
    write_record(meta, "mma16", stamp, args.out)


if __name__ == "__main__":
    main()
