"""Decode latency of the quantized-MLA core on one GPU: C16R16 vs C4R4 vs C2R4 vs unfused.

    python bench/decode.py                      # the full sweep, results under bench/results/
    python bench/decode.py --tune               # time candidate tiles first, sweep with the best
    python bench/decode.py --shapes 16:32:32768,128:32:32768   # chosen H:B:L shapes only
    python bench/decode.py --quick              # a few shapes (smoke test)

Sweeps heads H ∈ {16, 128}, batch B ∈ {1, 32, 64, 128}, context L ∈ {4K, 8K, 32K, 128K}
(shapes whose caches do not fit are skipped). Every request owns its pages (shuffled in the
pool) and C4R4/C2R4 carry the BF16 protection of sink 4 + recent 128. For each shape and
format it reports the median time of ``triton.testing.do_bench`` over CUDA-graph replays
(after warm-up; launch overhead stays out; L2 is flushed before every timed call, and
caches smaller than 2× L2 are additionally rotated over several page sets, one graph each),
the effective bandwidth on the bytes the format stores (pages + protection buffers), the
useful TFLOP/s (2·B·H·L·(576 + 512)) and the speed-up over C16R16. "unfused" dequantizes
the whole C4R4 cache with torch ops into BF16 pages and then runs the C16R16 kernel. The
device copy bandwidth (bytes read + written) is measured in the same run. ``--pv bf16``
times P·V with P as one BF16 tile instead of the hi/lo pair. At up to 16 heads the same C4R4
and C2R4 pages are also timed through the exact-dequantization kernel (``exact=True``:
keys ``c4r4_exact_*`` and ``c2r4_exact_*``). Writes ``decode-<date>.json`` (a list ``rows``,
top-level ``copy_TBps``) and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantmla import kernels  # noqa: E402
from quantmla.kernels import (  # noqa: E402
    PAGE,
    PagedLayer,
    PageFormat,
    dispatch,
)
from quantmla.kernels.splits import Case  # noqa: E402

FORMATS = {"c16r16": (16, 16), "c4r4": (4, 4), "c2r4": (2, 4)}
SINK, RECENT = 4, 128
D_C, D_R = 512, 64
TAU = 576**-0.5
DEV = torch.device("cuda")


def flops(B, H, L):
    return 2.0 * B * H * L * (D_C + D_R + D_C)


def fill(layer: PagedLayer, gen, chunk: int = 8192) -> None:
    """Random codes/rows and sane random metadata (non-zero data: zeros time differently)."""
    for name, v in layer.views.items():
        for s in range(0, v.shape[0], chunk):
            w = v[s : s + chunk]
            if name.endswith("_codes"):
                w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, device=w.device, generator=gen))
            elif name.endswith("_scale"):
                w.copy_((torch.rand(w.shape, device=w.device, generator=gen) * 0.05 + 0.01).to(w.dtype))
            elif name.endswith("_zero"):
                bits = layer.fmt.content_bits if name.startswith("C") else layer.fmt.rope_bits
                w.copy_(torch.randint(0, 2**bits, w.shape, dtype=torch.uint8, device=w.device, generator=gen))
            else:
                w.copy_(torch.randn(w.shape, device=w.device, generator=gen).to(w.dtype))
    if layer.prot is not None:
        layer.prot.copy_(torch.randn(layer.prot.shape, device=layer.prot.device, generator=gen).to(layer.prot.dtype))


def unfused_dequant(src, src_bt, dst, dst_bt, L: int, chunk: int = 4096) -> None:
    """Torch ops: the request pages of a C4R4 layer → BF16 pages of ``dst``, protected rows overlaid."""
    f = src.fmt
    v, d = src.views, dst.views
    sp, dp = src_bt.flatten().long(), dst_bt.flatten().long()
    for s in range(0, sp.numel(), chunk):
        a, b = sp[s : s + chunk], dp[s : s + chunk]
        for path, width in (("C", f.d_c), ("R", f.d_r)):
            codes = v[f"{path}_codes"][a]
            q = torch.stack([codes & 15, codes >> 4], -1).view(len(a), PAGE, width // 64, 64).float()
            x = (q - v[f"{path}_zero"][a].float().unsqueeze(-1)) * v[f"{path}_scale"][a].float().unsqueeze(-1)
            d[f"{path}_rows"][b] = x.view(len(a), PAGE, width).to(torch.bfloat16)
    B = src_bt.shape[0]
    dev = src_bt.device
    tok = torch.cat([torch.arange(SINK, device=dev), torch.arange(L - RECENT, L, device=dev)])
    row = torch.where(tok < SINK, tok, SINK + tok % RECENT)
    page = dst_bt[:, tok // PAGE].long()
    slot = (tok % PAGE).expand(B, -1)
    d["C_rows"][page, slot] = src.prot[:, row, : f.d_c]
    d["R_rows"][page, slot] = src.prot[:, row, f.d_c :]


def copy_bandwidth(nbytes=4 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / ms / 1e9


class Shape:
    """Queries and one paged cache per format for (H, B, L), rotated over page sets when small."""

    def __init__(self, H, B, L, gen, l2_bytes, formats=FORMATS):
        dev = DEV
        self.H, self.B, self.L = H, B, L
        self.per = -(-L // PAGE)
        self.q = torch.randn(B, H, D_C, device=dev, generator=gen).to(torch.bfloat16)
        self.qp = torch.randn(B, H, D_R, device=dev, generator=gen).to(torch.bfloat16)
        self.lengths = torch.full((B,), L, dtype=torch.int64, device=dev)
        self.layers, self.tables = {}, {}
        for name in formats:
            cb, rb = FORMATS[name]
            fmt = PageFormat(cb, rb, D_C, D_R, 64, torch.bfloat16)
            sets = max(1, min(8, -(-2 * l2_bytes // (B * fmt.request_bytes(L, SINK, RECENT)))))
            pool = B * self.per * sets
            layer = PagedLayer(fmt, pool, dev, batch=B, sink=SINK, recent=RECENT)
            fill(layer, gen)
            perm = torch.randperm(pool, device=dev, generator=gen).to(torch.int32)
            self.layers[name] = layer
            self.tables[name] = [perm[i * B * self.per : (i + 1) * B * self.per].view(B, self.per) for i in range(sets)]

    def stored_bytes(self, name) -> int:
        fmt = self.layers[name].fmt
        return self.B * (self.per * fmt.page_bytes + fmt.protection_bytes(SINK, RECENT))

    def time(self, name, cfg, exact=False) -> float:
        layer, tables = self.layers[name], self.tables[name]
        kernels.decode(layer, tables[0], self.lengths, self.q, self.qp, TAU, "triton", cfg, exact=exact)  # compiles
        cfg = dict(cfg, max_len=self.L)
        out = (torch.empty(self.B, self.H, D_C, device=DEV), torch.empty(self.B, self.H, device=DEV))
        calls = [
            functools.partial(dispatch.decode, layer, t, self.lengths, self.q, self.qp, TAU, cfg, out, exact)
            for t in tables
        ]
        return time_calls(calls)


TIMING = "triton.testing.do_bench median over CUDA-graph replays, L2 flushed before each"


def run_meta(props, stamp, command: str) -> dict:
    """The header every benchmark record starts with: when, on what, with which versions, how."""
    return {
        "date": stamp.isoformat(timespec="seconds"),
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": command,
        "timing": TIMING,
    }


def write_record(meta: dict, prefix: str, stamp, folder=None, quiet: bool = False) -> Path:
    """Write ``meta`` as ``<prefix>-<date>.json`` into ``folder`` (default ``bench/results``);
    the same stamp writes the same file again (a record that grows as a run goes)."""
    folder = Path(folder) if folder else Path(__file__).parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{prefix}-{stamp:%Y%m%d-%H%M%S}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(out)
    if not quiet:
        print(f"wrote {out}")
    return out


def time_calls(calls) -> float:
    """Median ms of ``do_bench`` over CUDA-graph replays of ``calls`` (one graph per page set,
    taken in turn), so the host's launch overhead stays out of the kernel time."""
    graphs = []
    for fn in calls:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    step = iter(range(1 << 62))
    return do_bench(lambda: graphs[next(step) % len(graphs)].replay(), warmup=25, rep=200, return_mode="median")


