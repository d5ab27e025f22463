"""MLA adapter: the paper's handles (its notation for C, K_P, W_UK, W_UV) on a native transformers attention module.

One small class per architecture family names the modules of the paper's equations.
Methods, the cache and the sensitivity probes talk to an :class:`MLA` object, never to raw
module names. Adapters are registered by the transformers attention *class* they cover.

Conventions (the paper's, around its eq. 1): ``C`` is the cached content latent (output of
``kv_a_layernorm``), ``K_P`` the cached post-RoPE key shared by all heads, ``W_UK`` /
``W_UV`` the per-head up-projections of ``kv_b_proj`` in absorbed form, ``tau`` the
softmax scale. Tensors are laid out ``(batch, heads, tokens, dim)``; the latent caches
have a single "head": ``C`` is ``(B, 1, n, d_c)`` and ``K_P`` is ``(B, 1, n, d_r)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantmla import placement

_ADAPTERS: dict[type, type[MLA]] = {}


def register_adapter(*attention_classes: type):
    """Class decorator: ``cls`` handles modules of these transformers attention classes."""

    def wrap(cls: type[MLA]) -> type[MLA]:
        for c in attention_classes:
            _ADAPTERS[c] = cls
        return cls

    return wrap


def adapter_class(module: nn.Module) -> type[MLA] | None:
    for klass in type(module).__mro__:
        if klass in _ADAPTERS:
            return _ADAPTERS[klass]
    return None


def supported_classes() -> list[str]:
    return sorted(c.__name__ for c in _ADAPTERS)


@dataclass(frozen=True)
class MLADims:
    H: int
    d_model: int
    d_c: int
    d_r: int
    d_nope: int
    d_v: int
    q_lora_rank: int | None


class MLA:
    """Handles on one MLA attention module (HF's, or a :class:`LatentAttention` holding its children).

    ``rope_style`` says how the model applies RoPE:

    - ``"complex"``: DeepseekV2's complex multiply on adjacent channels; post-RoPE keeps
      pairs at channels ``(2i, 2i+1)``.
    - ``"interleave"``: DeepseekV3/GLM with ``rope_interleave``: weight-space pairs
      ``(2i, 2i+1)`` come out in half-split order, pair ``i`` at ``(i, i + d_r/2)``.
    - ``"half"``: ``rotate_half`` on weights already in half-split order: pairs
      ``(i, i + d_r/2)`` before and after RoPE.
    """

    rope_style: str = "complex"

    def __init__(self, module: nn.Module):
        self.module = module
        m = module
        self.dims = MLADims(
            H=m.num_heads,
            d_model=m.config.hidden_size,
            d_c=m.kv_lora_rank,
            d_r=m.qk_rope_head_dim,
            d_nope=m.qk_nope_head_dim,
            d_v=m.v_head_dim,
            q_lora_rank=getattr(m, "q_lora_rank", None),
        )
        if m.kv_b_proj.bias is not None:
            raise ValueError("kv_b_proj with a bias is not an MLA layout this harness knows")

    # ----- modules of the paper's equations -------------------------------------------------
    @property
    def kv_a_proj_with_mqa(self) -> nn.Linear:
        return self.module.kv_a_proj_with_mqa

    @property
    def kv_a_layernorm(self) -> nn.Module:
        return self.module.kv_a_layernorm

    @property
    def kv_b_proj(self) -> nn.Linear:
        return self.module.kv_b_proj

    @property
    def o_proj(self) -> nn.Linear:
        return self.module.o_proj

    @property
    def q_rope_proj(self) -> nn.Linear:
        """The projection whose rows produce every head's pre-RoPE query (q_proj or q_b_proj)."""
        return self.module.q_proj if self.dims.q_lora_rank is None else self.module.q_b_proj

    @property
    def tau(self) -> float:
        return float(self.module.scaling)

    @property
    def q_scale(self) -> float:
        """A constant the model multiplies queries by (LongCat's ``mla_scale_q_lora``), else 1."""
        return 1.0

    @property
    def kv_scale(self) -> float:
        """A constant the model multiplies the latent by (LongCat's ``mla_scale_kv_lora``), else 1."""
        return 1.0

    @property
    def gamma(self) -> torch.Tensor:
        """Γ: the effective per-channel scale of the cached latent, C = u Γ."""
        with placement.loaded(self.kv_a_layernorm):
            return self.kv_a_layernorm.weight * self.kv_scale

    @property
    def norm_eps(self) -> float:
        return float(self.kv_a_layernorm.variance_epsilon)

    def q_rope_rows(self) -> torch.Tensor:
        """Row indices of ``q_rope_proj.weight`` holding the pre-RoPE query of every head."""
        d = self.dims
        qk = d.d_nope + d.d_r
        return torch.cat([torch.arange(h * qk + d.d_nope, (h + 1) * qk) for h in range(d.H)])

    def rope_pairs(self) -> list[tuple[int, int]]:
        """RoPE frequency pairs in the pre-RoPE (weight-space) channel order."""
        half = self.dims.d_r // 2
        if self.rope_style == "half":
            return [(i, i + half) for i in range(half)]
        return [(2 * i, 2 * i + 1) for i in range(half)]

    def post_rope_pairs(self) -> list[tuple[int, int]]:
        """RoPE frequency pairs in the post-RoPE (cached) channel order."""
        half = self.dims.d_r // 2
        if self.rope_style == "complex":
            return [(2 * i, 2 * i + 1) for i in range(half)]
        return [(i, i + half) for i in range(half)]

    # ----- absorbed-form weights ------------------------------------------------------------
    def _kv_b(self) -> torch.Tensor:
        d = self.dims
        with placement.loaded(self.kv_b_proj):  # an offloaded weight: the view keeps the loaded copy
            return self.kv_b_proj.weight.view(d.H, d.d_nope + d.d_v, d.d_c)

    def W_UK(self) -> torch.Tensor:
        """(H, d_nope, d_c): q_lat = q_nope @ W_UK[h] is the absorbed content query."""
        return self._kv_b()[:, : self.dims.d_nope]

    def W_UV(self) -> torch.Tensor:
        """(H, d_v, d_c): per-head value = C @ W_UV[h].T."""
        return self._kv_b()[:, self.dims.d_nope :]

    # ----- the forward pieces ---------------------------------------------------------------
    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE (q_nope, q_pe), each (B, H, n, ·)."""
        m, d = self.module, self.dims
        q = m.q_proj(x) if d.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
        q = q.view(*x.shape[:-1], d.H, d.d_nope + d.d_r).transpose(1, 2)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q[..., : d.d_nope], q[..., d.d_nope :]

    def latent_pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c̃, k̃_P): the pre-norm latent and the pre-RoPE shared key, each (B, 1, n, ·)."""
        ckv = self.kv_a_proj_with_mqa(x).unsqueeze(1)
        return ckv[..., : self.dims.d_c], ckv[..., self.dims.d_c :]

    def content(self, c_pre: torch.Tensor) -> torch.Tensor:
        """C = RMSNorm(c̃) Γ, the cached content latent."""
        c = self.kv_a_layernorm(c_pre)
        return c * self.kv_scale if self.kv_scale != 1.0 else c

    def rope(self, q_pe: torch.Tensor, k_pe: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def paths(self, x: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, ...]:
        """(q_nope, Q_P, C, K_P): what the content and RoPE paths of the paper's eq. 1 consume."""
        q_nope, q_pe = self.queries(x)
        c_pre, k_pre = self.latent_pre(x)
        q_pe, k_pe = self.rope(q_pe, k_pre, position_embeddings)
        return q_nope, q_pe, self.content(c_pre), k_pe

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_lat = q_nope · W_UK per head: (B, H, n, d_c), float32 (float64 if q_nope is)."""
        dt = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
        return torch.einsum("bhnd,hdc->bhnc", q_nope.to(dt), self.W_UK().to(dt))

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Y = o_proj(concat_h o_lat_h W_UV[h]^T): post-``o_proj`` output (B, n, d_model)."""
        w = self.W_UV()
        o = torch.einsum("bhnc,hvc->bnhv", o_lat.to(w.dtype), w)
        return self.o_proj(o.flatten(-2))


def _import_families() -> None:
    """Register the adapters for every native MLA family the installed transformers has."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as dsv2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dsv3

    @register_adapter(dsv2.DeepseekV2Attention)
    class DeepseekV2MLA(MLA):
        rope_style = "complex"

        def rope(self, q_pe, k_pe, position_embeddings):
            return dsv2.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))

    def interleaved_family(attention_cls, module):
        @register_adapter(attention_cls)
        class InterleavedMLA(MLA):
            def __init__(self, m):
                super().__init__(m)
                self.rope_style = "interleave" if getattr(m.config, "rope_interleave", True) else "half"

            def rope(self, q_pe, k_pe, position_embeddings):
                cos, sin = position_embeddings
                if self.rope_style == "interleave":
                    return module.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
                return module.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)

        InterleavedMLA.__name__ = attention_cls.__name__.replace("Attention", "") + "MLA"
        return InterleavedMLA

    interleaved_family(dsv3.DeepseekV3Attention, dsv3)
    try:
        from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as glm
    except ImportError:  # older transformers
        glm = None
    if glm is not None:
        interleaved_family(glm.Glm4MoeLiteAttention, glm)
    try:
        from transformers.models.longcat_flash import modeling_longcat_flash as lc
    except ImportError:
        lc = None
    if lc is not None:

        @register_adapter(lc.LongcatFlashMLA)
        class LongcatFlashMLA(MLA):
            rope_style = "interleave"

            @property
            def q_scale(self):
                return float(self.module.mla_scale_q_lora)

            @property
            def kv_scale(self):
                return float(self.module.mla_scale_kv_lora)

            def rope(self, q_pe, k_pe, position_embeddings):
                cos, sin = position_embeddings
                return lc.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)


_import_families()


class Adapted(nn.Module):
    """An attention module that carries its own adapter as ``.mla``: the harness's
    :class:`~quantmla.attention.LatentAttention`, which replaces a native module and serves its
    adapter to the methods."""

    mla: MLA


def find_mla(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every MLA attention module of ``model`` (name, module), in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Adapted) or adapter_class(m)]


def adapters(model: nn.Module) -> list[MLA]:
    """One adapter per MLA attention module of ``model``; a clear error if there is none."""
    found = find_mla(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no MLA attention this harness knows "
            f"(supported: {', '.join(supported_classes())})"
        )
    return [m.mla if isinstance(m, Adapted) else adapter_class(m)(m) for _, m in found]
