"""The harness's MLA attention: a drop-in module computing attention from the latent cache.

:func:`install` swaps every native MLA attention module of a transformers model for a
:class:`LatentAttention` that adopts the original's submodules under the same names (so
``state_dict`` keys do not change) and computes, per layer:

1. the paper's handles through the adapter: q_nope, post-RoPE Q_P, C and K_P;
2. attention through the quantized-MLA core (:mod:`quantmla.kernels`): with the paged
   generation cache (:func:`new_cache`) new tokens are written into packed pages and
   attended by the decode kernel; otherwise (evaluation, or any other transformers
   ``Cache``, which then keeps the cache-dtype latents) the teacher-forced core quantizes
   C and K_P into pages and applies the decode-faithful BF16 protection per (query, key);
3. W_UV / ``o_proj`` on the latent output.

Token indices for the protection rule count the real tokens of the attention mask, so
left-padded batches protect each request's own first tokens. The mask must be causal over
the real tokens (padding only); anything else raises.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from quantmla import kernels
from quantmla.cache import CacheSpec
from quantmla.mla import MLA, Adapted, adapter_class
from quantmla.paged_cache import LatentCache

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


class LatentAttention(Adapted):
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
        self.backend = "auto"  # attention core: auto | triton | reference (quantmla.kernels)
        self.masks = MaskMemo()  # shared by the layers of one model (install), so a mask is read once per pass
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
        q_lat = self.mla.absorb(q_nope)
        if isinstance(cache, LatentCache):
            # a static decode step (LatentCache.reserve) has one real token per request by contract: its
            # mask is not read (reading it waits for the device, which a CUDA graph cannot)
            valid = None if cache.static is not None else self._step_validity(cache, attention_mask, C)
            o_lat = cache.attend(self.layer_idx, self.spec, q_lat, q_pe, C, K_P, valid, self.mla.tau, self.backend)
            return self.mla.output(o_lat), None
        if cache is not None:
            C, K_P = cache.update(C, K_P, self.layer_idx)
        o_lat, _ = self.attend(q_lat, q_pe, C, K_P, attention_mask)
        return self.mla.output(o_lat), None

    def _step_validity(self, cache: LatentCache, attention_mask, C) -> torch.Tensor | None:
        """The step's key validity for the paged cache. Every layer of a step gets the same mask:
        it is checked once (each check reads the device) and shared through the cache."""
        n, L = C.shape[2], cache.get_seq_length(self.layer_idx) + C.shape[2]
        memo = cache.step_validity
        if memo is None or memo[0] is not attention_mask or memo[1] != (C.shape[0], n, L):
            valid = key_validity(attention_mask, C.shape[0], n, L, C.device)
            memo = cache.step_validity = (attention_mask, (C.shape[0], n, L), valid)
        return memo[2] if memo[2] is None else memo[2].to(C.device)  # layers may sit on other GPUs

    def attend(self, q_lat, q_pe, C, K_P, attention_mask):
        """Latent output (B, H, n, d_c) and LSE (B, H, n), float32, of queries (B, H, n, ·) over
        the latents C (B, 1, L, d_c), K_P (B, 1, L, d_r), through the core's teacher-forced path."""
        n, L = q_lat.shape[2], C.shape[2]
        valid = self.masks.validity(attention_mask, C.shape[0], n, L, C.device)
        return kernels.attend(q_lat, q_pe, C[:, 0], K_P[:, 0], valid, self.spec, self.mla.tau, self.backend)


class MaskMemo:
    """The last attention mask's key validity. Every layer of a forward pass gets the same mask,
    and checking it reads the device (the GPU's queue drains each time): the layers of one model
    share one memo, so the check runs once per pass, not once per layer. A mask changed in place
    (its version counter moves) is read again."""

    def __init__(self):
        self.key, self.valid = None, None

    def validity(self, mask, B: int, n: int, L: int, device) -> torch.Tensor | None:
        if not isinstance(mask, torch.Tensor):
            return key_validity(mask, B, n, L, device)
        key = (mask, mask._version, B, n, L)
        if self.key is None or self.key[0] is not mask or self.key[1:] != key[1:]:
            self.key, self.valid = key, key_validity(mask, B, n, L, device)
        return self.valid if self.valid is None else self.valid.to(device)  # layers may sit on other GPUs


def key_validity(mask, B: int, n: int, L: int, device) -> torch.Tensor | None:
    """Which of the L key columns are real tokens, (B, L) bool, or None when all are.

    ``mask`` is what transformers passed (None = plain causal, boolean or additive float
    ``(B, 1, n, L)``). It must be causal over the real tokens: padding is the only thing the
    core can express, and any other pattern raises instead of being silently changed.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention mask of type {type(mask).__name__} is not supported; use sdpa or eager")
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    m = mask[..., -n:, :L].expand(B, 1, n, L)[:, 0]
    valid = m[:, -1, :]  # the last query sees every real key
    causal = torch.arange(L, device=device).unsqueeze(0) <= torch.arange(L - n, L, device=device).unsqueeze(1)
    live = valid[:, L - n :].unsqueeze(-1)  # rows of padding queries are free
    if bool(((m != (valid.unsqueeze(1) & causal)) & live).any()):
        raise ValueError("the attention mask is not causal over the real tokens; the latent core supports padding only")
    return None if bool(valid.all()) else valid


def install(model: nn.Module, spec: CacheSpec, backend: str = "auto") -> list[LatentAttention]:
    """Route every MLA attention of ``model`` through the latent cache; returns the new modules.

    ``backend`` picks the attention core's implementation (see :mod:`quantmla.kernels`).
    """
    kernels.check_backend(backend)
    installed = []
    masks = MaskMemo()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LatentAttention):
                child.spec = spec
                spec.check_dims(child.kv_lora_rank, child.qk_rope_head_dim)
                child.backend, child.masks = backend, masks
                installed.append(child)
            elif adapter_class(child) is not None:
                new = LatentAttention(child, spec)
                new.backend, new.masks = backend, masks
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


def cache_keyword() -> str:
    """The keyword ``model.generate`` takes a prebuilt cache under: ``cache`` where transformers'
    generation loop names it so (5.24, which deprecates ``past_key_values`` in ``generate``),
    ``past_key_values`` before (5.17). Read from the library's ``GenerationMixin``, not from a
    model, whose own ``prepare_inputs_for_generation`` may take ``**kwargs``."""
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model: nn.Module, batch_size: int = 1, max_length: int | None = None):
    """A fresh cache for generation through the harness's attention
    (``model.generate(ids, **{cache_keyword(): new_cache(model, ...)})``).

    With layers installed by :func:`install` it is the paged latent cache of the core (packed pages,
    fused writer, decode kernel); ``max_length`` sizes its page pool (it grows if needed).
    """
    layers = latent_layers(model)
    if not layers:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    num_layers = max(num_layers, 1 + max(int(m.layer_idx) for m in layers))
    return LatentCache(num_layers, batch_size, max_length, backend=layers[0].backend)


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

    Differentiable; ``spec`` defaults to no quantization (the caches are used as given). C and
    K_P may come in different dtypes (a calibration's float32 C_hat beside a BF16 model's K_P):
    both then enter the core in the wider one, so no precision of the perturbed path is lost.
    """
    common = torch.promote_types(C.dtype, K_P.dtype)
    C, K_P = C.to(common), K_P.to(common)
    saved = layer.spec
    layer.spec = spec or CacheSpec(group=saved.group)
    try:
        o_lat, _ = layer.attend(layer.mla.absorb(q_nope), q_pe, C, K_P, attention_mask)
    finally:
        layer.spec = saved
    return layer.mla.output(o_lat)
