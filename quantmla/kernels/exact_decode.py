"""Decode over C4R4 and C2R4 pages for up to 16 heads, in Gluon for sm_90, on the exact dequantized cache:
the codes enter the tensor cores as the integers they are, and the scales and zero-points are
applied to the products instead of to every element.

The Triton kernel reconstructs s·(q − z) in BF16 for every element of every tile, which is ~1,100
values per token on the CUDA cores; that work, not the bytes, is what holds it to BF16's speed
(docs/kernel-design-notes.md). Here a 4-bit code
becomes an FP16 number with one logical operation per two codes and no arithmetic: the bits
``0x000n`` read as FP16 are the subnormal n·2^-24, exactly, and ``0x00n0`` is 16·n·2^-24. With
per-token group scales the algebra of absorbed attention allows the rest to move off the
elements (g: one 64-channel group, t: a token, h: a head)::

    q_h · Ĉ_t  = Σ_g s_tg (Σ_{c∈g} q_hc n_tc − z_tg Σ_{c∈g} q_hc)       scores: scale the group's partial product
    Σ_t p_ht Ĉ_tc = Σ_t (p_ht s_tg) n_tc − Σ_t (p_ht s_tg) z_tg          P·V: scale P, one zero column per group

so per token the CUDA cores turn 1,088 codes into FP16 (two unpackings, one per product) and
scale 16 heads x 9 groups of partial scores and 16 x 8 entries of P, instead of reconstructing
1,088 values. The result is attention over the exact ``s·(q − z)``: the cache is read as the paper's
eqs. 35-36 define it, without the BF16 rounding of the reconstructed tile that the paper's kernel and
:mod:`.reference` apply (the two differ by that rounding, which at large scores the softmax
amplifies). P enters P·V in FP16 (11 significant bits, where FlashMLA's BF16 P
has 8). :func:`quantmla.kernels.reference.decode` with ``exact=True`` is this kernel's reference.

2-bit content codes (C2R4; the RoPE codes stay 4-bit) take the same path with other masks: code i
of a 16-bit word (bits 2i, 2i+1) is ``and`` with 0x0003 << 2(i mod 4), after a shift by 8 for codes
4-7, so f_i·n·2^-24 with f_i = 4^(i mod 4), still one logical operation per two codes. Codes p and
p + 4 of a group's 8 words sit side by side as one wgmma's 16 K values (their query tiles divided
by 4^p), and P·V keeps one accumulator per code position (8 of 8 words instead of 4 of 16): the
same 39 wgmma and 72 ``mma.sync`` per tile, on half the content bytes.

Per 64-token page tile, in one warpgroup (4 warps) per program, two programs per SM (255
registers and 103 KB of shared memory each at C4R4, 79 KB at C2R4):

- the page (codes, scales and zero-points) is copied to shared memory by the TMA two tiles ahead,
  into one of three stages, in two boxes (the content codes with the 32-byte swizzle that keeps
  ``ldmatrix`` free of bank conflicts; then the RoPE codes and the metadata), one thread issuing them
  and an mbarrier per stage and box saying when they have landed;
- scores: for each of the 9 groups (8 content, 1 RoPE), ``ldmatrix`` gives each thread its wgmma
  A fragment of 16-bit code words (4 channels each), one PTX block turns each word pair into four
  FP16 pairs (nibble j of each word: channel 4m + j), and four ``wgmma.m64n16k16`` (tokens on M,
  heads on N, the queries in shared memory pre-permuted and pre-divided by 16 for the odd nibbles)
  give the group's partial scores, which one FMA per element scales into the tile's scores; the
  zero-point term of all 9 groups is three more wgmma (s·z and the query sums as FP16 hi/lo pairs).
  The nine groups' loads are all issued when the score phase starts, and P·V's before the softmax,
  so that no unpacking waits on its ``ldmatrix``;
- online softmax with a lazy maximum: P is taken against the running maximum, and each warp
  publishes by how much its scores pass it beside P' (no reduction across warps before P); only a
  tile that passes it by more than 2^LAZY (``LAZY``, log2 units) raises it, rescales everything
  accumulated and redoes P;
- P·V: P scaled by each group's scales (FP16, one store of 8 groups x 64 tokens x 16 heads), then
  per warp two groups of ``mma.sync.m16n8k16`` (heads on M) with the codes as B operands from
  ``ldmatrix.trans`` of the same shared tile, unpacked the same way, plus one 8-column product per
  group on a tile whose column 0 holds the zero-points (the ``Σ p s z`` term).

The protected rows (sink and ring, BF16) are three work tiles before the page tiles, each weighing
:data:`PROT_WEIGHT` page tiles when a request is cut into splits (:func:`split`:
a protected tile reads its BF16 rows outside the page pipeline and takes several page tiles' time,
so a split holding two or three of them on top of a full share of page tiles would finish last); a
split attends to its page tiles
first, then to its protected rows. They enter both products as FP16 (exact for magnitudes in
[2^-14, 65504], as cached latents are) through the same accumulators, once these have been brought
from the codes' 2^-24 units to units of 1. The LSE merge is :func:`quantmla.kernels.splits.merge`.
Range: P <= 2^LAZY and P' = P·s in FP16 take content scales below 4,000 (group ranges
below 60,000 at 4 bits, 12,000 at 2).

Where it is faster than C16R16 and where not (batch 1 and short contexts, where each split holds
one tile): docs/kernels.md.

Takes C4R4 or C2R4 in a BF16 cache (group 64, d_c 512, d_r 64, protection buffers on) for at most
16 heads on a Hopper GPU, and only ``exact`` decodes (:func:`supports` says when and why not). No
interpreter runs Gluon: the GPU tests cover this file, and ``python bench/gluon_sass.py --exact``
compiles it for sm_90 without a GPU.
"""

from __future__ import annotations

import weakref

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from quantmla.kernels._tiles import INTERPRET, LOG2E
from quantmla.kernels.gluon_decode import _join8, _prot_valid, hopper_format
from quantmla.kernels.splits import Case, Split, front_share, front_split_work

NAME = "exact"
WARPS = 4
STAGES = gl.constexpr(3)
LAZY = gl.constexpr(4)  # the accumulators are rescaled when a score passes the running maximum by 2^LAZY (log2 units)
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton 3.9 / 3.6
_NEW_VIEW = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # Triton 3.9; 3.6 has _reinterpret


@gluon.jit
def _view(x, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """Shared memory ``x`` seen as ``dtype`` of ``shape`` in ``layout`` (the same bytes, from its start)."""
    if _NEW_VIEW:
        return x.reinterpret(dtype, shape, layout)
    else:
        return x._reinterpret(dtype, shape, layout)


# The layouts the page's TMA copies write: the content codes at 4 bits (rows of 32 B) with the 32-byte
# swizzle, the same bytes as the ``SwizzledSharedLayout(8, 4, 2)`` the loads read (16-byte chunk c of
# row r at c ^ ((r / 4) mod 2)); at 2 bits (rows of 16 B), and the RoPE codes and metadata, unswizzled.
NV32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
NV0 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
NV32_3 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=3))
NV0_3 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3))

# One 32-bit register = two 16-bit code words (4 nibbles each, nibble j = channel 4m + j of its
# word m) -> four FP16 pairs: nibbles 0 and 2 as n·2^-24, nibbles 1 and 3 as 16·n·2^-24 (subnormals,
# exact). The outputs are written before the last read of the input: early-clobber.
_UNPACK4 = gl.constexpr(
    "{\n.reg .b32 t;\nshr.u32 t, $4, 8;\n"
    "and.b32 $0, $4, 0x000f000f;\nand.b32 $1, $4, 0x00f000f0;\n"
    "and.b32 $2, t, 0x000f000f;\nand.b32 $3, t, 0x00f000f0;\n}"
)


