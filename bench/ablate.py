"""Stage ablation of the decode kernel: time it with one stage left out (diagnostic).

The switches live in ``bench/ablate.patch``, not in the kernel: apply it to a scratch checkout
first (``git apply bench/ablate.patch``), then ``python bench/ablate.py``. It times, per shape
and format, the kernel as it is, with lazy rescaling of the accumulator (``lazy``), without
the P·V product (``ablate=2``) and without the 512-wide score product (``ablate=3``); the
differences say what each stage costs. Writes ``ablate-<date>.json`` into the folder given as
the first argument (default ``bench/results``).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode as bench  # noqa: E402

from quantmla.kernels import DECODE_CONFIG  # noqa: E402

SHAPES = [(16, 32, 32768), (16, 1, 131072), (128, 32, 32768)]
# the switches live in the Triton kernel: the Gluon one (C4R4 above 16 heads by default) is kept off
VARIANTS = [{"gluon": False} | v for v in ({}, {"lazy": True}, {"ablate": 2}, {"ablate": 3})]


def main() -> None:
    if "ablate" not in DECODE_CONFIG:
        raise SystemExit("bench/ablate.py needs the switches of bench/ablate.patch: git apply bench/ablate.patch")
    if not torch.cuda.is_available():
        raise SystemExit("bench/ablate.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    gen = torch.Generator(device=bench.DEV).manual_seed(0)
    stamp = datetime.datetime.now(datetime.UTC)
    meta = bench.run_meta(props, stamp, "git apply bench/ablate.patch && python bench/ablate.py")
    meta["ms"] = {}
    for H, B, L in SHAPES:
        for name in ("c16r16", "c4r4"):
            sh = bench.Shape(H, B, L, gen, props.L2_cache_size, formats=(name,))
            for extra in VARIANTS:
                ms = sh.time(name, dict(extra))
                key = f"H{H} B{B} L{L} {name} {json.dumps(extra)}"
                meta["ms"][key] = ms
                print(f"{key}: {ms:.4f} ms", flush=True)
            del sh
            torch.cuda.empty_cache()
    bench.write_record(meta, "ablate", stamp, sys.argv[1] if len(sys.argv) > 1 else None)


if __name__ == "__main__":
    main()
