"""Split counts for C4R4 where its splits hold one tile (16 heads; B=8 at 1K and 2K, B=32 at 1K),
timed beside C16R16 with bench/decode.py's timing, both P precisions. On the GPU:

    python bench/prototypes/splits_probe.py bench/results/splits-<date>.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from decode import Shape  # noqa: E402

from quantmla.kernels import triton_decode  # noqa: E402


def main(path: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    dev = torch.device("cuda")
    rows = []
    for B, L in ((8, 1024), (8, 2048), (32, 1024)):
        sh = Shape(16, B, L, gen, l2, formats={"c16r16": (16, 16), "c4r4": (4, 4)})
        for pv in (True, False):
            base = dict(pv_split=pv)
            d16 = triton_decode.default_config(B, 16, L, sh.layers["c16r16"], dev, base)["num_splits"]
            d4 = triton_decode.default_config(B, 16, L, sh.layers["c4r4"], dev, base)["num_splits"]
            r = dict(B=B, L=L, pv_split=pv, c16r16_splits=d16, c16r16_us=1e3 * sh.time("c16r16", base))
            r["c4r4_default_splits"] = d4
            for s in sorted({d4, d16, 12, 9, 8, 6, 4}):
                r[f"c4r4_s{s}_us"] = 1e3 * sh.time("c4r4", dict(base, num_splits=s))
            print(r, flush=True)
            rows.append(r)
    Path(path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