def run_shape(H, B, L, gen, l2_bytes, configs, check=True):
    sh = Shape(H, B, L, gen, l2_bytes)
    row = {"H": H, "B": B, "L": L}
    for name in FORMATS:
        cfg = configs.get((H, name), {})
        ms = sh.time(name, cfg)
        layer = sh.layers[name]
        full = dispatch.default_config(B, H, L, layer, layer.pool.device, cfg)
        row[f"{name}_kernel"] = dispatch.plan(Case(layer, H, L, layer.pool.device, False, full)).name
        row[f"{name}_ms"] = ms
        row[f"{name}_TBps"] = sh.stored_bytes(name) / ms / 1e9
        row[f"{name}_TFLOPs"] = flops(B, H, L) / ms / 1e9
    # unfused: torch dequantization of the whole C4R4 cache into BF16 pages, then the C16R16 kernel
    src, src_bt = sh.layers["c4r4"], sh.tables["c4r4"][0]
    dst, dst_bt = sh.layers["c16r16"], sh.tables["c16r16"][0]
    cfg4 = dict(configs.get((H, "c4r4"), {}), max_len=L)
    cfg16 = dict(configs.get((H, "c16r16"), {}), max_len=L)

    def unfused():
        unfused_dequant(src, src_bt, dst, dst_bt, L)
        return dispatch.decode(dst, dst_bt, sh.lengths, sh.q, sh.qp, TAU, cfg16)

    ms = time_calls([unfused])
    row["unfused_ms"] = ms
    row["unfused_TBps"] = sh.stored_bytes("c4r4") / ms / 1e9
    row["unfused_TFLOPs"] = flops(B, H, L) / ms / 1e9
    if check:  # the fused kernel and the unfused path compute the same function
        fused = dispatch.decode(src, src_bt, sh.lengths, sh.q, sh.qp, TAU, cfg4)[0]
        o_unf = unfused()[0]
        row["fused_vs_unfused_rel_err"] = float((fused - o_unf).norm() / o_unf.norm())
    names = list(FORMATS) + ["unfused"]
    for name in ("c4r4", "c2r4") if H <= 16 else ():  # the same pages through the exact-dequantization kernel
        ms = sh.time(name, configs.get((H, name), {}), exact=True)
        row[f"{name}_exact_kernel"] = "exact"
        row[f"{name}_exact_ms"] = ms
        row[f"{name}_exact_TBps"] = sh.stored_bytes(name) / ms / 1e9
        row[f"{name}_exact_TFLOPs"] = flops(B, H, L) / ms / 1e9
        names.append(f"{name}_exact")
    for name in names:
        row[f"{name}_speedup_vs_c16r16"] = row["c16r16_ms"] / row[f"{name}_ms"]
    return row


