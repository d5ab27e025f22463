"""lm-eval model class ``quantmla``: any lm-eval task on a quantized MLA model.

:class:`QuantMLALM` is lm-eval's ``HFLM`` around a model whose MLA attention was replaced by
:class:`quantmla.attention.LatentAttention` (method fused, cache bits set):

- log-likelihood requests run one teacher-forced forward per batch; every layer reads its
  CxRy quantize–dequantized latent cache with the decode-faithful BF16 protection of the
  sink and recent tokens (equal to token-by-token decoding);
- generation requests decode token by token through the harness's generation cache
  (:func:`quantmla.attention.new_cache`), so the prompt and every generated token pass
  through the quantized cache as they would in serving.

It is registered with lm-eval as ``quantmla`` and takes either a model prepared in memory
(``pretrained=<model object>``, as ``eval=lm_eval`` of the harness passes it) or the name of a
model config, prepared here exactly as ``python -m quantmla.run`` prepares it. lm-eval's own
command line, with the class registered (``quantmla-lm-eval``, :mod:`quantmla.evals.cli`)::

    quantmla-lm-eval --model quantmla --model_args pretrained=smollm2_mla,method=quantmla,bits=c4r4 \
        --tasks hellaswag --batch_size auto --output_path out --log_samples

``pretrained`` names a ``conf/model`` option (or a local checkpoint folder: ``model=local``); the
other harness keys of ``model_args`` (:data:`HARNESS_KEYS`, dotted for nested fields:
``method.steps=40``, ``protect.enabled=false``, ``calibration=quick``) become Hydra overrides of the
run config, checked and typed as a run's (:func:`quantmla.run.plan`); the rest go to ``HFLM``
(``max_length``, ``enable_thinking``, ...). ``--device`` is the run's ``device``. A method's calibrated
transforms are stored and reused under ``<runs_dir>/.transforms`` (``runs_dir=runs`` unless given), the
same store ``python -m quantmla.run`` uses.
"""

from __future__ import annotations

import logging
import os

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from quantmla import attention, generate, placement
from quantmla.evals.responses import ResponseCache
from quantmla.evals.scoring import BatchedScoring, in_halves_on_oom
from quantmla.schema import positive_int

log = logging.getLogger("quantmla")


HARNESS_KEYS = ("model", "method", "bits", "calibration", "seed", "backend", "exact", "protect", "runs_dir")
"""Top-level keys of the run config that ``model_args`` may set (with their nested fields, dotted)."""


def _override_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def harness_overrides(pretrained: str, args: dict, device: str | None = None) -> tuple[list[str], dict]:
    """(Hydra overrides of the run config, the remaining ``HFLM`` keyword arguments) of lm-eval's
    ``model_args``. ``pretrained``: a ``conf/model`` option, or a folder holding a checkpoint."""
    from pathlib import Path

    from quantmla.run import group_options

    if pretrained in group_options("model"):
        overrides = [f"model={pretrained}"]
    elif Path(pretrained).expanduser().is_dir():
        overrides = ["model=local", f"model.path={Path(pretrained).expanduser().resolve()}"]
    else:
        raise ValueError(
            f"pretrained={pretrained} is neither a model config ({', '.join(group_options('model'))}) "
            "nor a checkpoint folder"
        )
    overrides.append("logger=none")
    rest = {}
    for k, v in args.items():
        if k.split(".")[0] in HARNESS_KEYS:
            overrides.append(f"{k}={_override_value(v)}")
        else:
            rest[k] = v
    if device is not None:
        overrides.append(f"device={_usable_device(device)}")
    return overrides, rest


def _usable_device(device: str) -> str:
    """lm-eval's ``--device`` (``cuda:0`` unless given) where this machine has it; else ``auto``, as
    lm-eval's own ``hf`` model falls back."""
    from quantmla.schema import check_device

    try:
        check_device(device)
        return device
    except ValueError as e:
        log.warning("%s; using device=auto", e)
        return "auto"


