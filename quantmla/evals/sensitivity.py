"""Dual-path sensitivity (``eval=sensitivity``): Table 4's protocol and the local G = T·A + O analysis.

For every cell (a dataset and a seed) ``sequences`` random non-overlapping windows of
``seq_len`` tokens are drawn from the dataset's ``split``. The model runs once per cell with
exact caches to capture every MLA layer's input. Then, layer by layer, a float64 copy of the
layer measures, per sequence and one path at a time, the output NMSE caused by the path's
``bits``-bit quantization error rescaled to cache NMSE ``target_nmse`` (the paper's App. B.1), and —
for ``local_layers`` and the first ``local_sequences`` sequences of each cell — the local
analysis at ``local_target_nmse`` (the paper's App. B.3). With ``interventions`` > 0 the same local
points also get the equal-energy controls of Table 6 (that many draws per control and path).

The run's own cache bits do not enter: the probe perturbs exact caches of the model as the
method left it (with ``method=rtn`` the native model). Offline, the packaged Wikipedia
articles (``wiki``) stand in for WikiText-2 and the packaged news articles (``news``) for C4.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from quantmla import data, placement
from quantmla.attention import capture_inputs
from quantmla.cache import CacheSpec
from quantmla.evals import Eval, EvalContext
from quantmla.progress import bar as progress_bar
from quantmla.quant import check_bits
from quantmla.sensitivity import (
    PATHS,
    LayerProbe,
    cell_means,
    check_layers,
    frozen_copy,
    intervention_summary,
    mla_layers,
    model_summary,
    per_layer,
    predictor_check,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}
log = logging.getLogger("quantmla")


def _row(t, i: int):
    """Sequence ``i`` of a captured batch tensor (or tuple of tensors); batch-1 tensors broadcast."""
    if t is None:
        return None
    if isinstance(t, (tuple, list)):
        return type(t)(_row(u, i) for u in t)
    return t[i : i + 1] if t.shape[0] > 1 else t


@dataclass
class Sensitivity(Eval):
    name = "sensitivity"
    datasets: list = field(default_factory=lambda: ["wiki", "news"])
    split: str = "test"
    seeds: list = field(default_factory=lambda: [0, 1, 2])
    sequences: int = 8
    seq_len: int = 512
    target_nmse: float = 0.01
    bits: int = 4
    group: int = 64
    layers: list | None = None
    local: bool = True
    local_target_nmse: float = 1e-3
    local_layers: list | None = None
    local_sequences: int = 1
    probes: int = 256
    probe_batch: int = 16
    probe_seed: int = 0
    interventions: int = 0
    dtype: str = "float64"
    batch_size: int = 8

    def __post_init__(self):
        self.datasets = [str(d) for d in self.datasets]
        self.seeds = [int(s) for s in self.seeds]
        self.layers = None if self.layers is None else list(self.layers)
        self.local_layers = None if self.local_layers is None else list(self.local_layers)

    def check(self) -> None:
        for what, v in (("target_nmse", self.target_nmse), ("local_target_nmse", self.local_target_nmse)):
            if not float(v) > 0:
                raise ValueError(f"sensitivity {what} must be positive, got {v}")
        check_bits(self.bits, "sensitivity bits")
        if self.bits == 16:
            raise ValueError("sensitivity bits=16 has no quantization error to rescale; use 2, 3, 4 or 8")
        if self.seq_len < 2 or self.sequences < 1 or self.batch_size < 1:
            raise ValueError(
                f"sensitivity needs seq_len >= 2, sequences >= 1 and batch_size >= 1, got "
                f"{self.seq_len}, {self.sequences}, {self.batch_size}"
            )
        if not self.datasets or not self.seeds:
            raise ValueError("sensitivity needs at least one dataset and one seed")
        for d in self.datasets:
            if d not in data.TEXT_SOURCES:
                raise ValueError(f"unknown sensitivity dataset '{d}'; choose from {', '.join(data.TEXT_SOURCES)}")
        if self.split not in ("train", "test"):
            raise ValueError(f"unknown split '{self.split}' (train or test)")
        if self.dtype not in DTYPES:
            raise ValueError(f"sensitivity dtype '{self.dtype}' is not one of {', '.join(DTYPES)}")
        if self.local and (self.probes < 1 or self.probe_batch < 1 or self.local_sequences < 1):
            raise ValueError("sensitivity probes, probe_batch and local_sequences must be positive")
        if self.interventions < 0:
            raise ValueError(f"sensitivity interventions must be >= 0 (0 = none), got {self.interventions}")
        if self.interventions and not self.local:
            raise ValueError("sensitivity interventions run at the local points: set local=true")
        for what, idx in (("layers", self.layers), ("local_layers", self.local_layers)):
            if idx is not None and (not idx or any(int(i) < 0 for i in idx)):
                raise ValueError(f"sensitivity {what} must be null (all) or a non-empty list of layer indices >= 0")
        CacheSpec(self.bits, self.bits, group=self.group)
        data.wiki_path()  # the packaged corpora live in the gensim wheel

    def cells(self, tokenizer) -> dict[tuple[str, int], torch.Tensor]:
        """(dataset, seed) → (sequences, seq_len) token ids; fails early if a corpus is too short."""
        out = {}
        for d in self.datasets:
            stream = data.token_stream(tokenizer, data.texts(d, self.split))
            for s in self.seeds:
                try:
                    out[(d, s)] = data.windows(stream, self.seq_len, self.sequences, seed=s)
                except ValueError as e:
                    raise ValueError(f"sensitivity dataset '{d}' ({self.split}): {e}") from None
        return out

    def run(self, model, tokenizer, ctx: EvalContext) -> dict:
        layers = mla_layers(model)
        chosen = check_layers(self.layers, len(layers))
        local_set = set(chosen if self.local_layers is None else check_layers(self.local_layers, len(layers)))
        if not self.local:
            local_set = set()
        if not local_set <= set(chosen):
            raise ValueError(f"sensitivity local_layers {sorted(local_set - set(chosen))} are not among the layers")
        if ctx.max_positions and self.seq_len > ctx.max_positions:
            raise ValueError(f"sensitivity seq_len {self.seq_len} exceeds the model's context {ctx.max_positions}")
        cells = self.cells(tokenizer)
        device = placement.execution_device(model)
        dtype = DTYPES[self.dtype]
        gen = torch.Generator().manual_seed(self.probe_seed)
        # the interventions draw from their own stream, so turning them on leaves the probes (Table 5) as they were
        iv_gen = torch.Generator().manual_seed(self.probe_seed + 1)
        records, points = [], []
        saved = [layer.spec for layer in layers]
        bar = progress_bar(total=len(cells) * len(chosen), desc="sensitivity", unit="layer", enabled=ctx.progress)
        try:
            for layer in layers:  # capture the exact model: the layer input is the unperturbed hidden state
                layer.spec = CacheSpec(group=layer.spec.group)
            for (ds, seed), ids in cells.items():
                batches = [
                    (s, capture_inputs(model, ids[s : s + self.batch_size].to(device)))
                    for s in range(0, len(ids), self.batch_size)
                ]
                for li in chosen:
                    twin = frozen_copy(layers[li], dtype)
                    for start, captured in batches:
                        inp = captured[li]
                        for j in range(inp.x.shape[0]):
                            seq = start + j
                            probe = LayerProbe(
                                twin, inp.x[j : j + 1], _row(inp.position_embeddings, j), _row(inp.attention_mask, j)
                            )
                            rec = {"dataset": ds, "seed": seed, "sequence": seq, "layer": li}
                            for b in PATHS:
                                r = probe.response(b, self.target_nmse, self.bits, self.group)
                                rec |= {f"{k}_{b}": v for k, v in r.items()}
                            records.append(rec)
                            if li in local_set and seq < self.local_sequences:
                                pt = {"dataset": ds, "seed": seed, "sequence": seq, "layer": li}
                                for b in PATHS:
                                    lp = probe.local(
                                        b,
                                        self.local_target_nmse,
                                        self.bits,
                                        self.group,
                                        self.probes,
                                        self.probe_batch,
                                        gen,
                                    )
                                    pt |= {f"{k}_{b}": v for k, v in lp.items()}
                                    if self.interventions:
                                        iv = probe.interventions(
                                            b, self.local_target_nmse, self.interventions, self.bits, self.group, iv_gen
                                        )
                                        pt |= {f"{k}_{b}": v for k, v in iv.items()}
                                points.append(pt)
                    del twin
                    bar.update(1)
                    bar.set_postfix(cell=f"{ds}/{seed}", layer=li)
                del batches
                done = [r for r in records if (r["dataset"], r["seed"]) == (ds, seed)]
                log.info(
                    "sensitivity cell %s/%s: %d layers × %d sequences, mean R_C %.4g, mean R_P %.4g",
                    ds,
                    seed,
                    len(chosen),
                    len(ids),
                    sum(r["R_C"] for r in done) / len(done),
                    sum(r["R_P"] for r in done) / len(done),
                )
        finally:
            bar.close()
            for layer, spec in zip(layers, saved):
                layer.spec = spec
        cells_rows = cell_means(records)
        layer_rows = per_layer(cells_rows)
        metrics = model_summary(layer_rows) | {
            "target_nmse": self.target_nmse,
            "cells": [f"{d}/{s}" for d, s in cells],
            "per_layer": layer_rows,
            "per_cell": cells_rows,
            "records": records,
        }
        if points:
            metrics["local"] = predictor_check(points) | {"target_nmse": self.local_target_nmse}
            metrics["local_points"] = points
            if self.interventions:
                metrics["interventions"] = intervention_summary(points) | {
                    "draws": self.interventions,
                    "target_nmse": self.local_target_nmse,
                }
        return metrics