def tune(H, name, gen, l2_bytes, candidates, B=32, L=32768):
    """Median time of each candidate tile config on one representative shape; returns the best."""
    sh = Shape(H, B, L, gen, l2_bytes, formats=(name,))
    times = {}
    for c in candidates:
        try:
            times[json.dumps(c)] = sh.time(name, c)
        except Exception as e:  # noqa: BLE001 - a config the device cannot run (shared memory) is skipped
            print(f"tune H={H} {name} {c}: {type(e).__name__}: {e}", flush=True)
            times[json.dumps(c)] = float("inf")
    del sh
    torch.cuda.empty_cache()
    best = min(times, key=times.get)
    return json.loads(best), times


CANDIDATES = {  # tile configs timed by --tune (those that spill heavily in the compiler's report are left out)
    16: [dict(block_n=32, num_warps=8, num_stages=st) for st in (2, 3)]
    + [dict(block_n=64, num_warps=8, num_stages=st) for st in (2, 3)]
    + [dict(block_n=bn, num_warps=4, num_stages=st) for bn in (16, 32, 64) for st in (2, 3)]
    + [dict(block_n=32, num_warps=4, num_stages=4)]
    + [dict(block_n=64, num_warps=4, num_stages=2, chunks=c) for c in (2, 4)]
    + [dict(block_n=32, num_warps=4, num_stages=3, chunks=4)],
    # (register caps, "maxnreg", for three or four programs per SM were timed with --candidates
    # and lost everywhere)
    128: [
        dict(block_h=bh, block_n=bn, num_warps=8, num_stages=st) for bh in (16, 32) for bn in (32, 64) for st in (2, 3)
    ]
    + [dict(block_h=16, block_n=32, num_warps=4, num_stages=2)],
}