def prepared(pretrained: str, args: dict, device: str | None = None):
    """(model, tokenizer, HFLM keyword arguments): the run config that ``model_args`` name, planned
    (every value checked, one-line errors) and prepared as a run prepares it (:func:`quantmla.run.prepare`)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from quantmla.run import ConfigError, conf_dir, hydra_text, plan, prepare

    overrides, rest = harness_overrides(pretrained, args, device)

    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("run", overrides=overrides)
    except HydraException as e:
        raise ValueError(f"model_args {' '.join(overrides)}: {hydra_text(e)}") from None
    try:
        p = plan(cfg)
    except ConfigError as e:
        raise ValueError(f"model_args: {e}") from None
    log.info("quantmla: preparing %s (%s)", p.model.name, " ".join(overrides))
    model, tokenizer = prepare(p, cfg)
    return model, tokenizer, rest


class _Counted:
    """lm-eval's cache hook, passed through, with one step of a progress bar per request answered
    (lm-eval hands every answer to the hook, also those of requests that share one forward pass)."""

    def __init__(self, hook, bar):
        self.hook, self.bar = hook, bar

    def add_partial(self, kind: str, args, value) -> None:
        self.hook.add_partial(kind, args, value)
        self.bar.update(1)


class Progress:
    """Mixin for an lm-eval model class: where stderr is not a terminal, lm-eval's bars (which would
    fill a log with carriage returns) give way to periodic lines with an ETA (:mod:`quantmla.progress`),
    counting requests answered; on a terminal lm-eval's own bars show."""

    def _with_progress(self, kind: str, requests, compute, *args, **kwargs):
        from quantmla import progress

        if progress.interactive() or not requests:
            return compute(requests, *args, **kwargs)
        kwargs["disable_tqdm"] = True
        hook = self.cache_hook
        with progress.bar(total=len(requests), desc=f"lm-eval {kind}", unit="request") as bar:
            self.cache_hook = _Counted(hook, bar)
            try:
                return compute(requests, *args, **kwargs)
            finally:
                self.cache_hook = hook

    def loglikelihood(self, requests, *args, **kwargs):
        return self._with_progress("loglikelihood", requests, super().loglikelihood, *args, **kwargs)

    def loglikelihood_rolling(self, requests, *args, **kwargs):
        return self._with_progress("loglikelihood_rolling", requests, super().loglikelihood_rolling, *args, **kwargs)

    def generate_until(self, requests, *args, **kwargs):
        return self._with_progress("generate_until", requests, super().generate_until, *args, **kwargs)


class BatchedTokenizer:
    """Mixin for an lm-eval model class: the strings of a log-likelihood call are tokenized up front,
    each distinct one once and all in one call of the fast tokenizer, and lm-eval's own
    pairing (``_encode_pair``) reads them back through ``tok_encode``. lm-eval tokenizes one request
    at a time and a shared few-shot context once per answer choice: on MMLU 5-shot that is most of a
    run's time outside the model. Strings that start with the BOS text, and every call with explicit
    arguments, go through lm-eval's own ``tok_encode``; so does everything when the batched encoding
    of the first string differs from lm-eval's (another lm-eval's defaults)."""

    _encoded: dict | None = None

    def loglikelihood(self, requests, *args, **kwargs):
        self._encoded = self._encode_all([r.args for r in requests])
        try:
            return super().loglikelihood(requests, *args, **kwargs)
        finally:
            self._encoded = None

    def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
        if self._encoded is not None and add_special_tokens is None and not left_truncate_len and not kwargs:
            hit = self._encoded.get(string)
            if hit is not None:
                return list(hit)
        return super().tok_encode(
            string, add_special_tokens=add_special_tokens, left_truncate_len=left_truncate_len, **kwargs
        )

    def _encode_all(self, pairs) -> dict | None:
        """``{string: token ids}`` for every string ``_encode_pair`` will encode, or None."""
        if getattr(self, "backend", None) != "causal" or not getattr(self.tokenizer, "is_fast", False):
            return None
        try:
            from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix
        except ImportError:
            return None
        bos = self.tokenizer.decode(self.prefix_token_id)
        strings = {}
        for context, continuation in pairs:
            if not context:
                continue
            n = len(context) - len(context.rstrip())  # _encode_pair moves trailing spaces to the continuation
            if n:
                context, continuation = context[:-n], context[-n:] + continuation
            for x in (context, context + continuation):
                if not has_bos_prefix(x, bos):
                    strings[x] = None
        if len(strings) < 2:
            return None
        plain = list(strings)
        ids = encode_batch(self.tokenizer, plain, **_add_special_kwargs(None, self.add_bos_token))
        if list(ids[0]) != super().tok_encode(plain[0]):
            return None
        return dict(zip(plain, ids, strict=True))