@gluon.jit
def _unpack4(x):
    """int16 code words (any layout, pairs along the fastest register axis) -> the four FP16
    tensors of their nibbles 0..3 (values f_j·n·2^-24, f_j = 1, 16, 1, 16), same layout."""
    return gl.inline_asm_elementwise(_UNPACK4, "=&r,=&r,=&r,=&r,r", [x], dtype=(gl.float16,) * 4, is_pure=True, pack=2)


# C2: one 32-bit register = two 16-bit code words (8 codes each, code i = bits 2i..2i+1 = channel
# 8m + i of word m) -> eight FP16 pairs, code i as f_i·n·2^-24 with f_i = 4^(i mod 4) (codes 4-7 after
# a shift by 8; every value is a subnormal, exact). Early-clobber as above.
_UNPACK8 = gl.constexpr(
    "{\n.reg .b32 t;\nshr.u32 t, $8, 8;\n"
    "and.b32 $0, $8, 0x00030003;\nand.b32 $1, $8, 0x000c000c;\n"
    "and.b32 $2, $8, 0x00300030;\nand.b32 $3, $8, 0x00c000c0;\n"
    "and.b32 $4, t, 0x00030003;\nand.b32 $5, t, 0x000c000c;\n"
    "and.b32 $6, t, 0x00300030;\nand.b32 $7, t, 0x00c000c0;\n}"
)


@gluon.jit
def _unpack8(x):
    """int16 words of 2-bit codes (any layout, pairs along the fastest register axis) -> the eight
    FP16 tensors of their codes 0..7 (values f_i·n·2^-24, f_i = 4^(i mod 4)), same layout."""
    return gl.inline_asm_elementwise(
        _UNPACK8, "=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,r", [x], dtype=(gl.float16,) * 8, is_pure=True, pack=2
    )


@gluon.jit
def _unpack(x, CB: gl.constexpr):
    """The code words ``x`` of ``CB``-bit codes -> their 4 (CB = 4) or 8 (CB = 2) FP16 code tensors."""
    if CB == 4:
        return _unpack4(x)
    else:
        return _unpack8(x)


@gluon.jit
def _split4(x):
    """A tensor (..., 4) -> its four slices along the last axis (no data moves)."""
    shape: gl.constexpr = x.shape[:-1] + [2, 2]
    e, o = gl.split(gl.reshape(x, shape))
    x0, x2 = gl.split(e)
    x1, x3 = gl.split(o)
    return x0, x1, x2, x3


@gluon.jit
def _split8(x):
    """A tensor (..., 8) -> its eight slices along the last axis (no data moves)."""
    shape: gl.constexpr = x.shape[:-1] + [2, 2, 2]
    e, o = gl.split(gl.reshape(x, shape))
    e0, e1 = gl.split(e)
    o0, o1 = gl.split(o)
    x0, x4 = gl.split(e0)
    x2, x6 = gl.split(e1)
    x1, x5 = gl.split(o0)
    x3, x7 = gl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


# Register layouts. ACC: scores S^T (64 tokens x 16 heads), the wgmma accumulator and, with
# the same bases, its A operand. L8 (64 x 8): ACC's rows, all eight groups in each thread. LA8
# (64 x 8): the first eight columns of a wgmma A operand. M2: P·V (groups x 16 heads x columns),
# groups w and w + 4 in warp w. L3A / L3B: the A and B2 layouts with four channels per element
# (protected rows). L3Z: the zero-point column tile, eight columns per (token, group).
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
L8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 8]))  # fmt: skip
LA8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 8]))  # fmt: skip
M2 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
L3A = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [8, 0, 0], [0, 8, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 16, 4]))  # fmt: skip
L3B = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 8, 0, 0], [0, 16, 0, 0], [0, 32, 0, 0],
               [0, 0, 8, 0], [4, 0, 0, 0]],
    lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[8, 64, 16, 4]))  # fmt: skip
L3Z = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [8, 0, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 8, 8]))  # fmt: skip
LO = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [1, 2, 16, 1], [4, 1, 1, 1], [3, 2, 1, 0]))
# C2's protected rows and output: L3A2 (64 tokens x half x 8 words x 4; channel 8m + 4·half + p) gives
# per p the A layout of k = 8·half + m; L3B2 (groups x 64 x 8 words x 8 codes) the B2 layout of
# (groups, tokens, words) per code; LO2 the output, four consecutive channels per thread.
L3A2 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [8, 0, 0, 0], [0, 1, 0, 0]],
    lane_bases=[[0, 0, 2, 0], [0, 0, 4, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[64, 2, 8, 4]))  # fmt: skip
L3B2 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 1, 0, 0], [0, 8, 0, 0], [0, 16, 0, 0],
               [0, 32, 0, 0], [4, 0, 0, 0]],
    lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
    warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[8, 64, 8, 8]))  # fmt: skip
LO2 = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [1, 4, 4, 2], [4, 1, 1, 1], [3, 2, 1, 0]))