WIDE_P_BF16 = {  # 64-head tiles: with P as one BF16 tile they compile to wgmma without heavy spills
    128: [dict(block_h=64, block_n=bn, num_warps=8, num_stages=st) for bn, st in ((32, 2), (32, 3), (64, 2))]
    + [dict(block_h=64, block_n=64, num_warps=8, num_stages=2, chunks=c) for c in (2, 4)],
}


def candidates(H: int, pv: str) -> list[dict]:
    """Tile configs --tune times for H heads under the P·V choice ``pv`` ("default": the kernel's
    own choice per head count, "split": the hi/lo pair, "bf16": one BF16 tile)."""
    if pv == "bf16" or (pv == "default" and H > 16):
        return [dict(c, pv_split=False) for c in CANDIDATES.get(H, [{}]) + WIDE_P_BF16.get(H, [])]
    return [dict(c, pv_split=True) if pv == "split" else c for c in CANDIDATES.get(H, [{}])]


def pv_config(pv: str) -> dict:
    return {"split": {"pv_split": True}, "bf16": {"pv_split": False}}.get(pv, {})


def _warm_one(job) -> str:
    """Compile one (H, format, config, splits) variant on a tiny shape (fills Triton's disk cache)."""
    H, name, cfg = job
    try:
        sh = Shape(H, 1, 4 * 64, torch.Generator(device=DEV).manual_seed(0), 0, formats=(name,))
        for splits in (1, 2):
            kernels.decode(
                sh.layers[name],
                sh.tables[name][0],
                sh.lengths,
                sh.q,
                sh.qp,
                TAU,
                "triton",
                dict(cfg, num_splits=splits),
            )
        torch.cuda.synchronize()
        return f"ok {H} {name} {cfg}"
    except Exception as e:  # noqa: BLE001 - reported, the sweep then shows the failure too
        return f"FAILED {H} {name} {cfg}: {type(e).__name__}: {e}"