_THREADS = "TOKENIZERS_PARALLELISM"


def encode_batch(tokenizer, strings: list[str], **kwargs) -> list:
    """``tokenizer(strings, **kwargs)["input_ids"]`` with the fast tokenizer's own threads on for this
    call alone. The harness turns them off (``TOKENIZERS_PARALLELISM=false``), which keeps a later
    fork quiet and safe; the fast tokenizer reads the variable at every call, so it is set for this
    call and put back. On the 10,340 distinct strings of two MMLU 5-shot subjects with two cores:
    37.7 s with them off, 21.7 s on."""
    before = os.environ.get(_THREADS)
    os.environ[_THREADS] = "true"
    try:
        return tokenizer(strings, **kwargs)["input_ids"]
    finally:
        if before is None:
            os.environ.pop(_THREADS, None)
        else:
            os.environ[_THREADS] = before


class GenerationBatch:
    """Mixin for an lm-eval model class: generation requests in batches of ``generate_batch_size``
    (None: lm-eval's ``batch_size``, as lm-eval does), halved where the GPU runs out of memory.
    Scoring's memory is its [batch, length, vocabulary] logits, so its batch stays small; a decode
    step of a small model costs about the same for 32 sequences as for 8 (GSM8K's first 128 items,
    5-shot, on an H100: 52 s of generation at batch 32, 168 s at 8), so generation wants a larger one."""

    def __init__(self, *args, generate_batch_size: int | None = None, **kwargs):
        # lm-eval's --model_args parser already turns "128" into 128
        if generate_batch_size is not None and not positive_int(generate_batch_size):
            raise ValueError(f"generate_batch_size must be a positive integer, got {generate_batch_size!r}")
        super().__init__(*args, **kwargs)
        self.generate_batch_size = generate_batch_size

    def generate_until(self, requests, *args, **kwargs):
        if self.generate_batch_size is None:
            return super().generate_until(requests, *args, **kwargs)
        scoring, self.batch_size_per_gpu = self.batch_size_per_gpu, self.generate_batch_size
        try:
            return super().generate_until(requests, *args, **kwargs)
        finally:
            self.batch_size_per_gpu = scoring

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **kwargs) -> torch.Tensor:
        """lm-eval's batch of generation; one the GPU has no memory for is generated in two halves
        (GPUs shared by several runs), each sequence as it would have been in the whole batch (greedy
        decoding of a sequence does not depend on the others; the shorter half's output is padded
        as ``generate`` pads a sequence that stopped early)."""
        B = context.shape[0]

        def rows(a: int, b: int) -> torch.Tensor:
            part = {k: v[a:b] if isinstance(v, torch.Tensor) and v.shape[:1] == (B,) else v for k, v in kwargs.items()}
            return self._generate(context[a:b], max_length, stop, **part)

        parts = in_halves_on_oom(rows, B, "generating for", "prompts")
        if len(parts) == 1:
            return parts[0]
        width = max(p.shape[1] for p in parts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in parts])

    def _generate(self, context: torch.Tensor, max_length: int, stop: list[str], **kwargs) -> torch.Tensor:
        """One batch of ``model.generate``, as lm-eval runs it; a model class adds what a batch needs."""
        return super()._model_generate(context, max_length, stop, **kwargs)


class ReleasesMemory:
    """Mixin for an lm-eval model class: GPU memory goes back as scoring batches shrink.

    lm-eval scores the longest requests first, so a task's first batch makes the largest tensors of
    the run: the [batch, length, vocabulary] logits (5-shot MMLU's longest, about 3,500 tokens at
    batch 32 on a 49K vocabulary, some 11 GB; lm-eval's own loop also holds their log-softmax and
    the previous batch's while computing the next). PyTorch keeps freed memory for reuse, so a
    process would hold that peak to the end, where no other process on the GPU can use it. When a
    batch is half the size of the largest since the last release or less, the cached memory not in
    use is returned (``torch.cuda.empty_cache``): a handful of times per task, as lengths fall.
    Each class's ``_model_call`` calls :meth:`_release_if_shrunk` first."""

    _largest_call = 0

    def _release_if_shrunk(self, inps: torch.Tensor) -> None:
        n = inps.numel()
        if inps.is_cuda and 2 * n <= self._largest_call:
            torch.cuda.empty_cache()
            self._largest_call = 0
        self._largest_call = max(self._largest_call, n)


