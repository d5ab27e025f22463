"""Per-layer cache transforms and their offline fusion into MLA weights (the paper's App. C and D.2).

Every method describes what it does to one layer with a :class:`LayerTransform`:

- content path (the paper's §3.1, App. C.1): the cache becomes ``z_C = u R_C S_C``, with ``u`` the weightless
  RMSNorm of the latent, ``R_C`` orthogonal and ``S_C = diag(s_C)`` positive. The norm weight
  becomes ``s_C`` and every consumer gets ``S_C^-1 R_C^T Γ``. With neither set the layer keeps
  its native cache ``C = u Γ``.
- RoPE path, folded (the paper's Prop. 1, App. C.2): one angle ``theta_P`` and one tied scale ``s_P`` per
  frequency pair, ``K_P' = K_P R_P S_P`` and ``Q_P' = Q_P R_P S_P^-1``, folded into the
  pre-RoPE key rows of ``kv_a_proj_with_mqa`` and every head's pre-RoPE query rows.
- RoPE path, online (QuaRot†, the paper's App. D.2): ``H_P``, an orthogonal d_r × d_r map applied after RoPE to both
  q_pe and k_pe (QuaRot†'s Hadamard, which does not commute with RoPE and so cannot be folded).
  It runs in :class:`~quantmla.attention.LatentAttention` (``rope_transform``).

:func:`fuse` folds a transform into one layer through its adapter, in float32, then casts back
to the weight dtype (float64 weights are fused in float64). :func:`quantized_content` and :func:`quantized_rope` give the caches a
quantized fused layer effectively uses, mapped back to native coordinates: this is the
training-time forward of the two paths, which equals the fused model with QDQ inserted.

Dead latent channels: a channel whose norm weight Γ is zero never reaches a consumer and is
cached as zero (the embedded ``smollm2_mla`` model has such a group). Content transforms keep
those channels out: ``R_C`` must be the identity on them and never mix them with live
channels (:func:`embed_live` builds such a matrix), their fused norm weight stays zero, and
scale statistics are taken over live channels only. Real checkpoints have no dead channels,
so this changes nothing for them.

Row-vector convention: a paper matrix ``W`` is ``weight.T`` of an ``nn.Linear``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import torch

from quantmla import placement
from quantmla.mla import MLA
from quantmla.quant import qdq

ROPE_STYLES = ("complex", "interleave", "half")


# ----- building blocks ------------------------------------------------------------------------
def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix (n a power of two): H H^T = I, symmetric, no random signs."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return (H / math.sqrt(n)).to(dtype)


def block_hadamard(d: int, block: int | None = None) -> torch.Tensor:
    """Block-diagonal normalized Hadamard of width ``d`` (``block=None``: one block of size d)."""
    block = d if block is None else block
    if d % block:
        raise ValueError(f"Hadamard size {block} does not divide the dimension {d}")
    return torch.block_diag(*[hadamard(block)] * (d // block))


def live_channels(mla: MLA) -> torch.Tensor:
    """(d_c,) bool: latent channels whose norm weight Γ is non-zero (the others are cached as zero)."""
    return (mla.gamma != 0).detach().cpu()


def embed_live(R_live: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A d_c × d_c map acting as ``R_live`` on the live channels and as the identity on dead ones."""
    idx = live.nonzero().flatten()
    if R_live.shape != (idx.numel(), idx.numel()):
        raise ValueError(f"a {tuple(R_live.shape)} map does not fit {idx.numel()} live latent channels")
    R = torch.eye(live.numel(), dtype=R_live.dtype)
    R[idx.unsqueeze(1), idx.unsqueeze(0)] = R_live
    return R


def live_pairs_mask(live: torch.Tensor) -> torch.Tensor:
    """(d_c, d_c) float mask of the entries a content rotation may use: live × live."""
    f = live.float()
    return f.unsqueeze(1) * f.unsqueeze(0)


