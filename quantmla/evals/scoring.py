"""Log-likelihood scoring that reads each batch's answers back from the device once.

lm-eval's ``HFLM._loglikelihood_tokens`` answers the requests of a batch one at a time: per request
it copies the continuation to the device, slices, takes an argmax, compares, gathers and sums, and
reads the sum and the comparison back, two waits for the device per request; it also takes the
log-softmax of every position of the batch, where only the continuations' are needed. For a small
model the device work of a request is microseconds. Alone on an H100 the loop was a fifth of the
scoring time (HellaSwag and ARC-Easy at C4R4, ``bench/eval_speed.py``: 26.2 s with it, 20.8 s
without); with nine runs sharing the GPU, where every wait also waits for the other processes'
work, HellaSwag went from about 40 to 130-220 requests/s per run (docs/reproduction.md).

:class:`BatchedScoring` keeps lm-eval's order, batches, context grouping (one forward row for the
answer choices that share a context, ``logits_cache``), truncation and answers, and does the
per-request work for the whole batch at once: one copy of the inputs to the device, the output
layer (``logits_to_keep``) and the log-softmax at the continuation positions only, one read-back
of every answer. The log-softmax is taken per position in the same dtype as lm-eval's and each
answer's sum is reduced in that dtype, so the answers equal lm-eval's up to the order in which a
multi-token answer's log-probabilities are added: a float32 sum may differ in its last bits, a
bfloat16 one (accumulated in float32, then rounded) rarely by its last bit; greedy flags are equal
(``tests/test_evals_scoring.py`` compares both with lm-eval's own loop). One more difference,
where lm-eval's own result is wrong: when requests that share a forward row have continuations of
different lengths, lm-eval gathers the shorter one's log-probabilities from the start of the longer
one's positions, and here from its own (the last ones, where lm-eval also checks its greedy match). A group of one-token continuations,
the only kind the multiple-choice tasks make, is the same either way.

``share_prefix`` scores a prefix that many requests repeat once: MMLU 5-shot's rows repeat their
subject's 5-shot prefix, 85 % of its 10.1M tokens (docs/reproduction.md). Rows that share at least
``share_prefix`` leading tokens (after truncation, the tokens actually scored) run their common prefix
once, through a transformers ``DynamicCache`` (several groups' prefixes right-padded in one pass, each
group's cache cut at its own length); their suffixes then run on top of it, right-padded, the cache
expanded to the batch. The installed attention attends a step's queries over the cached and new
latents (:func:`quantmla.kernels.attend`, queries the last columns), so quantization (per token) and
the decode-faithful protection rule (per query and key position) are those of the whole row; only the
shapes of the products change, so answers equal whole-row scoring up to rounding
(``tests/test_evals_scoring.py``). The prefix ends before the position that predicts a row's first
continuation token.
"""

from __future__ import annotations

import inspect
import logging
from os.path import commonprefix

import torch
import torch.nn.functional as F

from quantmla.schema import positive_int

log = logging.getLogger("quantmla")

_NO_LOGITS = torch.empty(1, 0, 0)  # what lm-eval's Collator.get_cache expands for a context group


def in_halves_on_oom(run, n: int, doing: str, unit: str) -> list:
    """``[run(0, n)]``; where the GPU has no memory for more than one row, the results of ``run`` on
    each half instead, recursively, in row order. Several runs sharing a GPU: another run's peak may
    come at the same moment as this one's, and a smaller batch then goes through."""

    def rows(lo: int, hi: int) -> list:
        try:
            return [run(lo, hi)]
        except torch.OutOfMemoryError:
            if hi - lo == 1:
                raise
        torch.cuda.empty_cache()  # outside the handler, so that the failed attempt's tensors are freed
        mid = (lo + hi) // 2
        log.warning("out of GPU memory %s %d %s: as %d and %d", doing, hi - lo, unit, mid - lo, hi - mid)
        return rows(lo, mid) + rows(mid, hi)

    return rows(0, n)


def _longest_first(req):
    toks = req[1] + req[2]
    return -len(toks), tuple(toks)


def _shared_row(req):
    # requests with one context + continuation[:-1] are answered from one forward row
    return req[-2] + req[-1][:-1]


