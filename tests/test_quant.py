"""The quantizer against an independent float64 implementation of the paper's eqs. 35–36."""

import numpy as np
import pytest
import torch

from quantmla.quant import BITS, pack, qdq, quantize, unpack


def reference(x: np.ndarray, bits: int, group: int, scale_dtype=np.float64):
    """Eq. 35–36 in float64 with numpy (round half to even), written from the paper."""
    m = 2**bits - 1
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, group)
    xmin, xmax = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    s = np.maximum(xmax - xmin, 1e-8) / m
    if scale_dtype == "bf16":
        s = torch.from_numpy(s).to(torch.bfloat16).double().numpy()
    z = np.clip(np.rint(-xmin / s), 0, m)
    t = g / s + z
    q = np.clip(np.rint(t), 0, m)
    return q.reshape(x.shape), (s * (q - z)).reshape(x.shape), t.reshape(x.shape)


@pytest.mark.parametrize("bits", [b for b in BITS if b < 16])
@pytest.mark.parametrize("scale", ["fp32", "bf16"])
def test_random_matches_float64_reference(bits, scale):
    x = torch.randn(37, 3 * 64) * torch.rand(37, 1) * 4 + torch.randn(37, 1)
    dtype = torch.bfloat16 if scale == "bf16" else torch.float32
    qt = quantize(x, bits, 64, scale_dtype=dtype)
    q_ref, xh_ref, t = reference(x.numpy(), bits, 64, "bf16" if scale == "bf16" else np.float64)
    # float32 and float64 may round differently only where x/s + z sits on a tie to ~1e-4
    near_tie = np.abs(np.abs(t - np.floor(t)) - 0.5) < 1e-4
    same = qt.codes.numpy() == q_ref
    assert same[~near_tie].all()
    assert near_tie.mean() < 0.01
    xh = qdq(x, bits, 64, scale_dtype=dtype).double().numpy()
    np.testing.assert_allclose(xh[same], xh_ref[same], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(qt.dequantize().double().numpy()[same], xh_ref[same], rtol=1e-6, atol=1e-6)
    assert qt.codes.max() <= 2**bits - 1


def test_ties_round_to_even():
    # group min 0, max 3 at 2 bits: s = 1, z = 0, and x/s + z lands exactly on .5
    g = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0] + [1.0] * 59)
    q = quantize(g[None], 2, 64).codes[0]
    assert q[:5].tolist() == [0, 0, 2, 2, 3]
    # zero-point tie: x_min = -0.5, x_max = 2.5 → s = 1, -x_min/s = 0.5 → z = 0 (even)
    g2 = torch.tensor([-0.5, 2.5] + [0.0] * 62)
    qt = quantize(g2[None], 2, 64)
    assert qt.zero.item() == 0
    assert qdq(g2[None], 2, 64)[0, 0].item() == 0.0  # code clipped at 0, so -0.5 becomes 0


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_constant_groups(bits):
    x = torch.tensor([[2.0] * 64, [-3.0] * 64, [0.0] * 64]).reshape(1, 192)
    q_ref, xh_ref, _ = reference(x.numpy(), bits, 64)
    assert (quantize(x, bits, 64).codes.numpy() == q_ref).all()
    np.testing.assert_allclose(qdq(x, bits, 64).numpy(), xh_ref, rtol=1e-6, atol=1e-12)
    # the paper gives constant groups no special care: a positive constant collapses to s*m = 1e-8
    assert abs(qdq(x, bits, 64)[0, 0].item() - 1e-8) < 1e-12


def test_bits16_is_identity_and_dtype_kept():
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert qdq(x, 16) is x
    assert qdq(x, 4).dtype == torch.bfloat16


def test_error_shrinks_with_bits():
    x = torch.randn(64, 512)
    errs = [(qdq(x, b) - x).pow(2).mean().item() for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True)
    # the uniform-grid error of 8 bits is at most (s/2)^2 per element
    assert errs[-1] < ((x.max() - x.min()) / 255 / 2).pow(2).item()


def test_ste_gradient_is_identity_through_rounding():
    x = torch.randn(8, 64, requires_grad=True)
    qdq(x, 4, ste=True).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # d(x_hat)/dx sums to about 1 per element (STE) — far from the zero gradient of plain rounding
    assert 0.5 < x.grad.mean().item() < 1.5
    # without STE only each group's min and max receive gradient (through s and z)
    y = torch.randn(8, 64, requires_grad=True)
    qdq(y, 4, ste=False).sum().backward()
    assert (y.grad != 0).sum().item() <= 2 * 8


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip(bits):
    width = {2: 2, 3: 4, 4: 4, 8: 8}[bits]
    codes = torch.randint(0, 2**bits, (5, 7, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == 64 * width // 8
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_layout_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack(codes, 4).tolist() == [[0x21, 0x43]]
    assert pack(codes[:, :4] - 1, 2).tolist() == [[0 | (1 << 2) | (2 << 4) | (3 << 6)]]


def test_bad_inputs():
    with pytest.raises(ValueError, match="bits=5"):
        qdq(torch.randn(1, 64), 5)
    with pytest.raises(ValueError, match="does not divide"):
        qdq(torch.randn(1, 96), 4, 64)
