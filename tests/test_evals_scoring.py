"""Batched log-likelihood scoring answers as lm-eval's own loop does (quantmla.evals.scoring)."""

import os
from contextlib import contextmanager

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from quantmla import attention  # noqa: E402
from quantmla.cache import CacheSpec  # noqa: E402
from quantmla.evals.lm import QuantMLALM, language_model  # noqa: E402
from quantmla.models.tiny import build  # noqa: E402

TEXT = "The key-value cache keeps what earlier tokens contributed, so decoding does not recompute it. "
PAIRS = (
    # multiple choice: four one-token answers after one context share a forward row
    [(TEXT + "Question: which letter?\nAnswer:", f" {x}") for x in "ABCD"]
    # the same context with a longer continuation: a row of its own
    + [(TEXT + "Question: which letter?\nAnswer:", " A or B")]
    # multi-token continuations of various lengths, short and long contexts
    + [("The quick brown fox", " jumps over the lazy dog"), (TEXT * 4, " The cache is quantized."), ("Hi", "!")]
    # longer than max_length: cut from the left
    + [(TEXT * 12, " so the window moves.")]
)


def _answers(lm, pairs=PAIRS):
    return lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])


def _same(ours, theirs, dtype):
    """Equal greedy flags; log-likelihoods equal up to the summation order of a multi-token answer:
    within a few units in the last place of ``dtype`` (bfloat16: accumulated in float32, then rounded)."""
    assert [g for _, g in ours] == [g for _, g in theirs]
    ulp = torch.finfo(dtype).eps
    for (a, _), (b, _) in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 4 * ulp * abs(b), (a, b)
    return sum(a == b for (a, _), (b, _) in zip(ours, theirs, strict=True))


def _both(lm, monkeypatch):
    """(lm-eval's answers, the batched answers, the batched pass's forward shapes)."""
    from lm_eval.models.huggingface import HFLM

    own = []
    loop = HFLM._loglikelihood_tokens
    monkeypatch.setattr(HFLM, "_loglikelihood_tokens", lambda *a, **k: own.append(1) or loop(*a, **k))
    lm.batched_scoring = False
    theirs = _answers(lm)
    assert own  # lm-eval's loop answered
    own.clear()
    lm.batched_scoring = True
    calls = []
    call = lm._model_call
    lm._model_call = lambda inps, *a, **k: calls.append(inps.shape) or call(inps, *a, **k)
    ours = _answers(lm)
    assert not own  # and now it did not
    return theirs, ours, calls


@pytest.mark.parametrize("bits", [None, "c16r16", "c2r4"], ids=["native", "c16r16", "c2r4"])
def test_answers_equal_lm_evals_own_loop(bits, monkeypatch):
    model, tok = build()
    if bits:
        attention.install(model, CacheSpec.parse(bits))
    lm = language_model(model, tok, batch_size=3, max_length=512)
    theirs, ours, calls = _both(lm, monkeypatch)
    assert len(ours) == len(PAIRS)
    exact = _same(ours, theirs, torch.float32)
    assert exact >= len(PAIRS) - 3  # one-token answers and most others to the last bit
    assert sum(s[0] for s in calls) == len(PAIRS) - 3  # the four one-token answers took one row
    assert max(s[1] for s in calls) == 512  # the long request was cut to the model's window
    assert len({a[0] for a in ours}) == len(ours)  # no answer copied from another


def test_greedy_flag_and_sum_are_per_answer():
    """An answer the model would have produced itself is greedy; its log-likelihood is the sum of
    its tokens' log-probabilities, checked in float64 from the model's own logits."""
    model, tok = build()
    lm = language_model(model, tok, batch_size=4)
    context = tok.encode(TEXT)
    with torch.no_grad():
        ids = torch.tensor([context])
        greedy = []
        for _ in range(3):  # three greedy tokens, one at a time
            nxt = model(ids).logits[0, -1].argmax()
            greedy.append(int(nxt))
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        other = [(greedy[0] + 1) % 256, *greedy[1:]]
        n, want = len(context), []
        for x in (greedy, other):
            logp = torch.log_softmax(model(torch.tensor([context + x])).logits[0].double(), dim=-1)
            want.append(sum(float(logp[n - 1 + j, t]) for j, t in enumerate(x)))
    (ll_g, is_g), (ll_o, is_o) = lm._loglikelihood_tokens([((None, None), context, x) for x in (greedy, other)])
    assert is_g and not is_o
    assert abs(ll_g - want[0]) < 1e-4 and abs(ll_o - want[1]) < 1e-4
    assert ll_g > ll_o