class CachedHFLM(ReleasesMemory, ResponseCache, Progress, BatchedTokenizer, BatchedScoring, GenerationBatch, HFLM):
    """lm-eval's ``HFLM`` with the run's response cache (:mod:`quantmla.evals.responses`), progress,
    batched tokenization, batched scoring (:mod:`quantmla.evals.scoring`), its own generation batch
    size and memory returned as batches shrink."""

    def _model_call(self, inps, attn_mask=None, labels=None, logits_to_keep=None, cache=None):
        self._release_if_shrunk(inps)
        if logits_to_keep is None and cache is None:
            return super()._model_call(inps, attn_mask, labels)
        # a causal model's logits at some positions only (batched scoring), continuing the generation
        # cache ``cache`` where given (a shared prefix), in lm-eval's precision
        kw = {} if cache is None else {"use_cache": True, self._cache_keyword: cache}
        precision = self.mixed_precision_dtype
        with torch.no_grad(), torch.autocast(self.device.type, dtype=precision, enabled=precision is not None):
            return self.model(inps, logits_to_keep=logits_to_keep, **kw).logits


@register_model("quantmla")
class QuantMLALM(ReleasesMemory, ResponseCache, Progress, BatchedTokenizer, BatchedScoring, GenerationBatch, HFLM):
    def __init__(
        self,
        pretrained,
        tokenizer=None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        device: str | None = None,
        decode_graphs: bool = False,
        **kwargs,
    ):
        self.decode_graphs = bool(decode_graphs)  # greedy requests through quantmla.generate.greedy
        if isinstance(pretrained, str):
            harness = {k: kwargs.pop(k) for k in list(kwargs) if k.split(".")[0] in HARNESS_KEYS}
            pretrained, tokenizer, rest = prepared(pretrained, harness, device)
            kwargs |= rest
        if tokenizer is None:
            raise TypeError("QuantMLALM(model object) needs the model's tokenizer (tokenizer=...)")
        if not attention.latent_layers(pretrained):
            raise ValueError("the model has no LatentAttention layers; call quantmla.attention.install first")
        super().__init__(
            pretrained=pretrained, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, **kwargs
        )
        self._device = placement.execution_device(pretrained)  # inputs go to the first GPU of a spread model

    def _model_call(
        self, inps: torch.Tensor, attn_mask=None, labels=None, logits_to_keep=None, cache=None
    ) -> torch.Tensor:
        # Teacher-forced scoring: the installed attention quantizes the latent of every position and
        # protects per query (decode-faithful rule); with ``cache`` (a shared prefix's) over the
        # cached latents too. With ``logits_to_keep`` (batched scoring) the output layer runs on
        # those positions only.
        self._release_if_shrunk(inps)
        kw = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        kw |= {"use_cache": False} if cache is None else {"use_cache": True, self._cache_keyword: cache}
        with torch.no_grad():
            logits = self.model(inps, **kw).logits
        return logits

    def _generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        cache = attention.new_cache(self.model, batch_size=context.shape[0], max_length=max_length)
        generation_kwargs[attention.cache_keyword()] = cache
        if self.decode_graphs and not generation_kwargs.get("do_sample") and not generation_kwargs.get("temperature"):
            # lm-eval's greedy requests (its default); each decode step one CUDA graph replay
            generation_kwargs["custom_generate"] = generate.greedy
        return super()._generate(context, max_length, stop, **generation_kwargs)


def language_model(model, tokenizer, batch_size: int | str = 1, max_length: int | None = None, **kwargs) -> HFLM:
    """The lm-eval model for ``model``: :class:`QuantMLALM` when its MLA layers run through the
    harness attention; lm-eval's own ``HFLM`` for a native model (the reference a model-card
    comparison needs, e.g. the checkpoint an MLA conversion started from)."""
    if attention.latent_layers(model):
        return QuantMLALM(model, tokenizer, batch_size=batch_size, max_length=max_length, **kwargs)
    kwargs.pop("decode_graphs", None)  # the paged latent cache's; a native model decodes as transformers does
    return CachedHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, **kwargs)
