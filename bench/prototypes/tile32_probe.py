"""32-token tiles (2 or 3 pipeline stages, default or 34/36/66 splits) against the default 64-token
tiles, C16R16 and C4R4 at 16 heads where splits hold one tile (B=8 at 1K and 2K, B=1 at 4K), both P
precisions, with bench/decode.py's timing. On the GPU:

    python bench/prototypes/tile32_probe.py bench/results/tile32-<date>.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from decode import Shape  # noqa: E402


def main(path: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for B, L in ((8, 1024), (8, 2048), (1, 4096)):
        sh = Shape(16, B, L, gen, l2, formats={"c16r16": (16, 16), "c4r4": (4, 4)})
        for pv in (True, False):
            base = dict(pv_split=pv)
            r = dict(
                B=B, L=L, pv_split=pv, c16r16_us=1e3 * sh.time("c16r16", base), c4r4_us=1e3 * sh.time("c4r4", base)
            )
            for name in ("c16r16", "c4r4"):
                for bn, st in ((32, 2), (32, 3)):
                    for s in (None, 34, 36, 66):  # a split count above the tiles is cut to one tile per split
                        cfg = dict(base, block_n=bn, num_stages=st) | ({} if s is None else dict(num_splits=s))
                        r[f"{name}_bn{bn}_st{st}_s{s}_us"] = 1e3 * sh.time(name, cfg)
            print(r, flush=True)
            rows.append(r)
    Path(path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
