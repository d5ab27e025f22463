"""Calibration plumbing shared by the methods (spec §5): teacher pieces, statistics, objectives.

The teacher is the model as installed (every :class:`~quantmla.attention.LatentAttention`
unquantized). For a batch of token windows, :func:`layer_batches` yields, layer by layer, what
the path objectives need, computed from that layer's captured input: the absorbed-form pieces
(q_nope, post-RoPE Q_P, C, post-RoPE K_P), the weightless latent u and the teacher's
post-``o_proj`` output Y. Each layer sees the teacher's input, so layers are separable.

Objectives, per sample (one window) and layer, averaged by the caller:

- :func:`output_nmse` — spec §5.1: ‖Ŷ − Y‖² / max(‖Y‖², ε), as mean over mean.
- :func:`qk_nmse` — spec §5.2: Σ_h ‖Ω ⊙ (Q_P K̂_Pᵀ − Q_P K_Pᵀ)‖² / max(Σ_h ‖Ω ⊙ Q_P K_Pᵀ‖², 1e-8) over
  all heads and causal pairs, unscaled.
- :func:`cache_nmse` — plain cache reconstruction ‖Ĉ − C‖² / ‖C‖² (the objective the paper argues against).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from quantmla.attention import LatentAttention, capture_inputs, latent_layers, layer_output
from quantmla.mla import MLA
from quantmla.transforms import check_rope_pairing, rope_pairs, weightless


@dataclass
class LayerBatch:
    """Teacher pieces of one layer on one batch (no gradient)."""

    index: int
    layer: LatentAttention
    mask: torch.Tensor | None
    q_nope: torch.Tensor  # (B, H, n, d_nope)
    Q_P: torch.Tensor  # (B, H, n, d_r) post-RoPE
    C: torch.Tensor  # (B, 1, n, d_c) native cache
    K_P: torch.Tensor  # (B, 1, n, d_r) post-RoPE cache
    u: torch.Tensor  # (B, 1, n, d_c) float32 weightless latent
    Y: torch.Tensor | None  # (B, n, d_model) post-o_proj teacher output

    @property
    def mla(self) -> MLA:
        return self.layer.mla

    def output(self, C: torch.Tensor | None = None, K_P: torch.Tensor | None = None) -> torch.Tensor:
        """Post-``o_proj`` output with the given caches in place of the teacher's (differentiable)."""
        C = self.C if C is None else C
        K_P = self.K_P if K_P is None else K_P
        return layer_output(self.layer, self.q_nope, self.Q_P, C, K_P, self.mask)


