"""bench/gluon_sass.py compiles the Gluon decode kernel for sm_90 with the installed Triton (no GPU
needed) and finds its two tile loops: the page loop and the recent ring's, each issuing the
52 HGMMA of one 64-token tile (scores: 4 chunks x 8 + RoPE 4; P·V: 4 chunks x 4). Its loops may
not hold a divergent region (BSSY): the 128-head kernel's speed rests on ptxas predicating the
page loop's cross-warp reduction stores instead of wrapping them in six BSSY/BSYNC regions, a
compiler decision a kernel change can flip (docs/kernel-design-notes.md). And the exact kernel, and the
Triton decode and teacher-forced kernels, which the CPU tests otherwise run only in the
interpreter, compiled for sm_90 to the tensor-core products they are written for."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)

ROOT = Path(__file__).resolve().parents[1]


def _compile(*args):
    """``python <args>`` from the repository root with a real compiler (not the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.parametrize("bits", [4, 2])
def test_gluon_kernel_compiles_for_hopper_with_one_tile_per_loop_iteration(bits):
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    r = _compile("bench/gluon_sass.py", "--bits", str(bits))
    assert r.returncode == 0, r.stderr[-3000:]
    head = re.search(rf"C{bits}R4: REG:(\d+) STACK:(\d+) shared=(\d+) B", r.stdout)
    assert head and int(head.group(3)) <= 227 * 1024, r.stdout  # fits one SM's shared memory
    loops = re.findall(r"loop \d+: \d+ instructions, (\d+) HGMMA, \d+ HMMA, (\d+) BSSY", r.stdout)
    assert [int(h) for h, _ in loops] == [52, 52], r.stdout
    assert [int(b) for _, b in loops] == [0, 0], r.stdout  # predicated reductions


def test_triton_decode_kernel_compiles_for_hopper_with_bf16_tensor_core_products():
    """The Triton decode kernel at 16 heads (4 warps, 64-token tiles, hi/lo P) compiled for sm_90:
    only BF16 m16n8k16 products, one tile's worth per tile body: per warp 16 x 16 scores over 576
    channels (2 x 36) and, per content chunk of 128 channels, 16 x 32 outputs over 64 tokens twice
    (4 x 4 x 4 x 2), 200 in all. The page loop and the protected rows' loop are two bodies; with the
    sink in page tile 0 the peeled tile is a third."""
    r = _compile("bench/gluon_sass.py", "--triton", "--bits", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    per_tile = 2 * 36 + 4 * 4 * 4 * 2
    for swap, bodies in (("True", 3), ("False", 2)):
        m = re.search(
            rf"triton C4R4 sink_in_tile0={swap}: REG:\d+ STACK:\d+ shared=(\d+) B, (\d+) HMMA \((.*)\)", r.stdout
        )
        assert m and int(m.group(1)) <= 227 * 1024 // 2, r.stdout  # two programs per SM
        assert int(m.group(2)) == bodies * per_tile and m.group(3) == f"{bodies * per_tile} HMMA.16816.F32.BF16", (
            r.stdout
        )


def test_exact_kernel_compiles_for_hopper_with_one_tile_per_loop_iteration():
    """The 16-head exact-dequantization kernel compiled for sm_90, C4R4 and C2R4: two programs'
    shared memory fit one SM, no spill in the page loop (a few bytes of stack outside it, where
    the Triton version's register allocation puts them); the page loop copies the next page with two TMA
    copies and no cp.async, and issues one tile's products per iteration:
    9 groups x 4 wgmma for the scores (nibbles, or pairs of 2-bit codes) and 3 for their zero-point
    term (39 HGMMA), and per warp two groups of P·V, 4 nibbles x 2 n-blocks (or 8 codes x 1) x 4
    k-steps plus the zero column's 4 (72 HMMA); the protected rows' loop the 36 score wgmma and 64
    HMMA."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    r = _compile("bench/gluon_sass.py", "--exact")
    assert r.returncode == 0, r.stderr[-3000:]
    for bits in (4, 2):
        head = re.search(rf"exact C{bits}R4: REG:(\d+) STACK:(\d+) shared=(\d+) B\n((?:  loop.*\n)+)", r.stdout)
        assert head and int(head.group(3)) <= 227 * 1024 // 2 and int(head.group(2)) <= 64, r.stdout
        loops = re.findall(
            r"loop \d+: \d+ instructions, (\d+) HGMMA, (\d+) HMMA, \d+ BSSY, (\d+) local, (\d+) TMA \(\d+ barriers between\), "
            r"(\d+) cp.async",
            head.group(4),
        )
        # the page loop: no spill, the next page in two TMA copies (content codes; RoPE codes and metadata)
        assert [tuple(map(int, t)) for t in loops][0] == (39, 72, 0, 2, 0), (bits, r.stdout)
        assert [tuple(map(int, t))[:2] for t in loops] == [(39, 72), (36, 64)], (bits, r.stdout)


def test_teacher_forced_kernel_compiles_for_hopper_rounded_and_exact():
    """The teacher-forced kernel at its default tiles compiled for sm_90, its stored rows rounded and
    ``exact``: its tensor-core products are all BF16 m16n8k16 in both (a float32 operand left in the
    exact path's hi/lo pair would compile to TF32 products), and the exact tiles fit two programs'
    shared memory per SM."""
    r = _compile("bench/gluon_sass.py", "--prefill", "--bits", "4", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    for bits in (4, 2):
        for exact in ("False", "True"):
            m = re.search(
                rf"prefill C{bits}R4 exact={exact} \(.*\): REG:\d+ STACK:\d+ shared=(\d+) B, (\d+) HMMA \((.*)\)",
                r.stdout,
            )
            assert m and int(m.group(2)) > 0 and m.group(3) == f"{m.group(2)} HMMA.16816.F32.BF16", r.stdout
            if exact == "True":
                assert int(m.group(1)) <= 227 * 1024 // 2, r.stdout
