"""Teacher-forced attention with the decode-faithful rule: kernel vs reference vs the paper's equations."""

import pytest
import torch
from kernels_helpers import DEVICE, TOL, exact_rows, filled_layer, rel, same_inf

from quantmla import kernels
from quantmla.cache import CacheSpec, protected_pairs
from quantmla.kernels import PageFormat
from quantmla.kernels import reference as ref
from quantmla.quant import qdq

CASES = [
    # bits, heads, content width, keys per request, queries per request (the last tokens), sink, recent
    (4, 4, 16, 512, [80, 45, 5], [80, 20, 0], 4, 40),
    (2, 4, 4, 128, [80, 33], [80, 33], 4, 16),
    (4, 8, 20, 128, [90], [90], 2, 30),  # heads not a multiple of 16
    (16, 16, 16, 128, [100, 20], [100, 7], 0, 0),
    (4, 4, 16, 128, [70, 64], [70, 64], 0, 0),  # quantized, unprotected
    (3, 4, 128, 128, [40, 21], [12, 21], 4, 16),
    (4, 4, 9, 384, [90, 40], [90, 17], 4, 16),  # a latent width that is not a power of two
    # long prompts, short window: key tiles with every pair, no pair and some pairs protected
    # (recent 18 and 15 put a block's first or last query exactly one key off a tile's edge)
    (4, 4, 16, 128, [300, 190], [300, 150], 4, 18),
    (2, 4, 16, 64, [260], [260], 0, 15),
]


def _inputs(lengths, n, H, fmt, gen):
    q = (torch.randn(len(lengths), H, n, fmt.d_c, generator=gen) * 0.5).to(DEVICE)
    qp = torch.randn(len(lengths), H, n, fmt.d_r, generator=gen).to(DEVICE)
    return q, qp


@pytest.mark.slow
@pytest.mark.parametrize("cb, rb, H, d_c, kv, ql, sink, recent", CASES, ids=lambda v: str(v))
def test_prefill_kernel_matches_reference(cb, rb, H, d_c, kv, ql, sink, recent):
    gen = torch.Generator().manual_seed(cb + rb + H + sum(kv))
    fmt = PageFormat(cb, rb, d_c)
    layer, bt, kv_len, C, K = filled_layer(fmt, kv, gen, sink=0, recent=0)
    q_len = torch.tensor(ql, device=DEVICE)
    n = max(max(ql), 1)
    q, qp = _inputs(kv, n, H, fmt, gen)
    layer = layer if fmt.quantized else None
    o_ref, lse_ref = ref.prefill(q, qp, C, K, kv_len, q_len, 0.06, sink, recent, layer, bt)
    out = (torch.full(o_ref.shape, float("nan"), device=DEVICE), torch.full(lse_ref.shape, float("nan"), device=DEVICE))
    o, lse = kernels.prefill(q, qp, C, K, kv_len, q_len, 0.06, sink, recent, layer, bt, "triton", out=out)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel(o, o_ref) < TOL and rel(lse, lse_ref) < TOL and same_inf(lse, lse_ref)


