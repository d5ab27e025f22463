"""Greedy generation through the paged latent cache, each decode step one CUDA graph replay.

A decode step of a small model is host-bound: the GPU waits while Python launches some hundred
kernels per layer (about 2 ms per layer on an H100, ``bench/generate.py``). :func:`greedy` is a
decoding loop for ``model.generate`` (its ``custom_generate`` argument) that prefills the prompt as
``generate`` does, then fixes the cache's shape (:meth:`LatentCache.reserve`) and replays the decode
step as one CUDA graph, captured on the second step:

    out = model.generate(ids, attention_mask=mask, custom_generate=greedy, max_length=...,
                         **{attention.cache_keyword(): attention.new_cache(model, B, max_length)})

``generate`` still builds the logits processors and stopping criteria and checks its arguments;
token selection, padding of finished rows and stopping are those of its greedy loop, so the tokens
are the same as ``generate``'s own up to the decode kernel's split plan, which the fixed shape
plans for the longest possible request instead of the longest present one
(``tests/test_generate.py``).
:class:`DecodeStep` says why it runs a step eagerly where it cannot capture one (a model off CUDA
or over several devices, the torch reference backend, or a capture that failed, e.g. a model whose
forward reads the device): the tokens are then the same, only slower.
"""

from __future__ import annotations

import logging

import torch

from quantmla.attention import cache_keyword, latent_layers
from quantmla.paged_cache import LatentCache

log = logging.getLogger("quantmla")


def greedy(
    model,
    input_ids: torch.Tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    graphs: bool = True,
    **model_kwargs,
) -> torch.Tensor:
    """``model.generate``'s greedy decoding over a :class:`LatentCache`; pass as ``custom_generate``
    (``graphs=False``: every step eager). Returns the prompts with their new tokens, (B, T + new),
    rows that stopped early padded as ``generate`` pads them."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if not isinstance(cache, LatentCache):
        raise TypeError(f"greedy() decodes through the paged latent cache ({cache_keyword()}=new_cache(model, ...))")
    cfg = generation_config
    if cfg.do_sample or cfg.num_beams != 1 or cfg.return_dict_in_generate or model_kwargs.get("streamer"):
        raise ValueError("greedy() is greedy search returning token ids: no sampling, beams, dict outputs or streamer")
    B, dev = input_ids.shape[0], input_ids.device
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    positions = mask.long().cumsum(-1) - 1
    positions.masked_fill_(mask == 0, 1)
    kw = {cache_keyword(): cache}
    out = model(input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **kw)
    logits = out.logits[:, -1].to(dtype=torch.float32, copy=True)
    del out
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else _first(cfg.eos_token_id)
    if has_eos and pad is None:
        raise ValueError("greedy() needs pad_token_id (or eos_token_id) to pad the rows that stopped")
    cache.reserve(cfg.max_length)  # generate sets it (from max_new_tokens where given): the longest row
    step = DecodeStep(model, cache, positions[:, -1:] + 1, graphs)
    unfinished = torch.ones(B, dtype=torch.long, device=dev)
    while True:
        scores = logits_processor(input_ids, logits)
        tokens = torch.argmax(scores, dim=-1)
        if has_eos:
            tokens = tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        if unfinished.max() == 0:
            return input_ids
        logits = step(tokens)


def _first(ids):
    return ids[0] if isinstance(ids, (list, tuple)) else ids


class DecodeStep:
    """One decode step of ``model`` over a reserved ``cache``: the batch's next tokens in, the
    float32 logits of the position after them out. Its inputs and outputs live in fixed tensors
    (token, position, logits) that the step updates in place, so that on CUDA the step is captured
    once as a graph and replayed; :attr:`eager_reason` says why it is not (None: it is)."""

    def __init__(self, model, cache: LatentCache, positions: torch.Tensor, graphs: bool = True):
        self.model, self.cache = model, cache
        self.tokens = torch.zeros_like(positions)
        self.positions = positions.clone()
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_reason = capture_refusal(model, positions.device) if graphs else "graphs=False"
        self.steps = 0

    def _forward(self) -> torch.Tensor:
        out = self.model(self.tokens, position_ids=self.positions, use_cache=True, logits_to_keep=1,
                         **{cache_keyword(): self.cache})  # fmt: skip
        self.positions.add_(1)
        return out.logits[:, -1]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens[:, None])
        if self.graph is not None:
            self.graph.replay()
        elif self.eager_reason is None and self.steps >= 1:
            self._capture()
        elif self.eager_reason is None:
            # the first step runs eagerly on a side stream: kernels compiled and libraries set up
            # before the capture, as CUDA graphs require
            side = torch.cuda.Stream(self.tokens.device)
            side.wait_stream(torch.cuda.current_stream(self.tokens.device))
            with torch.cuda.stream(side):
                self.logits = self._forward()
            torch.cuda.current_stream(self.tokens.device).wait_stream(side)
        else:
            self.logits = self._forward()
        self.cache.advance()
        self.steps += 1
        return self.logits.to(dtype=torch.float32, copy=True)

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                logits = self._forward()
        except RuntimeError as e:  # the forward did something a graph cannot hold (e.g. read the device)
            self.eager_reason = f"capture failed: {str(e).splitlines()[0]}"
            log.warning("decode steps run eagerly (%s)", self.eager_reason)
            self.logits = self._forward()
            return
        self.graph, self.logits = graph, logits
        graph.replay()


def capture_refusal(model, device: torch.device) -> str | None:
    """Why a decode step of ``model`` cannot be captured as a CUDA graph, or None where it can."""
    if device.type != "cuda":
        return f"the model runs on {device.type}, not CUDA"
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        return "the model spreads over several devices"
    layers = latent_layers(model)
    if not layers:
        return "the model has no LatentAttention layers"
    if any(layer.backend == "reference" for layer in layers):
        return "the attention runs on the torch reference backend"
    return None
