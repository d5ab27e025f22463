"""Attention over the latent cache in absorbed form (spec §1.2, Eq. 1).

    S_h = tau (q_lat_h C^T + Q_P,h K_P^T),   A_h = softmax(S_h),   o_lat_h = A_h C

With a quantized cache every (query, key) pair uses either the BF16 row or the
dequantized row of the key, as the protection mask says, in the scores *and* the
aggregation, under one softmax (spec §9 item 1):
O = (P ⊙ M) C + (P ⊙ ¬M) Ĉ.

This is the torch reference the harness runs on CPU. It is written for clarity, computes
in float32 (float64 when the caches are float64, for the sensitivity probes) and processes
queries in chunks to bound memory.
"""

from __future__ import annotations

import torch

QUERY_CHUNK = 256


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def latent_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    C: torch.Tensor,
    K_P: torch.Tensor,
    C_hat: torch.Tensor | None,
    K_P_hat: torch.Tensor | None,
    allowed: torch.Tensor,
    protect: torch.Tensor | None,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent output (B, H, n, d_c) and log-sum-exp (B, H, n), both float32 (float64 if C is).

    q_lat (B, H, n, d_c) and q_pe (B, H, n, d_r) are the absorbed content query and the
    post-RoPE query; C (B, 1, L, d_c) and K_P (B, 1, L, d_r) the BF16 caches; C_hat and
    K_P_hat their dequantized copies (None: the cache is not quantized); ``allowed``
    (B, 1, n, L) the attention mask; ``protect`` (B, 1, n, L) True where the BF16 row is
    used (None: every pair uses the dequantized rows).
    """
    dt = compute_dtype(C)
    C, K_P = C.to(dt), K_P.to(dt)
    quantized = C_hat is not None
    if quantized:
        C_hat, K_P_hat = C_hat.to(dt), K_P_hat.to(dt)
    outs, lses = [], []
    n = q_lat.shape[2]
    for s in range(0, n, QUERY_CHUNK):
        e = min(n, s + QUERY_CHUNK)
        ql, qp, ok = q_lat[:, :, s:e].to(dt), q_pe[:, :, s:e].to(dt), allowed[:, :, s:e]
        scores = tau * (ql @ C.transpose(-1, -2) + qp @ K_P.transpose(-1, -2))
        if quantized:
            scores_hat = tau * (ql @ C_hat.transpose(-1, -2) + qp @ K_P_hat.transpose(-1, -2))
            keep = protect[:, :, s:e] if protect is not None else torch.zeros_like(ok)
            scores = torch.where(keep, scores, scores_hat)
        scores = scores.masked_fill(~ok, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        empty = torch.isinf(lse)  # a query that sees no key (padding): output 0
        p = torch.exp(scores - torch.where(empty, 0.0, lse).unsqueeze(-1))
        if quantized:
            pk = p * keep
            out = pk @ C + (p - pk) @ C_hat
        else:
            out = p @ C
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)
