"""Greedy generation with a fixed-shape decode step (:mod:`quantmla.generate`) against
``model.generate``'s own loop over the same paged cache, and the fixed-shape step's contract.

On a CPU every step runs eagerly and the tokens must equal ``generate``'s exactly (the torch
reference ignores the decode plan). On a GPU the graph replay must give the eager step's logits
bit for bit (same kernels, same plan), and ``generate``'s within the split plan's rounding.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quantmla import attention
from quantmla.cache import CacheSpec
from quantmla.generate import DecodeStep, capture_refusal, greedy
from quantmla.models.tiny import build

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPEC = CacheSpec(4, 4, sink=4, recent=16)
PROMPTS = ["The history of the city begins with a small settlement", "A short one", "Traders met on the river where"]


def _model(spec=SPEC, dtype=torch.float32):
    model, tok = build(dtype=dtype)
    model = model.to(DEVICE)
    attention.install(model, spec)
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    return model, tok, enc.input_ids.to(DEVICE), enc.attention_mask.to(DEVICE)


def _generate(model, tok, ids, mask, new=24, **kw):
    cache = attention.new_cache(model, ids.shape[0], ids.shape[1] + new)
    kw = {"do_sample": False} | kw
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=tok.pad_token_id,
                              **{attention.cache_keyword(): cache}, **kw)  # fmt: skip


@pytest.mark.parametrize("spec", [SPEC, CacheSpec(2, 4, sink=4, recent=16), CacheSpec(16, 16)], ids=lambda s: s.name)
def test_greedy_gives_generates_tokens_on_a_left_padded_batch(spec):
    model, tok, ids, mask = _model(spec)
    want = _generate(model, tok, ids, mask)
    got = _generate(model, tok, ids, mask, custom_generate=greedy)
    assert got.shape == want.shape == (3, ids.shape[1] + 24)
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    else:  # the decode plan for the longest possible request may round differently
        assert (got == want).float().mean() > 0.9


def test_rows_that_stop_are_padded_as_generate_pads_them():
    """An end-of-sequence token that the first row emits at its fourth step: that row is padded
    from there, the others go on, and the loop ends at the limit as ``generate``'s does."""
    model, tok, ids, mask = _model()
    first = _generate(model, tok, ids, mask)
    eos = int(first[0, ids.shape[1] + 3])
    want = _generate(model, tok, ids, mask, eos_token_id=eos)
    got = _generate(model, tok, ids, mask, eos_token_id=eos, custom_generate=greedy)
    assert (want[0, ids.shape[1] + 4 :] == tok.pad_token_id).all()
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    assert (got[0, ids.shape[1] + 4 :] == tok.pad_token_id).all()


def test_lm_eval_stop_strings_end_the_loop_where_generate_ends():
    """lm-eval's stop-sequence criteria (decoded text, all rows) through ``greedy``: same output."""
    from lm_eval.models.utils_hf import stop_sequences_criteria

    model, tok, ids, mask = _model()
    text = tok.decode(_generate(model, tok, ids, mask)[0, ids.shape[1] + 5 : ids.shape[1] + 7])
    outs = []
    for custom in ({}, {"custom_generate": greedy}):
        stop = stop_sequences_criteria(tok, [text], ids.shape[1], ids.shape[0])
        outs.append(_generate(model, tok, ids, mask, stopping_criteria=stop, **custom))
    assert outs[0].shape[1] < ids.shape[1] + 24  # the stop string ended it early
    if DEVICE.type == "cpu":
        assert torch.equal(outs[1], outs[0])


class _DeviceReads(TorchDispatchMode):
    """Operators whose result the host must read (a CUDA graph cannot hold them)."""

    READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::item"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _prefilled(model, ids, mask, capacity):
    cache = attention.new_cache(model, ids.shape[0], capacity)
    pos = mask.long().cumsum(-1) - 1
    pos.masked_fill_(mask == 0, 1)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **{attention.cache_keyword(): cache})
    cache.reserve(capacity)
    return cache, pos[:, -1:] + 1, out.logits[:, -1].argmax(-1)


