"""Float32 torch reference of the core, same signatures as the Triton kernels.

Written for clarity: it reads the same pages through the skeleton's quantizer
(:func:`quantmla.quant.quantize`, :func:`~quantmla.quant.pack`, :func:`~quantmla.quant.unpack`,
:meth:`~quantmla.quant.QTensor.dequantize`) and computes absorbed attention (the paper's
eq. 1) request by request in float32::

    S_h = tau (q_lat_h Ĉ^T + q_pe_h K̂_P^T),   A_h = softmax(S_h),   o_lat_h = A_h Ĉ

where a key row is the cache-dtype row when the (query, key) pair is protected and the
dequantized row otherwise, in the scores and in the aggregation, under one softmax.
:func:`dense` is the same attention without pages or padding, for all requests at once.

Queries enter in the cache dtype (``q.to(dtype)``), as the kernels take them. The
teacher-forced :func:`prefill` is differentiable in the queries and the cache-dtype keys
(dequantized rows are stored values: constants), so calibration and probes can use it;
float64 caches are computed in float64 throughout (probes that differentiate in double
precision), everything else in float32.
"""

from __future__ import annotations

import torch

from quantmla.cache import protected_pairs, protected_set
from quantmla.kernels.layout import PAGE
from quantmla.quant import QTensor, pack, quantize, unpack

