"""End to end on ``tiny``: perplexity and greedy generation through the core against independent references.

The independent reference is written here from the paper's equations in float64: the skeleton's
quantize–dequantize (:meth:`CacheSpec.qdq_content` / ``qdq_rope``) of the whole cache and
the decode-faithful per-pair protection (:func:`quantmla.cache.protected_pairs`), one
softmax, no pages and no kernels. It replaces ``attend`` on the installed layers and runs
generation with transformers' own DynamicCache.
"""

import types

import pytest
import torch
from kernels_helpers import DEVICE, exact_rows, rel

from quantmla import attention
from quantmla.cache import CacheSpec, protected_pairs
from quantmla.evals import EvalContext
from quantmla.evals.ppl import Perplexity
from quantmla.models.tiny import build

pytestmark = pytest.mark.slow  # minutes on two cores: the full suite only (scripts/test --fast skips it)

PROMPT = "The history of the city begins with a small settlement on the river, where traders met"


def spec_attend(self, q_lat, q_pe, C, K_P, mask):
    """The paper's eq. 1 with CxRy QDQ and per-pair BF16 protection, float64 (mask: None or padding)."""
    spec = self.spec
    B, H, n, _ = q_lat.shape
    L = C.shape[2]
    valid = attention.key_validity(mask, B, n, L, C.device)
    valid = torch.ones(B, L, dtype=torch.bool, device=C.device) if valid is None else valid
    k_index = valid.long().cumsum(-1) - 1
    Cf, Kf = C[:, 0].double(), K_P[:, 0].double()
    Ch, Kh = spec.qdq_content(C[:, 0]).double(), spec.qdq_rope(K_P[:, 0]).double()
    q, qp = q_lat.to(C.dtype).double(), q_pe.to(C.dtype).double()
    keep = protected_pairs(k_index[:, L - n :], k_index, spec.sink, spec.recent).unsqueeze(1)
    if not (spec.quantized and spec.protect):
        keep = torch.full_like(keep, not spec.quantized)
    s_bf = q @ Cf.transpose(1, 2).unsqueeze(1) + qp @ Kf.transpose(1, 2).unsqueeze(1)
    s_q = q @ Ch.transpose(1, 2).unsqueeze(1) + qp @ Kh.transpose(1, 2).unsqueeze(1)
    s = self.mla.tau * torch.where(keep, s_bf, s_q)
    cols = torch.arange(L, device=C.device)
    allowed = (cols[None, :] <= cols[L - n :, None]) & valid[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)))
    o = (p * keep) @ Cf.unsqueeze(1) + (p * ~keep) @ Ch.unsqueeze(1)
    return o.float(), lse.float()


def _model(spec, reference=False, dtype=torch.float32):
    model, tok = build(dtype=dtype)
    model = model.to(DEVICE)
    for layer in attention.install(model, spec):
        if reference:
            layer.attend = types.MethodType(spec_attend, layer)
    return model, tok


def _ppl(model, tok):
    ev = Perplexity(seq_len=256, max_tokens=512, batch_size=2)
    return ev.run(model, tok, EvalContext(progress=False))["ppl"]


def _greedy(model, ids, cache=None, mask=None, new=64):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=mask)
    if cache is not None:
        kw[attention.cache_keyword()] = cache
    with torch.no_grad():
        return model.generate(ids, **kw)[:, ids.shape[1] :]


