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
"""

from __future__ import annotations

import inspect
import logging

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
        **kwargs,
    ):
        for name, value in (("batched_scoring", batched_scoring), ("all_logits", all_logits)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if scoring_tokens is not None and not positive_int(scoring_tokens):
            raise ValueError(f"scoring_tokens must be a positive integer or None, got {scoring_tokens!r}")
        super().__init__(*args, **kwargs)
        self.batched_scoring, self.scoring_tokens, self.all_logits = batched_scoring, scoring_tokens, all_logits
        # whether the model's output layer can run on some positions only, and whether the indices must
        # be on the CPU (a model spread over devices ends on another one than its inputs)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._spread = len({str(d) for d in (getattr(self.model, "hf_device_map", None) or {}).values()}) > 1

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
        if self.scoring_tokens and not auto:
            chunks = self._by_tokens(next(order.get_batched(n=0), []))  # n=0: one list, longest first
        else:
            chunks = order.get_batched(n=size, batch_fn=batch_fn)
        for chunk in chunks:
            for key, answer in self._score_batch(chunk, order):
                answers.append(answer)
                if key is not None:  # None: a rolling log-likelihood's windows, recorded per document
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return order.get_original(answers)

    def _by_tokens(self, requests: list):
        """``requests`` (longest first) in batches of at most ``scoring_tokens`` tokens each."""
        i = 0
        while i < len(requests):
            _, context, continuation = requests[i]
            longest = min(len(context) + len(continuation) - 1, self.max_length)
            rows = max(1, self.scoring_tokens // longest)
            yield requests[i : i + rows]
            i += rows

    def _logits_at(self, batch: torch.Tensor, keep: list[int]) -> torch.Tensor:
        """The logits of ``batch`` at the positions ``keep`` of every row: [rows, len(keep), vocabulary].
        A model whose forward takes ``logits_to_keep`` (transformers' causal LMs) runs its output
        layer on those positions only; another one's full logits are sliced."""
        if not self.all_logits and self._takes_logits_to_keep:
            where = "cpu" if self._spread else batch.device
            return self._model_call(batch, logits_to_keep=torch.tensor(keep, device=where))
        return self._model_call(batch)[:, keep]

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
        # each row's answers: its own request's and those of the requests that share the row
        shared = [
            [(k, cont) for k, cont, _ in order.get_cache(req_str=key, cxt_toks=ctx, cont_toks=cont, logits=_NO_LOGITS)]
            for key, ctx, cont in chunk
        ]
        parts = in_halves_on_oom(lambda a, b: self._answers(inputs[a:b], shared[a:b]), len(inputs), "scoring", "rows")
        return [answer for part in parts for answer in part]

    def _answers(self, inputs: list[list[int]], shared: list[list]) -> list[tuple]:
        batch = torch.zeros(len(inputs), max(map(len, inputs)), dtype=torch.long)
        for i, x in enumerate(inputs):
            batch[i, : len(x)] = torch.tensor(x)

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
        logits = self._logits_at(batch.to(self.device), keep)  # [batch, len(keep), vocabulary]
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