class BatchedScoring:
    """Mixin for an lm-eval model class (before ``HFLM``): log-likelihood batches answered with one
    read-back each (module docstring). ``batched_scoring=False`` uses lm-eval's own loop, for
    comparison; so does a seq2seq model.

    ``scoring_tokens`` sizes batches by tokens instead of rows: each batch takes as many requests as
    fit that many tokens (rows × its longest input; at least one row), so short requests go many to a
    forward pass and long ones few. For a small model most of a pass's time is host work whatever
    its size, so a fixed row count is slow on short requests, and on long ones its activations
    (rows × length × width per layer) grow with the length. None (or an ``auto`` batch size,
    lm-eval's own search): ``batch_size`` rows, as lm-eval.

    The output layer runs only at the positions a continuation is predicted from
    (``logits_to_keep``); ``all_logits=True`` runs it on every position and slices, for comparison."""

    def __init__(
        self,
        *args,
        batched_scoring: bool = True,
        scoring_tokens: int | None = None,
        all_logits: bool = False,
        share_prefix: int | None = None,
        **kwargs,
    ):
        for name, value in (("batched_scoring", batched_scoring), ("all_logits", all_logits)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        for name, value in (("scoring_tokens", scoring_tokens), ("share_prefix", share_prefix)):
            if value is not None and not positive_int(value):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if share_prefix is not None and scoring_tokens is None:
            raise ValueError("share_prefix batches by tokens: set scoring_tokens too")
        super().__init__(*args, **kwargs)
        self.batched_scoring, self.scoring_tokens, self.all_logits = batched_scoring, scoring_tokens, all_logits
        self.share_prefix = share_prefix
        # whether the model's output layer can run on some positions only, and whether the indices must
        # be on the CPU (a model spread over devices ends on another one than its inputs)
        forward = inspect.signature(self.model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in forward
        self._spread = len({str(d) for d in (getattr(self.model, "hf_device_map", None) or {}).values()}) > 1
        # the keyword the model's forward takes a generation cache under (``_model_call(cache=)``):
        # ``cache`` from transformers 5.25, ``past_key_values`` before
        self._cache_keyword = "cache" if "cache" in forward else "past_key_values"

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if not self.batched_scoring or self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        from lm_eval.models.utils import Collator
        from tqdm import tqdm

        order = Collator(
            requests,
            sort_fn=_longest_first,
            group_by="contexts" if self.logits_cache else None,
            group_fn=_shared_row,
        )
        auto = self.batch_size == "auto"
        batch_fn = self._batch_scheduler if auto and len(order) and not override_bs else None
        if batch_fn is not None:
            self.batch_sizes = {}  # as lm-eval: sizes found for short requests must not serve long ones
        size = (override_bs or 0) if auto else self.batch_size
        answers = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")

        def done(key, answer) -> None:  # as each answer comes: kept (a crash loses none), progress
            if key is not None:  # None: a rolling log-likelihood's windows, recorded per document
                self.cache_hook.add_partial("loglikelihood", key, answer)
            bar.update(1)

        if self.scoring_tokens and not auto:
            items = next(order.get_batched(n=0), [])  # n=0: one list, longest first
            if self.share_prefix and self._takes_logits_to_keep and not self.all_logits:
                answers = [answer for _, answer in self._score_sharing_prefixes(items, order, done)]
                bar.close()
                return order.get_original(answers)
            chunks = self._by_tokens(items)
        else:
            chunks = order.get_batched(n=size, batch_fn=batch_fn)
        for chunk in chunks:
            for key, answer in self._score_batch(chunk, order):
                answers.append(answer)
                done(key, answer)
        bar.close()
        return order.get_original(answers)

    def _by_tokens(self, requests: list):
        """``requests`` (longest first) in batches of at most ``scoring_tokens`` tokens each."""
        lengths = [min(len(context) + len(continuation) - 1, self.max_length) for _, context, continuation in requests]
        for a, b in self._token_batches(lengths):
            yield requests[a:b]

    def _token_batches(self, lengths: list[int], prefix: int = 0):
        """(start, stop) of consecutive batches of rows of ``lengths`` (longest first), each within
        ``scoring_tokens`` tokens (rows × its longest) or one row; on top of a cached prefix of
        ``prefix`` tokens also within four times that many keys (rows × (prefix + its longest)),
        which the attention reads."""
        i = 0
        while i < len(lengths):
            n = self.scoring_tokens // lengths[i]
            if prefix:
                n = min(n, 4 * self.scoring_tokens // (prefix + lengths[i]))
            yield i, i + max(1, n)
            i += max(1, n)

    def _shared(self, chunk: list, order) -> list[list]:
        """Each request's row's answers: its own (cache key, continuation) and those of the requests
        lm-eval's context grouping answers from the same row."""
        return [
            [(k, cont) for k, cont, _ in order.get_cache(req_str=key, cxt_toks=ctx, cont_toks=cont, logits=_NO_LOGITS)]
            for key, ctx, cont in chunk
        ]

    def _score_sharing_prefixes(self, items: list, order, done) -> list[tuple]:
        """[(cache key, answer)] of ``items`` in lm-eval's order (each with the requests sharing its
        row), each group of rows with a long common prefix scored on top of that prefix run once
        (module docstring); ``done(key, answer)`` as each batch's answers come, in the groups' order."""
        inputs = [self._inputs(context, continuation) for _, context, continuation in items]
        shared = self._shared(items, order)
        ends = [len(x) - max(len(c) for _, c in row) for x, row in zip(inputs, shared, strict=True)]
        results: list = [None] * len(items)
        groups = prefix_groups(inputs, ends, self.share_prefix)
        alone = [r for P, rows in groups if not P for r in rows]
        groups = sorted(((P, rows) for P, rows in groups if P), key=lambda g: -g[0])
        # the groups' prefixes, longest first, as rows of token batches: a pass runs several prefixes
        for lo, hi in self._token_batches([P for P, _ in groups]):
            part = groups[lo:hi]
            prefixes = [inputs[rows[0]][:P] for P, rows in part]
            pasts = in_halves_on_oom(
                lambda a, b, prefixes=prefixes: self._run_prefixes(prefixes[a:b]), len(part), "prefixes", "rows"
            )
            for (P, rows), past in zip(part, (p for half in pasts for p in half), strict=True):
                self._run_rows(sorted(rows, key=lambda r: -len(inputs[r])), inputs, shared, results, done, past, P)
            del pasts
        self._run_rows(sorted(alone, key=lambda r: -len(inputs[r])), inputs, shared, results, done)
        return [answer for row in results for answer in row]

    def _run_rows(self, rows: list[int], inputs: list, shared: list, results: list, done, past=None, P: int = 0):
        """Answer ``rows`` (longest first) in batches of ``scoring_tokens``, each row's answers put at
        its index of ``results``; with ``past`` (the cache of the rows' first ``P`` tokens) each row
        runs its tokens after those."""
        for lo, hi in self._token_batches([len(inputs[r]) - P for r in rows], P):
            part = rows[lo:hi]
            got = in_halves_on_oom(
                lambda a, b, part=part: self._answers(
                    [inputs[r][P:] for r in part[a:b]], [shared[r] for r in part[a:b]], past
                ),
                len(part),
                "scoring",
                "rows",
            )
            answers, at = [a for g in got for a in g], 0
            for r in part:
                results[r], at = answers[at : at + len(shared[r])], at + len(shared[r])
            for key, answer in answers:
                done(key, answer)

    def _run_prefixes(self, prefixes: list[list[int]]) -> list[list[tuple]]:
        """Each prefix's cache as [(keys, values) of one row] per layer, from one pass over the
        prefixes right-padded to the longest: causal attention keeps a row's positions blind to the
        padding after them, and each row's cache stops at its own length."""
        from transformers import DynamicCache

        past = DynamicCache(config=self.model.config)
        self._model_call(_right_padded(prefixes).to(self.device), logits_to_keep=1, cache=past)
        return [
            [
                (layer.keys[i : i + 1, ..., : len(x), :], layer.values[i : i + 1, ..., : len(x), :])
                for layer in past.layers
            ]
            for i, x in enumerate(prefixes)
        ]

    def _logits_at(self, batch: torch.Tensor, keep: list[int], past=None) -> torch.Tensor:
        """The logits of ``batch`` at the positions ``keep`` of every row: [rows, len(keep), vocabulary].
        A model whose forward takes ``logits_to_keep`` (transformers' causal LMs) runs its output
        layer on those positions only; another one's full logits are sliced. With ``past`` (a
        prefix's cache from :meth:`_run_prefixes`) the rows continue that prefix, its cache expanded
        to them."""
        if past is None and (self.all_logits or not self._takes_logits_to_keep):
            return self._model_call(batch)[:, keep]
        cache = None
        if past is not None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            rows = batch.shape[0]
            for i, (keys, values) in enumerate(past):
                cache.update(keys.expand(rows, *keys.shape[1:]), values.expand(rows, *values.shape[1:]), i)
        where = "cpu" if self._spread else batch.device
        return self._model_call(batch, logits_to_keep=torch.tensor(keep, device=where), cache=cache)

    def _inputs(self, context: list[int], continuation: list[int]) -> list[int]:
        assert context and continuation and len(continuation) <= self.max_length
        total = len(context) + len(continuation)
        if total > self.max_length + 1:
            log.warning(
                "context (%d tokens) + continuation (%d) exceed the model's maximum length (%d): "
                "%d tokens cut from the left",
                len(context),
                len(continuation),
                self.max_length,
                total - self.max_length - 1,
            )
        return (context + continuation)[-(self.max_length + 1) :][:-1]

    def _score_batch(self, chunk, order) -> list[tuple]:
        """[(cache key, (log-likelihood, greedy))] of a batch's requests and of those sharing their rows."""
        inputs = [self._inputs(context, continuation) for _, context, continuation in chunk]
        shared = self._shared(chunk, order)
        parts = in_halves_on_oom(lambda a, b: self._answers(inputs[a:b], shared[a:b]), len(inputs), "scoring", "rows")
        return [answer for part in parts for answer in part]

    def _answers(self, inputs: list[list[int]], shared: list[list], past=None) -> list[tuple]:
        batch = _right_padded(inputs)

        keys, conts, rows, positions, tokens = [], [], [], [], []
        for i, (x, answers) in enumerate(zip(inputs, shared, strict=True)):
            for k, cont in answers:
                keys.append(k)
                conts.append(len(cont))
                rows += [i] * len(cont)
                positions += range(len(x) - len(cont), len(x))  # the logits that predict the continuation
                tokens += cont
        keep = sorted(set(positions))  # the positions any row needs: the output layer runs on these only
        column = {p: j for j, p in enumerate(keep)}
        logits = self._logits_at(batch.to(self.device), keep, past)  # [batch, len(keep), vocabulary]
        idx = torch.tensor([rows, [column[p] for p in positions], tokens], dtype=torch.long).to(logits.device)
        logp = F.log_softmax(logits[idx[0], idx[1]], dim=-1, dtype=self.softmax_dtype)  # [tokens, vocabulary]
        del logits  # the next batch's forward must not find this one's logits still held
        target = idx[2]
        token_logp = logp.gather(1, target[:, None])[:, 0]
        greedy = logp.argmax(dim=-1) == target

        # each answer's tokens side by side, padded: its log-probability sum (in the log-softmax's
        # dtype, as lm-eval sums) and whether every token is the greedy one
        width = max(conts)
        slot = torch.tensor([a * width + j for a, n in enumerate(conts) for j in range(n)], dtype=torch.long)
        slot = slot.to(target.device)
        n = len(conts) * width
        total = token_logp.new_zeros(n).index_copy(0, slot, token_logp).view(-1, width).sum(-1)
        every = greedy.new_ones(n).index_copy(0, slot, greedy).view(-1, width).all(-1)
        out = torch.stack([total.float(), every.float()]).cpu().tolist()
        return [(k, (s, bool(g))) for k, s, g in zip(keys, out[0], out[1], strict=True)]


def _right_padded(rows: list[list[int]]) -> torch.Tensor:
    """Token rows as one [rows, longest] batch, zeros after each row's end (causal attention keeps a
    row's positions blind to what follows them)."""
    n = max(map(len, rows))
    return torch.tensor([x + [0] * (n - len(x)) for x in rows], dtype=torch.long)


def prefix_groups(inputs: list[list[int]], ends: list[int], minimum: int) -> list[tuple[int, list[int]]]:
    """Rows of ``inputs`` grouped by a common prefix of at least ``minimum`` tokens: [(prefix length,
    row indices)], prefix length 0 for rows scored alone. A row's prefix stops at its ``ends`` entry
    (the position that predicts its first continuation token must be in its suffix).

    Sorted by their tokens, rows sharing a prefix sit side by side, and the common prefix of a run of
    them is the least of its neighbours' common prefixes. A run scored on its common prefix P saves
    P tokens for every row but one; it is split where its neighbours share least when its parts, each
    on its own longer prefix, save more (a subject's questions on the subject's few-shot prefix, not
    every row of a task on the task's first words)."""
    order = sorted(range(len(inputs)), key=lambda i: inputs[i])
    link = [0] + [min(len(commonprefix([inputs[a], inputs[b]])), ends[a], ends[b]) for a, b in zip(order, order[1:])]

    def place(lo: int, hi: int, depth: int) -> tuple[int, list]:
        if hi - lo == 1:
            return 0, [(0, [order[lo]])]
        m = min(link[lo + 1 : hi])
        here = m * (hi - lo - 1) if m >= minimum else -1
        if depth >= 64:  # runs nested this deep (not met in lm-eval's tasks): no further split
            return (here, [(m, order[lo:hi])]) if here >= 0 else (0, [(0, [i]) for i in order[lo:hi]])
        cuts = [lo, *(i for i in range(lo + 1, hi) if link[i] == m), hi]
        saved, groups = 0, []
        for a, b in zip(cuts, cuts[1:]):
            s, g = place(a, b, depth + 1)
            saved, groups = saved + s, groups + g
        return (here, [(m, order[lo:hi])]) if here >= saved else (saved, groups)

    return place(0, len(order), 0)[1] if order else []
