"""SmoothQuant† (the paper's App. D.2): equivalent per-channel scaling of both MLA caches, no gradients.

Content: the cache becomes u S_C (``kv_a_layernorm.weight`` := s_C) and every consumer gets
S_C^-1 Γ (folded into ``kv_b_proj``). RoPE: one positive scale per frequency pair, K_P' = K_P S_P
and Q_P' = Q_P S_P^-1, folded into the pre-RoPE key and query rows. Nothing runs online.

Scales follow Eq. 42: log s_j = clip(α [mean_k log ã_k − log ã_j], −2, 2) from the 99.9th
percentile |activation| over the train bank (content: channels of u; RoPE: post-RoPE K_P, both
channels of a pair pooled). α is searched over ``alphas`` (the paper's grid, all of
{0.125, 0.25, 0.5, 0.75, 1}, no 0), one per path per model, each path with the other exact,
both by held-out normalized attention-output MSE; ties go to the smaller α.

The chosen α of each path is stored under ``MethodContext.cache_dir/smoothquant/<key>/alpha.json``,
keyed by what it was computed from (the config, the bits and group, the calibration, the model's
and the banks' fingerprints): the protected and unprotected runs of a format, and a relaunched run,
search once. A file that does not hold an α of the grid for every path is set aside and searched again.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from quantmla.calibration import (
    Teacher,
    activation_percentiles,
    alpha_log_scales,
    check_pairing,
    content_loss,
    entry_key,
    heldout_mean,
    model_fingerprint,
    rope_loss,
    tensor_digest,
)
from quantmla.files import one_writer, reason, set_aside, write_atomic
from quantmla.registry import Method, MethodConfig, MethodContext, register
from quantmla.transforms import (
    LayerTransform,
    from_state,
    fuse,
    live_channels,
    rope_key_maps,
    to_state,
)

log = logging.getLogger("quantmla")
FORMAT_VERSION = 1


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

        paths = [p for p, on in (("C", do_C), ("P", do_P)) if on]
        folder = Path(ctx.cache_dir) / "smoothquant" / self._key(model, ctx, train, heldout)
        with one_writer(folder, f"SmoothQuant† α {folder.name}"):
            found = _stored(folder / "alpha.json", paths, alphas)
            if found is None:
                teacher = Teacher(model, heldout, cal.batch_size)
                means = heldout_mean(teacher, losses, desc="SmoothQuant† α search", progress=ctx.progress)
                found = {}
                for path in paths:
                    al = min(((means[path, a], a) for a in alphas), key=lambda t: (t[0], t[1]))[1]
                    found |= {f"alpha_{path}": al, f"heldout_nmse_{path}": means[path, al]}
                write_atomic(folder / "alpha.json", json.dumps(found, indent=1))
            else:
                self.info["cached"] = 1
                log.info("SmoothQuant† α: reusing %s", folder)
        self.info |= found
        best = {p: found[f"alpha_{p}"] for p in paths}
        transforms = [
            LayerTransform(
                s_C=logs_C[best["C"]][i].exp() if do_C else None,
                s_P=logs_P[best["P"]][i].exp() if do_P else None,
            )
            for i in range(len(adapters))
        ]
        return to_state(transforms)

    def _key(self, model, ctx: MethodContext, train, heldout) -> str:
        spec = ctx.spec
        blob = {
            "format": FORMAT_VERSION,
            "method": self.config.to_dict(),
            "bits": [spec.content_bits, spec.rope_bits],
            "group": spec.group,
            "calibration": ctx.calibration.to_dict(),
            "model": model_fingerprint(model, ctx.model_name),
            "data": tensor_digest(train, heldout),
        }
        return entry_key(blob)

    def fuse(self, model, adapters, transforms: dict, ctx: MethodContext) -> None:
        for mla, t in zip(adapters, from_state(transforms, len(adapters))):
            fuse(mla, t)


def _stored(f: Path, paths: list[str], alphas: list[float]) -> dict | None:
    """The α choice stored in ``f``: an α of the grid and a finite held-out NMSE for every path; None
    if there is none (one that is not is set aside)."""
    if not f.exists():
        return None
    try:
        found = json.loads(f.read_text())
        for p in paths:
            if found[f"alpha_{p}"] not in alphas or not math.isfinite(found[f"heldout_nmse_{p}"]):
                raise ValueError(f"no α of the grid {alphas} and finite held-out NMSE for path {p}")
    except (ValueError, KeyError, TypeError) as e:
        set_aside(f, reason(e))
        return None
    return found
