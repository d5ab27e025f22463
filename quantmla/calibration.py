"""Calibration plumbing shared by the methods (the paper's §3, App. C): teacher pieces, statistics, objectives.

The teacher is the model as installed (every :class:`~quantmla.attention.LatentAttention`
unquantized). For a batch of token windows, :func:`layer_batches` yields, layer by layer, what
the path objectives need, computed from that layer's captured input: the absorbed-form pieces
(q_nope, post-RoPE Q_P, C, post-RoPE K_P), the weightless latent u and the teacher's
post-``o_proj`` output Y. Each layer sees the teacher's input, so layers are separable.

Objectives, per sample (one window) and layer, averaged by the caller:

- :func:`output_nmse` — the paper's eq. 8: ‖Ŷ − Y‖² / max(‖Y‖², ε), as mean over mean.
- :func:`qk_nmse` — the paper's eq. 10:
  Σ_h ‖Ω ⊙ (Q_P K̂_Pᵀ − Q_P K_Pᵀ)‖² / max(Σ_h ‖Ω ⊙ Q_P K_Pᵀ‖², 1e-8) over
  all heads and causal pairs, unscaled.
- :func:`cache_nmse` — plain cache reconstruction ‖Ĉ − C‖² / ‖C‖² (the objective the paper argues against).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from quantmla import placement
from quantmla.attention import LatentAttention, capture_inputs, latent_layers, layer_output
from quantmla.cache import CacheSpec
from quantmla.mla import MLA
from quantmla.progress import bar
from quantmla.transforms import (
    LayerTransform,
    check_rope_pairing,
    pair_index,
    quantized_content,
    quantized_rope,
    rope_key_maps,
    rope_pairs,
    weightless,
)


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
    """Where the model's inputs go (the first GPU of a model spread over several)."""
    return placement.execution_device(model)


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


class Teacher:
    """Teacher pieces for a bank of windows, by batch.

    Pieces are recomputed with one teacher forward per batch, unless the whole bank fits in
    ``cache_bytes``: then they are computed once and kept (they do not depend on what is being
    calibrated), and any subset of windows is served from memory.
    """

    def __init__(self, model, ids: torch.Tensor, batch_size: int, outputs: bool = True, cache_bytes: float = 0):
        self.model, self.ids, self.batch_size, self.outputs = model, ids, batch_size, outputs
        self.store: list[list[LayerBatch]] | None = None
        if cache_bytes > 0 and len(ids):
            probe = list(layer_batches(model, ids[:1], outputs))
            per_window = sum(_nbytes(lb) for lb in probe)
            if per_window * len(ids) <= cache_bytes and all(lb.mask is None for lb in probe):
                self.store = [[] for _ in probe]
                for batch in batches(ids, batch_size):
                    for lb in layer_batches(model, batch, outputs):
                        self.store[lb.index].extend(_split(lb))

    def __len__(self) -> int:
        return len(self.ids)

    def layers(self, idx: torch.Tensor) -> Iterator[LayerBatch]:
        """Every layer's pieces for the windows ``idx`` of the bank."""
        if self.store is None:
            yield from layer_batches(self.model, self.ids[idx], self.outputs)
            return
        for per_window in self.store:
            yield _cat([per_window[int(i)] for i in idx])

    def __iter__(self) -> Iterator[tuple[int, Iterator[LayerBatch]]]:
        """(windows, layers) for each batch of the bank, in order."""
        for idx in batches(torch.arange(len(self.ids)), self.batch_size):
            yield len(idx), self.layers(idx)


_PIECES = ("q_nope", "Q_P", "C", "K_P", "u", "Y")


def _nbytes(lb: LayerBatch) -> int:
    return sum(t.numel() * t.element_size() for t in (getattr(lb, f) for f in _PIECES) if t is not None)


def _split(lb: LayerBatch) -> list[LayerBatch]:
    B = lb.q_nope.shape[0]
    return [
        LayerBatch(
            lb.index, lb.layer, None, *(None if (t := getattr(lb, f)) is None else t[b : b + 1] for f in _PIECES)
        )
        for b in range(B)
    ]


def _cat(parts: list[LayerBatch]) -> LayerBatch:
    first = parts[0]
    pieces = [None if getattr(first, f) is None else torch.cat([getattr(p, f) for p in parts]) for f in _PIECES]
    return LayerBatch(first.index, first.layer, None, *pieces)


def check_pairing(model, n: int = 32) -> None:
    """Verify every layer's RoPE pairing on the model's own rotary code (before any calibration)."""
    vocab = model.config.vocab_size
    ids = (torch.arange(n) * 7 % vocab).unsqueeze(0)
    inputs = capture_inputs(model, ids.to(model_device(model)))
    for layer, inp in zip(latent_layers(model), inputs):
        check_rope_pairing(layer.mla, inp.position_embeddings)


