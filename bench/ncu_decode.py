"""One decode launch per format for Nsight Compute: where a tile's time goes, from the counters.

    ncu --clock-control none --profile-from-start off -k regex:_decode_kernel --set full \\
        -o h16-c4r4 python bench/ncu_decode.py --shape 16:32:32768 --fmt c4r4

Builds the same inputs as ``bench/decode.py`` (random codes, shuffled pages, sink 4 + recent
128 protected), compiles and runs the kernel a few times outside the profiled range, then runs
it once between ``cudaProfilerStart``/``Stop`` so that only that launch is measured.
``bench/ncu.sh`` profiles the bar shapes and prints the counters that matter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import DEV, FORMATS, TAU, Shape, _shapes  # noqa: E402

from quantmla.kernels import triton_decode  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=_shapes, required=True, help="H:B:L")
    ap.add_argument("--fmt", choices=tuple(FORMATS), required=True)
    ap.add_argument("--config", default="", help="tile overrides, e.g. num_stages=3,block_n=32")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/ncu_decode.py needs a CUDA GPU")
    (H, B, L), *_ = args.shape
    cfg = {
        k: (v == "True" if v in ("True", "False") else int(v))
        for k, v in (kv.split("=") for kv in args.config.split(",") if kv)
    }
    gen = torch.Generator(device=DEV).manual_seed(0)
    sh = Shape(H, B, L, gen, 0, formats=(args.fmt,))
    layer, table = sh.layers[args.fmt], sh.tables[args.fmt][0]
    cfg = dict(cfg, max_len=L)
    chosen = triton_decode.default_config(B, H, L, layer, DEV, cfg)
    for _ in range(3):
        triton_decode.decode(layer, table, sh.lengths, sh.q, sh.qp, TAU, cfg)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    triton_decode.decode(layer, table, sh.lengths, sh.q, sh.qp, TAU, cfg)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled H={H} B={B} L={L} {args.fmt}: {chosen}")


if __name__ == "__main__":
    main()
