"""Check and time the role-split probe (bench/prototypes/ws_exact.py) beside the shipped exact kernel.

    python bench/ws_check.py --out $OUT                  # H200: correctness, then timings
    python bench/ws_check.py --check-only
    python bench/ws_check.py --shapes 16:32:32768 --variants 4:168:4,4:160:8 --ablate 1,2

Correctness: ragged batches of C4R4 pages written by the real writer, 9 and 16 heads, one to many
splits, outputs poisoned with NaN before each call, against the shipped exact kernel with
``ablate=11`` (the same attention over the page tiles only; the probe leaves the protected rows out),
and both against the float64 exact reference over the same page tokens
(:func:`page_reference`). Timing: ``bench/decode.py``'s method (CUDA-graph replays, L2 flushed,
medians) for C16R16, the shipped C4R4 exact kernel, its ``ablate=11`` and ``ablate=8`` (copies only)
variants and the probe's variants, in one run. Writes ``ws-<date>.json`` under ``--out``.
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
sys.path.insert(0, str(ROOT / "bench" / "prototypes"))

import ws_exact  # noqa: E402
from decode import Shape, copy_bandwidth, run_meta, time_calls, write_record  # noqa: E402
from exact16_check import ragged_layer, run  # noqa: E402

from quantmla.kernels import reference, triton_decode  # noqa: E402

DEV = torch.device("cuda")
TAU = 576**-0.5


def probe(layer, bt, lens, q, qp, max_len, out, variant="4:168:4", splits=None, ablate=0):
    """The probe through :func:`triton_decode.partials` and the LSE merge."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ns, per = ws_exact.plan(q.shape[0], max_len, sms if splits is None else splits * q.shape[0])
    op, lsep = triton_decode.partials(out[0], out[1], ns)
    stages, score_regs, pv_warps = map(int, variant.split(":"))
    ws_exact.decode(layer, bt, lens, q, qp, op, lsep, TAU, ns, per, stages, score_regs, ablate, pv_warps)
    triton_decode.merge(op, lsep, out[0], out[1])
    return ns


def page_reference(layer, bt, lens, q, qp):
    """Float64 attention over the exactly dequantized page tokens SINK <= t < L - RECENT only (what
    the probe and ``ablate=11`` compute): the exact reference with every other key's score at -inf."""
    B, H, _ = q.shape
    o = torch.empty(B, H, 512, dtype=torch.float64, device=q.device)
    lse = torch.empty(B, H, dtype=torch.float64, device=q.device)
    for i in range(B):
        L = int(lens[i])
        C, K = reference.stored_rows(layer, bt, i, L, exact=True)  # (L, 512), (L, 64) float64
        s = (q[i].double() @ C.T + qp[i].double() @ K.T) * TAU
        t = torch.arange(L, device=q.device)
        keep = (t >= layer.sink) & (t < L - layer.recent)
        s = torch.where(keep[None, :], s, float("-inf"))
        lse[i] = torch.logsumexp(s, dim=1)
        p = torch.exp(s - lse[i][:, None]).nan_to_num(0.0)
        o[i] = p @ C
    return o, lse


def case(H, lengths, splits, gen, variants):
    """Errors of the probe and of ``ablate=11`` against :func:`page_reference`, and whether every
    output of the probe was written."""
    B = len(lengths)
    layer, bt, lens = ragged_layer(lengths, 4, gen)
    q = torch.randn(B, H, 512, device=DEV, generator=gen).bfloat16()
    qp = torch.randn(B, H, 64, device=DEV, generator=gen).bfloat16()
    ro, rl = page_reference(layer, bt, lens, q, qp)
    has = torch.isfinite(rl)
    res = dict(H=H, lengths=lengths)
    calls = [(f"probe_{v}", functools.partial(probe, layer, bt, lens, q, qp, max(lengths), variant=v, splits=splits))
             for v in variants]  # fmt: skip
    calls.append(("ablate11", lambda o: run(layer, bt, lens, q, qp, splits or 8, max(lengths), o, True, 11)))
    for key, fn in calls:
        out = (torch.full((B, H, 512), float("nan"), device=DEV), torch.full((B, H), float("nan"), device=DEV))
        ns = fn(out=out) if key != "ablate11" else fn(out)
        torch.cuda.synchronize()
        o, lse = out
        written = bool(torch.isfinite(o[has]).all()) and bool((torch.isfinite(lse) | (lse == float("-inf"))).all())
        res[key] = dict(
            splits=ns, written=written,
            o_rel=float((o[has].double() - ro[has]).norm() / ro[has].norm()),
            lse_abs=float((lse[has].double() - rl[has]).abs().max()),
            lse_empty_ok=bool((lse[~has] == float("-inf")).all()),
        )  # fmt: skip
    return res