# ----- numerics ---------------------------------------------------------------------------------
MATMUL_PRECISIONS = ("highest", "high", "medium")


@contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """torch's float32 matrix-multiply precision (:func:`torch.set_float32_matmul_precision`) for the
    duration, then the one before. ``highest``: IEEE float32; ``high``: TensorFloat-32 inputs (10
    mantissa bits, float32 accumulation) on GPUs that have it (Ampere and later); ``medium``: bfloat16
    inputs. On a CPU the lower precisions apply only where oneDNN has such products (AMX)."""
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision '{precision}' is not one of {', '.join(MATMUL_PRECISIONS)}")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# ----- objectives -------------------------------------------------------------------------------
def _per_sample_mean(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).mean(1)


def output_nmse(Y_hat: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """(B,) normalized output MSE of the paper's eq. 8 (mean squared error over the teacher's mean square)."""
    Y = Y.float()
    return _per_sample_mean((Y_hat.float() - Y).pow(2)) / _per_sample_mean(Y.pow(2)).clamp_min(1e-8)


def cache_nmse(c_hat: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(B,) relative squared reconstruction error of a cache."""
    c = c.float()
    return (c_hat.float() - c).pow(2).flatten(1).sum(1) / c.pow(2).flatten(1).sum(1).clamp_min(1e-30)


def qk_nmse(Q_P: torch.Tensor, K_P: torch.Tensor, K_hat: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """(B,) the paper's L_P (eq. 10) for one layer: all heads, all causal pairs (diagonal included), unscaled.

    Chunked over query blocks. The score error is formed as Q_P (K̂_P − K_P)ᵀ, which equals
    Q_P K̂_Pᵀ − Q_P K_Pᵀ without the cancellation of two large score matrices.
    """
    Q, K = Q_P.float(), K_P.float()
    E = (K_hat.float() - K).transpose(-1, -2)
    Kt = K.transpose(-1, -2)
    n = Q.shape[2]
    keys = torch.arange(n, device=Q.device)
    num = den = 0.0
    for s in range(0, n, chunk):
        q = Q[:, :, s : s + chunk]
        J = s + q.shape[2]  # causal: keys after the block's last query are never read
        future = keys[:J].unsqueeze(0) > torch.arange(s, J, device=Q.device).unsqueeze(1)
        num = num + (q @ E[..., :J]).masked_fill(future, 0.0).pow(2).sum((1, 2, 3))
        with torch.no_grad():
            den = den + (q @ Kt[..., :J]).masked_fill(future, 0.0).pow(2).sum((1, 2, 3))
    return num / den.clamp_min(1e-8)


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def content_loss(
    lb: LayerBatch,
    bits: int,
    R: torch.Tensor | None = None,
    s: torch.Tensor | None = None,
    content: bool = True,
    objective: str = "output",
    group: int = 64,
    ste: bool = False,
) -> torch.Tensor:
    """(B,) content-path loss with the RoPE path exact: L_C (``output``) or plain ``cache_mse``."""
    R, s = _to(R, lb.u.device), _to(s, lb.u.device)
    C_hat = quantized_content(lb.u, lb.mla.gamma, bits, R, s, content, group, ste)
    if objective == "output":
        return output_nmse(lb.output(C=C_hat), lb.Y)
    if objective == "cache_mse":
        return cache_nmse(C_hat, lb.C)
    raise ValueError(f"unknown content objective '{objective}'")


def rope_loss(
    lb: LayerBatch,
    bits: int,
    M: torch.Tensor | None = None,
    M_inv: torch.Tensor | None = None,
    objective: str = "qk",
    group: int = 64,
    ste: bool = False,
) -> torch.Tensor:
    """(B,) RoPE-path loss with the content path exact: L_P (``qk``) or the attention ``output`` NMSE."""
    M, M_inv = _to(M, lb.K_P.device), _to(M_inv, lb.K_P.device)
    K_hat = quantized_rope(lb.K_P, bits, M, M_inv, group, ste)
    if objective == "qk":
        return qk_nmse(lb.Q_P, lb.K_P, K_hat)
    if objective == "output":
        return output_nmse(lb.output(K_P=K_hat), lb.Y)
    raise ValueError(f"unknown RoPE objective '{objective}'")


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

    The paper's eq. 37 (on tensors it leaves open): content on the weightless latent u, RoPE on the cached post-RoPE key
    with both channels of a frequency pair pooled.
    """
    tokens = ids.numel()
    acc_C: list[Percentile] = []
    acc_P: list[Percentile] = []
    for batch in bar(list(batches(ids, batch_size)), desc="statistics", unit="batch", enabled=progress):
        for lb in layer_batches(model, batch, outputs=False):
            if lb.index == len(acc_C):
                acc_C.append(Percentile(tokens, q))
                acc_P.append(Percentile(2 * tokens, q))
            d_c, d_r = lb.mla.dims.d_c, lb.mla.dims.d_r
            _, post = rope_pairs(lb.mla)
            acc_C[lb.index].update(lb.u.abs().reshape(-1, d_c))
            k = lb.K_P.float().abs().reshape(-1, d_r)
            a, b = pair_index(post, k.device)
            acc_P[lb.index].update(torch.cat([k[:, a], k[:, b]]))
    return [a.result() for a in acc_C], [a.result() for a in acc_P]


def alpha_log_scales(
    a: torch.Tensor, alpha: float, clip: float = 2.0, live: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 37/42: log s_j = clip(α [mean_k log ã_k − log ã_j], −clip, clip), ã = max(a, 1e-8).

    ``live`` (bool, content path) restricts the mean to live latent channels; dead ones get 0.
    """
    la = torch.log(a.float().clamp_min(1e-8))
    if live is None:
        return (alpha * (la.mean() - la)).clamp(-clip, clip)
    live = live.to(la.device)
    out = (alpha * (la[live].mean() - la)).clamp(-clip, clip)
    return torch.where(live, out, torch.zeros_like(out))


@torch.no_grad()
def heldout_mean(
    teacher: Teacher, fn: Callable[[LayerBatch], dict], desc: str = "held-out", progress: bool = True
) -> dict:
    """Mean over windows and layers of the per-sample losses ``fn`` returns for each layer batch.

    The sums stay on the device, in float64 and in the same order as a host sum of each layer's
    float32 total would add them (the same value), and are read once at the end: a read per layer
    would make the host wait for the device 240 times per validation of a 30-layer model."""
    sums: dict = {}
    count = 0
    n_batches = -(-len(teacher) // teacher.batch_size)
    for windows, layers in bar(teacher, total=n_batches, desc=desc, unit="batch", enabled=progress, leave=False):
        n_layers = 0
        for lb in layers:
            for k, v in fn(lb).items():
                total = v.sum().double()
                sums[k] = total if k not in sums else sums[k] + total.to(sums[k].device)
            n_layers += 1
        count += windows * n_layers
    return {k: float(v) / count for k, v in sums.items()}


def transform_objectives(
    model,
    ids: torch.Tensor,
    batch_size: int,
    transforms: list[LayerTransform],
    spec: CacheSpec,
    content_objective: str = "output",
    rope_objective: str = "qk",
    progress: bool = False,
) -> dict:
    """Held-out path objectives of per-layer transforms on the unfused model (each path with the other
    exact): ``L_C`` at the spec's content bits and ``L_P`` at its RoPE bits. Any method's transforms
    (an empty :class:`LayerTransform` is RTN) are comparable this way."""

    def fn(lb: LayerBatch) -> dict:
        t, out = transforms[lb.index], {}
        if spec.content_bits < 16:
            out["L_C"] = content_loss(lb, spec.content_bits, t.R_C, t.s_C, t.content, content_objective, spec.group)
        if spec.rope_bits < 16:
            M, M_inv = rope_key_maps(lb.mla, t)
            out["L_P"] = rope_loss(lb, spec.rope_bits, M, M_inv, rope_objective, spec.group)
        return out

    need_y = content_objective == "output" or rope_objective == "output"
    return heldout_mean(Teacher(model, ids, batch_size, need_y), fn, desc="objectives", progress=progress)


# -- keys of stored calibration results: what a result was computed from ---------------------------------
def model_fingerprint(model, name: str = "") -> str:
    """Hash of the model's class, config and every parameter (shape, dtype, edge values and sum)."""
    h = hashlib.sha256(f"{name}|{type(model).__name__}|{model.config.to_json_string()}".encode())
    with torch.no_grad():
        for pname, p in placement.named_parameters(model):
            t = p.detach().flatten()
            edges = torch.cat([t[:32], t[-32:]]).float().cpu()
            h.update(f"{pname}|{tuple(p.shape)}|{p.dtype}|{float(t.sum(dtype=torch.float64)):.6e}".encode())
            h.update(edges.numpy().tobytes())
    return h.hexdigest()


def tensor_digest(*ts: torch.Tensor) -> str:
    """Hash of the tensors' contents (a calibration's token banks)."""
    h = hashlib.sha256()
    for t in ts:
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def entry_key(blob: dict) -> str:
    """The key of a stored result: a short hash of everything it was computed from (JSON-able)."""
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:24]