def test_a_batch_out_of_gpu_memory_is_scored_in_halves(caplog):
    """A forward that runs out of memory (another run's peak on a shared GPU) is retried as two
    halves, down to one row, with the answers of a smaller batch; a single row out of memory still fails."""
    model, tok = build()
    attention.install(model, CacheSpec.parse("c4r4"))
    lm = language_model(model, tok, batch_size=8, max_length=512)
    want = _answers(lm)
    rows = []
    call = lm._model_call

    def tight(inps, *a, **k):
        rows.append(inps.shape[0])
        if inps.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return call(inps, *a, **k)

    lm._model_call = tight
    with caplog.at_level("WARNING", logger="quantmla"):
        got = _answers(lm)
    _same(got, want, torch.float32)  # as at a smaller batch size: the padding differs
    assert rows[0] > 2 and sum(r for r in rows if r <= 2) == len(PAIRS) - 3  # every row scored once
    assert any("out of GPU memory scoring" in m for m in caplog.messages)
    lm._model_call = lambda inps, *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("injected"))
    with pytest.raises(torch.OutOfMemoryError):
        _answers(lm)


def test_the_output_layer_runs_on_the_continuation_positions_only():
    """The output layer sees only the positions some request's continuation is predicted from, and
    the answers equal those scored from the full logits to the last bit."""
    model, tok = build()
    attention.install(model, CacheSpec.parse("c4r4"))
    lm = language_model(model, tok, batch_size=8, max_length=512)
    head = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: head.append(tuple(args[0].shape[:2])))
    try:
        kept, kept_head = _answers(lm), list(head)
        head.clear()
        lm.all_logits = True  # every position, then sliced: as for a model without logits_to_keep
        full, full_head = _answers(lm), list(head)
    finally:
        hook.remove()
    assert kept == full
    continuation_tokens = sum(len(tok.encode(c)) for _, c in PAIRS)
    assert sum(p for _, p in kept_head) <= continuation_tokens  # positions per pass, at most one per token
    assert max(p for _, p in full_head) == 512  # the full logits: every position of the longest row
    assert 4 * sum(r * p for r, p in kept_head) < sum(r * p for r, p in full_head)


def test_batches_by_tokens_take_many_short_requests_and_few_long_ones():
    """With ``scoring_tokens``, every forward pass holds at most that many tokens (rows x its longest
    input) or a single row, longest requests first; the answers are those of fixed-size batches."""
    model, tok = build()
    attention.install(model, CacheSpec.parse("c4r4"))
    lm = language_model(model, tok, batch_size=2, max_length=512)
    want = _answers(lm)
    budget = 600
    lm = language_model(model, tok, batch_size=2, max_length=512, scoring_tokens=budget)
    shapes = []
    call = lm._model_call
    lm._model_call = lambda inps, *a, **k: shapes.append(tuple(inps.shape)) or call(inps, *a, **k)
    _same(_answers(lm), want, torch.float32)
    assert all(r * n <= budget or r == 1 for r, n in shapes)
    assert shapes[0] == (1, 512)  # the cut request: one row
    assert max(r for r, _ in shapes) > 2  # short requests more to a batch than batch_size
    assert [n for _, n in shapes] == sorted((n for _, n in shapes), reverse=True)
    assert sum(r for r, _ in shapes) == len(PAIRS) - 3