CASES = [
    (16, [1000, 67, 5000], 1),
    (16, [1000, 67, 5000], 3),
    (16, [1000, 67, 5000], None),
    (9, [130, 2000], None),
    (16, [1, 133, 200, 8192], None),
    (16, [20000], None),
    (16, [4000, 3000], 7),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--shapes", default="16:32:8192,16:32:32768,16:1:131072,16:128:32768,16:64:8192")
    ap.add_argument("--variants", default="4:168:4", help="probe variants stages:score_regs:pv_warps, comma-separated")
    ap.add_argument(
        "--ablate",
        default="",
        help="also time these probe variants (1: no P·V products, 2: no score products, 3: neither, 4: copies and hand-offs only, 12: P·V on wgmma)",
    )
    ap.add_argument("--profile", help="H:B:L: one probe launch between cudaProfilerStart/Stop (for ncu), nothing else")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    if args.profile:
        H, B, L = map(int, args.profile.split(":"))
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        sh = Shape(H, B, L, gen, l2, formats={"c4r4": (4, 4)})
        out = (torch.empty(B, H, 512, device=DEV), torch.empty(B, H, device=DEV))
        v = args.variants.split(",")[0]
        for _ in range(3):
            probe(sh.layers["c4r4"], sh.tables["c4r4"][0], sh.lengths, sh.q, sh.qp, L, out, v)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        probe(sh.layers["c4r4"], sh.tables["c4r4"][-1], sh.lengths, sh.q, sh.qp, L, out, v)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("profiled", args.profile)
        return
    stamp = datetime.datetime.now()
    meta = run_meta(torch.cuda.get_device_properties(0), stamp, "python bench/ws_check.py " + " ".join(sys.argv[1:]))
    meta["cases"] = []
    for H, lengths, splits in CASES:
        r = case(H, lengths, splits, gen, args.variants.split(","))
        meta["cases"].append(r)
        print(r, flush=True)
    ok = all(
        r[k]["written"] and r[k]["o_rel"] < 2e-3 and r[k]["lse_abs"] < 2e-3 and r[k]["lse_empty_ok"]
        for r in meta["cases"]
        for k in r
        if k.startswith("probe") or k == "ablate11"
    )
    print("correct:", ok, flush=True)
    if not args.check_only:
        meta["copy_TBps"] = copy_bandwidth()
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        rows = []
        for spec in args.shapes.split(","):
            H, B, L = map(int, spec.split(":"))
            sh = Shape(H, B, L, gen, l2, formats={"c16r16": (16, 16), "c4r4": (4, 4)})
            row = dict(H=H, B=B, L=L)
            row["c16r16_ms"] = sh.time("c16r16", {})
            row["c4r4_exact_ms"] = sh.time("c4r4", {"exact": True})
            layer, tables = sh.layers["c4r4"], sh.tables["c4r4"]
            ns = triton_decode.default_config(B, H, L, layer, DEV, {"exact": True})["num_splits"]
            out = (torch.empty(B, H, 512, device=DEV), torch.empty(B, H, device=DEV))
            calls = [functools.partial(run, layer, t, sh.lengths, sh.q, sh.qp, ns, L, out, True, 11) for t in tables]
            row["c4r4_exact_no_protected_ms"] = time_calls(calls)
            calls = [functools.partial(run, layer, t, sh.lengths, sh.q, sh.qp, ns, L, out, True, 8) for t in tables]
            row["c4r4_exact_copies_only_ms"] = time_calls(calls)
            for v in args.variants.split(","):
                calls = [functools.partial(probe, layer, t, sh.lengths, sh.q, sh.qp, L, out, v) for t in tables]
                row[f"probe_{v}_ms"] = time_calls(calls)
                for ab in [int(a) for a in args.ablate.split(",") if a]:
                    calls = [
                        functools.partial(probe, layer, t, sh.lengths, sh.q, sh.qp, L, out, v, ablate=ab)
                        for t in tables
                    ]
                    row[f"probe_{v}_ablate{ab}_ms"] = time_calls(calls)
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            del sh
            torch.cuda.empty_cache()
        meta["rows"] = rows
    write_record(meta, "ws", stamp, args.out)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
