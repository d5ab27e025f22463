"""Compile the decode kernels for sm_90 without a GPU and summarize their SASS.

    python bench/gluon_sass.py            # the Gluon kernel, C4R4 and C2R4
    python bench/gluon_sass.py --bits 4 --keep /tmp/g4.sass
    python bench/gluon_sass.py --exact    # the 16-head exact-dequantization kernel, C4R4 and C2R4 (quantmla/kernels/exact_decode.py)
    python bench/gluon_sass.py --triton   # the Triton kernel at 16 heads, sink in page tile 0 and not
    python bench/gluon_sass.py --prefill  # the teacher-forced kernel, stored rows rounded and exact

Prints, per content width: registers, stack (spill) bytes, shared memory, and for each loop of
the kernel its instruction count, its HGMMA (wgmma) and HMMA (mma.sync) counts, its local-memory
accesses (``LDL``/``STL``: spills), its TMA (``UTMALDG``) and ``cp.async`` (``LDGSTS``) copies and its ``BSSY`` count (divergent regions:
the page loop is faster when ptxas compiles its cross-warp reductions predicated, with none;
docs/kernels.md). Uses the installed Triton's compiler and ``cuobjdump``; the
H200 runs Triton 3.6, whose ``ptxas`` gave the counts the tests check (other versions schedule
differently). With ``--triton`` it prints the Triton kernel's registers, spills, shared memory
and its ``HMMA`` (mma.sync) counts by kind: on a machine without a GPU, this is the check that the
kernel compiles for Hopper with BF16 tensor-core products (the interpreter does not compile).
``GluonASTSource`` and ``ASTSource`` are Triton's private API: this is a measuring tool, not part of
the package.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantmla.kernels import gluon_decode  # noqa: E402

POINTERS = dict(Q="bf16", QPE="bf16", O="fp32", LSE="fp32", BT="i32", LENS="i64", PROT="bf16",
                CCodes="u8", CScale="bf16", CZero="u8", RCodes="u8", RScale="fp32", RZero="u8")  # fmt: skip
INSTR = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")


def compile_sass(bits: int, exact: bool = False) -> tuple[str, str, int]:
    """(SASS text, resource line, shared bytes) of the Gluon kernel for ``bits``-bit content codes (or
    of the 16-head exact-dequantization kernel :mod:`quantmla.kernels.exact_decode`)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    if exact:
        import torch

        from quantmla.kernels import PageFormat, exact_decode

        k, warps = exact_decode._exact16_kernel, exact_decode.WARPS
        consts = exact_decode.constexprs(PageFormat(bits, 4, 512, 64, 64, torch.bfloat16), 4, 128, True)
    else:
        k, consts, warps = gluon_decode._h64_decode_kernel, dict(SINK=4, RECENT=128, SPLIT=True, C_BITS=bits), 8
    descs = exact_decode.descriptor_blocks(bits) if exact else {}
    sig, attrs = {}, {}
    for i, n in enumerate(k.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in descs:  # a TMA descriptor over the pool's 16-bit words
            block, layout = descs[n]
            sig[n] = f"tensordesc<i16[{', '.join(map(str, block))}],{layout!r}>"
            continue
        elif n in POINTERS:
            sig[n] = "*" + POINTERS[n]
        else:
            sig[n] = "fp32" if n == "qk_scale" else "i32"
        if n not in consts and n not in ("qk_scale", "tiles_per_split", "H"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(k, sig, constexprs=consts, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    return _sass(c)


def compile_triton_sass(bits: int, sink_in_tile0: bool) -> tuple[str, str, int]:
    """(SASS text, resource line, shared bytes) of the Triton decode kernel
    (:mod:`quantmla.kernels.triton_decode`) with its 16-head tiles, for ``bits``-bit content codes
    and 4-bit RoPE codes in a BF16 cache, the sink in page tile 0 or among the protected tiles."""
    from quantmla.kernels import PagedLayer, PageFormat, dispatch, triton_decode

    layer = PagedLayer(PageFormat(bits, 4), 1, "cpu", batch=1, sink=4, recent=128)
    cfg = dict(dispatch.TILES[(False, True)], block_h=16)
    consts = triton_decode.constexprs(layer, cfg, True, sink_in_tile0) | dict(INTERP=False)
    return _sass(_compile_triton(triton_decode._decode_kernel, layer, consts, POINTERS, cfg))


def _compile_triton(k, layer, consts: dict, pointers: dict, cfg: dict):
    """Triton kernel ``k`` compiled for sm_90: ``consts`` its compile-time arguments, ``layer``'s page
    regions and ``pointers`` (name: element type) its pointer arguments (16-byte aligned), every
    other argument an int32 but ``qk_scale``; tiles ``cfg`` (warps, stages)."""
    import torch
    from triton.compiler import ASTSource

    from quantmla.kernels._tiles import region_args

    types = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8", torch.int32: "i32"}
    regions = dict(zip(("CRows", "CCodes", "CScale", "CZero"), region_args(layer, "C")[:4]))
    regions |= dict(zip(("RRows", "RCodes", "RScale", "RZero"), region_args(layer, "R")[:4]))
    sig, attrs = {}, {}
    for i, n in enumerate(k.arg_names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in regions or n in pointers:
            sig[n] = "*" + (types[regions[n].dtype] if n in regions else pointers[n])
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n == "qk_scale" else "i32"
    src = ASTSource(k, sig, constexprs={(k.arg_names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_prefill_sass(bits: int, exact: bool) -> tuple[str, str, int, dict]:
    """(SASS text, resource line, shared bytes, tiles) of the teacher-forced kernel
    (:mod:`quantmla.kernels.triton_prefill`) with its default tiles, for ``bits``-bit content codes
    and 4-bit RoPE codes in a BF16 cache at d_c 512 with protection, the stored rows rounded or ``exact``."""
    from quantmla.kernels import PagedLayer, PageFormat, triton_prefill
    from quantmla.kernels._tiles import container_bits

    layer = PagedLayer(PageFormat(bits, 4), 1, "cpu", batch=1, sink=4, recent=128)
    cfg = triton_prefill.default_config(16, 1024, layer.fmt, True, exact)
    consts = dict(DC=512, DCP=512, DR=64, G=64, C_BITS=bits, R_BITS=4, C_W=container_bits(bits), R_W=4, QUANT=True,
                  SINK=4, RECENT=128, PAGE_SIZE=64, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], PV_SPLIT=True,
                  IEEE=False, KV=triton.language.bfloat16, INTERP=False, EXACT=exact, DEQ=not exact)  # fmt: skip
    pointers = dict(Q="bf16", QPE="bf16", O="fp32", LSE="fp32", C="bf16", KP="bf16", KVLEN="i64", QLEN="i64", BT="i32",
                    DQC="bf16", DQR="bf16")  # fmt: skip
    return (*_sass(_compile_triton(triton_prefill._prefill_kernel, layer, consts, pointers, cfg)), cfg)


def _sass(c) -> tuple[str, str, int]:
    """(SASS text, resource line, shared bytes) of compiled kernel ``c`` (``cuobjdump`` of its cubin)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        use = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    res = " ".join(re.findall(r"REG:\d+ STACK:\d+", use))
    return sass, res, c.metadata.shared


def loops(sass: str) -> list[dict]:
    """Each backward branch's body: instruction, HGMMA, HMMA, BSSY and local-memory (spill) access counts,
    its TMA copies and the CTA barriers (``BAR.SYNC``) between its first and last.
    An mbarrier wait's out-of-line retry (``SYNCS.PHASECHK`` then a branch to itself and one back to the
    wait) is not a loop of the kernel and is left out."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in INSTR.finditer(sass)]
    out = []
    for k, (addr, op, rest) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        retry = any(o.startswith("SYNCS.PHASECHK") for _, o, _ in ins[max(k - 2, 0) : k])
        if target and int(target.group(1), 16) < addr and not retry:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            copies = [i for i, o in enumerate(body) if o.startswith("UTMALDG")]
            between = body[copies[0] : copies[-1]] if copies else []
            out.append(dict(instructions=len(body), hgmma=sum(o.startswith("HGMMA") for o in body),
                            hmma=sum(o.startswith("HMMA") for o in body), bssy=sum(o == "BSSY" for o in body),
                            local=sum(o.startswith(("LDL", "STL")) for o in body),
                            tma=len(copies), tma_bars=sum(o.startswith("BAR.SYNC") for o in between),
                            cp_async=sum(o.startswith("LDGSTS") for o in body)))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, choices=(2, 4), nargs="*", default=[4, 2])
    ap.add_argument("--keep", help="also write the SASS here (one width only)")
    ap.add_argument("--triton", action="store_true", help="the Triton kernel at 16 heads instead")
    ap.add_argument("--exact", action="store_true", help="the 16-head exact-dequantization kernel instead")
    ap.add_argument("--prefill", action="store_true", help="the teacher-forced kernel instead, rounded and exact")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    if args.prefill:
        for bits in args.bits:
            for exact in (False, True):
                sass, res, shared, cfg = compile_prefill_sass(bits, exact)
                tiles = f"{cfg['block_m']}x{cfg['block_n']}/{cfg['num_warps']} warps"
                ops = re.findall(r"\b(HMMA\.\w+(?:\.\w+)*)", sass)
                kinds = ", ".join(f"{n} {o}" for o, n in sorted(Counter(ops).items()))
                print(f"prefill C{bits}R4 exact={exact} ({tiles}): {res} shared={shared} B, {len(ops)} HMMA ({kinds})")
        return
    if args.triton:
        for bits in args.bits:
            for swap in (True, False):
                sass, res, shared = compile_triton_sass(bits, swap)
                ops = re.findall(r"\b(HMMA\.\w+(?:\.\w+)*)", sass)
                kinds = ", ".join(f"{n} {o}" for o, n in sorted(Counter(ops).items()))
                print(f"triton C{bits}R4 sink_in_tile0={swap}: {res} shared={shared} B, {len(ops)} HMMA ({kinds})")
        return
    for bits in args.bits:
        sass, res, shared = compile_sass(bits, args.exact)
        if args.keep:
            Path(args.keep).write_text(sass)
        print(f"{'exact ' if args.exact else ''}C{bits}R4: {res} shared={shared} B")
        for i, loop in enumerate(loops(sass)):
            print(f"  loop {i}: {loop['instructions']} instructions, {loop['hgmma']} HGMMA, {loop['hmma']} HMMA, "
                  f"{loop['bssy']} BSSY, {loop['local']} local, {loop['tma']} TMA ({loop['tma_bars']} barriers between), "
                  f"{loop['cp_async']} cp.async")  # fmt: skip


if __name__ == "__main__":
    main()
