"""The LSE merge launched as a programmatic dependent of the decode kernel, timed against a plain launch.

    python bench/pdl_merge.py --out DIR          # H200, ~1 minute

A decode with splits is two kernels: the decode kernel writes each split's partial output and LSE,
and :func:`quantmla.kernels.triton_decode.merge` combines them. Launched plainly, the merge starts
only after the decode grid has drained. Launched as a programmatic dependent (``launch_pdl``, the
merge waiting in ``griddepcontrol.wait`` before it reads a partial), it can be placed on the SMs as
the decode programs leave them; with ``trigger`` the exact kernel's programs also say at their start
that the dependent may launch (``griddepcontrol.launch_dependents``), so it is launched while they run.

At each shape, for C16R16 and C4R4 with the default kernels (merge plain and dependent) and for C4R4
and C2R4 exact (plain, dependent, dependent with the trigger), ``bench/decode.py``'s timing (CUDA-graph
replays, L2 flushed before each, medians); first it checks at every shape that the variants give the
same outputs, bit for bit, as the plain launches. Writes ``pdlmerge-<date>.json`` under ``--out``.
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

from decode import Shape, run_meta, time_calls, write_record  # noqa: E402

from quantmla.kernels import exact_decode, triton_decode  # noqa: E402

DEV = torch.device("cuda")
TAU = 576**-0.5


def exact_call(sh: Shape, name: str, table, out, dependent: bool, trigger: bool):
    """One exact decode (kernel, then merge) of format ``name`` over ``table`` into ``out``."""
    layer = sh.layers[name]
    cfg = triton_decode.default_config(sh.B, sh.H, sh.L, layer, DEV, {"exact": True, "max_len": sh.L})
    splits, per = triton_decode.front_split_work(layer, sh.L, cfg["num_splits"], triton_decode.prot_weight(cfg))
    op, lsep = triton_decode.partials(out[0], out[1], splits)
    w = triton_decode.prot_weight(cfg)
    exact_decode.decode(
        layer, table, sh.lengths, sh.q, sh.qp, op, lsep, TAU, splits, per, weight=w, trigger=trigger and splits > 1
    )
    triton_decode.merge(op, lsep, out[0], out[1], dependent=dependent)


def default_call(sh: Shape, name: str, table, out, dependent: bool):
    """One decode with the default kernels, the merge plain or dependent."""
    keep = triton_decode.MERGE_PDL
    triton_decode.MERGE_PDL = dependent
    try:
        triton_decode.decode(sh.layers[name], table, sh.lengths, sh.q, sh.qp, TAU, {"max_len": sh.L}, out)
    finally:
        triton_decode.MERGE_PDL = keep


VARIANTS = {  # key: (format, exact, dependent, trigger)
    "c16r16": ("c16r16", False, False, False),
    "c16r16_pdl": ("c16r16", False, True, False),
    "c4r4": ("c4r4", False, False, False),
    "c4r4_pdl": ("c4r4", False, True, False),
    "c4r4_exact": ("c4r4", True, False, False),
    "c4r4_exact_pdl": ("c4r4", True, True, False),
    "c4r4_exact_pdl_trigger": ("c4r4", True, True, True),
    "c2r4_exact": ("c2r4", True, False, False),
    "c2r4_exact_pdl": ("c2r4", True, True, False),
    "c2r4_exact_pdl_trigger": ("c2r4", True, True, True),
}


def call(sh, key, table, out):
    name, exact, dependent, trigger = VARIANTS[key]
    if exact:
        return exact_call(sh, name, table, out, dependent, trigger)
    return default_call(sh, name, table, out, dependent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="16:1:131072,16:1:32768,16:32:8192,16:32:32768,16:128:32768")
    a = ap.parse_args()
    stamp = datetime.datetime.now(datetime.UTC)
    props = torch.cuda.get_device_properties(0)
    meta = run_meta(props, stamp, "python bench/pdl_merge.py " + " ".join(sys.argv[1:]))
    meta["rows"] = []
    gen = torch.Generator(DEV).manual_seed(0)
    for spec in a.shapes.split(","):
        H, B, L = map(int, spec.split(":"))
        sh = Shape(H, B, L, gen, props.L2_cache_size, formats={"c16r16": (16, 16), "c4r4": (4, 4), "c2r4": (2, 4)})
        row = {"H": H, "B": B, "L": L}
        outs = {}
        for key in VARIANTS:
            out = (torch.full((B, H, 512), float("nan"), device=DEV), torch.full((B, H), float("nan"), device=DEV))
            call(sh, key, sh.tables[VARIANTS[key][0]][0], out)
            torch.cuda.synchronize()
            outs[key] = out
        for key, (name, exact, _, _) in VARIANTS.items():
            base = outs[("c4r4_exact" if name == "c4r4" else "c2r4_exact") if exact else name]
            same = torch.equal(outs[key][0], base[0]) and torch.equal(outs[key][1], base[1])
            row[f"{key}_same"] = bool(same) and not bool(torch.isnan(outs[key][0]).any())
        for key, (name, _, _, _) in VARIANTS.items():
            out = (torch.empty(B, H, 512, device=DEV), torch.empty(B, H, device=DEV))
            row[f"{key}_ms"] = time_calls([functools.partial(call, sh, key, t, out) for t in sh.tables[name]])
        print({k: round(v * 1e3, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        meta["rows"].append(row)
        write_record(meta, "pdlmerge", stamp, a.out)
        del sh
        torch.cuda.empty_cache()
    if not all(v for r in meta["rows"] for k, v in r.items() if k.endswith("_same")):
        sys.exit("a dependent launch changed an output")


if __name__ == "__main__":
    main()