def batches(ids: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for s in range(0, len(ids), batch_size):
        yield ids[s : s + batch_size]


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def layer_batches(model, ids: torch.Tensor, outputs: bool = True) -> Iterator[LayerBatch]:
    """Teacher pieces of every MLA layer for a batch of windows (one teacher forward)."""
    ids = ids.to(model_device(model))
    inputs = capture_inputs(model, ids)
    for i, (layer, inp) in enumerate(zip(latent_layers(model), inputs)):
        with torch.no_grad():
            mla = layer.mla
            q_nope, q_pe = mla.queries(inp.x)
            c_pre, k_pre = mla.latent_pre(inp.x)
            Q_P, K_P = mla.rope(q_pe, k_pre, inp.position_embeddings)
            if layer.rope_transform is not None:
                Q_P, K_P = Q_P @ layer.rope_transform.to(Q_P.dtype), K_P @ layer.rope_transform.to(K_P.dtype)
            C = mla.content(c_pre)
            lb = LayerBatch(i, layer, inp.attention_mask, q_nope, Q_P, C, K_P, weightless(c_pre, mla.norm_eps), None)
            if outputs:
                lb.Y = lb.output()
        yield lb


def check_pairing(model, n: int = 32) -> None:
    """Verify every layer's RoPE pairing on the model's own rotary code (before any calibration)."""
    vocab = model.config.vocab_size
    ids = (torch.arange(n) * 7 % vocab).unsqueeze(0)
    inputs = capture_inputs(model, ids.to(model_device(model)))
    for layer, inp in zip(latent_layers(model), inputs):
        check_rope_pairing(layer.mla, inp.position_embeddings)


# ----- objectives -------------------------------------------------------------------------------
def _per_sample_mean(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).mean(1)


def output_nmse(Y_hat: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """(B,) normalized output MSE of spec §5.1 (mean squared error over the teacher's mean square)."""
    Y = Y.float()
    return _per_sample_mean((Y_hat.float() - Y).pow(2)) / _per_sample_mean(Y.pow(2)).clamp_min(1e-8)


def cache_nmse(c_hat: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(B,) relative squared reconstruction error of a cache."""
    c = c.float()
    return (c_hat.float() - c).pow(2).flatten(1).sum(1) / c.pow(2).flatten(1).sum(1).clamp_min(1e-30)


def qk_gram(Q_P: torch.Tensor) -> torch.Tensor:
    """G_j = Σ_h Σ_{i ≥ j} q_{h,i}ᵀ q_{h,i}: (B, n, d_r, d_r), float32.

    For any key error e_j, Σ_h Σ_{i ≥ j} (q_{h,i} · e_j)² = e_j G_j e_jᵀ, so the positional QK error
    summed over all heads and causal pairs is Σ_j e_j G_j e_jᵀ: exact, with no n × n score matrix.
    """
    outer = torch.einsum("bhid,bhie->bide", Q_P.float(), Q_P.float())
    return outer.flip(1).cumsum(1).flip(1)


def qk_nmse(G: torch.Tensor, K_P: torch.Tensor, K_hat: torch.Tensor) -> torch.Tensor:
    """(B,) spec §5.2's L_P for one layer: causal, all heads, unscaled, from the Gram form of :func:`qk_gram`."""
    K = K_P.float().squeeze(1)
    e = K_hat.float().squeeze(1) - K
    num = torch.einsum("bjd,bjde,bje->b", e, G, e)
    den = torch.einsum("bjd,bjde,bje->b", K, G, K)
    return num / den.clamp_min(1e-8)


def qk_nmse_direct(Q_P: torch.Tensor, K_P: torch.Tensor, K_hat: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The same quantity computed from score matrices, chunked over query blocks (reference)."""
    Q, K, Kh = Q_P.float(), K_P.float(), K_hat.float()
    n = Q.shape[2]
    num = torch.zeros(Q.shape[0], dtype=Q.dtype, device=Q.device)
    den = torch.zeros_like(num)
    keys = torch.arange(n, device=Q.device)
    for s in range(0, n, chunk):
        q = Q[:, :, s : s + chunk]
        causal = keys.unsqueeze(0) <= torch.arange(s, s + q.shape[2], device=Q.device).unsqueeze(1)
        Z = (q @ K.transpose(-1, -2)) * causal
        Zh = (q @ Kh.transpose(-1, -2)) * causal
        num = num + (Zh - Z).pow(2).sum((1, 2, 3))
        den = den + Z.pow(2).sum((1, 2, 3))
    return num / den.clamp_min(1e-8)


# ----- statistics -------------------------------------------------------------------------------
class Percentile:
    """Exact per-channel q-quantile (torch.quantile's linear interpolation) of a stream of rows.

    Keeps only the top k = total − ⌊(total − 1) q⌋ values of each channel, which hold both
    order statistics the interpolation needs.
    """

    def __init__(self, total: int, q: float):
        if not 0.0 < q <= 1.0:
            raise ValueError(f"percentile must be in (0, 100], got {100 * q}")
        self.total, self.q, self.seen = total, q, 0
        self.k = total - math.floor((total - 1) * q)
        self.top: torch.Tensor | None = None

    def update(self, rows: torch.Tensor) -> None:
        rows = rows.float()
        both = rows if self.top is None else torch.cat([self.top, rows])
        self.top = both.topk(min(self.k, len(both)), dim=0).values
        self.seen += len(rows)

    def result(self) -> torch.Tensor:
        if self.seen != self.total:
            raise RuntimeError(f"percentile expected {self.total} rows, saw {self.seen}")
        pos = (self.total - 1) * self.q
        lo = math.floor(pos)
        hi = min(lo + 1, self.total - 1)
        v_lo, v_hi = self.top[self.total - 1 - lo], self.top[self.total - 1 - hi]
        return v_lo + (pos - lo) * (v_hi - v_lo)


@torch.no_grad()
def activation_percentiles(
    model, ids: torch.Tensor, batch_size: int, q: float = 0.999, progress: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: a_C (d_c,) percentile of |u| per channel; a_P (d_r/2,) of |K_P| pooled per pair.

    Spec §5.5 / §9 item 7: content on the weightless latent u, RoPE on the cached post-RoPE key
    with both channels of a frequency pair pooled.
    """
    tokens = ids.numel()
    acc_C: list[Percentile] = []
    acc_P: list[Percentile] = []
    for batch in tqdm(list(batches(ids, batch_size)), desc="statistics", unit="batch", disable=not progress):
        for lb in layer_batches(model, batch, outputs=False):
            if lb.index == len(acc_C):
                acc_C.append(Percentile(tokens, q))
                acc_P.append(Percentile(2 * tokens, q))
            d_c, d_r = lb.mla.dims.d_c, lb.mla.dims.d_r
            _, post = rope_pairs(lb.mla)
            acc_C[lb.index].update(lb.u.abs().reshape(-1, d_c))
            k = lb.K_P.float().abs().reshape(-1, d_r)
            a = torch.tensor([p[0] for p in post], device=k.device)
            b = torch.tensor([p[1] for p in post], device=k.device)
            acc_P[lb.index].update(torch.cat([k[:, a], k[:, b]]))
    return [a.result() for a in acc_C], [a.result() for a in acc_P]


def alpha_log_scales(a: torch.Tensor, alpha: float, clip: float = 2.0) -> torch.Tensor:
    """Eq. 37/42: log s_j = clip(α [mean_k log ã_k − log ã_j], −clip, clip), ã = max(a, 1e-8)."""
    la = torch.log(a.float().clamp_min(1e-8))
    return (alpha * (la.mean() - la)).clamp(-clip, clip)


@torch.no_grad()
def heldout_mean(
    model,
    ids: torch.Tensor,
    batch_size: int,
    fn: Callable[[LayerBatch], dict],
    outputs: bool = True,
    desc: str = "held-out",
    progress: bool = True,
) -> dict:
    """Mean over windows and layers of the per-sample losses ``fn`` returns for each layer batch."""
    sums: dict = {}
    count = 0
    for batch in tqdm(list(batches(ids, batch_size)), desc=desc, unit="batch", disable=not progress, leave=False):
        layers = 0
        for lb in layer_batches(model, batch, outputs=outputs):
            for k, v in fn(lb).items():
                sums[k] = sums.get(k, 0.0) + float(v.sum())
            layers += 1
        count += len(batch) * layers
    return {k: v / count for k, v in sums.items()}