@gluon.jit
def _copy_tile(dc, dm, cst, mst, bc, bm, page, PAGE_BYTES: gl.constexpr, R_OFF: gl.constexpr, CB: gl.constexpr):
    """The TMA copy of page ``page`` into a stage in two boxes: the content codes (512 rows of 16 words at
    4 bits, with the 32-byte swizzle, or of 8 at 2; group-major, 64 tokens per group) into ``cst``,
    completing on ``bc``, and the 4 KB from the RoPE codes on (64 rows of 16 words, then the scales and
    zero-points, content and RoPE, then the page's padding) into ``mst``, unswizzled, completing on
    ``bm``. The two mbarriers are separate allocations: Triton 3.6 puts a CTA barrier between two
    operations on one allocation, so there is none between the two copies (one stays between the
    expects and the copies, one between the copies and the waits)."""
    mbarrier.expect(bc, R_OFF)
    mbarrier.expect(bm, PAGE_BYTES - R_OFF)
    if CB == 4:
        _tma_load(dc, [page * (PAGE_BYTES // 2048), 0, 0], bc, _view(cst, gl.int16, [8, 64, 16], NV32_3))
    else:
        _tma_load(dc, [page * (PAGE_BYTES // 4096), 0, 0], bc, _view(cst, gl.int16, [2, 256, 8], NV0_3))
    _tma_load(dm, [page * (PAGE_BYTES // 32) + R_OFF // 32, 0], bm, mst)


@gluon.jit
def _cols8(x, ROWS: gl.constexpr):
    """The eight columns of a (64, 8) tensor in ``L8`` as (64,) tensors in ``ROWS`` (no data moves)."""
    a, b = gl.split(gl.reshape(x, [64, 4, 2]))
    a0, a1 = gl.split(gl.reshape(a, [64, 2, 2]))
    b0, b1 = gl.split(gl.reshape(b, [64, 2, 2]))
    c0, c4 = gl.split(a0)
    c2, c6 = gl.split(a1)
    c1, c5 = gl.split(b0)
    c3, c7 = gl.split(b1)
    return (
        gl.convert_layout(c0, ROWS, assert_trivial=True),
        gl.convert_layout(c1, ROWS, assert_trivial=True),
        gl.convert_layout(c2, ROWS, assert_trivial=True),
        gl.convert_layout(c3, ROWS, assert_trivial=True),
        gl.convert_layout(c4, ROWS, assert_trivial=True),
        gl.convert_layout(c5, ROWS, assert_trivial=True),
        gl.convert_layout(c6, ROWS, assert_trivial=True),
        gl.convert_layout(c7, ROWS, assert_trivial=True),
    )


@gluon.jit
def _group_scores(a, qc, qr, G: gl.constexpr, ACC: gl.constexpr):
    """Issue the four wgmma of group ``G`` (A: the four nibble tensors of its code words; B: the
    query tiles of nibble j, ``qc`` index 8j + G for content groups, ``qr`` index j for RoPE)."""
    acc = gl.zeros([64, 16], gl.float32, ACC)
    if G < 8:
        acc = warpgroup_mma(a[0], qc.index(G).permute((1, 0)), acc, use_acc=False, is_async=True)
        acc = warpgroup_mma(a[1], qc.index(8 + G).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a[2], qc.index(16 + G).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a[3], qc.index(24 + G).permute((1, 0)), acc, is_async=True)
    else:
        acc = warpgroup_mma(a[0], qr.index(0).permute((1, 0)), acc, use_acc=False, is_async=True)
        acc = warpgroup_mma(a[1], qr.index(1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a[2], qr.index(2).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a[3], qr.index(3).permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _hilo(x):
    """``x`` (float32) as an FP16 pair hi + lo."""
    hi = x.to(gl.float16)
    return hi, (x - hi.to(gl.float32)).to(gl.float16)


@gluon.jit
def _zero_scores(wz, zb, ACC: gl.constexpr):
    """Issue Σ_g s_tg z_tg · 2^-8 Σ_c q'_hc (the zero-point term of the scores, 2^16 times too large)
    as three FP16 wgmma: A = s·z as a hi/lo pair (64 tokens x 9 groups, zero-padded to 16), B = the
    query sums as a hi/lo pair (``zb`` tiles 0 and 1)."""
    hi, lo = _hilo(wz)
    acc = gl.zeros([64, 16], gl.float32, ACC)
    acc = warpgroup_mma(hi, zb.index(0).permute((1, 0)), acc, use_acc=False, is_async=True)
    acc = warpgroup_mma(lo, zb.index(0).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(hi, zb.index(1).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _content_words(cst, g: gl.constexpr, CB: gl.constexpr, AL: gl.constexpr):
    """Content group ``g``'s code words of the tile in stage ``cst``: (64, 16) in the wgmma A
    layout at 4 bits, (64, 8) in its first eight columns (``LA8``) at 2."""
    if CB == 4:
        return cst.slice(64 * g, 64).load(AL)
    else:
        return cst.slice(64 * g, 64).load(LA8)


@gluon.jit
def _a_operands(x, CB: gl.constexpr, AL: gl.constexpr):
    """Code words from :func:`_content_words` -> the four FP16 A operands of their group's score
    wgmma: nibble j (channel 4m + j at k = m) at 4 bits; at 2, codes p and p + 4 side by side
    (channel 8m + p at k = m, 8m + 4 + p at k = 8 + m), both f_p·n·2^-24."""
    if CB == 4:
        return _unpack4(x)
    else:
        u = _unpack8(x)
        return (
            gl.convert_layout(_cols16(u[0], u[4]), AL, assert_trivial=True),
            gl.convert_layout(_cols16(u[1], u[5]), AL, assert_trivial=True),
            gl.convert_layout(_cols16(u[2], u[6]), AL, assert_trivial=True),
            gl.convert_layout(_cols16(u[3], u[7]), AL, assert_trivial=True),
        )


@gluon.jit
def _tile_words(cst, rst, CB: gl.constexpr, AL: gl.constexpr):
    """The nine groups' code words of the page tile in stage ``cst`` (RoPE: ``rst``) as loaded for
    the score products, all issued at once so that no unpacking waits on its ``ldmatrix``."""
    return (_content_words(cst, 0, CB, AL), _content_words(cst, 1, CB, AL), _content_words(cst, 2, CB, AL),
            _content_words(cst, 3, CB, AL), _content_words(cst, 4, CB, AL), _content_words(cst, 5, CB, AL),
            _content_words(cst, 6, CB, AL), _content_words(cst, 7, CB, AL), rst.load(AL))  # fmt: skip


@gluon.jit
def _scores(xs, qc, qr, zb, s, sr, wz, CB: gl.constexpr, AL: gl.constexpr, ACC: gl.constexpr):
    """Σ_g s_tg (Σ_c n_tc q'_hc 2^-24 − z_tg Σ_c q'_hc 2^-24) for the page tile whose code words are
    ``xs`` (:func:`_tile_words`; ``s``: the content groups' scales per token; ``wz``: the A operand of
    the zero-point term): tokens on M, one group's products in flight while the previous group's
    are scaled."""
    tot = gl.zeros([64, 16], gl.float32, ACC)
    zacc = _zero_scores(wz, zb, ACC)
    prev = _group_scores(_a_operands(xs[0], CB, AL), qc, qr, 0, ACC)
    for g in gl.static_range(8):
        if g < 7:
            nxt = _group_scores(_a_operands(xs[g + 1], CB, AL), qc, qr, g + 1, ACC)
        else:
            nxt = _group_scores(_unpack4(xs[8]), qc, qr, g + 1, ACC)
        prev = warpgroup_mma_wait(num_outstanding=4, deps=(prev,))
        tot = tot + s[g][:, None] * prev
        prev = nxt
    prev, zacc = warpgroup_mma_wait(num_outstanding=0, deps=(prev, zacc))
    return tot + sr[:, None] * prev - zacc * 1.52587890625e-05


@gluon.jit
def _prot_scores(prot, r0, ok, qc, qr, CB: gl.constexpr, ACC: gl.constexpr, AL: gl.constexpr, L3A: gl.constexpr):
    """Σ_c x_tc q'_hc for the 64 protected BF16 rows from ``r0`` of the protection buffer at
    ``prot`` (rows not ``ok`` read as zeros), the rows entering as FP16: each thread loads the 16
    bytes that hold its A fragments' four nibble positions of two words."""
    if CB == 2:
        return _prot_scores2(prot, r0, ok, qc, qr, ACC, AL, L3A)
    t = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3A)))[:, None, None]
    m = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3A)))[None, :, None]
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3A)))[None, None, :]
    okt = gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, L3A)), assert_trivial=True)[:, None, None]
    base = prot + (r0 + t) * 576 + 4 * m + j
    acc_e = gl.zeros([64, 16], gl.float32, ACC)
    acc_o = gl.zeros([64, 16], gl.float32, ACC)
    for g in gl.static_range(9):
        x = gl.load(base + 64 * g, mask=okt & (m >= 0) & (j >= 0), other=0.0).to(gl.float32).to(gl.float16)
        x0, x1, x2, x3 = _split4(x)
        if g < 8:
            acc_e = warpgroup_mma(gl.convert_layout(x0, AL, assert_trivial=True), qc.index(g).permute((1, 0)), acc_e)
            acc_o = warpgroup_mma(
                gl.convert_layout(x1, AL, assert_trivial=True), qc.index(8 + g).permute((1, 0)), acc_o
            )
            acc_e = warpgroup_mma(
                gl.convert_layout(x2, AL, assert_trivial=True), qc.index(16 + g).permute((1, 0)), acc_e
            )
            acc_o = warpgroup_mma(
                gl.convert_layout(x3, AL, assert_trivial=True), qc.index(24 + g).permute((1, 0)), acc_o
            )
        else:
            acc_e = warpgroup_mma(gl.convert_layout(x0, AL, assert_trivial=True), qr.index(0).permute((1, 0)), acc_e)
            acc_o = warpgroup_mma(gl.convert_layout(x1, AL, assert_trivial=True), qr.index(1).permute((1, 0)), acc_o)
            acc_e = warpgroup_mma(gl.convert_layout(x2, AL, assert_trivial=True), qr.index(2).permute((1, 0)), acc_e)
            acc_o = warpgroup_mma(gl.convert_layout(x3, AL, assert_trivial=True), qr.index(3).permute((1, 0)), acc_o)
    return acc_e + 16.0 * acc_o


@gluon.jit
def _prot_scores2(prot, r0, ok, qc, qr, ACC: gl.constexpr, AL: gl.constexpr, L3A: gl.constexpr):
    """:func:`_prot_scores` for the C2 query tiles: content group g's rows in ``L3A2`` (channel
    8m + 4·half + p), code p's A operand pairing with tile 8p + g (divided by 4^p, so one
    accumulator per p); the RoPE group as at 4 bits, its nibbles' tiles divided by 1 and 16."""
    RT: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L3A2)))
    t = gl.arange(0, 64, layout=RT)[:, None, None, None]
    hf = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L3A2))))[None, :, None, None]
    m = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L3A2))))[None, None, :, None]
    p = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L3A2))))[None, None, None, :]
    okt = gl.convert_layout(ok, RT, assert_trivial=True)[:, None, None, None]
    base = prot + (r0 + t) * 576 + 8 * m + 4 * hf + p
    z = gl.zeros([64, 16], gl.float32, ACC)
    acc = (z, z, z, z)
    for g in gl.static_range(8):
        x = gl.load(base + 64 * g, mask=okt & (hf >= 0) & (m >= 0) & (p >= 0), other=0.0)
        x0, x1, x2, x3 = _split4(x.to(gl.float32).to(gl.float16))
        acc = (
            warpgroup_mma(gl.convert_layout(gl.reshape(x0, [64, 16]), AL, assert_trivial=True),
                          qc.index(g).permute((1, 0)), acc[0]),
            warpgroup_mma(gl.convert_layout(gl.reshape(x1, [64, 16]), AL, assert_trivial=True),
                          qc.index(8 + g).permute((1, 0)), acc[1]),
            warpgroup_mma(gl.convert_layout(gl.reshape(x2, [64, 16]), AL, assert_trivial=True),
                          qc.index(16 + g).permute((1, 0)), acc[2]),
            warpgroup_mma(gl.convert_layout(gl.reshape(x3, [64, 16]), AL, assert_trivial=True),
                          qc.index(24 + g).permute((1, 0)), acc[3]),
        )  # fmt: skip
    tr = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3A)))[:, None, None]
    mr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3A)))[None, :, None]
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3A)))[None, None, :]
    okr = gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, L3A)), assert_trivial=True)[:, None, None]
    x = gl.load(prot + (r0 + tr) * 576 + 512 + 4 * mr + j, mask=okr & (mr >= 0) & (j >= 0), other=0.0)
    x0, x1, x2, x3 = _split4(x.to(gl.float32).to(gl.float16))
    a0 = warpgroup_mma(gl.convert_layout(x0, AL, assert_trivial=True), qr.index(0).permute((1, 0)), acc[0])
    a2 = warpgroup_mma(gl.convert_layout(x1, AL, assert_trivial=True), qr.index(1).permute((1, 0)), acc[2])
    a0 = warpgroup_mma(gl.convert_layout(x2, AL, assert_trivial=True), qr.index(2).permute((1, 0)), a0)
    a2 = warpgroup_mma(gl.convert_layout(x3, AL, assert_trivial=True), qr.index(3).permute((1, 0)), a2)
    return a0 + 4.0 * acc[1] + 16.0 * a2 + 64.0 * acc[3]


