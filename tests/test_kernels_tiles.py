"""The tile reader under every attention kernel: bit for bit the reference dequantization.

``load_meta`` + ``load_rows`` rebuild a tile of stored rows in the cache dtype. The BF16
packed path (two elements per instruction on the GPU) and the generic path must both give
exactly ``QTensor.dequantize`` rounded to the cache dtype, and exact zeros for tokens that are
not valid (their bytes are random here) and for the padding columns of a non-power-of-two width.
"""

import pytest
import torch
import triton
import triton.language as tl
from kernels_helpers import DEVICE, filled_layer

from quantmla.kernels import PAGE, PageFormat
from quantmla.kernels import reference as ref
from quantmla.kernels._tiles import INTERPRET, container_bits, load_meta, load_rows, padded, region_args, tl_dtype


@triton.jit
def _read_tiles(BT, OUT, Rows, Codes, Scale, Zero, ps_rows, ps_codes, ps_scale, ps_zero, n_tok,
                D: tl.constexpr, DP: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
                PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
    page = tl.load(BT + (t * BLOCK_N) // PAGE_SIZE).to(tl.int64)
    slots = (t * BLOCK_N) % PAGE_SIZE + tl.arange(0, BLOCK_N)
    valid = tok < n_tok
    s, z = load_meta(Scale, Zero, ps_scale, ps_zero, page, slots, valid, D, DP, BITS, G, BLOCK_N)
    x = load_rows(Rows, Codes, ps_rows, ps_codes, page, slots, valid, s, z, D, DP, BITS, W, G, BLOCK_N, KV, INTERP)
    cols = tl.arange(0, DP)
    tl.store(OUT + tok[:, None] * DP + cols[None, :], x)


CASES = [
    # content bits, RoPE bits, d_c, cache dtype
    (4, 4, 512, torch.bfloat16),
    (2, 4, 512, torch.bfloat16),
    (3, 4, 512, torch.bfloat16),
    (8, 8, 512, torch.bfloat16),
    (4, 4, 384, torch.bfloat16),  # padded to 512 columns
    (2, 4, 384, torch.bfloat16),
    (4, 4, 512, torch.float16),
    (2, 16, 512, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("block_n", [32, 64])
def test_tile_reader_is_the_reference_dequantization(case, block_n):
    cb, rb, d_c, dtype = case
    gen = torch.Generator().manual_seed(cb * 100 + rb + d_c + block_n)
    fmt = PageFormat(cb, rb, d_c, dtype=dtype)
    L = 150  # three pages, the last one partly filled: 42 slots of random bytes
    layer, bt, _, _, _ = filled_layer(fmt, [L], gen)
    want = dict(zip(("C", "R"), ref.stored_rows(layer, bt, 0, L)))
    for path, bits, d in (("C", cb, fmt.d_c), ("R", rb, fmt.d_r)):
        dp = padded(d)
        n_tiles = bt.shape[1] * PAGE // block_n
        out = torch.full((n_tiles * block_n, dp), float("nan"), dtype=dtype, device=DEVICE)
        _read_tiles[(n_tiles,)](
            bt, out, *region_args(layer, path), L, D=d, DP=dp, BITS=bits, W=container_bits(bits), G=fmt.group,
            PAGE_SIZE=PAGE, BLOCK_N=block_n, KV=tl_dtype(dtype), INTERP=INTERPRET,
        )  # fmt: skip
        got = out.cpu()
        assert not torch.isnan(got).any(), "a tile element was not written"
        assert torch.equal(got[:L, :d], want[path].cpu()), f"{path} rows differ from the reference"
        assert (got[L:] == 0).all(), f"{path}: tokens past the request's length are not zero"
        assert (got[:, d:] == 0).all(), f"{path}: padding columns are not zero"
