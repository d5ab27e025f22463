"""How fast can the 16-head score product run when wgmma takes the reconstructed keys from registers?

    python bench/prototypes/rega16.py            # H200: check one tile against float64, then time
    python bench/prototypes/rega16.py --batch 1 --length 131072   # as many tokens as H=16, B=1, L=128K
    python bench/prototypes/rega16.py --sass     # no GPU: compile for sm_90 and count the loop

A measuring kernel, not a decode: it computes S^T = K̂ q^T for 16 heads over flat 64-token tiles of
4-bit codes (9 groups of 64 channels per token: the 512 content channels and the 64 RoPE ones,
all with a BF16 scale and an integer zero point) and sums the score tiles, with no softmax and no
P·V. It asks the question bench/NOTES.md leaves open under "Where it stands": the register-fed
kernel of v17-v19 spends ~126 instructions per token with ``mma.sync``, 16 heads on M, and partial
scores exchanged between warps. Here tokens are on wgmma's M side (64 per warpgroup), so one
``wgmma.m64n16k16`` per 16 channels covers all of a tile's tokens with no exchange, and each thread
reconstructs exactly the A-fragment values it owns, eight per code word, with the same PTX block
as the register-fed kernel (``_SCORE_WORD``: BF16 s·(q − z), rounded as the reference rounds).

A thread of lane ``l`` in warp ``w`` owns tokens 16w + l//4 and 16w + l//4 + 8 and, in each group,
words 2·(l % 4) and 2·(l % 4) + 1 (one 64-bit load per token and group). Its eight BF16 pairs per
token and group are joined, permuted and reshaped so that their layout is the wgmma A operand's
(checked by ``convert_layout(..., assert_trivial=True)``: no data moves between threads); the
queries are stored in shared memory once, in the same channel order.

``MODE``: 0 the product as described; 1 reconstruction only (the pairs folded into a checksum,
no wgmma); 2 loads and wgmma on a fixed A (no reconstruction). ``WAIT`` ≥ 0: wait after each group's
product until at most that many are in flight (fewer A registers live); −1: only at the tile's end.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from quantmla.kernels.mma_decode import _SCORE_WORD  # noqa: E402

WORDS = gl.constexpr(72)  # 9 groups x 8 words of 8 nibbles
GROUPS = gl.constexpr(9)


@gluon.jit
def _pair(x):
    """A BF16 value (as int16 bits) twice in one 32-bit register."""
    return gl.inline_asm_elementwise("mov.b32 $0, {$1, $1};", "=r,h", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _halves(x):
    return gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [x], dtype=(gl.bfloat16, gl.bfloat16),
                                     is_pure=True, pack=1)  # fmt: skip


@gluon.jit
def _unpack(w, sp, zp):
    """Each word (8 nibbles) -> four BF16 pairs s·(q − z): channels (0, 2), (1, 3), (4, 6), (5, 7)."""
    return gl.inline_asm_elementwise(
        _SCORE_WORD, "=&r,=&r,=&r,=&r,r,r,r", [w, sp, zp], dtype=(gl.int32,) * 4, is_pure=True, pack=1
    )


@gluon.jit
def _a_operand(o0, o1, o2, o3, AL: gl.constexpr):
    """The pairs of words (64 tokens, 4 lanes, 2) of one group -> the (64, 64) BF16 A operand in
    layout ``AL``; column k = 32v + 16·(i // 2) + 8·(i % 2) + 2p + e holds pair i's half e of
    word 2p + v, i.e. channel 8·(2p + v) + 4·(i // 2) + i % 2 + 2e of the group."""
    l0, h0 = _halves(o0)
    l1, h1 = _halves(o1)
    l2, h2 = _halves(o2)
    l3, h3 = _halves(o3)
    u = gl.join(gl.join(gl.join(l0, h0), gl.join(l1, h1)), gl.join(gl.join(l2, h2), gl.join(l3, h3)))
    a = gl.reshape(gl.permute(u, (0, 2, 5, 4, 1, 3)), [64, 64])
    return gl.convert_layout(a, AL, assert_trivial=True)


@gluon.jit
def _q_column(k):
    """The channel (within its group) at column k of the A operand (see :func:`_a_operand`)."""
    v = k // 32
    i = 2 * ((k // 16) % 2) + (k // 8) % 2
    p = (k // 2) % 4
    e = k % 2
    return 8 * (2 * p + v) + 4 * (i // 2) + i % 2 + 2 * e


@gluon.jit
def _kernel(W, S, Z, Q, OUT, n_tiles, MODE: gl.constexpr, WAIT: gl.constexpr):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    LW: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, 4, 2],
    )
    LT: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LW))
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [GROUPS, 16, 64], q_layout)

    qh = gl.arange(0, 16, layout=gl.SliceLayout(1, LQ))
    qc = _q_column(gl.arange(0, 64, layout=gl.SliceLayout(0, LQ)))
    for g in gl.static_range(GROUPS):
        q_smem.index(g).store(gl.load(Q + qh[:, None] * 576 + 64 * g + qc[None, :]))
    fence_async_shared()

    t = gl.arange(0, 64, layout=LT)
    p = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    v = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    offs = t[:, None, None] * WORDS + 2 * p[None, :, None] + v[None, None, :]
    fixed = gl.full([64, 64], 1.0, gl.bfloat16, layout=AL)
    tot = gl.zeros([64, 16], gl.float32, layout=ACC)
    chk = gl.zeros([64, 4, 2], gl.int32, layout=LW)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for tile in range(pid, n_tiles, nprog):
        tok = tile.to(gl.int64) * 64
        acc = gl.zeros([64, 16], gl.float32, layout=ACC)
        for g in gl.static_range(GROUPS):
            w = gl.load(W + tok * WORDS + 8 * g + offs)
            if MODE == 2:
                chk = chk ^ w
                acc = warpgroup_mma(fixed, q_smem.index(g).permute((1, 0)), acc, is_async=True)
                if WAIT >= 0:
                    acc = warpgroup_mma_wait(num_outstanding=WAIT, deps=(acc,))
            else:
                s = gl.load(S + (tok + t) * GROUPS + g)
                z = gl.load(Z + (tok + t) * GROUPS + g)
                sp = _pair(s.to(gl.int16, bitcast=True))
                zp = _pair((-128.0 - z.to(gl.float32)).to(gl.bfloat16).to(gl.int16, bitcast=True))
                o0, o1, o2, o3 = _unpack(w, sp[:, None, None], zp[:, None, None])
                if MODE == 1:
                    chk = chk ^ o0 ^ o1 ^ o2 ^ o3
                else:
                    a = _a_operand(o0, o1, o2, o3, AL)
                    acc = warpgroup_mma(a, q_smem.index(g).permute((1, 0)), acc, is_async=True)
                    if WAIT >= 0:
                        acc = warpgroup_mma_wait(num_outstanding=WAIT, deps=(acc,))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        tot += acc
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    co = gl.arange(0, 16, layout=gl.SliceLayout(0, ACC))
    chk_t = gl.convert_layout(gl.sum(gl.sum(chk, 2), 1).to(gl.float32), gl.SliceLayout(1, ACC))
    gl.store(OUT + pid * 1024 + ro[:, None] * 16 + co[None, :], tot + chk_t[:, None] * 0.0)


def compile_sass(mode: int = 0, wait: int = -1):
    """(SASS, resource line) of the kernel for sm_90, compiled without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(ROOT / "bench"))
    from gluon_sass import _sass

    sig = dict(W="*i32", S="*bf16", Z="*u8", Q="*bf16", OUT="*fp32", n_tiles="i32", MODE="constexpr", WAIT="constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    src = GluonASTSource(_kernel, sig, constexprs=dict(MODE=mode, WAIT=wait), attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    return _sass(c)


def reference(W, S, Z, Q, n_tiles: int):
    """float64 sum over tiles of S^T = K̂ q^T, with K̂ = BF16(s·(q − z)) as the kernels round it."""
    import torch

    T = n_tiles * 64
    sh = torch.arange(8, device=W.device, dtype=torch.int32) * 4
    codes = ((W[:T, :, None] >> sh) & 15).reshape(T, GROUPS.value, 64).float()
    k = (S[:T].float()[:, :, None] * (codes - Z[:T].float()[:, :, None])).to(torch.bfloat16).reshape(T, 576)
    st = k.double() @ Q.double().T
    return st.view(n_tiles, 64, 16).sum(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass", action="store_true", help="compile for sm_90 and count the loop (no GPU)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--batch", type=int, default=32, help="tokens = batch x length, 16 heads (default B=32)")
    ap.add_argument("--length", type=int, default=32768)
    args = ap.parse_args()
    if args.sass:
        sys.path.insert(0, str(ROOT / "bench"))
        from gluon_sass import loops

        for mode, wait in ((0, -1), (0, 1), (0, 0), (1, -1), (2, -1)):
            sass, res, shared = compile_sass(mode, wait)
            print(f"MODE {mode} WAIT {wait}: {res}, {shared} B shared, loops {loops(sass)}")
        return

    import torch
    import triton
    from triton.testing import do_bench

    sys.path.insert(0, str(ROOT / "bench"))
    from decode import Shape, run_meta

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    T = args.batch * args.length
    W = torch.randint(-(2**31), 2**31 - 1, (T, WORDS.value), device=dev, dtype=torch.int32, generator=gen)
    S = (torch.rand(T, GROUPS.value, device=dev, generator=gen) * 0.3 + 0.05).to(torch.bfloat16)
    Z = torch.randint(0, 16, (T, GROUPS.value), device=dev, dtype=torch.uint8, generator=gen)
    Q = (torch.randn(16, 576, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    rows = []
    for n_tiles in (1, 3):
        out = torch.empty(1, 64, 16, device=dev)
        ref = reference(W, S, Z, Q, n_tiles)
        for wait in (-1, 1):
            _kernel[(1,)](W, S, Z, Q, out, n_tiles, MODE=0, WAIT=wait, num_warps=4)
            err = float((out[0].double() - ref).norm() / ref.norm())
            rows.append(dict(check_tiles=n_tiles, wait=wait, rel_err=err))
            print(rows[-1], flush=True)
    stored = T * (WORDS.value * 4 + GROUPS.value * 3)
    runs = [(0, -1, None), (0, 1, None), (0, 0, None), (0, 1, 168), (0, 1, 128), (0, 0, 128),
            (1, -1, None), (2, -1, None), (2, 1, None)]  # fmt: skip
    for mode, wait, nreg in runs:
        for progs in (132, 264, 396, 528, 792, 1056, 2112):
            out = torch.empty(progs, 64, 16, device=dev)
            extra = {} if nreg is None else dict(maxnreg=nreg)
            fn = functools.partial(
                _kernel[(progs,)], W, S, Z, Q, out, T // 64, MODE=mode, WAIT=wait, num_warps=4, **extra
            )
            fn()
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            cyc = ms * 1e-3 * 1.98e9 * 132 / T
            rows.append(dict(mode=mode, wait=wait, maxnreg=nreg, programs=progs, ms=ms, TBps=stored / ms / 1e9,
                             cycles_per_token_sm=cyc))  # fmt: skip
            print(rows[-1], flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sh = Shape(16, args.batch, args.length, gen, l2, formats={"c16r16": (16, 16), "c4r4": (4, 4)})
    base = dict(c16r16_ms=sh.time("c16r16", {}), c4r4_ms=sh.time("c4r4", {}),
                c16r16_bf16_p_ms=sh.time("c16r16", dict(pv_split=False)))  # fmt: skip
    print(base, flush=True)
    stamp = datetime.datetime.now()
    cmd = f"python bench/prototypes/rega16.py --batch {args.batch} --length {args.length}"
    meta = run_meta(torch.cuda.get_device_properties(0), stamp, cmd)
    meta.update(tokens=T, stored_bytes=stored, rows=rows, decode_h16=dict(B=args.batch, L=args.length, **base))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"rega16-{stamp:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(meta, indent=1))
    print(f"wrote {path} (triton {triton.__version__})")


if __name__ == "__main__":
    main()