def warm(heads, workers=None, only=None) -> None:
    """Compile every kernel variant the sweep can use (or the tile configs ``only``), in parallel processes."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))

    if only is not None:
        jobs = [(H, name, cfg) for H in heads for name in FORMATS for cfg in only]
    else:
        jobs = [
            (H, name, cfg)
            for H in heads
            for name in FORMATS
            for pv in ("default", "split", "bf16")
            for cfg in candidates(H, pv) + [pv_config(pv)]
        ]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for msg in ex.map(_warm_one, jobs):
            print("warm", msg, flush=True)


def table(rows, copy) -> str:
    head = (
        "| H | B | L | C16R16 ms (TB/s) | C4R4 ms (TB/s, ×) | C4R4 exact ms (TB/s, ×) | C2R4 ms (TB/s, ×) "
        "| C2R4 exact ms (TB/s, ×) | unfused C4R4 ms (×) | TFLOP/s C16R16 / C4R4 |"
    )
    out = [head, "|" + "---|" * 10]

    def cell(r, name):
        if f"{name}_ms" not in r:
            return "–"
        return f"{r[f'{name}_ms']:.3f} ({r[f'{name}_TBps']:.2f}, {r[f'{name}_speedup_vs_c16r16']:.2f}×)"

    for r in rows:
        out.append(
            f"| {r['H']} | {r['B']} | {r['L'] // 1024}K "
            f"| {r['c16r16_ms']:.3f} ({r['c16r16_TBps']:.2f}) "
            f"| {cell(r, 'c4r4')} | {cell(r, 'c4r4_exact')} | {cell(r, 'c2r4')} | {cell(r, 'c2r4_exact')} "
            f"| {r['unfused_ms']:.3f} ({r['unfused_speedup_vs_c16r16']:.2f}×) "
            f"| {r['c16r16_TFLOPs']:.0f} / {r['c4r4_TFLOPs']:.0f} |"
        )
    return "\n".join(out) + f"\n\nDevice copy bandwidth (read + write): {copy:.2f} TB/s\n"


def _shapes(text: str) -> list[tuple[int, int, int]]:
    try:
        shapes = [tuple(int(v) for v in x.split(":")) for x in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(t) != 3 or min(t) < 1 for t in shapes):
        raise argparse.ArgumentTypeError(f"expected H:B:L[,H:B:L...] with positive integers, got '{text}'")
    return shapes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--tune", action="store_true", help="time candidate tile configs first and use the best")
    ap.add_argument("--warm", action="store_true", help="compile all kernel variants in parallel, then exit")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,32,64,128")
    ap.add_argument("--lengths", default="4096,8192,32768,131072")
    ap.add_argument(
        "--shapes", type=_shapes, default=None, help="explicit H:B:L shapes (comma-separated) instead of the sweep"
    )
    ap.add_argument(
        "--pv",
        choices=("default", "split", "bf16"),
        default="default",
        help="P·V as the kernel chooses per head count (default), with P as a hi/lo BF16 pair (float32 "
        "accuracy), or with P as one BF16 tile (FlashMLA's choice)",
    )
    ap.add_argument(
        "--candidates",
        type=json.loads,
        default=None,
        help="tile configs for --tune and --warm instead of the built-in list, as JSON, e.g. "
        '\'[{"block_n": 32, "num_warps": 4, "num_stages": 2, "maxnreg": 168}]\'',
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode.py needs a CUDA GPU")
    heads = [int(x) for x in args.heads.split(",")]
    if args.warm:
        return warm(heads, only=args.candidates)
    gen = torch.Generator(device=DEV).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    copy = copy_bandwidth()
    print(f"{props.name}: copy {copy:.2f} TB/s, L2 {l2 >> 20} MiB, {props.multi_processor_count} SMs", flush=True)
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.quick:
        batches, lengths = [1, 32], [4096, 32768]
    shapes = args.shapes or [(H, B, L) for H in heads for B in batches for L in lengths]
    heads = sorted({H for H, _, _ in shapes})
    common = pv_config(args.pv)
    configs = {(H, n): dict(common) for H in heads for n in FORMATS}
    tuning = {}
    if args.tune:
        given = [dict(common, **c) for c in args.candidates] if args.candidates else None
        for H in heads:
            for name in FORMATS:
                best, times = tune(H, name, gen, l2, given or candidates(H, args.pv))
                configs[(H, name)] = best
                tuning[f"H{H}-{name}"] = times
                print(f"tune H={H} {name}: {times} -> {best}", flush=True)
    free = torch.cuda.mem_get_info()[0]
    stamp = datetime.datetime.now(datetime.UTC)
    meta = run_meta(props, stamp, "python bench/decode.py " + " ".join(sys.argv[1:] if argv is None else argv))
    meta |= {
        "sms": props.multi_processor_count,
        "python": platform.python_version(),
        "copy_TBps": copy,
        "pv": args.pv,
        "configs": {f"H{h}-{n}": c for (h, n), c in configs.items()},
        "tuning_ms": tuning,
        "rows": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"decode-{stamp:%Y%m%d-%H%M%S}"

    def save():  # after every shape, so an interrupted sweep keeps what it measured
        base.with_suffix(".json").write_text(json.dumps(meta, indent=1))
        md = f"# Decode benchmark, {meta['date']}\n\n{props.name}, torch {torch.__version__}, Triton {triton.__version__}\n\n"
        base.with_suffix(".md").write_text(md + table(meta["rows"], copy))

    for H, B, L in shapes:
        need = B * (PageFormat(16, 16).request_bytes(L) + 2 * PageFormat(4, 4).request_bytes(L))
        if need * 1.3 > free:
            print(f"skip H={H} B={B} L={L}: needs ~{need / 2**30:.0f} GiB", flush=True)
            continue
        r = run_shape(H, B, L, gen, l2, configs)
        torch.cuda.empty_cache()
        meta["rows"].append(r)
        save()
        print(
            f"H={H:3d} B={B:3d} L={L:6d}  c16r16 {r['c16r16_ms']:.3f} ms {r['c16r16_TBps']:.2f} TB/s "
            f"{r['c16r16_TFLOPs']:.0f} TF | c4r4 {r['c4r4_ms']:.3f} ({r['c4r4_speedup_vs_c16r16']:.2f}x, "
            f"{r['c4r4_TBps']:.2f} TB/s) | c2r4 {r['c2r4_ms']:.3f} ({r['c2r4_speedup_vs_c16r16']:.2f}x) | "
            f"unfused {r['unfused_ms']:.3f} | err {r.get('fused_vs_unfused_rel_err', 0):.1e}",
            flush=True,
        )
    save()
    print(table(meta["rows"], copy))
    print(f"wrote {base}.json and .md")


if __name__ == "__main__":
    main()
