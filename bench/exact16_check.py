"""Check and time the 16-head exact-dequantization decode kernel (quantmla/kernels/exact_decode.py).

    python bench/exact16_check.py                 # H200: correctness against float64, then timings
    python bench/exact16_check.py --check-only
    python bench/exact16_check.py --shapes 16:32:32768,16:1:131072

Correctness: ragged batches of C4R4 and C2R4 pages written by the real writer, 9 and 16 heads, 1 to many splits, outputs
poisoned with NaN before each call, against :func:`quantmla.kernels.reference.decode` with
``exact=True`` (float64 attention over the exact ``s·(q − z)``); the paper-semantics reference
(BF16-rounded rows) is printed beside it for scale. Also checks that the tensor cores keep FP16
subnormals (the kernel's codes are subnormal FP16 numbers). Timing: ``bench/decode.py``'s method
(CUDA-graph replays, L2 flushed, medians) for C16R16, C4R4 with the default kernels, C4R4 with a
BF16 P, C4R4 exact, C2R4 with the default kernels and C2R4 exact, in one run; then, at each ``--ablate-shape``, the kernel's variants: the
running maximum checked by a reduction before P (``late_check=False``) instead of per warp
beside P', and each stage left out in turn (``ablate`` 1: no P·V, 2: no score products, 3: no
maximum check, 5: no unpacking in either product, 6: none in the score products, 7: neither
product, 8: only the page copies and the loop's barrier, 9: as 8 with the pages copied as 256-byte
rows, 11: no protected rows, 12: as 11 with P·V as wgmma (channels on M) instead of mma.sync and
without its zero-point column; wrong outputs, timing only; 10: the whole kernel on pages copied as
256-byte rows, whose outputs ``--wide`` checks against float64). ``--maxnreg N`` adds every check and timing of the exact
kernel under a register cap of N (168 lets three C2R4 programs share an SM); ``--only`` times a
subset beside C16R16 and leaves the variants out (for A/B runs of several trees, ``bench/ab.sh``). Writes
``exact16-<date>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode import Shape, copy_bandwidth, run_meta, time_calls, write_record  # noqa: E402

from quantmla import kernels  # noqa: E402
from quantmla.kernels import PagedLayer, PageFormat, exact_decode, reference, triton_decode  # noqa: E402

DEV = torch.device("cuda")
TAU = 576**-0.5


def subnormal_check(gen) -> float:
    """Relative error of an FP16 matrix product whose left operand holds only subnormals (n·2^-24,
    n < 16, as the kernel's codes), against float64: ~1e-7 if the tensor cores keep them, 1 if
    they flush them to zero."""
    n = torch.randint(0, 16, (256, 512), device=DEV, generator=gen, dtype=torch.int16)
    a = n.view(torch.float16)  # bit pattern n = the subnormal n·2^-24
    b = (torch.randn(512, 256, device=DEV, generator=gen) * 1024).half()
    ref = (n.double() * 2.0**-24) @ b.double()
    got = (a @ b).double()
    return float((got - ref).norm() / ref.norm())


def ragged_layer(lengths, cb, gen, scale=1.0):
    """(layer, block table, lengths) of C``cb``R4 pages in shuffled slots, holding the requests of ``lengths``
    tokens of random latents (times ``scale``) written by the real writer; the slots no token was written
    to hold random bytes."""
    B = len(lengths)
    per = max(-(-L // 64) for L in lengths)
    layer = PagedLayer(PageFormat(cb, 4), B * per + 3, DEV, batch=B, sink=4, recent=128)
    layer.pool.random_(0, 256, generator=gen)
    bt = (torch.randperm(B * per + 3, device=DEV, generator=gen)[: B * per]).view(B, per).to(torch.int32)
    lens = torch.tensor(lengths, device=DEV, dtype=torch.int64)
    T = sum(lengths)
    C = (torch.randn(T, 512, device=DEV, generator=gen) * scale).to(torch.bfloat16)
    K = (torch.randn(T, 64, device=DEV, generator=gen) * scale).to(torch.bfloat16)
    req = torch.repeat_interleave(torch.arange(B, device=DEV), lens).to(torch.int32)
    pos = torch.cat([torch.arange(L, device=DEV) for L in lengths])
    kernels.write(layer, bt, C, K, req, pos, lens, backend="triton")
    return layer, bt, lens


def case(H, lengths, splits, gen, scale=1.0, cb=4, extra=None, ablate=0):
    """(rel. error of o, max |lse error|) against the exact reference, the same for the
    paper-semantics reference, and whether every output was written; C``cb``R4 pages (``ablate``:
    the kernel launched with that variant through :func:`run`, for variants that keep the outputs)."""
    B = len(lengths)
    layer, bt, lens = ragged_layer(lengths, cb, gen, scale)
    fmt = layer.fmt
    q = torch.randn(B, H, 512, device=DEV, generator=gen)
    qp = torch.randn(B, H, 64, device=DEV, generator=gen)
    out = (torch.full((B, H, 512), float("nan"), device=DEV), torch.full((B, H), float("nan"), device=DEV))
    cfg = {"exact": True} | ({} if splits is None else {"num_splits": splits}) | (extra or {})
    if ablate:
        ns = triton_decode.default_config(B, H, max(lengths), layer, DEV, cfg)["num_splits"]
        run(layer, bt, lens, q.bfloat16(), qp.bfloat16(), ns, max(lengths), out, True, ablate)
        o, lse = out
    else:
        o, lse = kernels.decode(layer, bt, lens, q, qp, TAU, "triton", cfg, out=out)
    torch.cuda.synchronize()
    ro, rl = reference.decode(layer, bt, lens, q, qp, TAU, exact=True)
    po, pl = reference.decode(layer, bt, lens, q, qp, TAU)
    written = bool(torch.isfinite(o).all()) and bool((torch.isfinite(lse) | (lse == float("-inf"))).all())
    full = triton_decode.default_config(B, H, max(lengths), layer, DEV, cfg)
    plan = triton_decode.plan(layer, H, full, DEV, max(lengths))
    return dict(
        fmt=fmt.name, H=H, lengths=lengths, splits=plan.splits, ablate=ablate, per=plan.per, scale=scale, written=written, **(extra or {}),
        o_rel=float((o - ro).norm() / ro.norm()), lse_abs=float((lse - rl).abs().max()),
        paper_o_rel=float((po - ro).norm() / ro.norm()), paper_lse_abs=float((pl - rl).abs().max()),
    )  # fmt: skip


def run(layer, bt, lens, q, qp, nsplit, max_len, out, late_check=True, ablate=0, weight=None):
    """The exact kernel through ``front_split_work`` and the Triton kernel's LSE merge, with its variant
    knobs (``weight``: a protected tile's weight in the splits, default ``EXACT_PROT_WEIGHT``)."""
    weight = triton_decode.prot_weight({} if weight is None else {"prot_weight": weight})
    splits, per = triton_decode.front_split_work(layer, max_len, nsplit, weight)
    op, lsep = triton_decode.partials(out[0], out[1], splits)
    exact_decode.decode(layer, bt, lens, q, qp, op, lsep, TAU, splits, per, None, late_check, ablate, weight)
    triton_decode.merge(op, lsep, out[0], out[1])


def variants(spec, gen, l2) -> dict:
    """At one H:B:L, the exact kernel as shipped, with the reduction check, and each stage left out."""
    H, B, L = map(int, spec.split(":"))
    sh = Shape(H, B, L, gen, l2, formats={"c4r4": (4, 4)})
    layer, tables = sh.layers["c4r4"], sh.tables["c4r4"]
    full = triton_decode.default_config(B, H, L, layer, DEV, {"exact": True})
    ns = full["num_splits"]
    out = (torch.empty(B, H, 512, device=DEV), torch.empty(B, H, device=DEV))
    row = dict(H=H, B=B, L=L, num_splits=ns)
    for key, late, ab in (("shipped", True, 0), ("reduction_check", False, 0), ("no_pv", True, 1),
                          ("no_scores", True, 2), ("no_max_check", True, 3), ("no_unpacking", True, 5),
                          ("no_score_unpacking", True, 6), ("no_products", True, 7), ("copies_only", True, 8),
                          ("copies_only_wide", True, 9), ("wide_copies", True, 10), ("no_protected", True, 11),
                          ("pv_wgmma_no_protected", True, 12)):  # fmt: skip
        calls = [functools.partial(run, layer, t, sh.lengths, sh.q, sh.qp, ns, L, out, late, ab) for t in tables]
        row[f"{key}_ms"] = time_calls(calls)
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return row


CASES = [
    (16, [1000, 67, 5000], 1),
    (16, [1000, 67, 5000], 3),
    (16, [1000, 67, 5000], None),
    (9, [130, 2000], None),
    (16, [1, 133, 132, 131], None),
    (16, [8192], None),
    (16, [4000, 3000], 7),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--shapes", default="16:32:8192,16:32:32768,16:1:131072,16:128:32768,16:64:8192")
    ap.add_argument("--ablate-shape", default="16:32:32768", help="H:B:L of the variants (comma-separated)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--wide", action="store_true", help="also check variant 10 (pages copied in 256-byte rows)")
    ap.add_argument("--maxnreg", type=int, help="also check and time the exact kernel under this register cap")
    ap.add_argument("--only", help="time only these keys (comma-separated, e.g. c16r16,c4r4_exact,c2r4_exact); "
                    "C16R16 is always timed, and the variants are left out")  # fmt: skip
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    stamp = datetime.datetime.now()
    meta = run_meta(
        torch.cuda.get_device_properties(0), stamp, "python bench/exact16_check.py " + " ".join(sys.argv[1:])
    )
    meta["subnormal_rel_err"] = subnormal_check(gen)
    print("fp16 subnormal product, rel. error:", meta["subnormal_rel_err"], flush=True)
    meta["cases"] = []
    capped = [None] + ([{"maxnreg": args.maxnreg}] if args.maxnreg else [])
    for cb in (4, 2):
        for H, lengths, splits in CASES:
            for scale in (1.0, 8.0) if lengths == [1000, 67, 5000] and splits == 3 else (1.0,):
                for extra in capped:
                    r = case(H, lengths, splits, gen, scale, cb, extra)
                    meta["cases"].append(r)
                    print(r, flush=True)
                if args.wide:
                    r = case(H, lengths, splits, gen, scale, cb, None, ablate=10)
                    meta["cases"].append(r)
                    print(r, flush=True)
    ok = all(r["written"] and r["o_rel"] < 2e-3 and r["lse_abs"] < 2e-3 for r in meta["cases"])
    print("correct:", ok, flush=True)
    if not args.check_only:
        meta["copy_TBps"] = copy_bandwidth()
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        rows = []
        for spec in args.shapes.split(","):
            H, B, L = map(int, spec.split(":"))
            sh = Shape(H, B, L, gen, l2, formats={"c16r16": (16, 16), "c4r4": (4, 4), "c2r4": (2, 4)})
            row = dict(H=H, B=B, L=L)
            timed = (("c16r16", "c16r16", {}), ("c4r4", "c4r4", {}), ("c4r4_bf16p", "c4r4", {"pv_split": False}),
                     ("c4r4_exact", "c4r4", {"exact": True}), ("c2r4", "c2r4", {}), ("c2r4_exact", "c2r4", {"exact": True}))  # fmt: skip
            if args.maxnreg:
                timed += tuple((f"{f}_exact_r{args.maxnreg}", f, {"exact": True, "maxnreg": args.maxnreg}) for f in ("c4r4", "c2r4"))  # fmt: skip
            if args.only:
                keep = {"c16r16", *args.only.split(",")}
                timed = tuple(t for t in timed if t[0] in keep)
            for key, name, cfg in timed:
                ms = sh.time(name, cfg)
                row[f"{key}_ms"] = ms
                row[f"{key}_TBps"] = sh.stored_bytes(name) / ms / 1e9
            for key, _, _ in timed[1:]:
                row[f"{key}_speedup_vs_c16r16"] = row["c16r16_ms"] / row[f"{key}_ms"]
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            del sh
            torch.cuda.empty_cache()
        meta["rows"] = rows
        if not args.only:
            meta["variants"] = [variants(spec, gen, l2) for spec in args.ablate_shape.split(",")]
    write_record(meta, "exact16", stamp, args.out)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