def test_reference_prefill_is_the_spec():
    """Float64, per (query, key) pair: BF16 row iff j < sink or j > t − recent (equal to token-by-token decoding)."""
    gen = torch.Generator().manual_seed(4)
    fmt = PageFormat(4, 4)
    sink, recent, tau = 3, 20, 0.08
    kv, ql = [75, 40], [30, 40]
    layer, bt, kv_len, C, K = filled_layer(fmt, kv, gen, sink=0, recent=0)
    q, qp = _inputs(kv, 40, 4, fmt, gen)
    o, lse = ref.prefill(q, qp, C, K, kv_len, torch.tensor(ql, device=DEVICE), tau, sink, recent, layer, bt)
    for b, (L, m) in enumerate(zip(kv, ql)):
        Cb, Kb = C[b, :L].cpu().double(), K[b, :L].cpu().double()
        Ch = qdq(C[b, :L].cpu(), 4, 64, scale_dtype=torch.bfloat16).double()
        Kh = qdq(K[b, :L].cpu(), 4, 64, scale_dtype=torch.float32).double()
        t = torch.arange(L - m, L)
        j = torch.arange(L)
        keep = protected_pairs(t, j, sink, recent)
        qb = q[b, :, :m].cpu().to(fmt.dtype).double()
        qpb = qp[b, :, :m].cpu().to(fmt.dtype).double()
        s = tau * torch.where(keep, qb @ Cb.T + qpb @ Kb.T, qb @ Ch.T + qpb @ Kh.T)
        s = s.masked_fill(j[None, :] > t[:, None], float("-inf"))
        p = torch.softmax(s, -1)
        want = (p * keep) @ Cb + (p * ~keep) @ Ch
        assert rel(o[b, :, :m], want) < 1e-5 and rel(lse[b, :, :m], torch.logsumexp(s, -1)) < 1e-6
        assert (o[b, :, m:] == 0).all() and torch.isinf(lse[b, :, m:]).all()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_attend_with_padding_counts_real_tokens_only(backend):
    """Left padding: a request's protected tokens are its own first and latest real tokens."""
    gen = torch.Generator().manual_seed(9)
    B, H, L = 2, 4, 60
    C = torch.randn(B, L, 128, generator=gen).to(DEVICE)
    K = torch.randn(B, L, 64, generator=gen).to(DEVICE)
    q = torch.randn(B, H, L, 128, generator=gen).to(DEVICE)
    qp = torch.randn(B, H, L, 64, generator=gen).to(DEVICE)
    valid = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    valid[1, :13] = False
    spec = CacheSpec(4, 4, sink=2, recent=10)
    o, lse = kernels.attend(q, qp, C, K, valid, spec, 0.1, backend)
    alone, alone_lse = kernels.attend(q[1:, :, 13:], qp[1:, :, 13:], C[1:, 13:], K[1:, 13:], None, spec, 0.1, backend)
    assert rel(o[1, :, 13:], alone[0]) < 1e-5 and rel(lse[1, :, 13:], alone_lse[0]) < 1e-5
    assert (o[1, :, :13] == 0).all() and torch.isinf(lse[1, :, :13]).all()


