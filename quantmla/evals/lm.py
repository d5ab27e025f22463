"""lm-eval model class ``quantmla``: any lm-eval task on a model prepared by the harness.

:class:`QuantMLALM` is lm-eval's ``HFLM`` around an in-memory model whose MLA attention
was replaced by :class:`quantmla.attention.LatentAttention` (method fused, cache bits set):

- log-likelihood requests run one teacher-forced forward per batch; every layer reads its
  CxRy quantize–dequantized latent cache with the decode-faithful BF16 protection of the
  sink and recent tokens (equal to token-by-token decoding);
- generation requests decode token by token through the harness's generation cache
  (:func:`quantmla.attention.new_cache`), so the prompt and every generated token pass
  through the quantized cache as they would in serving.

It is registered with lm-eval as ``quantmla`` so it can be named like ``hf``, but it takes
a prepared model object (``pretrained=model``), not a hub id: preparing a model (method,
bits) is the harness's job (``python -m quantmla.run eval=lm_eval ...``).
"""

from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from quantmla import attention, placement
from quantmla.evals.responses import ResponseCache


class CachedHFLM(ResponseCache, HFLM):
    """lm-eval's ``HFLM`` with the run's response cache (:mod:`quantmla.evals.responses`)."""


@register_model("quantmla")
class QuantMLALM(ResponseCache, HFLM):
    def __init__(self, pretrained, tokenizer, batch_size: int = 1, max_length: int | None = None, **kwargs):
        if isinstance(pretrained, str):
            raise TypeError(
                "the 'quantmla' lm-eval model takes a model prepared by the harness (pretrained=<model object>); "
                "run evaluations through `python -m quantmla.run eval=lm_eval eval.tasks=[...]`"
            )
        if not attention.latent_layers(pretrained):
            raise ValueError("the model has no LatentAttention layers; call quantmla.attention.install first")
        super().__init__(
            pretrained=pretrained, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, **kwargs
        )
        self._device = placement.execution_device(pretrained)  # inputs go to the first GPU of a spread model

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        # Teacher-forced scoring: no generation cache, the installed attention quantizes the
        # latent of every position and protects per query (decode-faithful rule).
        with torch.no_grad():
            return self.model(inps, use_cache=False).logits

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        cache = attention.new_cache(self.model, batch_size=context.shape[0], max_length=max_length)
        generation_kwargs[attention.cache_keyword()] = cache
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def language_model(model, tokenizer, batch_size: int = 1, max_length: int | None = None, **kwargs) -> HFLM:
    """The lm-eval model for ``model``: :class:`QuantMLALM` when its MLA layers run through the
    harness attention; lm-eval's own ``HFLM`` for a native model (the reference a model-card
    comparison needs, e.g. the checkpoint an MLA conversion started from)."""
    if attention.latent_layers(model):
        return QuantMLALM(model, tokenizer, batch_size=batch_size, max_length=max_length, **kwargs)
    return CachedHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, **kwargs)