@gluon.jit
def _mma_each(pa, b, acc, CB: gl.constexpr):
    """acc_j += pa · b_j for each code position j of a word (4 at 4 bits, 8 at 2)."""
    if CB == 4:
        return mma_v2(pa, b[0], acc[0]), mma_v2(pa, b[1], acc[1]), mma_v2(pa, b[2], acc[2]), mma_v2(pa, b[3], acc[3])
    else:
        return (mma_v2(pa, b[0], acc[0]), mma_v2(pa, b[1], acc[1]), mma_v2(pa, b[2], acc[2]), mma_v2(pa, b[3], acc[3]),
                mma_v2(pa, b[4], acc[4]), mma_v2(pa, b[5], acc[5]), mma_v2(pa, b[6], acc[6]), mma_v2(pa, b[7], acc[7]))  # fmt: skip


@gluon.jit
def _b_operands(x, B2: gl.constexpr, CB: gl.constexpr):
    """Protected rows (groups, tokens, words, code positions) -> one ``B2`` operand per position
    (the conversions move no data)."""
    if CB == 4:
        x0, x1, x2, x3 = _split4(x)
        return (gl.convert_layout(x0, B2, assert_trivial=True), gl.convert_layout(x1, B2, assert_trivial=True),
                gl.convert_layout(x2, B2, assert_trivial=True), gl.convert_layout(x3, B2, assert_trivial=True))  # fmt: skip
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x)
        return (gl.convert_layout(x0, B2, assert_trivial=True), gl.convert_layout(x1, B2, assert_trivial=True),
                gl.convert_layout(x2, B2, assert_trivial=True), gl.convert_layout(x3, B2, assert_trivial=True),
                gl.convert_layout(x4, B2, assert_trivial=True), gl.convert_layout(x5, B2, assert_trivial=True),
                gl.convert_layout(x6, B2, assert_trivial=True), gl.convert_layout(x7, B2, assert_trivial=True))  # fmt: skip


@gluon.jit
def _pv(psm, words, ztm, acc, az, CB: gl.constexpr, A2: gl.constexpr, B2: gl.constexpr):
    """acc_j += P'_g · codes_j of the page tile's code ``words`` (:func:`_pv_words`; j: nibble 0..3 at
    4 bits, code 0..7 at 2) and the zero column: az += P'_g · (z·2^-24 in column 0)."""
    pa = psm.permute((0, 2, 1)).load(A2)
    acc = _mma_each(pa, _unpack(words, CB), acc, CB)
    az = mma_v2(pa, ztm.load(B2), az)
    return acc, az


@gluon.jit
def _pv_words(cst, CB: gl.constexpr, B2: gl.constexpr):
    """The page tile's code words as P·V's B operands (groups on the batch axis, two per warp)."""
    return cst.reshape([8, 64, 4 * CB]).load(B2)


