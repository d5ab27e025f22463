"""bench/gluon_sass.py compiles the Gluon decode kernel for sm_90 with the installed Triton (no GPU
needed) and finds its two tile loops: the page loop and the recent ring's, each issuing the
52 HGMMA of one 64-token tile (scores: 4 chunks x 8 + RoPE 4; P·V: 4 chunks x 4); and the same for
the 16-head register-fed kernel, whose page and protected-row loops each issue one tile's
mma.sync per warp. Neither kernel's loops may hold a divergent region (BSSY): the 128-head
kernel's speed rests on ptxas predicating the page loop's cross-warp reduction stores instead
of wrapping them in six BSSY/BSYNC regions, a compiler decision a kernel change can flip
(bench/NOTES.md, v16)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bits", [4, 2])
def test_gluon_kernel_compiles_for_hopper_with_one_tile_per_loop_iteration(bits):
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    r = subprocess.run(
        [sys.executable, "bench/gluon_sass.py", "--bits", str(bits)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    head = re.search(rf"C{bits}R4: REG:(\d+) STACK:(\d+) shared=(\d+) B", r.stdout)
    assert head and int(head.group(3)) <= 227 * 1024, r.stdout  # fits one SM's shared memory
    loops = re.findall(r"loop \d+: \d+ instructions, (\d+) HGMMA, \d+ HMMA, (\d+) BSSY", r.stdout)
    assert [int(h) for h, _ in loops] == [52, 52], r.stdout
    assert [int(b) for _, b in loops] == [0, 0], r.stdout  # predicated reductions (v16)


def test_register_fed_kernel_compiles_for_hopper_with_one_tile_per_loop_iteration():
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "bench/gluon_sass.py", "--mma16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    head = re.search(r"mma16 C4R4: REG:(\d+) STACK:(\d+) shared=(\d+) B", r.stdout)
    assert head and int(head.group(3)) <= 227 * 1024, r.stdout
    loops = re.findall(r"loop \d+: \d+ instructions, (\d+) HGMMA, (\d+) HMMA, (\d+) BSSY", r.stdout)
    from quantmla.kernels import mma_decode

    # per warp and tile: 4 warps own two groups (scores 8 n-blocks x 9 k-blocks, P·V 4 x 16),
    # 8 warps one (scores 8 x (4 + one k8 RoPE block), P·V 4 x 8)
    per_tile = {4: 136, 8: 72}[mma_decode.WARPS]
    assert [tuple(map(int, t)) for t in loops] == [(0, per_tile, 0), (0, per_tile, 0)], r.stdout
