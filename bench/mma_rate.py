"""How many tensor-core products an SM retires per cycle at the exact kernel's shapes.

    python bench/mma_rate.py --out DIR          # H200, ~30 s
    python bench/mma_rate.py --sass             # no GPU: compile each kernel for sm_90, count its loop

The exact decode kernel (quantmla/kernels/exact_decode.py) multiplies with 16 heads on N: per
64-token tile, 39 ``wgmma.m64n16k16`` for the scores (A from registers, B from shared memory) and
per warp 72 ``mma.sync.m16n8k16`` for P·V. This script times each instruction alone in a loop, with
no loads and nothing else to wait for, at 1 to 4 programs (warpgroups) per SM and 1 to 8 independent
accumulators per warpgroup, and for comparison wgmma at N = 32, 64 and 128:

- ``wgmma``: each accumulator a chain of four products per iteration (as a score group's four
  nibbles), all chains issued, then one wait;
- ``mma_sync``: one ``m16n8k16`` per warp and accumulator per iteration, A and B in registers;
- ``mixed``: two wgmma chains issued, 16 ``mma.sync`` per warp issued while they run, then the wait,
  against each kind alone in the same loop: whether the two overlap on the tensor cores.

Reports per SM: cycles per instruction (at the SM clock read from the device), and the multiply-adds
per cycle against the dense FP16 peak (989.4 TFLOP/s for H100/H200 SXM at 1.83 GHz: 2048 per SM
per cycle). Medians of ``triton.testing.do_bench``. Writes ``mmarate-<date>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from decode import run_meta, write_record  # noqa: E402

_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
PEAK_FMA = 2048  # dense FP16 multiply-adds per SM and cycle (H100/H200 SXM)


@gluon.jit
def _chain4(a, b, acc):
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma(a, b, acc, is_async=True)
    return warpgroup_mma(a, b, acc, is_async=True)


@gluon.jit
def _a_values(L: gl.constexpr):
    """A (64, 16) FP16 operand in layout ``L`` that the compiler cannot fold (it depends on the program id)."""
    LB: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, LB))[:, None]
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, LB))[None, :]
    return gl.convert_layout(((r + c + gl.program_id(0)) % 7).to(gl.float16) * 0.001, L)


@gluon.jit
def _b_values(K: gl.constexpr, N: gl.constexpr):
    """A (K, N) FP16 tile in a blocked layout."""
    LB: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0])
    rk = gl.arange(0, K, layout=gl.SliceLayout(1, LB))[:, None]
    cn = gl.arange(0, N, layout=gl.SliceLayout(0, LB))[None, :]
    return ((rk * 3 + cn) % 5).to(gl.float16) * 0.001


@gluon.jit
def _wgmma_operands(N: gl.constexpr, ACC: gl.constexpr):
    """wgmma's A (64 x 16, registers) and B (16 x N, shared memory, stored N x 16 as the exact kernel's
    query tiles) for accumulator layout ``ACC``."""
    a = _a_values(gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2))
    bs = gl.allocate_shared_memory(gl.float16, [N, 16], gl.NVMMASharedLayout.get_default_for([N, 16], gl.float16))
    bs.store(_b_values(N, 16))
    fence_async_shared()
    _barrier()
    return a, bs.permute((1, 0))


@gluon.jit
def _mma_operands(M2: gl.constexpr):
    """mma.sync's A (64 x 16) and B (16 x 8), both in registers, for accumulator layout ``M2``."""
    a = _a_values(gl.DotOperandLayout(operand_index=0, parent=M2, k_width=2))
    return a, gl.convert_layout(_b_values(16, 8), gl.DotOperandLayout(operand_index=1, parent=M2, k_width=2))


@gluon.jit
def _wgmma_kernel(OUT, iters, N: gl.constexpr, CHAINS: gl.constexpr):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    a, b = _wgmma_operands(N, ACC)
    z = gl.zeros([64, N], gl.float32, ACC)
    a0 = z
    a1 = z + 1.0
    a2 = z + 2.0
    a3 = z + 3.0
    for _ in range(iters):
        a0 = _chain4(a, b, a0)
        if CHAINS > 1:
            a1 = _chain4(a, b, a1)
        if CHAINS > 2:
            a2 = _chain4(a, b, a2)
            a3 = _chain4(a, b, a3)
        a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1, a2, a3))
    tot = gl.sum(gl.sum(a0 + a1 + a2 + a3, axis=1), axis=0)
    gl.store(OUT + gl.program_id(0), tot)


