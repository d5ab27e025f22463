"""SmoothQuant† (the paper's App. D.2): equivalent per-channel scaling of both MLA caches, no gradients.

Content: the cache becomes u S_C (``kv_a_layernorm.weight`` := s_C) and every consumer gets
S_C^-1 Γ (folded into ``kv_b_proj``). RoPE: one positive scale per frequency pair, K_P' = K_P S_P
and Q_P' = Q_P S_P^-1, folded into the pre-RoPE key and query rows. Nothing runs online.

Scales follow Eq. 42: log s_j = clip(α [mean_k log ã_k − log ã_j], −2, 2) from the 99.9th
percentile |activation| over the train bank (content: channels of u; RoPE: post-RoPE K_P, both
channels of a pair pooled). α is searched over ``alphas`` (the paper's grid, all of
{0.125, 0.25, 0.5, 0.75, 1}, no 0), one per path per model, each path with the other exact,
both by held-out normalized attention-output MSE; ties go to the smaller α.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantmla.calibration import (
    Teacher,
    activation_percentiles,
    alpha_log_scales,
    check_pairing,
    content_loss,
    heldout_mean,
    rope_loss,
)
from quantmla.registry import Method, MethodConfig, MethodContext, register
from quantmla.transforms import (
    LayerTransform,
    from_state,
    fuse,
    live_channels,
    rope_key_maps,
    to_state,
)


@dataclass
class SmoothQuantConfig(MethodConfig):
    name = "smoothquant"
    alphas: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 0.75, 1.0])
    percentile: float = 99.9
    log_scale_clip: float = 2.0

    def __post_init__(self):
        self.alphas = [float(a) for a in self.alphas]
        if not self.alphas:
            raise ValueError("SmoothQuant† needs at least one alpha")
        for a in self.alphas:
            if not 0.0 < a <= 1.0:
                raise ValueError(f"SmoothQuant† alpha {a} is outside (0, 1]")
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"SmoothQuant† percentile {self.percentile} is outside (0, 100]")
        if self.log_scale_clip <= 0:
            raise ValueError(f"SmoothQuant† log_scale_clip must be positive, got {self.log_scale_clip}")


@register(SmoothQuantConfig)
class SmoothQuant(Method):
    needs_data = True

    def calibrate(self, model, adapters, ctx: MethodContext) -> dict:
        cfg, spec, cal = self.config, ctx.spec, ctx.calibration
        do_C, do_P = spec.content_bits < 16, spec.rope_bits < 16
        self.info = {}
        if not (do_C or do_P):
            return {}
        check_pairing(model)
        train, heldout = cal.banks(ctx.tokenizer)
        a_C, a_P = activation_percentiles(model, train, cal.batch_size, cfg.percentile / 100, ctx.progress)
        alphas = sorted(cfg.alphas)
        live = [live_channels(m) for m in adapters]
        logs_C = {al: [alpha_log_scales(a, al, cfg.log_scale_clip, v) for a, v in zip(a_C, live)] for al in alphas}
        logs_P = {al: [alpha_log_scales(a, al, cfg.log_scale_clip) for a in a_P] for al in alphas}

        def losses(lb):
            out, g = {}, spec.group
            for al in alphas if do_C else ():
                s = logs_C[al][lb.index].exp()
                out["C", al] = content_loss(lb, spec.content_bits, s=s, objective="output", group=g)
            for al in alphas if do_P else ():
                M, M_inv = rope_key_maps(lb.mla, LayerTransform(s_P=logs_P[al][lb.index].exp()))
                out["P", al] = rope_loss(lb, spec.rope_bits, M, M_inv, objective="output", group=g)
            return out

        teacher = Teacher(model, heldout, cal.batch_size)
        means = heldout_mean(teacher, losses, desc="SmoothQuant† α search", progress=ctx.progress)
        best = {}
        for path in ("C", "P"):
            scores = [(means[path, al], al) for al in alphas if (path, al) in means]
            if scores:
                best[path] = min(scores, key=lambda t: (t[0], t[1]))[1]
                self.info[f"alpha_{path}"] = best[path]
                self.info[f"heldout_nmse_{path}"] = means[path, best[path]]
        transforms = [
            LayerTransform(
                s_C=logs_C[best["C"]][i].exp() if do_C else None,
                s_P=logs_P[best["P"]][i].exp() if do_P else None,
            )
            for i in range(len(adapters))
        ]
        return to_state(transforms)

    def fuse(self, model, adapters, transforms: dict, ctx: MethodContext) -> None:
        for mla, t in zip(adapters, from_state(transforms, len(adapters))):
            fuse(mla, t)
