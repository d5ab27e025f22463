"""Perplexity on held-out real text (``eval=ppl``).

Non-overlapping windows of ``seq_len`` tokens from the held-out split of a packaged
corpus (default: the Wikipedia articles of :mod:`quantmla.data`), up to ``max_tokens``
tokens (``null``: every window the split holds, ``eval=ppl_full``); every window is scored
on its own, through the model as installed (quantized cache with its protection policy).
ppl = exp(mean NLL over predicted tokens).

The record states the text scored (``tokens`` predicted, ``windows``, ``held_out_tokens`` in the
split) and each window's mean NLL (``window_nll``, in the split's order), from which the standard
error of the perplexity (``ppl_se``, over windows) and the paired error of a difference between two
runs on the same windows are computed. ``order_seed`` scores the windows in a random order (the
noise floor's ``order`` perturbation, :mod:`quantmla.noise`); the record keeps the split's order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantmla import data, placement
from quantmla.evals import Eval, EvalContext
from quantmla.progress import bar as progress_bar


@dataclass
class Perplexity(Eval):
    name = "ppl"
    source: str = "wiki"
    split: str = "test"
    seq_len: int = 512
    max_tokens: int | None = 16384
    batch_size: int = 4
    order_seed: int | None = None

    def check(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"ppl seq_len must be at least 2, got {self.seq_len}")
        if self.max_tokens is not None and self.max_tokens < self.seq_len:
            raise ValueError(f"ppl max_tokens ({self.max_tokens}) is smaller than seq_len ({self.seq_len})")
        if self.batch_size < 1:
            raise ValueError(f"ppl batch_size must be positive, got {self.batch_size}")
        if self.source not in data.TEXT_SOURCES:
            raise ValueError(f"unknown ppl source '{self.source}'; choose one of {', '.join(data.TEXT_SOURCES)}")
        data.wiki_path()

    def check_model(self, config) -> None:
        limit = getattr(config, "max_position_embeddings", None)
        if limit and self.seq_len > limit:
            raise ValueError(
                f"ppl seq_len {self.seq_len} exceeds the model's context ({limit} tokens, "
                "max_position_embeddings); lower eval.seq_len"
            )

    def windows(self, tokenizer) -> tuple[torch.Tensor, int]:
        """(windows, tokens in the split): the first ``max_tokens // seq_len`` windows, or all of them."""
        stream = data.token_stream(tokenizer, data.texts(self.source, self.split))
        total = stream.numel() // self.seq_len
        count = total if self.max_tokens is None else min(total, self.max_tokens // self.seq_len)
        return data.windows(stream, self.seq_len, count), stream.numel()

    @torch.no_grad()
    def run(self, model, tokenizer, ctx: EvalContext) -> dict:
        if ctx.max_positions and self.seq_len > ctx.max_positions:
            raise ValueError(f"ppl seq_len {self.seq_len} exceeds the model's context {ctx.max_positions}")
        w, held_out = self.windows(tokenizer)
        order = torch.arange(len(w))
        if self.order_seed is not None:
            order = torch.randperm(len(w), generator=torch.Generator().manual_seed(self.order_seed))
        device = placement.execution_device(model)
        per_window = torch.zeros(len(w), dtype=torch.float64)
        bar = progress_bar(range(0, len(w), self.batch_size), desc="ppl", unit="batch", enabled=ctx.progress)
        for s in bar:
            rows = order[s : s + self.batch_size]
            ids = w[rows].to(device)
            logits = model(ids, use_cache=False).logits.float()
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
            per_window[rows] = loss.view(len(rows), -1).double().mean(1).cpu()
            bar.set_postfix(ppl=f"{math.exp(per_window[order[: s + len(rows)]].mean()):.3f}")
        nll = per_window.mean().item()  # every window predicts seq_len - 1 tokens: the mean over tokens
        se = per_window.std().item() / math.sqrt(len(w)) if len(w) > 1 else math.nan
        return {
            "ppl": math.exp(nll),
            "nll": nll,
            "ppl_se": math.exp(nll) * se,  # delta method: d ppl = ppl · d nll
            "nll_se": se,
            "tokens": len(w) * (self.seq_len - 1),
            "windows": len(w),
            "held_out_tokens": held_out,
            "window_nll": per_window.tolist(),
        }
