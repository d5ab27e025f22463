"""The fused writer: bit for bit with the skeleton's quantizer, protection buffers, 64-bit addressing."""

import pytest
import torch
from kernels_helpers import DEVICE, PAGE, latents, shuffled_table, to_device

from quantmla import kernels
from quantmla.kernels import PagedLayer, PageFormat
from quantmla.kernels import reference as ref
from quantmla.quant import pack, quantize

FORMATS = [
    (4, 4, torch.bfloat16),
    (2, 4, torch.bfloat16),
    (3, 4, torch.bfloat16),
    (8, 8, torch.bfloat16),
    (4, 8, torch.bfloat16),
    (16, 16, torch.bfloat16),
    (16, 4, torch.bfloat16),
    (4, 16, torch.bfloat16),
    (4, 4, torch.float32),
    (2, 4, torch.float16),
]


def _kind(C, K, kind, gen):
    """``random`` rows as drawn; ``outliers``: a few channels and tokens 30-300× the rest (the
    heavy-tailed latents of real MLA models); ``large``: every row scaled to magnitudes in the
    hundreds, where float32 division by the scale rounds differently from a reciprocal product."""
    if kind == "outliers":
        for x in (C, K):
            ch = torch.randint(0, x.shape[1], (max(1, x.shape[1] // 32),), generator=gen)
            x[:, ch] *= 30
            x[torch.randint(0, x.shape[0], (3,), generator=gen)] *= 10
    elif kind == "large":
        C.mul_(173.3)
        K.mul_(97.1)
    return C, K


def _poisoned_pair(fmt, num, B, gen, sink=4, recent=128):
    a = PagedLayer(fmt, num, "cpu", batch=B, sink=sink, recent=recent)
    a.pool.copy_(torch.randint(0, 256, a.pool.shape, generator=gen, dtype=torch.uint8))
    if a.prot is not None:
        a.prot.copy_(torch.randn(a.prot.shape, generator=gen).to(fmt.dtype))
    b = PagedLayer(fmt, num, "cpu", batch=B, sink=sink, recent=recent)
    b.pool.copy_(a.pool)
    if b.prot is not None:
        b.prot.copy_(a.prot)
    return a, to_device(b)


def _chunk(lengths, gen):
    req = torch.cat([torch.full((L,), b, dtype=torch.int32) for b, L in enumerate(lengths)])
    pos = torch.cat([torch.arange(L) for L in lengths])
    perm = torch.randperm(len(req), generator=gen)  # token order does not matter
    return req[perm], pos[perm], torch.tensor(lengths)


@pytest.mark.parametrize("kind", ["random", "outliers", "large"])
@pytest.mark.parametrize(
    "cb, rb, dtype, d_c",
    [(*f, 512) for f in FORMATS] + [(4, 4, torch.bfloat16, 384), (2, 4, torch.bfloat16, 128)],
    ids=str,
)
def test_writer_matches_the_quantizer_bit_for_bit(cb, rb, dtype, d_c, kind):
    """Codes, scales and zero-points are the bytes of quant.quantize + quant.pack, whichever device
    the quantizer runs on: the Triton writer divides with IEEE rounding (div_rn) in the
    quantizer's order of operations, and quant.quantize divides exactly on CUDA too."""
    gen = torch.Generator().manual_seed(cb * 100 + rb + len(kind))
    fmt = PageFormat(cb, rb, d_c, 64, 64, dtype)
    lengths = [150, 3, 64]
    bt, num = shuffled_table(3, 3, 2, gen)
    want, got = _poisoned_pair(fmt, num, 3, gen)
    req, pos, lens = _chunk(lengths, gen)
    C, K = latents(len(req), fmt, gen)
    C, K = _kind(C.float(), K.float(), kind, gen)
    C, K = C.to(dtype), K.to(dtype)
    ref.write(want, bt, C, K, req, pos, lens)
    kernels.write(
        got, bt.to(DEVICE), C.to(DEVICE), K.to(DEVICE), req.to(DEVICE), pos.to(DEVICE), lens.to(DEVICE), "triton"
    )
    assert torch.equal(got.pool.cpu(), want.pool)  # written slots equal, every other byte untouched
    if want.prot is not None:
        assert torch.equal(got.prot.cpu(), want.prot)
    # and directly against quant.quantize / quant.pack (not through the reference writer)
    page, slot = bt[req.long(), pos // PAGE].long(), pos % PAGE
    for path, x, bits, sdt in (("C", C, cb, torch.bfloat16), ("R", K, rb, torch.float32)):
        v = {k: t.cpu() for k, t in got.views.items()}
        if bits == 16:
            assert torch.equal(v[f"{path}_rows"][page, slot], x)
            continue
        for dev in {torch.device("cpu"), DEVICE}:  # the quantizer on the CPU and on the kernel's device
            q = quantize(x.to(dev), bits, 64, scale_dtype=sdt)
            assert torch.equal(v[f"{path}_codes"][page, slot].flatten(-2), pack(q.codes, bits).cpu()), (path, dev)
            assert torch.equal(v[f"{path}_scale"][page, slot], q.scale.cpu()), (path, dev)
            assert torch.equal(v[f"{path}_zero"][page, slot], q.zero.cpu()), (path, dev)


@pytest.mark.slow
def test_protection_buffers_hold_sink_and_latest_recent_rows():
    gen = torch.Generator().manual_seed(7)
    fmt = PageFormat(4, 4)
    sink, recent = 4, 16
    bt, num = shuffled_table(2, 2, 0, gen)
    _, layer = _poisoned_pair(fmt, num, 2, gen, sink, recent)
    before = layer.prot.cpu().clone()
    lengths = [100, 9]
    req, pos, lens = _chunk(lengths, gen)
    C, K = latents(len(req), fmt, gen)
    kernels.write(layer, bt.to(DEVICE), C.to(DEVICE), K.to(DEVICE), req.to(DEVICE), pos.to(DEVICE), lens.to(DEVICE))
    prot = layer.prot.cpu()
    row = torch.cat([C, K], -1)
    for b, L in enumerate(lengths):
        mine = req == b
        for t in range(L):
            x = row[mine][pos[mine] == t][0]
            if t < sink:
                assert torch.equal(prot[b, t], x)
            if t >= L - recent:
                assert torch.equal(prot[b, sink + t % recent], x)
    assert torch.equal(prot[1, sink + 9 :], before[1, sink + 9 :])  # ring rows no token reached


def test_token_by_token_writes_equal_one_chunk():
    """A token leaving the recent window keeps the codes written at insertion (never re-quantized)."""
    gen = torch.Generator().manual_seed(3)
    fmt = PageFormat(2, 4)
    bt, num = shuffled_table(1, 4, 1, gen)
    chunk, steps = _poisoned_pair(fmt, num, 1, gen, 4, 32)
    chunk = to_device(chunk)
    C, K = latents(200, fmt, gen)
    C, K, btd = C.to(DEVICE), K.to(DEVICE), bt.to(DEVICE)
    zeros = torch.zeros(200, dtype=torch.int32, device=DEVICE)
    kernels.write(chunk, btd, C, K, zeros, torch.arange(200, device=DEVICE), torch.tensor([200], device=DEVICE))
    for t in range(0, 200, 25):  # decode-sized and prefill-sized steps
        idx = torch.arange(t, t + 25, device=DEVICE)
        kernels.write(steps, btd, C[idx], K[idx], zeros[:25], idx, torch.tensor([t + 25], device=DEVICE))
    assert torch.equal(chunk.pool, steps.pool)
    assert torch.equal(chunk.prot, steps.prot)


@pytest.mark.slow
@pytest.mark.parametrize("cb, rb", [(4, 4), (16, 16)])
def test_addresses_past_2_31_elements(cb, rb):
    """A page whose first element lies past 2^31 elements of its region view: only 64-bit offsets reach it.

    The pool is allocated but only the pages used are touched (on CPU it stays virtual)."""
    fmt = PageFormat(cb, rb)
    elems = fmt.regions["C_codes" if cb < 16 else "C_rows"]
    stride = fmt.page_bytes // elems.dtype.itemsize  # elements between pages in that view
    far = 2**31 // stride + 2
    layer = PagedLayer(fmt, far + 1, DEVICE, batch=1, sink=4, recent=128)
    assert far * stride > 2**31 and layer.pool.numel() > 2**31
    gen = torch.Generator().manual_seed(5)
    bt = torch.tensor([[far, 1]], dtype=torch.int32, device=DEVICE)
    C, K = latents(100, fmt, gen)
    C, K = C.to(DEVICE), K.to(DEVICE)
    pos = torch.arange(100, device=DEVICE)
    lens = torch.tensor([100], device=DEVICE)
    kernels.write(layer, bt, C, K, torch.zeros(100, dtype=torch.int32, device=DEVICE), pos, lens, "triton")
    if cb < 16:
        q = quantize(C[:64].cpu(), cb, 64, scale_dtype=torch.bfloat16)
        assert torch.equal(layer.views["C_codes"][far].flatten(-2).cpu(), pack(q.codes, cb))
    else:
        assert torch.equal(layer.views["C_rows"][far].cpu(), C[:64].cpu())
    q = torch.randn(1, 16, 512, generator=gen).to(DEVICE)
    qp = torch.randn(1, 16, 64, generator=gen).to(DEVICE)
    o, lse = kernels.decode(layer, bt, lens, q, qp, 0.05, "triton")
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 0.05)
    assert float((o - o_ref).norm() / o_ref.norm()) < 1e-3
    assert float((lse - lse_ref).abs().max()) < 1e-3


def test_bad_writes_raise_before_touching_the_pool():
    gen = torch.Generator().manual_seed(1)
    fmt = PageFormat(4, 4)
    layer = PagedLayer(fmt, 2, DEVICE, batch=1, sink=4, recent=8)
    layer.pool.fill_(0x5A)
    C, K = latents(10, fmt, gen)
    C, K = C.to(DEVICE), K.to(DEVICE)
    req = torch.zeros(10, dtype=torch.int32, device=DEVICE)
    pos = torch.arange(10, device=DEVICE)
    lens = torch.tensor([10], device=DEVICE)
    good = torch.tensor([[1]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="cache holds torch.bfloat16"):
        kernels.write(layer, good, C.half(), K.half(), req, pos, lens)
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.write(layer, torch.tensor([[2]], dtype=torch.int32, device=DEVICE), C, K, req, pos, lens)
    with pytest.raises(ValueError, match="width"):
        kernels.write(layer, good, C[:, :256], K, req, pos, lens)
    with pytest.raises(ValueError, match="below its request's length"):
        kernels.write(layer, good, C, K, req, pos, torch.tensor([5], device=DEVICE))
    assert bool((layer.pool == 0x5A).all())