def cayley(P: torch.Tensor) -> torch.Tensor:
    """R = (I - A)(I + A)^-1 with A = P - P^T (a Cayley form; the paper does not give its variant):
    orthogonal, R = I at P = 0."""
    A = P - P.transpose(-1, -2)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    # (I - A) and (I + A) commute, so (I - A)(I + A)^-1 = (I + A)^-1 (I - A). I + A is invertible for
    # every skew A (its eigenvalues are 1 + iλ), so solve_ex: solve's check of that reads the GPU's result
    return torch.linalg.solve_ex(eye + A, eye - A).result


def check_pairs(pairs: list[tuple[int, int]], d_r: int, what: str) -> None:
    flat = sorted(i for p in pairs for i in p)
    if len(pairs) != d_r // 2 or flat != list(range(d_r)):
        raise ValueError(f"{what} {pairs[:3]}… are not a split of the {d_r} RoPE channels into {d_r // 2} pairs")


def pair_index(pairs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second channels of every pair, as index tensors on ``device``. Built once per
    pairing and device: a calibration step asks for them for every layer, and each new tensor copied
    to a GPU waits for the work queued before it."""
    return _pair_index(tuple((int(a), int(b)) for a, b in pairs), None if device is None else torch.device(device))


@functools.lru_cache(maxsize=1024)
def _pair_index(pairs: tuple[tuple[int, int], ...], device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([p[0] for p in pairs], device=device), torch.tensor([p[1] for p in pairs], device=device)


def pair_matrix(
    pairs: list[tuple[int, int]],
    d_r: int,
    theta: torch.Tensor | None = None,
    s: torch.Tensor | None = None,
    inverse_scale: bool = False,
) -> torch.Tensor:
    """R_P S_P (or R_P S_P^-1) as a d_r × d_r row-vector map, in the channel order of ``pairs``.

    Pair i = (a, b) gets the planar rotation [[cos θ_i, sin θ_i], [-sin θ_i, cos θ_i]] on rows/columns
    (a, b) and the scale s_i on both channels. Differentiable in ``theta`` and ``s``.
    """
    ref = theta if theta is not None else s
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else None
    half = len(pairs)
    a, b = pair_index(pairs, device)
    th = theta if theta is not None else torch.zeros(half, dtype=dtype, device=device)
    sc = s if s is not None else torch.ones(half, dtype=dtype, device=device)
    if inverse_scale:
        sc = 1.0 / sc
    c, sn = torch.cos(th) * sc, torch.sin(th) * sc
    M = torch.zeros(d_r, d_r, dtype=dtype, device=device)
    M = M.index_put((a, a), c).index_put((a, b), sn).index_put((b, a), -sn).index_put((b, b), c)
    return M


def interleaved_order(post_pairs: list[tuple[int, int]], d_r: int) -> torch.Tensor:
    """Permutation P with (x P)[2i], (x P)[2i+1] = x[a_i], x[b_i]: post-RoPE tensor → native interleaved order."""
    P = torch.zeros(d_r, d_r)
    for i, (a, b) in enumerate(post_pairs):
        P[a, 2 * i] = 1.0
        P[b, 2 * i + 1] = 1.0
    return P


# ----- what a method does to one layer ----------------------------------------------------------
@dataclass
class LayerTransform:
    R_C: torch.Tensor | None = None  # (d_c, d_c) orthogonal
    s_C: torch.Tensor | None = None  # (d_c,) positive
    theta_P: torch.Tensor | None = None  # (d_r/2,) angle per frequency pair
    s_P: torch.Tensor | None = None  # (d_r/2,) positive, tied within a pair
    H_P: torch.Tensor | None = None  # (d_r, d_r) orthogonal, online post-RoPE (HF post-RoPE layout)

    @property
    def content(self) -> bool:
        return self.R_C is not None or self.s_C is not None

    @property
    def rope(self) -> bool:
        return self.theta_P is not None or self.s_P is not None

    def detach(self) -> LayerTransform:
        return LayerTransform(**{f.name: _det(getattr(self, f.name)) for f in fields(self)})


def _det(t):
    return None if t is None else t.detach().float().cpu().contiguous()


def to_state(transforms: list[LayerTransform]) -> dict[str, torch.Tensor]:
    """Flat ``{"<layer>.<field>": tensor}`` (safetensors-ready) from per-layer transforms."""
    out = {}
    for i, t in enumerate(transforms):
        for f in fields(t):
            v = getattr(t, f.name)
            if v is not None:
                out[f"{i}.{f.name}"] = _det(v)
    return out


def from_state(state: dict[str, torch.Tensor], n_layers: int) -> list[LayerTransform]:
    out = [LayerTransform() for _ in range(n_layers)]
    names = {f.name for f in fields(LayerTransform)}
    for key, v in state.items():
        i, _, name = key.partition(".")
        if name not in names or not i.isdigit() or int(i) >= n_layers:
            raise ValueError(f"unexpected transform entry '{key}' for a model of {n_layers} MLA layers")
        setattr(out[int(i)], name, v)
    return out


# ----- RoPE pairing -----------------------------------------------------------------------------
def rope_pairs(mla: MLA) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(pre-RoPE, post-RoPE) frequency pairs of a layer; ValueError if they cannot be determined."""
    name = type(mla).__name__
    style = getattr(mla, "rope_style", None)
    if style not in ROPE_STYLES:
        raise ValueError(
            f"cannot determine the RoPE pairing of {name}: rope_style '{style}' is not one of {', '.join(ROPE_STYLES)}"
        )
    d_r = mla.dims.d_r
    if d_r % 2:
        raise ValueError(f"cannot determine the RoPE pairing of {name}: odd RoPE width {d_r}")
    pre, post = mla.rope_pairs(), mla.post_rope_pairs()
    check_pairs(pre, d_r, f"cannot determine the RoPE pairing of {name}: pre-RoPE pairs")
    check_pairs(post, d_r, f"cannot determine the RoPE pairing of {name}: post-RoPE pairs")
    return pre, post


def _float_pe(pe):
    if isinstance(pe, (tuple, list)):
        return type(pe)(t.float() for t in pe)
    return pe if pe.is_complex() else pe.float()


@torch.no_grad()
def check_rope_pairing(mla: MLA, position_embeddings, tol: float = 1e-4, seed: int = 0) -> float:
    """Check on the model's own rotary code that pair-tied transforms commute with its RoPE.

    For random angles and tied scales M (built in the pre-RoPE pairing) and M' (the same
    transform in the post-RoPE pairing), RoPE_p(x M) must equal RoPE_p(x) M' at every position
    of ``position_embeddings`` (spec Prop. 1). Returns the relative error; raises ValueError
    (the pairing cannot be determined) above ``tol``.
    """
    pre, post = rope_pairs(mla)
    d_r = mla.dims.d_r
    pe = _float_pe(position_embeddings)
    n = (pe[0] if isinstance(pe, (tuple, list)) else pe).shape[-2]
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(d_r // 2, generator=g, dtype=torch.float64) * 2 * math.pi
    s = torch.exp(torch.randn(d_r // 2, generator=g, dtype=torch.float64) * 0.5)
    x = torch.randn(2, 1, n, d_r, generator=g, dtype=torch.float64).float()
    dev = (pe[0] if isinstance(pe, (tuple, list)) else pe).device
    x = x.to(dev)
    M_pre = pair_matrix(pre, d_r, theta, s).float().to(dev)
    M_post = pair_matrix(post, d_r, theta, s).float().to(dev)
    lhs, _ = mla.rope(x @ M_pre, x, pe)
    rhs, _ = mla.rope(x, x, pe)
    rhs = rhs @ M_post
    err = float((lhs - rhs).abs().max() / rhs.abs().max().clamp_min(1e-30))
    if not err <= tol:
        raise ValueError(
            f"cannot determine the RoPE pairing of {type(mla).__name__} (rope_style '{mla.rope_style}'): "
            f"a pair-tied transform on its pairs does not commute with its RoPE (relative error {err:.2e})"
        )
    return err


# ----- offline fusion ---------------------------------------------------------------------------
# A layer of a model spread over devices is fused on the device it computes on, its offloaded weights
# loaded for the duration and the results written back into accelerate's store (quantmla.placement).
def _work(module: torch.nn.Module):
    """Cast to the fusion's working precision on the device ``module`` computes on: float32, or float64
    for float64 weights."""
    dtype = torch.float64 if module.weight.dtype == torch.float64 else torch.float32
    device = placement.execution_device(module)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=dtype)

    return cast


def fuse_content(mla: MLA, R: torch.Tensor | None = None, s: torch.Tensor | None = None) -> None:
    """Eq. 22: W_a' = W_a R (bias too), Γ' = S, W_b' = S^-1 R^T Γ W_b. Γ is folded into kv_b_proj."""
    kva, kvb, norm = mla.kv_a_proj_with_mqa, mla.kv_b_proj, mla.kv_a_layernorm
    with placement.loaded(kva, kvb, norm):
        _fuse_content(mla, kva, kvb, norm, R, s)


def _fuse_content(mla: MLA, kva, kvb, norm, R, s) -> None:
    d_c = mla.dims.d_c
    w = _work(kva)
    g = w(mla.gamma)
    R = None if R is None else w(R)
    s = w(torch.ones(d_c)) if s is None else w(s)
    if R is not None:
        W = w(kva.weight).clone()
        W[:d_c] = R.T @ W[:d_c]
        placement.write(kva, "weight", W)
        if kva.bias is not None:
            b = w(kva.bias).clone()
            b[:d_c] = b[:d_c] @ R
            placement.write(kva, "bias", b)
    live = g != 0
    if R is not None and not bool(live.all()):
        mixed = R[~live][:, live].abs().max().item() + R[live][:, ~live].abs().max().item()
        if mixed > 1e-6:
            raise ValueError("a content transform may not mix latent channels whose norm weight is zero with live ones")
    Wb = w(kvb.weight) * g  # weight' = weight · diag(γ) R diag(1/s)
    if R is not None:
        Wb = Wb @ R
    placement.write(kvb, "weight", Wb / s)
    # the model multiplies by kv_scale again (LongCat)
    placement.write(norm, "weight", torch.where(live, s, 0.0) / mla.kv_scale)


def fuse_rope(mla: MLA, theta: torch.Tensor | None = None, s: torch.Tensor | None = None) -> None:
    """Eq. 25 in weight space: pre-RoPE key rows ← (R_P S_P)^T ·, every head's query rows ← (R_P S_P^-1)^T ·."""
    with placement.loaded(mla.kv_a_proj_with_mqa, mla.q_rope_proj):
        _fuse_rope(mla, theta, s)


def _fuse_rope(mla: MLA, theta, s) -> None:
    d, (pre, _) = mla.dims, rope_pairs(mla)
    w = _work(mla.kv_a_proj_with_mqa)
    th = None if theta is None else theta.detach().double()
    sc = None if s is None else s.detach().double()
    M_K = w(pair_matrix(pre, d.d_r, th, sc))
    M_Q = w(pair_matrix(pre, d.d_r, th, sc, inverse_scale=True))
    kva = mla.kv_a_proj_with_mqa
    W = w(kva.weight).clone()
    W[d.d_c :] = M_K.T @ W[d.d_c :]
    placement.write(kva, "weight", W)
    if kva.bias is not None:
        b = w(kva.bias).clone()
        b[d.d_c :] = b[d.d_c :] @ M_K
        placement.write(kva, "bias", b)
    qp = mla.q_rope_proj
    Wq = w(qp.weight).clone()
    rows = mla.q_rope_rows().to(Wq.device)
    Wq[rows] = (M_Q.T @ Wq[rows].view(d.H, d.d_r, -1)).flatten(0, 1)
    placement.write(qp, "weight", Wq)
    if qp.bias is not None:
        bq = w(qp.bias).clone()
        bq[rows] = (bq[rows].view(d.H, d.d_r) @ M_Q).flatten()
        placement.write(qp, "bias", bq)


def set_online_rope(mla: MLA, H: torch.Tensor | None) -> None:
    """Install an online post-RoPE map on q_pe and k_pe (needs the harness's LatentAttention)."""
    from quantmla.attention import LatentAttention

    if not isinstance(mla.module, LatentAttention):
        raise TypeError("an online post-RoPE transform needs the harness attention: call quantmla.attention.install")
    mla.module.rope_transform = None if H is None else _work(mla.kv_a_proj_with_mqa)(H)


def fuse(mla: MLA, t: LayerTransform) -> None:
    """Fold ``t`` into one layer (content, then pre-RoPE pairs, then the online post-RoPE map)."""
    if t.content:
        fuse_content(mla, t.R_C, t.s_C)
    if t.rope:
        fuse_rope(mla, t.theta_P, t.s_P)
    if t.H_P is not None:
        set_online_rope(mla, t.H_P)


def online_rope_flops(mla: MLA) -> int:
    """FLOPs per token of a dense online d_r × d_r map on the key and every head's query."""
    d = mla.dims
    return 2 * d.d_r * d.d_r * (d.H + 1)


# ----- training-time forward: effective caches in native coordinates ----------------------------
def weightless(c_pre: torch.Tensor, eps: float) -> torch.Tensor:
    """u = RMSNorm_1(c̃) in float32 (the kv_a_layernorm without its weight)."""
    c = c_pre.float()
    return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)


def quantized_content(
    u: torch.Tensor,
    gamma: torch.Tensor,
    bits: int,
    R: torch.Tensor | None = None,
    s: torch.Tensor | None = None,
    content: bool = True,
    group: int = 64,
    ste: bool = False,
) -> torch.Tensor:
    """What the consumers see of a quantized content cache, in native coordinates.

    With a transform: QDQ(u R S) S^-1 R^T Γ (= the fused layer's cache through its compensated
    consumer); without (``content=False``): QDQ(u Γ), the native RTN cache.
    """
    g = gamma.float()
    if not content:
        return qdq(u * g, bits, group, ste=ste)
    z = u @ R if R is not None else u
    if s is not None:
        z = z * s
    z = z * (g != 0)  # dead channels are cached as zero (their fused norm weight stays zero)
    zq = qdq(z, bits, group, ste=ste)
    if s is not None:
        zq = zq / s
    if R is not None:
        zq = zq @ R.T
    return zq * g


def quantized_rope(
    K_P: torch.Tensor,
    bits: int,
    M: torch.Tensor | None = None,
    M_inv: torch.Tensor | None = None,
    group: int = 64,
    ste: bool = False,
) -> torch.Tensor:
    """QDQ(K_P M) M^-1: the post-RoPE key a quantized transformed cache is worth, in native coordinates."""
    if M is None:
        return qdq(K_P.float(), bits, group, ste=ste)
    return qdq(K_P.float() @ M, bits, group, ste=ste) @ M_inv


def rope_key_maps(mla: MLA, t: LayerTransform, dtype=torch.float32) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(M, M^-1) with K_P' = K_P M in the HF post-RoPE layout, from a transform's RoPE part."""
    pre, post = rope_pairs(mla)
    d_r = mla.dims.d_r
    if t.H_P is not None:
        H = t.H_P.to(dtype)
        return H, H.T
    if not t.rope:
        return None, None
    M = pair_matrix(post, d_r, t.theta_P, t.s_P).to(dtype)
    M_inv = pair_matrix(post, d_r, t.theta_P, t.s_P, inverse_scale=True).T.to(dtype)
    return M, M_inv