@gluon.jit
def _pv_prot(psm, prot, r0, L, acc, CB: gl.constexpr, A2: gl.constexpr, B2: gl.constexpr, L3B: gl.constexpr,
             SINK: gl.constexpr, RECENT: gl.constexpr):  # fmt: skip
    """acc_j += P · x for the 64 protected BF16 rows from ``r0`` of the protection buffer at ``prot``
    (rows that hold no token read as zeros), the rows entering as FP16, four (4 bits) or eight (2
    bits) channels per load."""
    pa = psm.permute((0, 2, 1)).load(A2)
    LB: gl.constexpr = L3B if CB == 4 else L3B2
    W: gl.constexpr = 4 * CB  # code words per group and token
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LB))))[:, None, None, None]
    t = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LB))))[None, :, None, None]
    m = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LB))))[None, None, :, None]
    j = gl.arange(0, 16 // CB, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LB))))[None, None, None, :]
    r = r0 + t
    ok = _prot_valid(r, L, SINK, RECENT) & (g >= 0) & (m >= 0) & (j >= 0)
    x = gl.load(prot + r * 576 + 64 * g + (16 // CB) * m + j, mask=ok, other=0.0).to(gl.float32).to(gl.float16)
    return _mma_each(pa, _b_operands(x, B2, CB), acc, CB)


@gluon.jit
def _times(acc, f, CB: gl.constexpr):
    """Each P·V accumulator times ``f`` (broadcast)."""
    if CB == 4:
        return acc[0] * f, acc[1] * f, acc[2] * f, acc[3] * f
    else:
        return acc[0] * f, acc[1] * f, acc[2] * f, acc[3] * f, acc[4] * f, acc[5] * f, acc[6] * f, acc[7] * f


@gluon.jit
def _raise_max(x, m_ref, lacc, acc, az, CB: gl.constexpr, M2: gl.constexpr):
    """The running maximum raised to the tile's (``x``: scores in log2 units, -inf where not
    valid), everything accumulated so far rescaled to it."""
    m_new = gl.maximum(m_ref, gl.max(x, axis=0))
    alpha = gl.exp2(m_ref - m_new)  # 0 where m_ref was -inf
    al = gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(2, M2)))[None, :, None]
    return m_new, lacc * alpha[None, :], _times(acc, al, CB), az * al


@gluon.jit
def _p(x, m_ref):
    return gl.exp2(x - gl.where(m_ref == float("-inf"), 0.0, m_ref)[None, :])


@gluon.jit
def _softmax(x, valid, m_ref, lacc, acc, az, CB: gl.constexpr, M2: gl.constexpr):
    """P = exp2(x − m_ref) for the tile's scores ``x`` (log2 units), with the running maximum
    ``m_ref`` raised (and everything accumulated so far rescaled) only when a score passes it by
    more than 2^LAZY; rows not ``valid`` get P = 0."""
    x = gl.where(valid[:, None], x, float("-inf"))
    over = gl.max(gl.max(gl.where(valid[:, None], x - m_ref[None, :], float("-inf")), axis=1), axis=0)
    if over > LAZY:
        m_ref, lacc, acc, az = _raise_max(x, m_ref, lacc, acc, az, CB, M2)
    p = _p(x, m_ref)
    return p, m_ref, lacc + p, acc, az


@gluon.jit
def _over_per_warp(x, valid, m_ref):
    """How far each warp's scores (tokens 16w .. 16w + 15) pass the running maximum: (4,), the
    reduction within each warp only."""
    d = gl.where(valid[:, None], x - m_ref[None, :], float("-inf"))
    return gl.max(gl.max(gl.reshape(d, [4, 16, 16]), axis=2), axis=1)


@gluon.jit
def _store_p(psm, p, s8):
    """P'_g = P·s_g (FP16) of the eight content groups into the P buffer (group, token, head), one
    store (stores into slices of one buffer get a barrier each from the compiler)."""
    p16 = p.to(gl.float16)
    pg = _join8(p16 * s8[0].to(gl.float16)[:, None], p16 * s8[1].to(gl.float16)[:, None],
                p16 * s8[2].to(gl.float16)[:, None], p16 * s8[3].to(gl.float16)[:, None],
                p16 * s8[4].to(gl.float16)[:, None], p16 * s8[5].to(gl.float16)[:, None],
                p16 * s8[6].to(gl.float16)[:, None], p16 * s8[7].to(gl.float16)[:, None])  # fmt: skip
    psm.store(gl.permute(gl.reshape(pg, [64, 16, 8]), (2, 0, 1)))


@gluon.jit
def _qload(base, g: gl.constexpr, mask):
    """Group ``g``'s query channels (BF16, as stored) at the (head, word, nibble) pointers ``base``."""
    return gl.load(base + 64 * g, mask=mask, other=0.0)


@gluon.jit
def _halves(q):
    """(16 heads, 16 m') with m' = 2m + half -> (16, 16) with k = 8·half + m."""
    return gl.reshape(gl.permute(gl.reshape(q, [16, 8, 2]), (0, 2, 1)), [16, 16])


@gluon.jit
def _queries(Qb, stride_qh, Rb, stride_rh, H, qc, qr, zb, CB: gl.constexpr):
    """The queries q' = q·2^kq per head (max |q'| < 2^15: FP16 holds them exactly) as the score
    wgmma's B tiles: at 4 bits ``qc`` index 8j + g = channel 64g + 4m + j at (head, m), the odd
    nibbles' tiles divided by 16 (those codes enter as 16n); at 2 bits ``qc`` index 8p + g =
    channel 64g + 8k + p at (head, k < 8) and 64g + 8(k − 8) + 4 + p above, divided by 4^p; ``qr``
    index j = RoPE channel 4m + j (4-bit codes, odd nibbles divided by 16); ``zb``:
    2^-8 Σ_{c in g} q'_hc per group g (column 8: RoPE) as a hi/lo pair, the zero-point term's B.
    ``Qb``/``Rb``: the request's rows of head 0 (heads from ``H`` on read as zeros). Returns kq (in
    its own layout: the caller converts it once)."""
    LQ: gl.constexpr = gl.BlockedLayout([1, 1, 4], [2, 16, 1], [4, 1, 1], [2, 1, 0])  # (head, word, nibble)
    HQ: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LQ))
    m = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LQ)))[None, :, None]
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LQ)))[None, None, :]
    h = gl.arange(0, 16, layout=HQ)[:, None, None]
    hq = (h < H) & (m >= 0) & (j >= 0)
    qb = Qb + h * stride_qh + 4 * m + j
    rb = Rb + h * stride_rh + 4 * m + j
    # all nine groups loaded at once, before any shared-memory store (a store's barrier would
    # otherwise hold each group's load behind the previous group's stores)
    qs = (_qload(qb, 0, hq), _qload(qb, 1, hq), _qload(qb, 2, hq), _qload(qb, 3, hq), _qload(qb, 4, hq),
          _qload(qb, 5, hq), _qload(qb, 6, hq), _qload(qb, 7, hq), _qload(rb, 0, hq))  # fmt: skip
    amax = gl.max(gl.max(gl.abs(qs[8].to(gl.float32)), axis=2), axis=1)
    for g in gl.static_range(8):
        amax = gl.maximum(amax, gl.max(gl.max(gl.abs(qs[g].to(gl.float32)), axis=2), axis=1))
    e = ((amax.to(gl.int32, bitcast=True) >> 23) & 255) - 127  # floor(log2 max |q|)
    kq = gl.minimum(gl.maximum(gl.where(amax > 0, 14 - e, 0), -100), 100)
    sc = ((kq + 127) << 23).to(gl.float32, bitcast=True)[:, None, None]  # 2^kq
    LZB: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0])
    col = gl.arange(0, 16, layout=gl.SliceLayout(0, LZB))[None, :]
    zs = gl.zeros([16, 16], gl.float32, LZB)
    for g in gl.static_range(9):
        q = qs[g].to(gl.float32) * sc
        q0, q1, q2, q3 = _split4(q)
        if g < 8:
            if CB == 4:
                qc.index(g).store(q0.to(gl.float16))
                qc.index(8 + g).store((q1 * 0.0625).to(gl.float16))
                qc.index(16 + g).store(q2.to(gl.float16))
                qc.index(24 + g).store((q3 * 0.0625).to(gl.float16))
            else:  # q_p (head, 4m' + p) with m' = 2m + half -> (head, k = 8·half + m), over 4^p
                qc.index(g).store(_halves(q0).to(gl.float16))
                qc.index(8 + g).store((_halves(q1) * 0.25).to(gl.float16))
                qc.index(16 + g).store((_halves(q2) * 0.0625).to(gl.float16))
                qc.index(24 + g).store((_halves(q3) * 0.015625).to(gl.float16))
        else:
            qr.index(0).store(q0.to(gl.float16))
            qr.index(1).store((q1 * 0.0625).to(gl.float16))
            qr.index(2).store(q2.to(gl.float16))
            qr.index(3).store((q3 * 0.0625).to(gl.float16))
        gsum = gl.convert_layout(gl.sum(gl.sum(q, axis=2), axis=1) * 0.00390625, gl.SliceLayout(1, LZB))
        zs = gl.where(col == g, gsum[:, None], zs)
    hi = zs.to(gl.float16)
    zb.index(0).store(hi)
    zb.index(1).store((zs - hi.to(gl.float32)).to(gl.float16))
    return kq


@gluon.jit
def _cols16(a, b):
    """Two (R, 8) tensors -> one (R, 16): columns 0-7 from ``a``, 8-15 from ``b``."""
    R: gl.constexpr = a.shape[0]
    return gl.reshape(gl.permute(gl.join(a, b), (0, 2, 1)), [R, 16])


