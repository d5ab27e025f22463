"""Check and time the Gluon decode prototype against the Triton kernel (one Hopper GPU).

    python bench/prototypes/gluon_check.py [out-dir]

Correctness: ragged batches, 1 and 3 splits, against ``triton_decode.decode`` (itself tested
against the float32 reference), with the hi/lo P·V and with P as one BF16 tile. Timing: the
sweep's method (``bench/decode.py``: CUDA-graph replays, L2 flushed, page sets rotated) at
H = 16 for C16R16, the Triton C4R4 kernel and the prototype. Writes
``gluon-prototype-<date>.json`` into ``out-dir`` (default ``bench/results``).
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
import gluon_decode  # noqa: E402

from quantmla.kernels import triton_decode  # noqa: E402


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench/prototypes/gluon_check.py needs a Hopper GPU")
    props = torch.cuda.get_device_properties(0)
    gen = torch.Generator(device=bench.DEV).manual_seed(0)
    stamp = datetime.datetime.now(datetime.UTC)
    meta = bench.run_meta(props, stamp, "python bench/prototypes/gluon_check.py")
    meta["check_rel_err_vs_triton"] = {}
    meta["ms"] = {}
    for B, L in [(3, 700), (2, 5000), (1, 131072)]:
        sh = bench.Shape(16, B, L, gen, 0, formats=("c4r4",))
        lens = torch.randint(1, L + 1, (B,), device=bench.DEV, generator=gen)
        lens[0] = L
        layer, tab = sh.layers["c4r4"], sh.tables["c4r4"][0]
        for S in (1, 3):
            o_t, lse_t = triton_decode.decode(layer, tab, lens, sh.q, sh.qp, bench.TAU, dict(max_len=L, num_splits=S))
            for pv in (True, False):
                o, lse = gluon_decode.decode(layer, tab, lens, sh.q, sh.qp, bench.TAU, S, L, pv)
                key = f"B{B} L{L} splits{S} pv_split={pv}"
                meta["check_rel_err_vs_triton"][key] = dict(
                    o=rel(o, o_t), lse=rel(lse, lse_t), nan=bool(o.isnan().any())
                )
                print("check", key, meta["check_rel_err_vs_triton"][key], flush=True)
        del sh
    for B, L in [(32, 32768), (1, 131072), (128, 131072), (32, 8192)]:
        sh = bench.Shape(16, B, L, gen, props.L2_cache_size, formats=("c4r4", "c16r16"))
        layer, tabs = sh.layers["c4r4"], sh.tables["c4r4"]
        S = triton_decode.default_config(B, 16, L, layer, torch.device(bench.DEV))["num_splits"]
        row = {
            "c16r16": sh.time("c16r16", {}),
            "triton_c4r4": sh.time("c4r4", {}),
            "triton_c4r4_bf16_p": sh.time("c4r4", {"pv_split": False}),
        }
        for pv, name in ((True, "gluon_c4r4"), (False, "gluon_c4r4_bf16_p")):
            calls = [
                functools.partial(gluon_decode.decode, layer, t, sh.lengths, sh.q, sh.qp, bench.TAU, S, L, pv)
                for t in tabs
            ]
            row[name] = bench.time_calls(calls)
        meta["ms"][f"H16 B{B} L{L} splits{S}"] = row
        print(f"H16 B{B} L{L}:", {k: round(v, 4) for k, v in row.items()}, flush=True)
        del sh
        torch.cuda.empty_cache()
    bench.write_record(meta, "gluon-prototype", stamp, sys.argv[1] if len(sys.argv) > 1 else None)


if __name__ == "__main__":
    main()