def test_batched_scoring_and_scoring_tokens_are_checked():
    model, tok = build()
    attention.install(model, CacheSpec.parse("c4r4"))
    with pytest.raises(ValueError, match="batched_scoring must be true or false"):
        QuantMLALM(model, tok, batched_scoring="yes")
    with pytest.raises(ValueError, match="all_logits must be true or false"):
        QuantMLALM(model, tok, all_logits="yes")
    for bad in (0, -5, "1024", True):
        with pytest.raises(ValueError, match="scoring_tokens must be a positive integer or None"):
            QuantMLALM(model, tok, scoring_tokens=bad)
        with pytest.raises(ValueError, match="share_prefix must be a positive integer or None"):
            QuantMLALM(model, tok, scoring_tokens=1024, share_prefix=bad)
    with pytest.raises(ValueError, match="share_prefix batches by tokens: set scoring_tokens too"):
        QuantMLALM(model, tok, share_prefix=64)


# Two "subjects" of MMLU's shape: a long shared few-shot prefix (longer than 4 sink + 128 recent tokens,
# so the protection rule crosses from prefix to question), then per question four one-token answers
# sharing a row and one longer answer; and requests that share nothing.
OTHER = "Latent attention caches one compressed vector per token and a small rotary key beside it. "
SHOTS = [TEXT * 3 + "Subject one.\n\n", OTHER * 3 + "Subject two.\n\n"]
SHARING = [
    (shots + f"Question {q}: {w}?\nAnswer:", answer)
    for shots in SHOTS
    for q, w in enumerate(("which letter", "what is cached", "why quantize", "how many bits"))
    for answer in [" A", " B", " C", " D", " the latent"]
] + [("The quick brown fox", " jumps over the lazy dog"), ("Hi", "!"), (TEXT, " The end.")]


@contextmanager
def _pass_shapes(model):
    """The (rows, tokens) of every forward pass of ``model``'s decoder while the block runs."""
    shapes = []
    hook = model.model.register_forward_pre_hook(
        lambda m, args, kw: shapes.append(tuple(kw.get("input_ids", args[0] if args else None).shape)),
        with_kwargs=True,
    )
    try:
        yield shapes
    finally:
        hook.remove()


@pytest.mark.parametrize(
    "bits, protect", [(None, True), ("c2r4", True), ("c2r4", False)], ids=["native", "c2r4", "c2r4-unprotected"]
)
def test_rows_sharing_a_prefix_run_it_once_with_the_answers_of_whole_rows(bits, protect):
    """``share_prefix``: the subjects' prefixes run once, together in one pass, and each subject's
    questions run on top of its own; in float64 every answer equals whole-row scoring's to rounding,
    so quantization and the protection rule see the same tokens at the same positions across the
    prefix boundary, and the shorter prefix nothing of the padding after it."""
    model, tok = build(dtype=torch.float64)
    if bits:
        attention.install(model, CacheSpec.parse(bits, protect=protect))
    whole = language_model(model, tok, batch_size=4, max_length=512, scoring_tokens=2048)
    want = _answers(whole, SHARING)
    lm = language_model(model, tok, batch_size=4, max_length=512, scoring_tokens=2048, share_prefix=64)
    kept = []  # the forward passes run when each answer was handed to lm-eval's cache
    with _pass_shapes(model) as shapes:
        lm.cache_hook.add_partial = lambda *a: kept.append(len(shapes))
        got = _answers(lm, SHARING)
    assert len(kept) == len(SHARING) and kept[0] < len(shapes)  # kept as each batch ends, not at the end
    assert [g for _, g in got] == [g for _, g in want]
    for (a, _), (b, _) in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (a, b)
    prefixes = sorted(len(tok.encode(x)) for x in SHOTS)
    assert prefixes[1] - prefixes[0] > 8  # the padding of the shorter prefix is not a token or two
    ((rows, n),) = [(r, n) for r, n in shapes if n >= prefixes[0]]  # both prefixes in one pass, once
    assert rows == 2 and prefixes[1] <= n < prefixes[1] + 16  # the common prefix, not a whole question
    # the questions' rows after their prefix: a few tokens each, not the prefix again
    rows_after = [(r, n) for r, n in shapes if n < 40 and r > 1]
    assert sum(r for r, _ in rows_after) >= 2 * 4 * 2  # 4 questions x 2 rows (ABCD, the latent) x 2 subjects
    assert sum(r * n for r, n in shapes) < 0.5 * sum(len(tok.encode(c + a)) for c, a in SHARING)


