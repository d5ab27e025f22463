"""Check and time the 64-head Gluon decode prototype against the Triton kernel (one Hopper GPU).

    python bench/prototypes/gluon_check_h64.py [out-dir]

Correctness: ragged batches at 128 and 100 heads, 1 and 3 splits, against
``triton_decode.decode`` with P as one BF16 tile (the same rounding; itself tested against the
float32 reference). Timing: the sweep's method (``bench/decode.py``: CUDA-graph replays, L2
flushed, page sets rotated) at H = 128 for C16R16 and C4R4 through the Triton kernel and C4R4
through the prototype, in each of its variants (``VARIANTS``: content chunks of the next tile
reconstructed while the scores run, block-table entries read a step ahead, the next tile's scores
issued right behind this tile's P·V). Writes ``gluon-h64-<date>.json`` into ``out-dir`` (default ``bench/results``).
"""

from __future__ import annotations

import datetime
import functools
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import decode as bench  # noqa: E402
import gluon_decode_h64  # noqa: E402

from quantmla.kernels import triton_decode  # noqa: E402

VARIANTS = {  # the prototype's knobs (gluon_decode_h64.decode); earlier runs timed rebuild_s=2 and no page_ahead
    "rebuild_s=4 page_ahead=1": dict(rebuild_s=4, page_ahead=True),
    "rotate": dict(rotate=True),
}


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench/prototypes/gluon_check_h64.py needs a Hopper GPU")
    props = torch.cuda.get_device_properties(0)
    gen = torch.Generator(device=bench.DEV).manual_seed(0)
    stamp = datetime.datetime.now(datetime.UTC)
    meta = bench.run_meta(props, stamp, "python bench/prototypes/gluon_check_h64.py")
    meta["check_rel_err_vs_triton"] = {}
    meta["ms"] = {}
    for H, B, L in [(128, 3, 700), (100, 2, 5000), (128, 1, 131072)]:
        sh = bench.Shape(H, B, L, gen, 0, formats=("c4r4",))
        lens = torch.randint(1, L + 1, (B,), device=bench.DEV, generator=gen)
        lens[0] = L
        layer, tab = sh.layers["c4r4"], sh.tables["c4r4"][0]
        for S in (1, 3):
            cfg = dict(max_len=L, num_splits=S, pv_split=False)
            o_t, lse_t = triton_decode.decode(layer, tab, lens, sh.q, sh.qp, bench.TAU, cfg)
            for name, kw in VARIANTS.items():
                o, lse = gluon_decode_h64.decode(layer, tab, lens, sh.q, sh.qp, bench.TAU, S, L, **kw)
                key = f"H{H} B{B} L{L} splits{S} {name}"
                err = dict(o=rel(o, o_t), lse=rel(lse, lse_t), nan=bool(o.isnan().any()))
                meta["check_rel_err_vs_triton"][key] = err
                print("check", key, err, flush=True)
        del sh
    for B, L in [(32, 32768), (32, 8192), (64, 32768), (1, 131072)]:
        sh = bench.Shape(128, B, L, gen, props.L2_cache_size, formats=("c4r4", "c16r16"))
        layer, tabs = sh.layers["c4r4"], sh.tables["c4r4"]
        S = triton_decode.default_config(B, 128, L, layer.fmt, torch.device(bench.DEV))["num_splits"]
        row = {"c16r16": sh.time("c16r16", {}), "triton_c4r4": sh.time("c4r4", {})}
        for name, kw in VARIANTS.items():
            dec = functools.partial(gluon_decode_h64.decode, **kw)
            ms = bench.time_calls(
                [functools.partial(dec, layer, t, sh.lengths, sh.q, sh.qp, bench.TAU, S, L) for t in tabs]
            )
            row[f"gluon_c4r4 {name}"] = ms
            row[f"gluon_vs_c16r16 {name}"] = row["c16r16"] / ms
            row[f"gluon_TFLOPs {name}"] = 2 * 128 * (576 + 512) * B * L / ms / 1e9
        meta["ms"][f"H128 B{B} L{L} splits{S}"] = row
        print(f"H128 B{B} L{L} splits{S}:", {k: round(v, 4) for k, v in row.items()}, flush=True)
        del sh
        torch.cuda.empty_cache()
    bench.write_record(meta, "gluon-h64", stamp, sys.argv[1] if len(sys.argv) > 1 else None)


if __name__ == "__main__":
    main()
