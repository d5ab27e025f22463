"""QuaRot† (the paper's App. D.2): fixed normalized Hadamard rotations of both MLA caches, no learning.

Content: z = u H_C in the weightless coordinates of ``kv_a_layernorm``, fused offline like
the content fusion (the paper's App. C.1) with R_C = H_C, S_C = I (Γ folded into ``kv_b_proj``, the norm
weight set to 1).
No per-token work at inference.

RoPE: K_P' = K_P H_P and Q_P' = Q_P H_P *after* RoPE. H_P mixes frequency pairs, so it does
not commute with the position-dependent rotation and cannot be folded into the pre-RoPE
weights: it runs online, on each new key before caching and on every head's query, through
``LatentAttention.rope_transform``. Cost per token and layer: 2·d_r²·(H + 1) FLOPs as a dense
matmul (139,264 for DeepSeek-V2-Lite; a fast Walsh–Hadamard transform needs d_r·log2(d_r) adds
per vector instead). H_P acts on the checkpoint's native interleaved pair order (what vLLM and FlashMLA
cache): for HF tensors in half-split order the online map is P·H_P with P the permutation to
interleaved order. Sylvester construction, no random signs; ``content_block`` / ``rope_block``
choose block-diagonal Hadamards. By default one block spans the full width (512 and 64 for
the paper's models); a width that is not a power of two gets the largest power-of-two block
that divides it. Latent channels whose norm weight is zero are left out (``embed_live``).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.calibration import check_pairing
from quantmla.registry import Method, MethodConfig, MethodContext, register
from quantmla.transforms import (
    LayerTransform,
    block_hadamard,
    embed_live,
    from_state,
    fuse,
    interleaved_order,
    live_channels,
    online_rope_flops,
    rope_pairs,
    to_state,
)


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclass
class QuaRotConfig(MethodConfig):
    name = "quarot"
    content_block: int | None = None  # Hadamard size on the content latent (None: see default_block)
    rope_block: int | None = None  # Hadamard size on the post-RoPE key (None: see default_block)

    def __post_init__(self):
        for what, b in (("content_block", self.content_block), ("rope_block", self.rope_block)):
            if b is not None and not _power_of_two(int(b)):
                raise ValueError(f"QuaRot† {what} {b} is not a power of two (Sylvester Hadamard)")


def default_block(width: int, block: int | None, what: str = "content latent") -> int:
    """``block``, or the full width if it is a power of two, else its largest power-of-two divisor."""
    if block is not None:
        if width % int(block):
            raise ValueError(f"QuaRot† Hadamard size {block} does not divide the {what} width {width}")
        return int(block)
    return width & -width


@register(QuaRotConfig)
class QuaRot(Method):
    def check_dims(self, d_c: int, d_r: int) -> None:
        default_block(d_c, self.config.content_block)
        default_block(d_r, self.config.rope_block, "RoPE key")

    def online_work(self, spec) -> str | None:
        if spec.rope_bits >= 16:
            return None
        return "QuaRot† rotates q_pe and k_pe by H_P after RoPE at every step (online: H_P does not commute with RoPE)"

    def calibrate(self, model, adapters, ctx: MethodContext) -> dict:
        spec, cfg = ctx.spec, self.config
        for mla in adapters:
            self.check_dims(mla.dims.d_c, mla.dims.d_r)
        do_C, do_P = spec.content_bits < 16, spec.rope_bits < 16
        if do_P:
            check_pairing(model)
        transforms = []
        for mla in adapters:
            d = mla.dims
            t = LayerTransform()
            if do_C:
                live = live_channels(mla)
                n = int(live.sum())
                t.R_C = embed_live(block_hadamard(n, default_block(n, cfg.content_block, "live content latent")), live)
            if do_P:
                _, post = rope_pairs(mla)
                t.H_P = interleaved_order(post, d.d_r) @ block_hadamard(
                    d.d_r, default_block(d.d_r, cfg.rope_block, "RoPE key")
                )
            transforms.append(t)
        self.info = {"online_rope_flops_per_token": sum(online_rope_flops(m) for m in adapters) if do_P else 0}
        return to_state(transforms)

    def fuse(self, model, adapters, transforms: dict, ctx: MethodContext) -> None:
        for mla, t in zip(adapters, from_state(transforms, len(adapters))):
            fuse(mla, t)