SPECS = [CacheSpec(4, 4, sink=4, recent=16), CacheSpec(2, 4, sink=4, recent=16), CacheSpec(16, 16)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_ppl_and_greedy_generation_match_the_spec_reference(spec):
    core, tok = _model(spec)
    want, _ = _model(spec, reference=True)
    p_core, p_ref = _ppl(core, tok), _ppl(want, tok)
    assert abs(p_core / p_ref - 1) < 1e-3, (p_core, p_ref)
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(DEVICE)
    got = _greedy(core, ids, attention.new_cache(core, 1, ids.shape[1] + 64))
    assert torch.equal(got, _greedy(want, ids))


def test_bf16_model_runs_through_the_core():
    """A BF16 model: float32 absorbed queries, BF16 caches and protection rows, CxRy pages."""
    spec = CacheSpec(4, 4, sink=4, recent=16)
    core, tok = _model(spec, dtype=torch.bfloat16)
    want, _ = _model(spec, reference=True, dtype=torch.bfloat16)
    assert abs(_ppl(core, tok) / _ppl(want, tok) - 1) < 1e-3
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(DEVICE)
    got = _greedy(core, ids, attention.new_cache(core, 1, 200), new=16)
    assert torch.equal(got, _greedy(want, ids, new=16))


def test_bf16_cache_matches_native_attention():
    core, tok = _model(CacheSpec(16, 16))
    native, _ = build()
    native = native.to(DEVICE)
    assert abs(_ppl(core, tok) / _ppl(native, tok) - 1) < 1e-3
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(DEVICE)
    assert torch.equal(_greedy(core, ids, attention.new_cache(core, 1, 200)), _greedy(native, ids))


def test_left_padded_batch_generates_like_single_requests():
    spec = CacheSpec(4, 4, sink=4, recent=16)
    core, tok = _model(spec)
    a = tok(PROMPT, return_tensors="pt").input_ids[0]
    b = tok("A short one", return_tensors="pt").input_ids[0]
    ids = torch.full((2, len(a)), tok.pad_token_id)
    ids[0], ids[1, len(a) - len(b) :] = a, b
    mask = (ids != tok.pad_token_id).long()
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    batch = _greedy(core, ids, attention.new_cache(core, 2, 100), mask, new=24)
    for row, x in ((0, a), (1, b)):
        x = x[None].to(DEVICE)
        assert torch.equal(batch[row], _greedy(core, x, attention.new_cache(core, 1, 100), new=24)[0])


def test_generation_through_the_triton_kernels():
    """The paged cache with the Triton writer and decode kernel (interpreter on CPU) gives the same tokens."""
    spec = CacheSpec(4, 4, sink=4, recent=16)
    core, tok = _model(spec)
    attention.install(core, spec, backend="reference")
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(DEVICE)
    n = 8 if DEVICE.type == "cpu" else 64
    ref_tokens = _greedy(core, ids, attention.new_cache(core, 1, 200), new=n)
    attention.install(core, spec, backend="triton")
    assert torch.equal(_greedy(core, ids, attention.new_cache(core, 1, 200), new=n), ref_tokens)


def test_masks_the_core_cannot_express_raise():
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)  # not causal
    with pytest.raises(ValueError, match="not causal"):
        attention.key_validity(mask, 1, 4, 4, "cpu")


@pytest.mark.parametrize("cb", [4, 2])
def test_exact_spec_reaches_both_steps_of_the_paged_cache(cb):
    """``CacheSpec(exact=True)`` through the paged cache: a 40-token prompt (teacher-forced kernel)
    then three decode steps (on a Hopper GPU the exact decode kernel: 16 heads, d_c 512, BF16),
    each query's output against float64 attention written here over the unrounded s·(q − z) with
    the decode-faithful rule; the default spec on the same tokens sits measurably further away."""
    from quantmla.paged_cache import LatentCache

    gen = torch.Generator().manual_seed(cb)
    B, H, n, steps, tau = 2, 16, 40, 3, 0.06
    L = n + steps
    C = (torch.randn(B, 1, L, 512, generator=gen) + 0.3).to(torch.bfloat16).to(DEVICE)
    K = torch.randn(B, 1, L, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = (torch.randn(B, H, L, 512, generator=gen) * 0.3).to(DEVICE)
    qp = torch.randn(B, H, L, 64, generator=gen).to(DEVICE)
    Ch = torch.stack([exact_rows(C[b, 0].cpu(), cb, torch.bfloat16) for b in range(B)])
    Kh = torch.stack([exact_rows(K[b, 0].cpu(), 4, torch.float32) for b in range(B)])
    Cf, Kf = C[:, 0].cpu().double(), K[:, 0].cpu().double()
    t, j = torch.arange(L), torch.arange(L)
    keep = protected_pairs(t, j, 4, 16)
    qd, qpd = q.cpu().to(torch.bfloat16).double(), qp.cpu().to(torch.bfloat16).double()
    s_bf = qd @ Cf.transpose(1, 2).unsqueeze(1) + qpd @ Kf.transpose(1, 2).unsqueeze(1)
    s_q = qd @ Ch.transpose(1, 2).unsqueeze(1) + qpd @ Kh.transpose(1, 2).unsqueeze(1)
    s = (tau * torch.where(keep, s_bf, s_q)).masked_fill(j[None, :] > t[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    want = (p * keep) @ Cf.unsqueeze(1) + (p * ~keep) @ Ch.unsqueeze(1)
    errs = {}
    for exact in (True, False):
        spec = CacheSpec(cb, 4, sink=4, recent=16, exact=exact)
        cache = LatentCache(1, B, L)
        outs = [cache.attend(0, spec, q[:, :, :n], qp[:, :, :n], C[:, :, :n], K[:, :, :n], None, tau)]
        for i in range(n, L):
            sl = slice(i, i + 1)
            outs.append(cache.attend(0, spec, q[:, :, sl], qp[:, :, sl], C[:, :, sl], K[:, :, sl], None, tau))
        got = torch.cat(outs, 2)
        errs[exact] = (rel(got[:, :, :n], want[:, :, :n]), rel(got[:, :, n:], want[:, :, n:]))
    # prompt: hi/lo BF16 rows (float64 on the CPU); decode: P in FP16 on the kernel
    assert errs[True][0] < 3e-5 and errs[True][1] < 1e-3, errs
    assert errs[False][0] > 10 * errs[True][0], errs
