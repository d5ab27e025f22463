"""The harness attention: exact with quantization off, decode-faithful with it on."""

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from quantmla.attention import install, latent_layers, new_cache, uninstall
from quantmla.cache import CacheSpec, protected_pairs, protected_set
from quantmla.mla import adapters
from quantmla.models.tiny import FAMILIES, build, family_config


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("q_lora_rank", [None, 96])
def test_unquantized_harness_reproduces_native_logits(family, q_lora_rank):
    model, _ = build(family_config(family, q_lora_rank=q_lora_rank), seed=1)
    ids = torch.randint(3, 259, (2, 150))
    with torch.no_grad():
        ref = model(ids).logits
        install(model, CacheSpec())
        out = model(ids).logits
    assert len(latent_layers(model)) == model.config.num_hidden_layers
    assert (out - ref).abs().max().item() <= 1e-4
    uninstall(model)
    assert not latent_layers(model)


def test_state_dict_keys_unchanged(tiny):
    model, _ = tiny
    keys = list(model.state_dict())
    install(model, CacheSpec.parse("c4r4"))
    assert list(model.state_dict()) == keys


@pytest.mark.slow
def test_quantization_changes_logits_more_at_fewer_bits(tiny):
    model, _ = tiny
    ids = torch.randint(3, 259, (1, 300))
    with torch.no_grad():
        ref = model(ids).logits
        errs = []
        for name in ("c8r8", "c4r4", "c2r4"):
            install(model, CacheSpec.parse(name, protect=False))
            errs.append((model(ids).logits - ref).pow(2).mean().item())
    assert errs[0] < errs[1] < errs[2]


def _decode_logits(model, ids, prefill):
    cache = new_cache(model, ids.shape[0], ids.shape[1])
    outs = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
    for i in range(prefill, ids.shape[1]):
        outs.append(model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(outs, 1)


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["c4r4", "c2r4", "c3r8"])
@pytest.mark.parametrize("prefill", [1, 23])
def test_token_by_token_decode_matches_teacher_forced(tiny, bits, prefill):
    model, _ = tiny
    install(model, CacheSpec.parse(bits, sink=4, recent=16))
    ids = torch.randint(3, 259, (2, 70))
    with torch.no_grad():
        full = model(ids).logits
        step = _decode_logits(model, ids, prefill)
    assert (full - step).abs().max().item() <= 1e-4
    # and the protection mattered: without it the teacher-forced logits differ
    install(model, CacheSpec.parse(bits, protect=False))
    with torch.no_grad():
        assert (model(ids).logits - full).abs().max().item() > 1e-3


def test_left_padding_protects_each_request_own_tokens(tiny):
    model, tok = tiny
    install(model, CacheSpec.parse("c2r4", sink=4, recent=8))
    a = torch.randint(3, 259, (1, 40))
    pad = torch.full((1, 7), tok.pad_token_id)
    ids = torch.cat([torch.cat([pad, a[:, :33]], 1), a], 0)
    mask = torch.cat([torch.cat([torch.zeros(1, 7), torch.ones(1, 33)], 1), torch.ones(1, 40)], 0).long()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, position_ids=pos).logits
        alone = model(a[:, :33]).logits
    assert (batched[0, 7:] - alone[0]).abs().max().item() <= 1e-4


def test_protected_set_examples_from_spec():
    assert protected_set(1000) == list(range(4)) + list(range(872, 1000))
    assert protected_set(132) == list(range(132))
    assert protected_set(3) == [0, 1, 2]
    L = 1000
    k = torch.arange(L)
    decode_row = protected_pairs(torch.tensor([L - 1]), k, 4, 128)[0]
    assert decode_row.nonzero().flatten().tolist() == protected_set(L)


def test_absorbed_form_handles(tiny):
    """W_UK / W_UV views reproduce kv_b_proj's expansion (the paper's eq. 1)."""
    model, _ = tiny
    mla = adapters(model)[0]
    C = torch.randn(3, mla.dims.d_c)
    kv = mla.kv_b_proj(C).view(3, mla.dims.H, -1)
    k_nope = torch.einsum("nc,hdc->nhd", C, mla.W_UK())
    v = torch.einsum("nc,hvc->nhv", C, mla.W_UV())
    assert torch.allclose(kv[..., : mla.dims.d_nope], k_nope, atol=1e-5)
    assert torch.allclose(kv[..., mla.dims.d_nope :], v, atol=1e-5)
    assert mla.rope_pairs()[:2] == [(0, 1), (2, 3)]