def test_a_reserved_decode_step_reads_nothing_back_and_changes_no_host_state():
    """The step a graph captures: no operator whose value the host reads, and the host's counts move
    only in ``advance`` (a replay runs no Python)."""
    model, tok, ids, mask = _model()
    attention.install(model, SPEC, backend="triton")  # the kernels a GPU runs (on a CPU: Triton's interpreter)
    cache, positions, tokens = _prefilled(model, ids, mask, ids.shape[1] + 8)
    step = DecodeStep(model, cache, positions, graphs=False)
    columns = [layer.columns for layer in cache.layers]
    lengths = [list(layer.lengths) for layer in cache.layers]
    with torch.no_grad(), _DeviceReads() as reads:
        step._forward()
    assert reads.seen == []
    assert [layer.columns for layer in cache.layers] == columns
    assert [layer.lengths for layer in cache.layers] == lengths
    assert torch.equal(step.positions, positions + 1)
    real = mask.sum(1)
    for layer in cache.layers:
        assert torch.equal(layer.lengths_dev.cpu(), (real + 1).cpu())  # one more token per request, in place


def test_reserve_checks_its_use():
    model, tok, ids, mask = _model()
    cache = attention.new_cache(model, 3, ids.shape[1] + 8)
    with pytest.raises(ValueError, match="follows the prompt's prefill"):
        cache.reserve(ids.shape[1] + 8)
    cache, positions, _ = _prefilled(model, ids, mask, ids.shape[1] + 8)
    with pytest.raises(ValueError, match="one new token for each"), torch.no_grad():  # two tokens at once
        model(ids[:, :2], position_ids=positions.expand(3, 2), use_cache=True, **{attention.cache_keyword(): cache})
    fresh, _, _ = _prefilled(model, ids, mask, ids.shape[1] + 8)
    fresh.static = None
    with pytest.raises(ValueError, match="already holds"):
        fresh.reserve(int(mask.sum(1).max()))


def test_greedy_refuses_what_it_does_not_do():
    model, tok, ids, mask = _model()
    with pytest.raises(ValueError, match="no sampling"):
        _generate(model, tok, ids, mask, custom_generate=greedy, do_sample=True)
    with pytest.raises(TypeError, match="paged latent cache"), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, custom_generate=greedy)


def test_capture_refusals_say_why():
    model, tok, ids, mask = _model()
    assert "not CUDA" in capture_refusal(model, torch.device("cpu"))
    plain, _ = build()
    assert "no LatentAttention" in capture_refusal(plain.to(DEVICE), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [SPEC, CacheSpec(2, 4, sink=4, recent=16), CacheSpec(16, 16)], ids=lambda s: s.name)
def test_graph_replays_give_the_eager_steps_logits(spec):
    """The captured step replayed 12 times against the same step run eagerly on an identical cache:
    the same logits bit for bit, and within 1e-3 of ``generate``'s own (unreserved) decode."""
    model, tok, ids, mask = _model(spec, dtype=torch.bfloat16)
    capacity = ids.shape[1] + 16
    runs = {}
    for graphs in (True, False):
        cache, positions, tokens = _prefilled(model, ids, mask, capacity)
        step = DecodeStep(model, cache, positions, graphs=graphs)
        logits = []
        with torch.no_grad():
            for _ in range(12):
                out = step(tokens)
                logits.append(out)
                tokens = out.argmax(-1)
        runs[graphs] = (step, torch.stack(logits))
    graphed, eager = runs[True][0], runs[False][0]
    assert graphed.eager_reason is None and graphed.graph is not None
    assert eager.graph is None
    assert torch.equal(runs[True][1], runs[False][1])
    want = _generate(model, tok, ids, mask, new=13, output_logits=True, return_dict_in_generate=True)
    dyn = torch.stack(want.logits[1:]).float()
    rel = (runs[True][1] - dyn).norm() / dyn.norm()
    assert rel < 1e-2, rel
