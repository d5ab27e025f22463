"""Compile the Gluon decode kernel for sm_90 without a GPU and summarize its SASS.

    python bench/gluon_sass.py            # C4R4 and C2R4
    python bench/gluon_sass.py --bits 4 --keep /tmp/g4.sass
    python bench/gluon_sass.py --mma16    # the 16-head register-fed kernel (quantmla/kernels/mma_decode.py)

Prints, per content width: registers, stack (spill) bytes, shared memory, and for each loop of
the kernel its instruction count, its HGMMA (wgmma) and HMMA (mma.sync) counts, and its ``BSSY`` count (divergent regions:
bench/NOTES.md, v16, found the page loop 4-6 % faster when ptxas compiles its cross-warp
reductions predicated, with none). Uses the installed Triton's compiler and ``cuobjdump``; the
H200 runs Triton 3.6, whose ``ptxas`` is the one the notes quote (other versions schedule
differently). ``GluonASTSource`` is Triton's private API: this is a measuring tool, not part of
the package.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantmla.kernels import gluon_decode  # noqa: E402

POINTERS = dict(Q="bf16", QPE="bf16", O="fp32", LSE="fp32", BT="i32", LENS="i64", PROT="bf16",
                CCodes="u8", CScale="bf16", CZero="u8", RCodes="u8", RScale="fp32", RZero="u8")  # fmt: skip
INSTR = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")


def compile_sass(bits: int, mma16: bool = False) -> tuple[str, str, int]:
    """(SASS text, resource line, shared bytes) of the kernel for ``bits``-bit content codes (or
    of the 16-head register-fed kernel :mod:`quantmla.kernels.mma_decode`, C4R4 only)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    if mma16:
        from quantmla.kernels import mma_decode

        k, consts, warps = mma_decode._h16_decode_kernel, dict(SINK=4, RECENT=128, SPLIT=True, ABL=0), mma_decode.WARPS
    else:
        k, consts, warps = gluon_decode._h64_decode_kernel, dict(SINK=4, RECENT=128, SPLIT=True, C_BITS=bits), 8
    sig, attrs = {}, {}
    for i, n in enumerate(k.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in POINTERS:
            sig[n] = "*" + POINTERS[n]
        else:
            sig[n] = "fp32" if n == "qk_scale" else "i32"
        if n not in consts and n not in ("qk_scale", "tiles_per_split", "H"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(k, sig, constexprs=consts, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        use = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    res = " ".join(re.findall(r"REG:\d+ STACK:\d+", use))
    return sass, res, c.metadata.shared


def loops(sass: str) -> list[dict]:
    """Each backward branch's body: instruction, HGMMA, HMMA and BSSY counts."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in INSTR.finditer(sass)]
    out = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            out.append(dict(instructions=len(body), hgmma=sum(o.startswith("HGMMA") for o in body),
                            hmma=sum(o.startswith("HMMA") for o in body), bssy=sum(o == "BSSY" for o in body)))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, choices=(2, 4), nargs="*", default=[4, 2])
    ap.add_argument("--keep", help="also write the SASS here (one width only)")
    ap.add_argument("--mma16", action="store_true", help="the 16-head register-fed kernel instead (C4R4)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    for bits in [4] if args.mma16 else args.bits:
        sass, res, shared = compile_sass(bits, args.mma16)
        if args.keep:
            Path(args.keep).write_text(sass)
        print(f"{'mma16 ' if args.mma16 else ''}C{bits}R4: {res} shared={shared} B")
        for i, loop in enumerate(loops(sass)):
            print(f"  loop {i}: {loop['instructions']} instructions, {loop['hgmma']} HGMMA, {loop['hmma']} HMMA, "
                  f"{loop['bssy']} BSSY")  # fmt: skip


if __name__ == "__main__":
    main()