@gluon.jit
def _store_out(o_b, y, H, stride_oh, LOUT: gl.constexpr):
    """Store y (groups, heads, words, codes of a word) at ``o_b`` + head·stride_oh + channel, the
    channel 64g + J·m + j of J codes per word (heads from ``H`` not stored)."""
    W: gl.constexpr = y.shape[2]
    J: gl.constexpr = y.shape[3]
    og = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LOUT))))[:, None, None, None]
    oh = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LOUT))))[None, :, None, None]
    om = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LOUT))))[None, None, :, None]
    oj = gl.arange(0, J, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LOUT))))[None, None, None, :]
    gl.store(o_b + oh * stride_oh + 64 * og + J * om + oj, y, mask=(oh < H) & (og >= 0) & (om >= 0) & (oj >= 0))


@gluon.jit
def _prefetch_l2(base, tid, nbytes):
    """Thread 0 of the program: ``nbytes`` (a multiple of 16) from ``base`` into L2."""
    gl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.eq.u32 p, $1, 0;\n@p cp.async.bulk.prefetch.L2.global [$2], $3;\nmov.u32 $0, 0;\n}",
        "=r,r,l,r", [tid, base.to(gl.pointer_type(gl.int8)), nbytes], dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _lse(lacc, m_ref):
    """The softmax's denominators per head (the sum of P over the accumulated tiles ``lacc``), whether any
    row counted, and the LSE (natural log) against the running maximum ``m_ref`` (log2 units)."""
    l = gl.sum(lacc, axis=0)
    has = l > 0
    return l, has, gl.where(has, (m_ref + gl.log2(gl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))


@gluon.jit
def _tile_meta(mt, valid, c8, S_OFF: gl.constexpr, Z_OFF: gl.constexpr, RS_OFF: gl.constexpr,
               RZ_OFF: gl.constexpr, AL: gl.constexpr):  # fmt: skip
    """What a page tile's second box ``mt`` (the RoPE codes, then the metadata) gives the products, for
    tokens ``valid`` (``c8``: 0..7 along the columns of ``LA8``): the RoPE code words (a view), the
    content groups' scales per token (eight (64,) tensors) and the RoPE scales, all 0 where not valid;
    the zero-point term's A operand (s·z per token and group, RoPE in column 8); and the content
    zero-points as the source of P·V's zero-point column tile."""
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    P2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    P1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    rst = _view(mt.slice(0, 64), gl.int16, [64, 16], P2)
    # the metadata, 2 KB from the content scales (:func:`constexprs` checks these offsets: each region
    # at a multiple of its size, as slices of shared memory must be)
    mb = _view(mt.slice(64, 64), gl.uint8, [2048], P1)
    sst = _view(mb.slice(0, 1024), gl.bfloat16, [64, 8], P2)
    zst = _view(mb.slice(Z_OFF - S_OFF, 512), gl.uint8, [64, 8], P2)
    rsst = _view(mb.slice(RS_OFF - S_OFF, 256), gl.float32, [64], P1)
    rzst = _view(mb.slice(RZ_OFF - S_OFF, 64), gl.uint8, [64], P1)
    # scales of rows that hold no page token read as 0 (their slots may hold anything): their P'
    # is then 0, not 0 times a stray NaN
    v8 = gl.convert_layout(valid, gl.SliceLayout(1, L8), assert_trivial=True)[:, None]
    s8 = _cols8(gl.where(v8, sst.load(L8).to(gl.float32), 0.0), ROWS)
    sr = gl.where(valid, rsst.load(ROWS), 0.0)
    # the zero-point term's A (s·z per token and group, RoPE in column 8) and the zero-point
    # column tile of P·V (z·2^-24 in column 0 of each group's 8)
    za = zst.load(LA8)
    va = gl.convert_layout(valid, gl.SliceLayout(1, LA8), assert_trivial=True)[:, None]
    wr = gl.convert_layout(sr * rzst.load(ROWS).to(gl.float32), gl.SliceLayout(1, LA8), assert_trivial=True)
    wc = gl.where(va, sst.load(LA8).to(gl.float32), 0.0) * za.to(gl.float32)
    wz = gl.convert_layout(_cols16(wc, gl.where(c8 == 0, wr[:, None], 0.0)), AL, assert_trivial=True)
    zc = gl.convert_layout(za.to(gl.int16), gl.SliceLayout(2, L3Z), assert_trivial=True)[:, :, None]
    return rst, s8, sr, wz, zc


@gluon.jit
def _exact16_kernel(Q, QPE, O, LSE, BT, LENS, PROT, DC, DM,
                    H, stride_qb, stride_qh, stride_rb, stride_rh, stride_pb,
                    stride_ob, stride_oh, stride_os, stride_bt, tiles_per_split, prot_per, prot_end, qk_scale,
                    PAGE_BYTES: gl.constexpr, R_OFF: gl.constexpr, S_OFF: gl.constexpr, RS_OFF: gl.constexpr,
                    Z_OFF: gl.constexpr, RZ_OFF: gl.constexpr,
                    SINK: gl.constexpr, RECENT: gl.constexpr, SPLIT: gl.constexpr, CB: gl.constexpr):  # fmt: skip
    BN: gl.constexpr = 64
    NS: gl.constexpr = STAGES
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    A2: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M2, k_width=2)
    B2: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=M2, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    COLS: gl.constexpr = gl.SliceLayout(0, ACC)
    SW: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 2, order=[1, 0])  # rows of 32 B, ldmatrix without conflicts
    SW3: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 2, order=[2, 1, 0])
    P3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    P2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    P1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, 16], gl.float16)
    # per stage: the content codes, 8 groups x 64 tokens, 16 words (4 bits, 32 B rows, swizzled) or 8
    # (2 bits, 16 B rows: an 8 x 8 ldmatrix block is 128 contiguous bytes, without conflicts
    # unswizzled), written by the TMA in the NVMMA layouts and read through the swizzled ones (the same
    # bytes); and the 4 KB from the RoPE codes on: those codes (64 rows of 32 B), then from byte
    # S_OFF − R_OFF the content scales (token, group) BF16 and zero-points, the RoPE scales and zero-points
    if CB == 4:
        cs = gl.allocate_shared_memory(gl.int16, [NS, 512, 16], NV32)
    else:
        cs = gl.allocate_shared_memory(gl.int16, [NS, 512, 8], NV0)
    ms = gl.allocate_shared_memory(gl.int16, [NS, 128, 16], NV0)
    # one mbarrier per stage and box (content codes; RoPE codes and metadata)
    bc = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    bm = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bc.index(i), count=1)
        mbarrier.init(bm.index(i), count=1)
    qc = gl.allocate_shared_memory(gl.float16, [32, 16, 16], QS)  # score B tiles, content: (8j + g) x (head, word)
    qr = gl.allocate_shared_memory(gl.float16, [4, 16, 16], QS)  # score B tiles, RoPE: j x (head, word)
    zb = gl.allocate_shared_memory(gl.float16, [2, 16, 16], QS)  # zero-point term B: hi, lo x (head, group)
    psm = gl.allocate_shared_memory(gl.float16, [8, 64, 16], SW3)  # P'_g: (group, token, head)
    ztm = gl.allocate_shared_memory(gl.float16, [8, 64, 8], P3)  # zero-point column tile (group, token, 8)
    fl = gl.allocate_shared_memory(gl.float32, [4], P1)  # each warp's overshoot of the running maximum
    LF: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])

    pid_s = gl.program_id(0)
    b = gl.program_id(1).to(gl.int64)
    L = gl.load(LENS + b).to(gl.int32)

    low_hi = L - RECENT  # tokens SINK <= t < L - RECENT are read from the pages
    n_tiles = gl.cdiv(gl.minimum(gl.maximum(low_hi, SINK), L), BN)
    # this split's work units pid_s·per … (pid_s + 1)·per − 1 (splits.front_split_work): first
    # the request's protected tiles, prot_per to a split, then its page tiles from unit prot_end on
    u_lo = pid_s * tiles_per_split
    t_lo = gl.maximum(u_lo - prot_end, 0)
    t_hi = gl.minimum(gl.maximum(u_lo + tiles_per_split - prot_end, 0), n_tiles)
    bt_row = BT + b * stride_bt
    rows = gl.arange(0, BN, layout=ROWS)
    n8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3Z)))[None, None, :]
    c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, LA8))[None, :]

    # the first tiles' copies under the queries' preparation
    for i in gl.static_range(NS - 1):
        if t_lo + i < t_hi:
            page = gl.load(bt_row + t_lo + i)
            _copy_tile(DC, DM, cs.index(i), ms.index(i), bc.index(i), bm.index(i), page, PAGE_BYTES, R_OFF, CB)
    kq = _queries(Q + b * stride_qb, stride_qh, QPE + b * stride_rb, stride_rh, H, qc, qr, zb, CB)
    # per head: the scores in log2 units are c_h · (products), c_h = tau·log2(e)·2^(24 − kq)
    ch = gl.convert_layout(qk_scale * ((151 - kq) << 23).to(gl.float32, bitcast=True), COLS)
    fence_async_shared()
    _barrier()

    m_ref = gl.full([16], float("-inf"), gl.float32, COLS)
    lacc = gl.zeros([64, 16], gl.float32, ACC)
    # P·V: one accumulator per code position j of a word (groups x heads x words; channel
    # 64g + (16/CB)·m + j)
    if CB == 4:
        a0 = gl.zeros([8, 16, 16], gl.float32, M2)
        acc = (a0, a0, a0, a0)
    else:
        a0 = gl.zeros([8, 16, 8], gl.float32, M2)
        acc = (a0, a0, a0, a0, a0, a0, a0, a0)
    az = gl.zeros([8, 16, 8], gl.float32, M2)

    # block-table entries NS − 1 and NS tiles ahead: the next copy's page, and the one after it (read
    # an iteration early)
    pn = gl.load(bt_row + gl.minimum(t_lo + NS - 1, t_hi - 1), mask=t_lo < t_hi, other=0)
    pp = gl.load(bt_row + gl.minimum(t_lo + NS, t_hi - 1), mask=t_lo < t_hi, other=0)
    tid = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    # this split's protected rows (sink, then the recent ring; read after its page tiles) go to L2 now
    KP: gl.constexpr = (SINK + RECENT + BN - 1) // BN
    p_lo = gl.minimum(pid_s * prot_per, KP) * BN
    p_hi = gl.minimum(pid_s * prot_per + prot_per, KP) * BN
    if p_lo < p_hi:
        row_bytes: gl.constexpr = 576 * 2  # a protected row: d_c + d_r BF16 values
        _prefetch_l2(PROT + b * stride_pb + p_lo * 576, tid, (gl.minimum(p_hi, SINK + RECENT) - p_lo) * row_bytes)
    for t in range(t_lo, t_hi):
        it = t - t_lo
        _barrier()  # every warp done with tile t - 1: its stage and the P buffer can be written
        if t + NS - 1 < t_hi:
            sn = (it + NS - 1) % NS
            _copy_tile(DC, DM, cs.index(sn), ms.index(sn), bc.index(sn), bm.index(sn), pn, PAGE_BYTES, R_OFF, CB)
        pn = pp
        pp = gl.load(bt_row + gl.minimum(t + NS + 1, t_hi - 1))
        st = it % NS
        mbarrier.wait(bc.index(st), (it // NS) & 1)  # tile t in shared memory
        mbarrier.wait(bm.index(st), (it // NS) & 1)
        if CB == 4:
            cst = _view(cs.index(st), gl.int16, [512, 16], SW)
        else:
            cst = _view(cs.index(st), gl.int16, [512, 8], P2)
        tok = t * BN + rows
        valid = (tok >= SINK) & (tok < low_hi)
        rst, s8, sr, wz, zc = _tile_meta(ms.index(st), valid, c8, S_OFF, Z_OFF, RS_OFF, RZ_OFF, AL)
        ztm.permute((1, 0, 2)).store(gl.where(n8 == 0, zc, 0).to(gl.float16, bitcast=True))
        xs = _tile_words(cst, rst, CB, AL)
        x = _scores(xs, qc, qr, zb, s8, sr, wz, CB, AL, ACC) * ch[None, :]
        # P·V's code words while the softmax runs (the tile is in shared memory since the loop's barrier)
        words = _pv_words(cst, CB, B2)
        # optimistic: P against the running maximum, each warp's overshoot published with P';
        # the rare tile that passes it by more than 2^LAZY is redone after the barrier
        x = gl.where(valid[:, None], x, float("-inf"))
        fl.store(_over_per_warp(x, valid, m_ref))
        p = _p(x, m_ref)
        _store_p(psm, p, s8)
        _barrier()  # P', the zero-point tile and the overshoots visible to every warp
        if gl.max(fl.load(LF), axis=0) > LAZY:
            m_ref, lacc, acc, az = _raise_max(x, m_ref, lacc, acc, az, CB, M2)
            p = _p(x, m_ref)
            _store_p(psm, p, s8)
            _barrier()
        lacc = lacc + p
        acc, az = _pv(psm, words, ztm, acc, az, CB, A2, B2)
    for i in gl.static_range(NS):
        mbarrier.invalidate(bc.index(i))
        mbarrier.invalidate(bm.index(i))

    # accumulators from units of 2^-24 (and of 1/16 for the odd nibbles) to units of 1: the
    # protected rows below add into them in FP16 units
    if CB == 4:
        acc = (acc[0] * 16777216.0, acc[1] * 1048576.0, acc[2] * 16777216.0, acc[3] * 1048576.0)
    else:  # code j's values were 4^(j mod 4)·n·2^-24
        acc = (acc[0] * 16777216.0, acc[1] * 4194304.0, acc[2] * 1048576.0, acc[3] * 262144.0,
               acc[4] * 16777216.0, acc[5] * 4194304.0, acc[6] * 1048576.0, acc[7] * 262144.0)  # fmt: skip
    az = az * 16777216.0

    if p_lo < p_hi:  # this split's protected rows
        prot = PROT + b * stride_pb
        one = gl.full([BN], 1.0, gl.float32, ROWS)
        for r0 in range(p_lo, p_hi, BN):
            _barrier()  # every warp done with the P buffer
            valid = _prot_valid(r0 + rows, L, SINK, RECENT)
            x = _prot_scores(prot, r0, valid, qc, qr, CB, ACC, AL, L3A) * (ch * 5.9604644775390625e-08)[None, :]
            p, m_ref, lacc, acc, az = _softmax(x, valid, m_ref, lacc, acc, az, CB, M2)
            _store_p(psm, p, (one, one, one, one, one, one, one, one))
            _barrier()
            acc = _pv_prot(psm, prot, r0, L, acc, CB, A2, B2, L3B, SINK, RECENT)

    # out: O[h, 64g + (16/CB)·m + j] = (acc_j[g, h, m] − Σ_t p s z [g, h]) / l_h, four consecutive
    # channels of one (g, h) in each thread (16-byte stores, a warp's two or four heads x 256 B contiguous)
    l, has, lse = _lse(lacc, m_ref)
    inv = gl.convert_layout(1.0 / gl.where(has, l, 1.0), gl.SliceLayout(0, gl.SliceLayout(2, M2)))[None, :, None]
    nz = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, M2)))
    zsum = gl.sum(gl.where(nz[None, None, :] == 0, az, 0.0), axis=2)[:, :, None]
    o_b = O + b * stride_ob + pid_s * stride_os
    if CB == 4:
        y = gl.join(gl.join((acc[0] - zsum) * inv, (acc[2] - zsum) * inv),
                    gl.join((acc[1] - zsum) * inv, (acc[3] - zsum) * inv))  # fmt: skip
        _store_out(o_b, gl.convert_layout(gl.reshape(y, [8, 16, 16, 4]), LO), H, stride_oh, LO)
    else:
        y = _join8((acc[0] - zsum) * inv, (acc[1] - zsum) * inv, (acc[2] - zsum) * inv, (acc[3] - zsum) * inv,
                   (acc[4] - zsum) * inv, (acc[5] - zsum) * inv, (acc[6] - zsum) * inv, (acc[7] - zsum) * inv)  # fmt: skip
        _store_out(o_b, gl.convert_layout(gl.reshape(y, [8, 16, 8, 8]), LO2), H, stride_oh, LO2)
    lh = gl.arange(0, 16, layout=COLS)
    if SPLIT:
        gl.store(LSE + (b * H + lh) * gl.num_programs(0) + pid_s, lse, mask=lh < H)
    else:
        gl.store(LSE + b * H + lh, lse, mask=lh < H)


PROT_WEIGHT = 5
"""Page tiles one protected tile weighs when a request is cut into splits (config ``prot_weight``
overrides): a protected tile reads its BF16 rows outside the page pipeline, so it costs several page
tiles' time (docs/kernels.md)."""


def split(case: Case) -> Split:
    """Protected tiles first, each weighing config ``prot_weight`` (default :data:`PROT_WEIGHT`) page
    tiles, then the page tiles (:func:`quantmla.kernels.splits.front_split_work`)."""
    cfg = case.config
    return front_split_work(case.layer, case.max_len, int(cfg["num_splits"]), int(cfg.get("prot_weight", PROT_WEIGHT)))


def supports(case: Case) -> str | None:
    """Why this kernel cannot run ``case`` (None: it can). It computes attention over the exactly
    dequantized cache and nothing else, so it takes only ``exact`` decodes, and of those C4R4 or C2R4
    at up to 16 heads in the page layout and on the device of :func:`.gluon_decode.hopper_format`."""
    if not case.exact:
        return "the exact kernel attends to the exactly dequantized cache; this decode asks for the rounded rows"
    fmt, protected, H = case.fmt, case.layer.prot is not None, case.heads
    if INTERPRET or fmt.content_bits not in (2, 4) or H > 16 or not hopper_format(fmt, protected, case.device):
        return (
            "the exact kernel takes C4R4 or C2R4 in a BF16 cache with protection buffers, group 64, d_c 512, d_r 64, "
            f"at most 16 heads, on a Hopper (sm_90) GPU, compiled (not the Triton interpreter); got {fmt.name} in "
            f"{fmt.dtype}, group {fmt.group}, d_c {fmt.d_c}, d_r {fmt.d_r}, {H} heads, protection "
            f"{'on' if protected else 'off'}, device {case.device}"
        )
    return None


def launch(case: Case, sp: Split, block_table, lengths, q, qpe, o, lse, tau: float) -> None:
    """Launch over ``sp.splits`` splits of ``sp.per`` work units each (:func:`split`: sink and ring as
    three tiles of ``prot_weight`` units each, first, then the page tiles of one unit each): ``q``,
    ``qpe`` BF16 contiguous; ``o`` (B, H, splits, d_c) and ``lse`` (B, H, splits) float32 partials
    when ``splits > 1``, else the outputs themselves. Config ``maxnreg`` caps the registers."""
    layer, cfg = case.layer, case.config
    B, H, _ = q.shape
    fmt = layer.fmt
    prot = layer.prot
    weight = int(cfg.get("prot_weight", PROT_WEIGHT))
    prot_per, prot_end = front_share(sp.per, weight, -(-(layer.sink + layer.recent) // 64))
    _exact16_kernel[(sp.splits, B)](
        q, qpe, o, lse, block_table, lengths, prot, *descriptors(layer.pool, fmt.content_bits),
        H, q.stride(0), q.stride(1), qpe.stride(0), qpe.stride(1), prot.stride(0),
        o.stride(0), o.stride(1), o.stride(2), block_table.stride(0), sp.per, prot_per, prot_end, tau * LOG2E,
        **constexprs(fmt, layer.sink, layer.recent, sp.splits > 1),
        num_warps=WARPS, maxnreg=cfg.get("maxnreg"),
    )  # fmt: skip


def descriptor_blocks(cb: int) -> dict:
    """The block shape (in 16-bit words) and shared layout of the kernel's two TMA descriptors over a
    pool of ``cb``-bit content pages: ``DC`` the content codes, ``DM`` the 4 KB from the RoPE codes on
    (those codes and the metadata)."""
    content = ([8, 64, 16], NV32_3.value) if cb == 4 else ([2, 256, 8], NV0_3.value)
    return dict(DC=content, DM=([128, 16], NV0.value))


_DESCRIPTORS: dict = {}  # id(pool) -> (weak reference to the pool, content bits, descriptors)


def descriptors(pool: torch.Tensor, cb: int) -> tuple:
    """The TMA descriptors of :func:`descriptor_blocks` over ``pool`` (pages x bytes, uint8), viewed as
    16-bit words: (pages x 8 or 2 boxes, rows, words) for ``DC``, rows of 32 B for ``DM``. Kept per pool
    tensor; the entries of pools that are gone (a pool that grows is a new tensor) are dropped at the
    next new one."""
    hit = _DESCRIPTORS.get(id(pool))
    if hit is not None and hit[0]() is pool and hit[1] == cb:
        return hit[2]
    for k in [k for k, v in _DESCRIPTORS.items() if v[0]() is None]:
        del _DESCRIPTORS[k]
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    words = pool.view(torch.int16)
    out = []
    for block, layout in descriptor_blocks(cb).values():
        rows = words.view(-1, *block[1:])
        out.append(TensorDescriptor(rows, list(rows.shape), list(rows.stride()), block, layout))
    _DESCRIPTORS[id(pool)] = (weakref.ref(pool), cb, tuple(out))
    return tuple(out)


def constexprs(fmt, sink: int, recent: int, split: bool) -> dict:
    """The kernel's compile-time arguments for pages of ``fmt`` (also what ``bench/gluon_sass.py
    --exact`` compiles for sm_90 without a GPU)."""
    regions = dict(R_OFF="R_codes", S_OFF="C_scale", RS_OFF="R_scale", Z_OFF="C_zero", RZ_OFF="R_zero")
    off = {k: fmt.regions[n].offset for k, n in regions.items()}
    # the page's two TMA boxes: 512 rows of content codes, then 4 KB from the RoPE codes (2 KB of them,
    # then the metadata, each region at a multiple of its size from the first)
    meta = {"S_OFF": 0, "Z_OFF": 1024, "RS_OFF": 1536, "RZ_OFF": 1792}
    boxes = (off["R_OFF"], off["S_OFF"] - off["R_OFF"], fmt.page_bytes - off["R_OFF"])
    if boxes != (512 * 8 * fmt.content_bits, 2048, 4096) or {k: off[k] - off["S_OFF"] for k in meta} != meta:
        raise ValueError(f"the exact decode kernel does not read pages laid out as {fmt.regions}")
    return dict(PAGE_BYTES=fmt.page_bytes, **off, SINK=sink, RECENT=recent, SPLIT=split, CB=fmt.content_bits)


__all__ = ["NAME", "PROT_WEIGHT", "constexprs", "descriptor_blocks", "launch", "split", "supports"]