def test_attend_is_differentiable_through_the_reference():
    gen = torch.Generator().manual_seed(6)
    C = torch.randn(1, 30, 128, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    K = torch.randn(1, 30, 64, generator=gen, dtype=torch.float64).to(DEVICE)
    q = torch.randn(1, 2, 30, 128, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    qp = torch.randn(1, 2, 30, 64, generator=gen, dtype=torch.float64).to(DEVICE)
    # reference semantics in float64 (the teacher-forced path on unquantized latents is plain causal attention)
    o, _ = kernels.attend(q, qp, C, K, None, CacheSpec(), 0.1)
    o.square().sum().backward()
    s = 0.1 * (q @ C.transpose(-1, -2) + qp @ K.transpose(-1, -2))
    s = s.masked_fill(torch.ones(30, 30, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    gq, gC = torch.autograd.grad((torch.softmax(s, -1) @ C).square().sum(), (q, C))
    assert o.dtype == torch.float64  # float64 caches stay float64 (probes differentiate in double)
    assert rel(q.grad, gq) < 1e-10 and rel(C.grad, gC) < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_reference_is_prefill_without_pages_batched(dtype):
    """``reference.dense`` (what calibration trains through) gives prefill's outputs and gradients
    for full requests, over more than one query chunk and with fewer queries than keys."""
    gen = torch.Generator().manual_seed(12)
    B, H, L = 3, 2, ref.QUERY_CHUNK + 45
    for n in (L, L - 30):
        C = torch.randn(B, L, 32, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()
        K = torch.randn(B, L, 16, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()
        q = torch.randn(B, H, n, 32, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()
        qp = torch.randn(B, H, n, 16, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()
        full = torch.full((B,), L, device=DEVICE), torch.full((B,), n, device=DEVICE)
        o, lse = ref.dense(q, qp, C, K, 0.2)
        o_ref, lse_ref = ref.prefill(q, qp, C, K, *full, 0.2, 0, 0)
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        assert o.dtype == o_ref.dtype and rel(o, o_ref) < tol and rel(lse, lse_ref) < tol
        w = torch.randn(o.shape, generator=gen, dtype=dtype).to(DEVICE)
        got = torch.autograd.grad((o * w).sum() + lse.sum(), (q, qp, C, K))
        want = torch.autograd.grad((o_ref * w).sum() + lse_ref.sum(), (q, qp, C, K))
        assert all(rel(g, h) < 10 * tol for g, h in zip(got, want))


def test_bad_prefill_inputs_raise():
    gen = torch.Generator().manual_seed(8)
    fmt = PageFormat(4, 4)
    layer, bt, kv_len, C, K = filled_layer(fmt, [50], gen, sink=0, recent=0)
    q, qp = _inputs([50], 50, 4, fmt, gen)
    ql = torch.tensor([50], device=DEVICE)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        kernels.prefill(q, qp, C, K, kv_len, ql + 1, 0.1, 4, 8, layer, bt)
    with pytest.raises(TypeError, match="pages hold"):
        kernels.prefill(q, qp, C.float(), K.float(), kv_len, ql, 0.1, 4, 8, layer, bt)
    with pytest.raises(TypeError, match="C is torch.bfloat16 but K_P"):
        kernels.prefill(q, qp, C, K.float(), kv_len, ql, 0.1, 4, 8, layer, bt)
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.prefill(q, qp, C, K, kv_len, ql, 0.1, 4, 8, layer, bt + 10)
    with pytest.raises(ValueError, match=r"unknown prefill config keys \['block_h'\]"):
        kernels.prefill(q, qp, C, K, kv_len, ql, 0.1, 4, 8, layer, bt, "triton", dict(block_h=16))


@pytest.mark.slow
@pytest.mark.parametrize("cb", [4, 2])
def test_reference_exact_prefill_is_attention_over_the_unrounded_rows(cb):
    """Config ``exact``: float64 attention with each unprotected pair on s·(q − z) unrounded, the
    rule as above; and not the default function, whose rows are rounded to BF16
    (on these latents that moves the output by more than 1e-5)."""
    gen = torch.Generator().manual_seed(40 + cb)
    fmt = PageFormat(cb, 4)
    sink, recent, tau = 3, 20, 0.08
    kv, ql = [75, 40], [30, 40]
    layer, bt, kv_len, C, K = filled_layer(fmt, kv, gen, sink=0, recent=0)
    q, qp = _inputs(kv, 40, 4, fmt, gen)
    q_len = torch.tensor(ql, device=DEVICE)
    o, lse = ref.prefill(q, qp, C, K, kv_len, q_len, tau, sink, recent, layer, bt, dict(exact=True))
    o_paper, _ = ref.prefill(q, qp, C, K, kv_len, q_len, tau, sink, recent, layer, bt)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    for b, (L, m) in enumerate(zip(kv, ql)):
        Cb, Kb = C[b, :L].cpu().double(), K[b, :L].cpu().double()
        Ch, Kh = exact_rows(C[b, :L].cpu(), cb, torch.bfloat16), exact_rows(K[b, :L].cpu(), 4, torch.float32)
        t, j = torch.arange(L - m, L), torch.arange(L)
        keep = protected_pairs(t, j, sink, recent)
        qb, qpb = q[b, :, :m].cpu().to(fmt.dtype).double(), qp[b, :, :m].cpu().to(fmt.dtype).double()
        s = tau * torch.where(keep, qb @ Cb.T + qpb @ Kb.T, qb @ Ch.T + qpb @ Kh.T)
        s = s.masked_fill(j[None, :] > t[:, None], float("-inf"))
        p = torch.softmax(s, -1)
        assert rel(o[b, :, :m], (p * keep) @ Cb + (p * ~keep) @ Ch) < 1e-6
        assert rel(lse[b, :, :m], torch.logsumexp(s, -1)) < 1e-7
        assert (o[b, :, m:] == 0).all() and torch.isinf(lse[b, :, m:]).all()
    assert rel(o_paper, o) > 1e-5


EXACT_CASES = [
    (4, 4, 4, 512, [80, 45, 5], [80, 20, 0], 4, 40),
    (2, 4, 4, 64, [260], [260], 0, 15),  # key tiles with every pair, no pair and some pairs protected
    (4, 4, 4, 128, [70, 64], [70, 64], 0, 0),  # quantized, unprotected
]


@pytest.mark.slow
@pytest.mark.parametrize("cb, rb, H, d_c, kv, ql, sink, recent", EXACT_CASES, ids=lambda v: str(v))
def test_exact_prefill_kernel_matches_the_exact_reference(cb, rb, H, d_c, kv, ql, sink, recent):
    """The teacher-forced kernel with config ``exact`` (float32 rows as hi/lo BF16 pairs) against the
    float64 exact reference, every output written, within 3e-5 (the pair holds a row to about
    2^-17; the interpreter truncates each half); the default kernel on the same inputs sits more
    than ten times further away (its rows are rounded to BF16)."""
    gen = torch.Generator().manual_seed(7 * cb + H + sum(kv))
    fmt = PageFormat(cb, rb, d_c)
    layer, bt, kv_len, C, K = filled_layer(fmt, kv, gen, sink=0, recent=0)
    q_len = torch.tensor(ql, device=DEVICE)
    q, qp = _inputs(kv, max(ql), H, fmt, gen)
    args = (q, qp, C, K, kv_len, q_len, 0.06, sink, recent, layer, bt)
    o_ref, lse_ref = ref.prefill(*args, dict(exact=True))
    out = (torch.full(o_ref.shape, float("nan"), device=DEVICE), torch.full(lse_ref.shape, float("nan"), device=DEVICE))
    o, lse = kernels.prefill(*args, "triton", dict(exact=True), out=out)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel(o, o_ref) < 3e-5 and rel(lse, lse_ref) < 1e-5 and same_inf(lse, lse_ref)
    o_paper, _ = kernels.prefill(*args, "triton")
    assert rel(o_paper, o_ref) > 10 * rel(o, o_ref)


def _compiled(kernel) -> int:
    """Compiled variants of a Triton kernel on every device (its JIT cache)."""
    return sum(len(c[0]) for c in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.parametrize("bits", ["c16r16", "c4r4"])
def test_one_compilation_serves_every_batch_shape(bits):
    """An evaluation's batches differ in length and query rows; each shape must not compile the
    teacher-forced kernels again (each compile takes seconds on the H200)."""
    from quantmla.kernels import triton_prefill, triton_write

    spec = CacheSpec.parse(bits)
    kernels_used = (triton_prefill._prefill_kernel, triton_prefill._dequant_kernel, triton_write._write_kernel)

    def attend(B, L):
        gen = torch.Generator().manual_seed(L)
        C = torch.randn(B, L, 384, generator=gen).to(DEVICE, torch.bfloat16)
        K = torch.randn(B, L, 64, generator=gen).to(DEVICE, torch.bfloat16)
        q = torch.randn(B, 9, L, 384, generator=gen).to(DEVICE, torch.bfloat16)
        qp = torch.randn(B, 9, L, 64, generator=gen).to(DEVICE, torch.bfloat16)
        kernels.attend(q, qp, C, K, None, spec, 0.1, "triton")

    attend(32, 100)
    torch.cuda.synchronize()
    before = [_compiled(k) for k in kernels_used]
    for B, L in ((32, 64), (7, 1), (32, 129), (3, 250), (16, 200), (32, 96)):
        attend(B, L)
    torch.cuda.synchronize()
    assert [_compiled(k) for k in kernels_used] == before