QUERY_CHUNK = 256


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for a float64 cache, float32 for every other."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def write(layer, block_table, C, K_P, req, pos, lens_after) -> None:
    """Quantize and store tokens ``C`` (T, d_c), ``K_P`` (T, d_r) of requests ``req`` (T,) at
    token indices ``pos`` (T,) into their pages; update the protection buffers, where the ring
    keeps the tokens with ``pos >= lens_after[req] - recent`` (``lens_after``: (B,) lengths
    once these tokens are in)."""
    fmt = layer.fmt
    req, pos = req.long(), pos.long()
    page = block_table[req, pos // PAGE].long()
    slot = pos % PAGE
    v = layer.views
    for path, x, bits, scale_dtype in (
        ("C", C, fmt.content_bits, torch.bfloat16),
        ("R", K_P, fmt.rope_bits, torch.float32),
    ):
        if bits == 16:
            v[f"{path}_rows"][page, slot] = x.to(fmt.dtype)
            continue
        qt = quantize(x, bits, fmt.group, scale_dtype=scale_dtype)
        codes = v[f"{path}_codes"]
        codes[page, slot] = pack(qt.codes, bits).view(-1, *codes.shape[2:])
        v[f"{path}_scale"][page, slot] = qt.scale
        v[f"{path}_zero"][page, slot] = qt.zero
    if layer.prot is None:
        return
    row = torch.cat([C, K_P], -1).to(fmt.dtype)
    sink = pos < layer.sink
    layer.prot[req[sink], pos[sink]] = row[sink]
    if layer.recent:
        ring = pos >= lens_after.long()[req] - layer.recent
        layer.prot[req[ring], layer.sink + pos[ring] % layer.recent] = row[ring]


def stored_rows(layer, block_table, b: int, L: int, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``b``'s first ``L`` tokens as stored in the pages: (C, K_P) in the cache dtype
    (dequantized for quantized paths); with ``exact``, float64 rows with the quantized paths'
    ``s·(q − z)`` computed in float64 (exact) and not rounded."""
    fmt = layer.fmt
    idx = torch.arange(L, device=block_table.device)
    page = block_table[b, idx // PAGE].long()
    slot = idx % PAGE
    out = []
    for path, bits in (("C", fmt.content_bits), ("R", fmt.rope_bits)):
        v = layer.views
        if bits == 16:
            out.append(v[f"{path}_rows"][page, slot].to(torch.float64) if exact else v[f"{path}_rows"][page, slot])
            continue
        if exact:
            q = unpack(v[f"{path}_codes"][page, slot].flatten(-2), bits).double().unflatten(-1, (-1, fmt.group))
            s, z = v[f"{path}_scale"][page, slot].double(), v[f"{path}_zero"][page, slot].double()
            out.append((s.unsqueeze(-1) * (q - z.unsqueeze(-1))).flatten(-2))
            continue
        qt = QTensor(
            codes=unpack(v[f"{path}_codes"][page, slot].flatten(-2), bits),
            scale=v[f"{path}_scale"][page, slot],
            zero=v[f"{path}_zero"][page, slot],
            bits=bits,
            group=fmt.group,
        )
        out.append(qt.dequantize(fmt.dtype))
    return out[0], out[1]


def decode(
    layer, block_table, lengths, q_lat, q_pe, tau: float, config: dict | None = None, out=None, exact: bool = False
):
    """One query per request at token index ``lengths[b] - 1`` over its ``lengths[b]`` cached tokens.

    q_lat (B, H, d_c), q_pe (B, H, d_r). Returns the latent output (B, H, d_c) and the
    log-sum-exp (B, H), float32 (0 and -inf for an empty request), written into ``out``
    when given. ``config`` tunes the kernels and is ignored here. With ``exact`` the dequantized
    rows are ``s·(q − z)`` computed in float64 and kept there, not rounded to the cache dtype, and
    the attention runs in float64.
    """
    fmt = layer.fmt
    cd = torch.float64 if exact else compute_dtype(fmt.dtype)
    B, H, _ = q_lat.shape
    o = torch.zeros(B, H, fmt.d_c, dtype=cd, device=q_lat.device)
    lse = torch.full((B, H), float("-inf"), dtype=cd, device=q_lat.device)
    for b in range(B):
        L = int(lengths[b])
        if L == 0:
            continue
        Ck, Rk = stored_rows(layer, block_table, b, L, exact)
        if layer.prot is not None:
            Ck, Rk = Ck.clone(), Rk.clone()
            for j in protected_set(L, layer.sink, layer.recent):
                r = j if j < layer.sink else layer.sink + j % layer.recent
                Ck[j], Rk[j] = layer.prot[b, r, : fmt.d_c].to(Ck.dtype), layer.prot[b, r, fmt.d_c :].to(Rk.dtype)
        q = q_lat[b].to(fmt.dtype).to(cd)
        qp = q_pe[b].to(fmt.dtype).to(cd)
        s = tau * (q @ Ck.to(cd).T + qp @ Rk.to(cd).T)
        lse[b] = torch.logsumexp(s, -1)
        o[b] = torch.softmax(s, -1) @ Ck.to(cd)
    return _into(out, o.float(), lse.float()) if exact else _into(out, o, lse)


def dense(q_lat, q_pe, C, K_P, tau: float):
    """:func:`prefill` without pages or padding (every request holds all ``L`` keys and its ``n``
    queries are the last ``n`` tokens), computed for all requests at once: no per-request loop and
    no lengths read from the device. Differentiable; what calibration trains through."""
    B, H, n, d_c = q_lat.shape
    L, dtype = C.shape[1], C.dtype
    cd = compute_dtype(dtype)
    keys, rkeys = C.to(cd), K_P.to(cd)
    q, qp = q_lat.to(dtype).to(cd), q_pe.to(dtype).to(cd)
    k_index = torch.arange(L, device=C.device)
    outs, lses = [], []
    for s0 in range(0, n, QUERY_CHUNK):
        s1 = min(n, s0 + QUERY_CHUNK)
        m, J = s1 - s0, L - n + s1  # causal: the chunk's last query sees keys 0 .. J-1, no later one is read
        t = L - n + torch.arange(s0, s1, device=C.device)
        allowed = k_index[:J].unsqueeze(0) <= t.unsqueeze(1)
        k_j, r_j = keys[:, :J], rkeys[:, :J]
        # the heads' queries as rows of one product per request: (B, H·m, d) @ (B, d, J)
        q_c, qp_c = q[:, :, s0:s1].reshape(B, H * m, -1), qp[:, :, s0:s1].reshape(B, H * m, -1)
        s = tau * (q_c @ k_j.transpose(-1, -2) + qp_c @ r_j.transpose(-1, -2))
        s = s.view(B, H, m, J).masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1))
        outs.append((p.view(B, H * m, J) @ k_j).view(B, H, m, d_c))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _into(out, o, lse):
    if out is None:
        return o, lse
    out[0].copy_(o)
    out[1].copy_(lse)
    return out


def prefill(
    q_lat,
    q_pe,
    C,
    K_P,
    kv_len,
    q_len,
    tau: float,
    sink: int,
    recent: int,
    layer=None,
    block_table=None,
    config: dict | None = None,
    out=None,
):
    """Teacher-forced attention with the decode-faithful protection rule (equal to token-by-token decoding).

    Request ``b`` has ``kv_len[b]`` keys: rows of ``C`` (B, L, d_c) and ``K_P`` (B, L, d_r) in
    the cache dtype, and (when ``layer`` is given) their stored copies in ``layer``'s pages
    through ``block_table``. Its ``q_len[b]`` queries ``q_lat[b, :, :q_len[b]]`` (B, H, n, d_c)
    and ``q_pe`` (B, H, n, d_r) are its last tokens: query ``i`` has token index
    ``t = kv_len[b] - q_len[b] + i`` and sees keys ``j <= t``, the cache-dtype row iff
    ``j < sink`` or ``j > t - recent``, else the stored row. Without ``layer`` every key is
    the cache-dtype row. Returns (B, H, n, d_c) and (B, H, n) float32; rows past ``q_len``
    are 0 and -inf (written into ``out`` when given; the result is differentiable otherwise;
    float64 for a float64 cache). ``config`` tunes the kernel and is ignored here, but for its key
    ``exact``: the stored rows are then ``s·(q − z)`` computed in float64 and not rounded to the
    cache dtype, and the attention runs in float64 (returned as float32, as from the kernel).
    """
    B, H, n, d_c = q_lat.shape
    dtype = C.dtype
    exact = bool((config or {}).get("exact")) and layer is not None
    cd = torch.float64 if exact else compute_dtype(dtype)
    outs, lses = [], []
    for b in range(B):
        L, m = int(kv_len[b]), int(q_len[b])
        keys, rkeys = C[b, :L].to(cd), K_P[b, :L].to(cd)
        if layer is not None:
            hat, rhat = (t.to(cd) for t in stored_rows(layer, block_table, b, L, exact))
        q = q_lat[b, :, :m].to(dtype).to(cd)
        qp = q_pe[b, :, :m].to(dtype).to(cd)
        k_index = torch.arange(L, device=C.device)
        o_b, lse_b = [], []
        for s0 in range(0, m, QUERY_CHUNK):
            s1 = min(m, s0 + QUERY_CHUNK)
            t = L - m + torch.arange(s0, s1, device=C.device)
            J = L - m + s1  # causal: the chunk's last query sees keys 0 .. J-1, no later one is read
            k_j = k_index[:J]
            allowed = k_j.unsqueeze(0) <= t.unsqueeze(1)
            s = tau * (q[:, s0:s1] @ keys[:J].T + qp[:, s0:s1] @ rkeys[:J].T)
            if layer is not None:
                keep = protected_pairs(t, k_j, sink, recent)
                s_hat = tau * (q[:, s0:s1] @ hat[:J].T + qp[:, s0:s1] @ rhat[:J].T)
                s = torch.where(keep, s, s_hat)
            s = s.masked_fill(~allowed, float("-inf"))
            lse = torch.logsumexp(s, -1)
            p = torch.exp(s - lse.unsqueeze(-1))
            if layer is not None:
                pk = p * keep
                o_b.append(pk @ keys[:J] + (p - pk) @ hat[:J])
            else:
                o_b.append(p @ keys[:J])
            lse_b.append(lse)
        pad = n - m
        o_b = torch.cat(o_b + [q_lat.new_zeros(H, pad, d_c, dtype=cd)], 1) if m else None
        lse_b = torch.cat(lse_b + [q_lat.new_full((H, pad), float("-inf"), dtype=cd)], 1) if m else None
        if m == 0:
            o_b = q_lat.new_zeros(H, n, d_c, dtype=cd)
            lse_b = q_lat.new_full((H, n), float("-inf"), dtype=cd)
        outs.append(o_b)
        lses.append(lse_b)
    o, lse = torch.stack(outs), torch.stack(lses)
    return _into(out, o.float(), lse.float()) if exact and dtype != torch.float64 else _into(out, o, lse)