def test_prefixes_beyond_one_token_batch_run_in_several_passes():
    """With a token budget that holds one prefix, each runs in a pass of its own; answers unchanged."""
    model, tok = build(dtype=torch.float64)
    attention.install(model, CacheSpec.parse("c2r4"))
    want = _answers(language_model(model, tok, batch_size=4, max_length=512, scoring_tokens=2048), SHARING)
    budget = max(len(tok.encode(x)) for x in SHOTS) + 20
    lm = language_model(model, tok, batch_size=4, max_length=512, scoring_tokens=budget, share_prefix=64)
    with _pass_shapes(model) as shapes:
        got = _answers(lm, SHARING)
    assert sorted(r for r, n in shapes if n >= min(len(tok.encode(x)) for x in SHOTS)) == [1, 1]
    assert [g for _, g in got] == [g for _, g in want]
    for (a, _), (b, _) in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (a, b)


def test_prefix_groups_hold_rows_sharing_at_least_the_minimum():
    from quantmla.evals.scoring import prefix_groups

    a = list(range(100))
    rows = [a + [7, 8, 9], [5, 5], a + [7, 1], a[:70] + [3, 3, 3], a + [2]]
    ends = [len(x) - 1 for x in rows]
    groups = prefix_groups(rows, ends, 64)
    by_rows = {tuple(sorted(g)): p for p, g in groups}
    assert by_rows == {(0, 2, 3, 4): 70, (1,): 0}  # a shared prefix of 70 tokens; [5, 5] alone
    # a row's prefix stops before the position predicting its continuation
    assert dict((tuple(sorted(g)), p) for p, g in prefix_groups(rows, [101, 1, 101, 60, 100], 64)) == {
        (0, 2, 4): 100,
        (3,): 0,
        (1,): 0,
    }
    assert prefix_groups(rows, ends, 200) == [(0, [i]) for i in sorted(range(5), key=lambda i: rows[i])]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [None, "c4r4"], ids=["native", "c4r4"])
@pytest.mark.parametrize("scoring_tokens", [None, 600], ids=["rows", "tokens"])
def test_answers_equal_lm_evals_own_loop_in_bf16_on_the_gpu(bits, scoring_tokens, monkeypatch):
    model, tok = build(dtype=torch.bfloat16)
    model.to("cuda")
    if bits:
        attention.install(model, CacheSpec.parse(bits))
    lm = language_model(model, tok, batch_size=3, max_length=512, scoring_tokens=scoring_tokens)
    theirs, ours, _ = _both(lm, monkeypatch)
    exact = _same(ours, theirs, torch.bfloat16)
    assert exact >= len(PAIRS) - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sharing_a_prefix_answers_as_whole_rows_in_bf16_on_the_gpu():
    """In bfloat16 on the GPU the prefix's latents come from a one-row product instead of the batch's,
    so a quantized code may round the other way: answers agree to bf16 noise, greedy flags almost all."""
    model, tok = build(dtype=torch.bfloat16)
    model.to("cuda")
    attention.install(model, CacheSpec.parse("c4r4"))
    want = _answers(language_model(model, tok, batch_size=4, max_length=512, scoring_tokens=2048), SHARING)
    lm = language_model(model, tok, batch_size=4, max_length=512, scoring_tokens=2048, share_prefix=64)
    got = _answers(lm, SHARING)
    assert sum(a[1] != b[1] for a, b in zip(got, want, strict=True)) <= 2
    for (a, _), (b, _) in zip(got, want, strict=True):
        assert abs(a - b) <= 0.02 * abs(b) + 0.05, (a, b)