@gluon.jit
def _mma_kernel(OUT, iters, CHAINS: gl.constexpr):
    M2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a, b = _mma_operands(M2)
    z = gl.zeros([64, 8], gl.float32, M2)  # distinct starts: equal chains would be merged by the compiler
    c0 = z
    c1 = z + 1.0
    c2 = z + 2.0
    c3 = z + 3.0
    c4 = z + 4.0
    c5 = z + 5.0
    c6 = z + 6.0
    c7 = z + 7.0
    for _ in range(iters):
        c0 = mma_v2(a, b, c0)
        if CHAINS > 1:
            c1 = mma_v2(a, b, c1)
        if CHAINS > 2:
            c2 = mma_v2(a, b, c2)
            c3 = mma_v2(a, b, c3)
        if CHAINS > 4:
            c4 = mma_v2(a, b, c4)
            c5 = mma_v2(a, b, c5)
            c6 = mma_v2(a, b, c6)
            c7 = mma_v2(a, b, c7)
    tot = gl.sum(gl.sum(c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7, axis=1), axis=0)
    gl.store(OUT + gl.program_id(0), tot)


@gluon.jit
def _mixed_kernel(OUT, iters, W: gl.constexpr, M: gl.constexpr):
    """Per iteration (``W``) two chains of four ``wgmma.m64n16k16`` issued, (``M``) four chains of four
    ``mma.sync.m16n8k16`` per warp issued while they run, then the wgmma waited for: with both, whether
    the two kinds of product overlap on the tensor cores or queue behind each other."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    M2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a, b = _wgmma_operands(16, ACC)
    am, bm = _mma_operands(M2)
    z = gl.zeros([64, 16], gl.float32, ACC)
    w0 = z
    w1 = z + 1.0
    zm = gl.zeros([64, 8], gl.float32, M2)
    m0 = zm
    m1 = zm + 1.0
    m2 = zm + 2.0
    m3 = zm + 3.0
    for _ in range(iters):
        if W:
            w0 = _chain4(a, b, w0)
            w1 = _chain4(a, b, w1)
        if M:
            for _k in gl.static_range(4):
                m0 = mma_v2(am, bm, m0)
                m1 = mma_v2(am, bm, m1)
                m2 = mma_v2(am, bm, m2)
                m3 = mma_v2(am, bm, m3)
        if W:
            w0, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(w0, w1))
    tot = gl.sum(gl.sum(w0 + w1, axis=1), axis=0) + gl.sum(gl.sum(m0 + m1 + m2 + m3, axis=1), axis=0)
    gl.store(OUT + gl.program_id(0), tot)


def mixed(per_sm: int, sms: int, clock_hz: float) -> dict:
    """:func:`_mixed_kernel`'s time with wgmma only, mma.sync only and both, at ``per_sm`` programs per SM:
    cycles per iteration (8 wgmma per SM and program, 16 mma.sync per warp)."""
    grid = sms * per_sm
    out = torch.empty(grid, device="cuda")
    iters = 4096
    row = dict(kind="mixed", programs_per_sm=per_sm, wgmma_per_iteration=8, mma_sync_per_iteration_and_warp=16)
    for key, w, m in (("wgmma_only", True, False), ("mma_sync_only", False, True), ("both", True, True)):

        def go(w=w, m=m):
            _mixed_kernel[(grid,)](out, iters, W=w, M=m, num_warps=4)

        go()
        torch.cuda.synchronize()
        ms = do_bench(go, warmup=10, rep=100, return_mode="median")
        row[f"{key}_cycles_per_iteration"] = ms * 1e-3 * clock_hz / iters
    return row


def rate(kind: str, per_sm: int, chains: int, n: int, sms: int, clock_hz: float) -> dict:
    """Cycles per instruction per SM (wgmma) or per SM sub-partition (mma.sync, one warp of each program
    on each), and multiply-adds per SM and cycle."""
    grid = sms * per_sm
    out = torch.empty(grid, device="cuda")
    iters = 4096
    if kind == "wgmma":

        def go():
            _wgmma_kernel[(grid,)](out, iters, N=n, CHAINS=chains, num_warps=4)

        per_program = iters * 4 * chains  # wgmma per program (one warpgroup)
        fma = 64 * n * 16
    else:

        def go():
            _mma_kernel[(grid,)](out, iters, CHAINS=chains, num_warps=4)

        per_program = iters * chains  # mma.sync per warp; each program has one warp per sub-partition
        fma = 16 * 8 * 16 * 4  # per program-instruction: four warps, one m16n8k16 each
    go()
    torch.cuda.synchronize()
    ms = do_bench(go, warmup=10, rep=100, return_mode="median")
    cycles = ms * 1e-3 * clock_hz
    instr_per_sm = per_program * per_sm
    return dict(
        kind=kind, N=n if kind == "wgmma" else 8, programs_per_sm=per_sm, chains=chains, ms=ms,
        cycles_per_instruction=cycles / instr_per_sm, fma_per_cycle=instr_per_sm * fma / cycles,
        of_peak=instr_per_sm * fma / cycles / PEAK_FMA,
    )  # fmt: skip


CASES = [("wgmma", 16, c) for c in (1, 2, 4)] + [("mma_sync", 8, c) for c in (1, 2, 4, 8)]
CASES += [("wgmma", n, 2) for n in (32, 64, 128)]


def sass_counts() -> list[dict]:
    """Each case compiled for sm_90 without a GPU (Triton's private ``GluonASTSource``, as
    ``bench/gluon_sass.py``): registers, spills and the HGMMA / HMMA of its main loop (the compiler
    unrolls it; per iteration of the source loop there must be 4 x chains wgmma or chains mma.sync)."""
    import triton
    from gluon_sass import _sass, loops
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    out = []
    for kind, n, chains in CASES + [("mixed", 16, 2)]:
        k = {"wgmma": _wgmma_kernel, "mma_sync": _mma_kernel, "mixed": _mixed_kernel}[kind]
        consts = {"wgmma": dict(N=n, CHAINS=chains), "mma_sync": dict(CHAINS=chains), "mixed": dict(W=True, M=True)}[
            kind
        ]
        sig = {a: "constexpr" if a in consts else "*fp32" if a == "OUT" else "i32" for a in k.arg_names}
        c = triton.compile(GluonASTSource(k, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4))  # fmt: skip
        sass, res, _ = _sass(c)
        main = max(loops(sass), key=lambda lp: lp["hgmma"] + lp["hmma"])
        out.append(dict(kind=kind, N=n, chains=chains, resources=res, hgmma=main["hgmma"], hmma=main["hmma"],
                        local=main["local"]))  # fmt: skip
    return out


def sm_clock_hz() -> float:
    """The GPU's maximum SM clock (``nvidia-smi``), 1.98 GHz if it cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        return float(out.stdout.split()[0]) * 1e6
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 1.98e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 and count, no GPU")
    a = ap.parse_args()
    if a.sass:
        for r in sass_counts():
            print(r)
        return
    stamp = datetime.datetime.now(datetime.UTC)
    props = torch.cuda.get_device_properties(0)
    meta = run_meta(props, stamp, "python bench/mma_rate.py " + " ".join(sys.argv[1:]))
    clock = sm_clock_hz()
    meta["sm_clock_hz"] = clock
    meta["timing"] = "triton.testing.do_bench median, plain launches (~1 ms each)"
    rows = []
    for kind, n, chains in CASES:
        for per_sm in (1, 2, 4) if n <= 16 else (2,):
            rows.append(rate(kind, per_sm, chains, n, props.multi_processor_count, clock))
            print(rows[-1], flush=True)
    for per_sm in (1, 2):
        rows.append(mixed(per_sm, props.multi_processor_count, clock))
        print(rows[-1], flush=True)
    meta["rows"] = rows
    write_record(meta, "mmarate", stamp, a.out)


if __name__ == "__main__":
    main()
