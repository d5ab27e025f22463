"""Held-out cache and output errors of a fused model against the original, computed in float64
with the test's own algebra (shared by the baseline and QuantMLA tests)."""

from __future__ import annotations

import torch

from quantmla.attention import capture_inputs, latent_layers
from quantmla.cache import CacheSpec
from quantmla.transforms import from_state, pair_matrix


def _maps(mla, t):
    """(A, M): the fused caches are z = u A and K' = K_P M (HF post-RoPE layout), per the transform."""
    d = mla.dims
    if t.content:
        R = t.R_C.double() if t.R_C is not None else torch.eye(d.d_c, dtype=torch.float64)
        s = t.s_C.double() if t.s_C is not None else torch.ones(d.d_c, dtype=torch.float64)
        A = R * s
    else:
        A = torch.diag(mla.gamma.detach().double())
    if t.H_P is not None:
        M = t.H_P.double()
    elif t.rope:
        M = pair_matrix(
            mla.post_rope_pairs(),
            d.d_r,
            t.theta_P.double() if t.theta_P is not None else None,
            t.s_P.double() if t.s_P is not None else None,
        )
    else:
        M = torch.eye(d.d_r, dtype=torch.float64)
    return A, M


@torch.no_grad()
def errors(original, fused, state: dict, ids: torch.Tensor, spec: CacheSpec) -> dict:
    """Mean over layers of: content and RoPE cache NMSE in native coordinates, and the attention-output
    NMSE of the fused layer quantized with ``spec`` (no protection) against the original layer."""
    spec = CacheSpec(spec.content_bits, spec.rope_bits, spec.group, protect=False)
    o_layers, f_layers = latent_layers(original), latent_layers(fused)
    transforms = from_state(state, len(o_layers))
    inputs = capture_inputs(original, ids)
    out = {"cache_C": 0.0, "cache_P": 0.0, "output": 0.0, "fused_cache_dev": 0.0}
    for lo, lf, inp, t in zip(o_layers, f_layers, inputs, transforms):
        x, pe, mask = inp.x, inp.position_embeddings, inp.attention_mask
        mo, mf = lo.mla, lf.mla
        c_pre, k_pre = mo.latent_pre(x)
        c64 = c_pre.double()
        u = c64 / torch.sqrt(c64.pow(2).mean(-1, keepdim=True) + mo.norm_eps)
        C = u * mo.gamma.double()
        _, K = mo.rope(mo.queries(x)[1], k_pre, pe)
        K = K.double()
        fc_pre, fk_pre = mf.latent_pre(x)
        Cf = mf.content(fc_pre).double()
        _, Kf = mf.rope(mf.queries(x)[1], fk_pre, pe)
        Kf = Kf.double() if lf.rope_transform is None else Kf.double() @ lf.rope_transform.double()
        A, M = _maps(mo, t)
        dev = max(float((Cf - u @ A).norm() / (u @ A).norm()), float((Kf - K @ M).norm() / (K @ M).norm()))
        out["fused_cache_dev"] = max(out["fused_cache_dev"], dev)
        C_hat = spec.qdq_content(Cf) @ torch.linalg.inv(A) * mo.gamma.double()
        K_hat = spec.qdq_rope(Kf) @ torch.linalg.inv(M)
        out["cache_C"] += float((C_hat - C).pow(2).sum() / C.pow(2).sum())
        out["cache_P"] += float((K_hat - K).pow(2).sum() / K.pow(2).sum())
        lo.spec, lf.spec = CacheSpec(), spec
        try:
            Y = lo(x, position_embeddings=pe, attention_mask=mask)[0].double()
            Yq = lf(x, position_embeddings=pe, attention_mask=mask)[0].double()
        finally:
            lf.spec = CacheSpec()
        out["output"] += float((Yq - Y).pow(2).mean() / Y.pow(2).mean())
    n = len(o_layers)
    return {k: (v if k == "fused_cache_dev" else v / n) for k, v in out.items()}