GLUE = ("attention.py", "paged_cache.py", "kernels/__init__.py", "kernels/layout.py")


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values back to the host made by the harness's glue code (the
    attention module, the paged cache and the core's entry points). On a GPU each such read
    waits for the device to drain its queue; the backends' own code is not counted."""

    READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "nonzero", "cpu"}

    def __init__(self):
        super().__init__()
        self.sites = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS or (name == "__getitem__" and _boolean_index(args)):
            frame = sys._getframe(1)
            while frame and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            where = frame.f_code.co_filename.replace("\\", "/") if frame else ""
            if "/quantmla/" in where and where.endswith(GLUE):
                self.sites.append(f"{where.split('/quantmla/')[-1]}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


def _boolean_index(args) -> bool:
    """x[mask] with a boolean tensor: its result's size is read from the device."""
    index = args[1] if len(args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


def _padded_batch(layers: int):
    """A C4R4 tiny model of ``layers`` layers and two requests of 30 tokens, the first left-padded by 5
    (the mask is a real tensor, not None): model, ids, mask, positions."""
    model, tok = build(family_config(layers=layers))
    install(model, CacheSpec.parse("c4r4", sink=4, recent=8))
    ids = torch.randint(3, 259, (2, 30))
    ids[0, :5] = tok.pad_token_id
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return model, ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)


def _teacher_forced_reads(layers: int) -> list[str]:
    model, ids, mask, pos = _padded_batch(layers)
    with torch.no_grad(), HostReads() as reads:
        model(ids, attention_mask=mask, position_ids=pos)
    return reads.sites


def test_a_teacher_forced_pass_reads_the_device_once_whatever_the_depth():
    """Evaluation's forward pass: the padding mask is checked once for all layers, and the
    temporary pages are written and read without checks or boolean indexing that would wait for
    the GPU in every layer."""
    two, four = _teacher_forced_reads(2), _teacher_forced_reads(4)
    assert len(two) == len(four) <= 2, (two, four)


def _decode_step_reads(layers: int) -> list[str]:
    model, ids, mask, pos = _padded_batch(layers)
    cache = new_cache(model, 2, 40)
    with torch.no_grad():
        model(ids[:, :20], attention_mask=mask[:, :20], position_ids=pos[:, :20], past_key_values=cache)
        with HostReads() as reads:
            model(ids[:, 20:21], attention_mask=mask[:, :21], position_ids=pos[:, 20:21], past_key_values=cache)
    return reads.sites


def test_a_decode_step_reads_the_device_once_whatever_the_depth():
    """The mask check and the new-token counts are shared by all layers of a step, and the
    cache's own block table skips the core's device-reading checks: the host waits on the GPU a
    fixed number of times per generated token, not once or more per layer."""
    two, four = _decode_step_reads(2), _decode_step_reads(4)
    assert len(two) == len(four) <= 3, (two, four)


@pytest.mark.slow
def test_a_reset_cache_decodes_like_a_fresh_one(tiny):
    model, _ = tiny
    install(model, CacheSpec.parse("c4r4", sink=4, recent=8))
    first, second = torch.randint(3, 259, (2, 30)), torch.randint(3, 259, (2, 30))
    cache = new_cache(model, 2, 30)
    with torch.no_grad():
        model(first[:, :20], past_key_values=cache)
        model(first[:, 20:21], past_key_values=cache)
        cache.reset()
        again = [
            model(second[:, :20], past_key_values=cache).logits,
            model(second[:, 20:21], past_key_values=cache).logits,
        ]
        fresh_cache = new_cache(model, 2, 30)
        fresh = [model(second[:, :20], past_key_values=fresh_cache).logits]
        fresh.append(model(second[:, 20:21], past_key_values=fresh_cache).logits)
    assert cache.get_seq_length() == 21
    assert all(torch.equal(a, b) for a, b in zip(again, fresh))
