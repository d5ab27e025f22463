"""The physical layout of the paper's App. C.5: byte counts, eq. 40, validation of what it cannot hold."""

import pytest
import torch
from kernels_helpers import DEVICE

from quantmla.kernels import PagedLayer, PageFormat
from quantmla.kernels.layout import check_block_table


def test_bytes_per_token_match_the_paper():
    c4r4 = PageFormat(4, 4)
    assert c4r4.page_bytes == 20_480 and c4r4.bytes_per_token == 320  # the paper's App. C.5
    assert c4r4.payload_bytes_per_token == 256 + 32 + 8 * 2 + 4 + 9  # codes, BF16/FP32 scales, uint8 zeros
    assert PageFormat(16, 16).page_bytes == 73_728  # BF16 page, 64 × 576 × 2
    assert PageFormat(2, 4).bytes_per_token == 192
    assert PageFormat(3, 4).bytes_per_token == 320  # 3-bit codes travel in nibbles
    assert c4r4.protection_bytes(4, 128) == 152_064


def test_request_bytes_follow_eq_40():
    c4r4, bf16 = PageFormat(4, 4), PageFormat(16, 16)
    assert c4r4.request_bytes(4096) == 1_463_296 and bf16.request_bytes(4096) == 4_718_592
    assert c4r4.request_bytes(131072) == 42_111_488 and bf16.request_bytes(131072) == 150_994_944
    assert round(bf16.request_bytes(4096) / c4r4.request_bytes(4096), 2) == 3.22
    assert round(bf16.request_bytes(131072) / c4r4.request_bytes(131072), 2) == 3.59


def test_views_alias_the_pool():
    layer = PagedLayer(PageFormat(4, 4), 3, DEVICE, batch=2, sink=4, recent=128)
    layer.views["C_scale"][1, 5, 2] = 1.5
    r = layer.fmt.regions["C_scale"]
    off = r.offset + (5 * 8 + 2) * 2
    assert layer.pool[1, off : off + 2].view(torch.bfloat16).item() == 1.5
    assert layer.prot.shape == (2, 132, 576) and layer.prot.dtype == torch.bfloat16


@pytest.mark.parametrize("cb, per_group", [(4, 32), (2, 16)])
def test_codes_are_group_major_in_a_page(cb, per_group):
    """Byte k of group g of slot s sits at g·64·per_group + s·per_group + k of the codes region."""
    layer = PagedLayer(PageFormat(cb, 4), 2, DEVICE)
    layer.pool.zero_()
    codes = layer.views["C_codes"]
    assert codes.shape == (2, 64, 8, per_group)
    codes[1, 5, 3, 7] = 201
    off = layer.fmt.regions["C_codes"].offset + 3 * 64 * per_group + 5 * per_group + 7
    assert layer.pool[1, off].item() == 201 and int(layer.pool.sum()) == 201
    assert layer.views["R_codes"].shape == (2, 64, 1, 32)  # a single group: rows as before


@pytest.mark.parametrize("cb", [2, 3, 4, 8])
def test_metadata_regions_each_lie_at_a_multiple_of_their_size(cb):
    """At d_c 512, d_r 64, group 64 the metadata follows the codes as content scales, content zero-points,
    RoPE scales, RoPE zero-points, each at a multiple of its (power-of-two) size from the first: a kernel
    copying all of it at once can view every region as an aligned slice of shared memory (the exact
    decode kernel does)."""
    fmt = PageFormat(cb, 4)
    names = ["C_scale", "C_zero", "R_scale", "R_zero"]
    regions = [fmt.regions[n] for n in names]
    assert list(fmt.regions)[2:] == names
    base = regions[0].offset
    assert [r.nbytes for r in regions] == [1024, 512, 256, 64]
    for r in regions:
        assert (r.offset - base) % r.nbytes == 0, (r.name, r.offset - base)
    assert regions[-1].offset + 64 <= fmt.page_bytes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(content_bits=5, rope_bits=4), "content bits 5"),
        (dict(content_bits=4, rope_bits=6), "RoPE bits 6"),
        (dict(content_bits=4, rope_bits=4, d_c=500), "d_c=500 cannot be held"),
        (dict(content_bits=4, rope_bits=4, d_r=48), "d_r=48 cannot be held"),
        (dict(content_bits=4, rope_bits=4, group=48), "group 48"),
        (dict(content_bits=4, rope_bits=4, d_r=32), "does not divide d_r=32"),
        (dict(content_bits=4, rope_bits=4, dtype=torch.int8), "dtype"),
    ],
)
def test_unsupported_formats_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageFormat(**kwargs)


def test_block_table_checks():
    lens = torch.tensor([70, 10])
    check_block_table(torch.tensor([[3, 1], [0, 9]], dtype=torch.int32), lens, 4, 2)  # page 9 is never used
    with pytest.raises(ValueError, match="outside the pool"):
        check_block_table(torch.tensor([[3, 4], [0, 1]], dtype=torch.int32), lens, 4, 2)
    with pytest.raises(ValueError, match="needs 2 pages"):
        check_block_table(torch.tensor([[3], [0]], dtype=torch.int32), lens, 4, 2)
    with pytest.raises(TypeError, match="int32 or int64"):
        check_block_table(torch.tensor([[3.0, 1.0], [0.0, 1.0]]), lens, 4, 2)
