"""The harness's MLA attention: a drop-in module computing attention from the latent cache.

:func:`install` swaps every native MLA attention module of a transformers model for a
:class:`LatentAttention` that adopts the original's submodules under the same names (so
``state_dict`` keys do not change) and computes, per layer:

1. the paper's handles through the adapter: q_nope, post-RoPE Q_P, C and K_P;
2. the cache update (whatever transformers ``Cache`` the model passes keeps BF16 latents);
3. CxRy quantize–dequantize of C and K_P with the evaluation-time BF16 protection;
4. absorbed attention (:func:`quantmla.core.latent_attention`) and W_UV / ``o_proj``.

Token indices for the protection rule come from the attention mask, so left-padded
batches protect each request's own first tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from quantmla.cache import CacheSpec, protected_pairs
from quantmla.core import latent_attention
from quantmla.mla import MLA, adapter_class

_COPIED = (
    "config",
    "layer_idx",
    "num_heads",
    "q_lora_rank",
    "qk_rope_head_dim",
    "kv_lora_rank",
    "v_head_dim",
    "qk_nope_head_dim",
    "qk_head_dim",
    "scaling",
    "mla_scale_q_lora",
    "mla_scale_kv_lora",
)


class LatentAttention(nn.Module):
    def __init__(self, attn: nn.Module, spec: CacheSpec):
        super().__init__()
        klass = adapter_class(attn)
        if klass is None:
            raise TypeError(f"{type(attn).__name__} is not an MLA attention this harness knows")
        for name in _COPIED:
            if hasattr(attn, name):
                setattr(self, name, getattr(attn, name))
        for name, child in attn.named_children():
            self.add_module(name, child)
        self.__dict__["original"] = attn  # not a submodule: install() can put it back
        self.mla: MLA = klass(self)
        self.spec = spec
        self.rope_transform: torch.Tensor | None = None  # online post-RoPE map (QuaRot†'s H_P), else None
        spec.check_dims(self.kv_lora_rank, self.qk_rope_head_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        q_nope, q_pe, C, K_P = self.mla.paths(hidden_states, position_embeddings)
        if self.rope_transform is not None:
            q_pe = q_pe @ self.rope_transform.to(q_pe.dtype)
            K_P = K_P @ self.rope_transform.to(K_P.dtype)
        if cache is not None:
            C, K_P = cache.update(C, K_P, self.layer_idx)
        o_lat, _ = self.attend(self.mla.absorb(q_nope), q_pe, C, K_P, attention_mask)
        return self.mla.output(o_lat), None

    def attend(self, q_lat, q_pe, C, K_P, attention_mask):
        n, L = q_lat.shape[2], C.shape[2]
        allowed = _allowed(attention_mask, q_lat.shape[0], n, L, q_lat.device)
        spec = self.spec
        if not spec.quantized:
            return latent_attention(q_lat, q_pe, C, K_P, None, None, allowed, None, self.mla.tau)
        protect = None
        if spec.protect:
            k_index = allowed[:, 0, -1, :].long().cumsum(-1) - 1  # token index within the request
            protect = protected_pairs(k_index[:, L - n :], k_index, spec.sink, spec.recent).unsqueeze(1)
        C_hat, K_P_hat = spec.qdq_content(C), spec.qdq_rope(K_P)
        return latent_attention(q_lat, q_pe, C, K_P, C_hat, K_P_hat, allowed, protect, self.mla.tau)


def _allowed(mask, B: int, n: int, L: int, device) -> torch.Tensor:
    """Boolean (B, 1, n, L) mask from whatever transformers passed (None = plain causal)."""
    if mask is None:
        q = torch.arange(L - n, L, device=device).unsqueeze(-1)
        return (torch.arange(L, device=device) <= q).expand(B, 1, n, L)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention mask of type {type(mask).__name__} is not supported; use sdpa or eager")
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[..., -n:, :L].expand(B, 1, n, L)


def install(model: nn.Module, spec: CacheSpec) -> list[LatentAttention]:
    """Route every MLA attention of ``model`` through the latent cache; returns the new modules."""
    installed = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LatentAttention):
                child.spec = spec
                spec.check_dims(child.kv_lora_rank, child.qk_rope_head_dim)
                installed.append(child)
            elif adapter_class(child) is not None:
                new = LatentAttention(child, spec)
                setattr(parent, name, new)
                installed.append(new)
    if not installed:
        raise ValueError(f"{type(model).__name__} has no MLA attention this harness knows")
    return installed


def uninstall(model: nn.Module) -> None:
    """Put the native attention modules back (their submodules were shared, so weights carry over)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LatentAttention):
                setattr(parent, name, child.original)


def new_cache(model: nn.Module, batch_size: int = 1, max_length: int | None = None):
    """A fresh cache for generation through the harness's attention (pass as ``past_key_values``)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def latent_layers(model: nn.Module) -> list[LatentAttention]:
    return [m for m in model.modules() if isinstance(m, LatentAttention)]


class LayerInput:
    """What one attention layer received in a forward pass: its input x (after
    ``input_layernorm``), the position embeddings and the attention mask."""

    def __init__(self, x: torch.Tensor, position_embeddings, attention_mask):
        self.x, self.position_embeddings, self.attention_mask = x, position_embeddings, attention_mask


@torch.no_grad()
def capture_inputs(model: nn.Module, input_ids: torch.Tensor, **model_kwargs) -> list[LayerInput]:
    """Run ``model`` once and return every LatentAttention layer's input, in layer order."""
    layers = latent_layers(model)
    if not layers:
        raise ValueError("the model has no LatentAttention layers; call quantmla.attention.install first")
    seen: dict[int, LayerInput] = {}

    def hook(i):
        def fn(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            seen[i] = LayerInput(x.detach(), kwargs.get("position_embeddings"), kwargs.get("attention_mask"))

        return fn

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        model(input_ids, use_cache=False, **model_kwargs)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(layers))]


def layer_output(layer: LatentAttention, q_nope, q_pe, C, K_P, attention_mask=None, spec: CacheSpec | None = None):
    """Post-``o_proj`` output Y of ``layer`` from given (possibly perturbed) caches.

    Differentiable; ``spec`` defaults to no quantization (the caches are used as given).
    """
    saved = layer.spec
    layer.spec = spec or CacheSpec(group=saved.group)
    try:
        o_lat, _ = layer.attend(layer.mla.absorb(q_nope), q_pe, C, K_P, attention_mask)
    finally:
        layer.spec = saved
    return layer.mla.output(o_lat)
