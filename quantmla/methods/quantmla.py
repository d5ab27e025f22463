"""QuantMLA (the paper's §3, App. C): path-specific learned transforms, function-aligned objectives, offline fusion.

Content path (the paper's §3.1, App. C.1): per layer an orthogonal R_C = Cayley(P) (P = 0 at start) and a positive
channel scale s_C = exp(clip(ρ_C, ±2)) in the weightless-RMSNorm coordinates; the cache becomes
z_C = u R_C S_C. Trained against L_C, the post-``o_proj`` attention-output NMSE (eq. 8), with
the RoPE path exact. RoPE path (Prop. 1, App. C.2): per layer one angle and one tied scale per frequency pair,
in the model's own pairing; trained against L_P, the positional QK reconstruction over all heads
and causal pairs (eq. 10), with the content path exact. Both: straight-through rounding, FP32
quantizer scales, no protection (every token quantized), anchors 1e-4 × mean-squared deviation
from the initialization (a form the paper leaves open), scale init by the held-out α-grid of eq. 37 (α = 0 wins ties).
Each path is learned separately with its own budget, selected at its best held-out step
(:mod:`quantmla.optim`), then both are fused offline (:mod:`quantmla.transforms`) and the fused
model's NLL on a held-out window is compared with the original's (quantization off, App. C.4).

Every path's result is stored under ``MethodContext.cache_dir/quantmla/<key>/`` as safetensors
with the config that made it, keyed by a hash of (model weights and config, method config, the
path's bit width, calibration windows); later runs reuse it. C4R4 and C2R4 therefore share the
RoPE calibration, and the ablation rows share the content calibration. ``checkpoint.pt`` in the
same folder lets an interrupted calibration resume. One process at a time computes an entry (its
folder's lock; another process that needs it waits, then reuses it; a process that needs several
computes one no other process holds first), and a stored entry is checked
when read (its key, layers, fields, shapes, finite values): a damaged one is set aside and computed
again.

Named deviations from the paper's recipe, all off by default: ``paths`` (Table 3's ablation:
content / RoPE transform on or off; protection is the run's ``protect.enabled``),
``content_objective: cache_mse`` (plain cache reconstruction), ``rope_objective: output``,
``select: last`` (keep the final step instead of the best held-out one). ``matmul_precision``
(``high``: TensorFloat-32 products on GPUs) sets torch's float32 matrix-multiply precision while the
paths train; at ``highest``, the default, every product is IEEE float32.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantmla import placement
from quantmla.calibration import (
    MATMUL_PRECISIONS,
    LayerBatch,
    Teacher,
    activation_percentiles,
    alpha_log_scales,
    check_pairing,
    content_loss,
    entry_key,
    heldout_mean,
    matmul_precision,
    model_fingerprint,
    rope_loss,
    tensor_digest,
)
from quantmla.files import first_writer, reason, remove_stale_temps, replacing, set_aside, write_atomic
from quantmla.optim import Schedule, train_path
from quantmla.registry import Method, MethodConfig, MethodContext, register
from quantmla.transforms import (
    LayerTransform,
    cayley,
    from_state,
    fuse,
    live_channels,
    live_pairs_mask,
    pair_matrix,
    rope_key_maps,
    rope_pairs,
    to_state,
)

log = logging.getLogger("quantmla")

PATHS = ("content", "rope")
CONTENT_OBJECTIVES = ("output", "cache_mse")
ROPE_OBJECTIVES = ("qk", "output")
FORMAT_VERSION = 1


@dataclass
class QuantMLAConfig(MethodConfig):
    name = "quantmla"
    paths: dict = field(default_factory=lambda: {"content": True, "rope": True})
    steps: int = 300
    warmup: float = 0.1
    grad_clip: float = 1.0
    val_every: int = 20
    lr_rotation: float = 3e-3
    lr_content_scale: float = 1e-3
    lr_angle: float = 1e-3
    lr_rope_scale: float = 1e-3
    anchor: float = 1e-4
    alphas: list[float] = field(default_factory=lambda: [0.0, 0.125, 0.25, 0.5, 0.75, 1.0])
    percentile: float = 99.9
    log_scale_clip: float = 2.0
    content_objective: str = "output"
    rope_objective: str = "qk"
    select: str = "best"  # best: the lowest held-out step (paper); last: the final step
    matmul_precision: str = "highest"  # float32 products while calibrating: highest (IEEE) | high (TF32) | medium
    cache: bool = True
    teacher_cache_gb: float = 4.0  # keep the teacher's pieces in memory when a whole bank fits

    def __post_init__(self):
        self.paths = dict(self.paths)
        for k in self.paths:
            if k == "protect":
                raise ValueError("protection is not a QuantMLA switch: it is the run's protect.enabled")
            if k not in PATHS:
                raise ValueError(f"unknown ablation switch '{k}' in QuantMLA paths; choose from {', '.join(PATHS)}")
        self.paths = {p: bool(self.paths.get(p, True)) for p in PATHS}
        if int(self.steps) < 1:
            raise ValueError(f"QuantMLA steps must be at least 1, got {self.steps}")
        if int(self.val_every) < 1:
            raise ValueError(f"QuantMLA val_every must be at least 1, got {self.val_every}")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"QuantMLA warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        for what in ("lr_rotation", "lr_content_scale", "lr_angle", "lr_rope_scale", "anchor"):
            if getattr(self, what) < 0:
                raise ValueError(f"QuantMLA {what} must not be negative, got {getattr(self, what)}")
        if self.grad_clip <= 0 or self.log_scale_clip <= 0:
            raise ValueError("QuantMLA grad_clip and log_scale_clip must be positive")
        self.alphas = sorted(float(a) for a in self.alphas)
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"QuantMLA alphas must be a non-empty list in [0, 1], got {self.alphas}")
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"QuantMLA percentile {self.percentile} is outside (0, 100]")
        if self.content_objective not in CONTENT_OBJECTIVES:
            raise ValueError(
                f"unknown content_objective '{self.content_objective}'; choose {', '.join(CONTENT_OBJECTIVES)}"
            )
        if self.select not in ("best", "last"):
            raise ValueError(f"QuantMLA select must be 'best' or 'last', got '{self.select}'")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"QuantMLA matmul_precision '{self.matmul_precision}' is not one of {', '.join(MATMUL_PRECISIONS)}"
            )
        if self.rope_objective not in ROPE_OBJECTIVES:
            raise ValueError(f"unknown rope_objective '{self.rope_objective}'; choose {', '.join(ROPE_OBJECTIVES)}")

    @property
    def schedule(self) -> Schedule:
        return Schedule(int(self.steps), self.warmup, self.grad_clip, int(self.val_every), self.select)


# ----- the two trainable paths -----------------------------------------------------------------
class ContentPath:
    """Per layer: skew generator P (R_C = Cayley(P)) and log-scale ρ_C, trained against L_C."""

    label = "C"

    def __init__(self, cfg: QuantMLAConfig, log_s0: list[torch.Tensor], bits: int, group: int, devices, live=None):
        """``devices``: where each layer computes (its parameters live there)."""
        self.cfg, self.bits, self.group = cfg, bits, group
        d_c = log_s0[0].numel()
        self.P = [torch.zeros(d_c, d_c, device=dev, requires_grad=True) for dev in devices]
        # the rotation acts on live latent channels only (identity on channels whose Γ is zero)
        live = live or [torch.ones(d_c, dtype=torch.bool)] * len(log_s0)
        self.mask = [live_pairs_mask(v).to(dev) for v, dev in zip(live, devices)]
        self.rho = [ls.detach().float().to(dev).clone().requires_grad_() for ls, dev in zip(log_s0, devices)]
        self.rho0 = [ls.detach().float().to(dev).clone() for ls, dev in zip(log_s0, devices)]
        self.needs_outputs = cfg.content_objective == "output"

    def param_groups(self) -> list[dict]:
        return [{"params": self.P, "lr": self.cfg.lr_rotation}, {"params": self.rho, "lr": self.cfg.lr_content_scale}]

    def scale(self, i: int) -> torch.Tensor:
        c = self.cfg.log_scale_clip
        return torch.exp(self.rho[i].clamp(-c, c))

    def loss(self, lb: LayerBatch, ste: bool) -> torch.Tensor:
        i = lb.index
        R = cayley(self.P[i] * self.mask[i])
        return content_loss(lb, self.bits, R, self.scale(i), True, self.cfg.content_objective, self.group, ste)

    def anchor(self) -> torch.Tensor:
        n = self.P[0].shape[0]
        upper = {dev: torch.triu_indices(n, n, offset=1, device=dev) for dev in {P.device for P in self.P}}
        skew = _mean([((P - P.T) * m)[tuple(upper[P.device])].pow(2).mean() for P, m in zip(self.P, self.mask)])
        scale = _mean([(r - r0).pow(2).mean() for r, r0 in zip(self.rho, self.rho0)])
        return self.cfg.anchor * (skew + scale)

    def snapshot(self) -> dict:
        return {"P": [p.detach().cpu().clone() for p in self.P], "rho": [r.detach().cpu().clone() for r in self.rho]}

    def restore(self, snap: dict) -> None:
        with torch.no_grad():
            for dst, src in zip(self.P + self.rho, snap["P"] + snap["rho"]):
                dst.copy_(src)

    def transforms(self) -> list[dict]:
        """The selected R_C and s_C; R_C is solved once more in float64 so the fused rotation is orthogonal
        to round-off (training solves in float32)."""
        with torch.no_grad():
            return [
                {"R_C": cayley((self.P[i] * self.mask[i]).double()).float(), "s_C": self.scale(i)}
                for i in range(len(self.P))
            ]


class RopePath:
    """Per layer: one angle θ_i and one log-scale ρ_i per frequency pair, trained against L_P."""

    label = "P"

    def __init__(self, cfg: QuantMLAConfig, log_s0: list[torch.Tensor], pairs: list, bits: int, group: int, devices):
        """``devices``: where each layer computes (its parameters live there)."""
        self.cfg, self.bits, self.group, self.pairs = cfg, bits, group, pairs
        self.d_r = 2 * log_s0[0].numel()
        self.theta = [torch.zeros(ls.numel(), device=dev, requires_grad=True) for ls, dev in zip(log_s0, devices)]
        self.rho = [ls.detach().float().to(dev).clone().requires_grad_() for ls, dev in zip(log_s0, devices)]
        self.rho0 = [ls.detach().float().to(dev).clone() for ls, dev in zip(log_s0, devices)]
        self.needs_outputs = cfg.rope_objective == "output"

    def param_groups(self) -> list[dict]:
        return [{"params": self.theta, "lr": self.cfg.lr_angle}, {"params": self.rho, "lr": self.cfg.lr_rope_scale}]

    def scale(self, i: int) -> torch.Tensor:
        c = self.cfg.log_scale_clip
        return torch.exp(self.rho[i].clamp(-c, c))

    def loss(self, lb: LayerBatch, ste: bool) -> torch.Tensor:
        i, s = lb.index, self.scale(lb.index)
        M = pair_matrix(self.pairs[i], self.d_r, self.theta[i], s)  # K_P' = K_P R_P S_P (post-RoPE layout)
        M_inv = pair_matrix(self.pairs[i], self.d_r, self.theta[i], s, inverse_scale=True).T
        return rope_loss(lb, self.bits, M, M_inv, self.cfg.rope_objective, self.group, ste)

    def anchor(self) -> torch.Tensor:
        angle = _mean([t.pow(2).mean() for t in self.theta])
        scale = _mean([(r - r0).pow(2).mean() for r, r0 in zip(self.rho, self.rho0)])
        return self.cfg.anchor * (angle + scale)

    def snapshot(self) -> dict:
        return {
            "theta": [t.detach().cpu().clone() for t in self.theta],
            "rho": [r.detach().cpu().clone() for r in self.rho],
        }

    def restore(self, snap: dict) -> None:
        with torch.no_grad():
            for dst, src in zip(self.theta + self.rho, snap["theta"] + snap["rho"]):
                dst.copy_(src)

    def transforms(self) -> list[dict]:
        with torch.no_grad():
            return [{"theta_P": self.theta[i].clone(), "s_P": self.scale(i)} for i in range(len(self.theta))]


def _mean(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Mean of per-layer scalars, on the first layer's device (layers may compute on different GPUs)."""
    return torch.stack([t.to(per_layer[0].device) for t in per_layer]).mean()


# ----- caching ---------------------------------------------------------------------------------
@register(QuantMLAConfig)
class QuantMLA(Method):
    needs_data = True

    def __init__(self, config: QuantMLAConfig):
        super().__init__(config)
        self.on_step: Callable[[int], None] | None = None  # called after every update (progress hooks, tests)

    # -- what each path is, and where its result lives ---------------------------------------------
    def _todo(self, spec) -> dict[str, int]:
        cfg = self.config
        todo = {}
        if cfg.paths["content"] and spec.content_bits < 16:
            todo["C"] = spec.content_bits
        if cfg.paths["rope"] and spec.rope_bits < 16:
            todo["P"] = spec.rope_bits
        return todo

    def _key(self, path: str, bits: int, model_fp: str, data_fp: str, ctx: MethodContext) -> str:
        method = {k: v for k, v in self.config.to_dict().items() if k not in ("paths", "cache", "teacher_cache_gb")}
        if method["matmul_precision"] == "highest":  # what every entry stored before the setting existed used
            del method["matmul_precision"]
        blob = {
            "format": FORMAT_VERSION,
            "path": path,
            "bits": bits,
            "group": ctx.spec.group,
            "method": method,
            "calibration": ctx.calibration.to_dict(),
            "model": model_fp,
            "data": data_fp,
        }
        return entry_key(blob)

    def _load(self, folder: Path, key: str, shapes: dict[str, tuple], layers: int) -> list[dict] | None:
        """The stored result of entry ``key`` (None if there is none); a damaged one is set aside."""
        f = folder / "transforms.safetensors"
        if not (self.config.cache and f.exists()):
            return None
        try:
            with safe_open(str(f), "pt") as handle:
                if (handle.metadata() or {}).get("key") != key:
                    raise ValueError("it was written for another key")
            state = load_file(f)
            result = [{} for _ in range(layers)]
            for name, v in state.items():
                i, field_ = name.split(".", 1)
                if not i.isdigit() or int(i) >= layers or field_ not in shapes:
                    raise ValueError(f"unexpected tensor '{name}' for {layers} layers of {', '.join(shapes)}")
                if tuple(v.shape) != shapes[field_] or not torch.isfinite(v).all():
                    raise ValueError(
                        f"tensor '{name}' has shape {tuple(v.shape)} (expected {shapes[field_]}) or non-finite values"
                    )
                result[int(i)][field_] = v
            if any(t.keys() != shapes.keys() for t in result):
                raise ValueError(f"some layers lack {', '.join(shapes)}")
        except Exception as e:  # noqa: BLE001 - any failure means the file cannot be trusted
            set_aside(f, reason(e))
            return None
        return result

    def _save(self, folder: Path, key: str, path: str, bits: int, result: list[dict], report: dict, ctx) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        state = {f"{i}.{k}": v.detach().float().cpu().contiguous() for i, t in enumerate(result) for k, v in t.items()}
        meta = {
            "key": key,
            "path": path,
            "bits": str(bits),
            "model": ctx.model_name,
            "method": json.dumps(self.config.to_dict()),
            "calibration": json.dumps(ctx.calibration.to_dict()),
        }
        write_atomic(folder / "config.json", json.dumps(meta | {"result": report}, indent=2, default=str))
        with replacing(folder / "transforms.safetensors") as tmp:  # last: its presence says the entry is complete
            save_file(state, str(tmp), metadata=meta)

    # -- calibration ---------------------------------------------------------------------------------
    def calibrate(self, model, adapters, ctx: MethodContext) -> dict:
        spec, cal = ctx.spec, ctx.calibration
        self.info, self.stored = {}, {}
        todo = self._todo(spec)
        if not todo:
            return {}
        if "P" in todo:
            check_pairing(model)
        train, heldout = cal.banks(ctx.tokenizer)  # missing or too-short data stops here, before any statistics
        model_fp, data_fp = model_fingerprint(model, ctx.model_name), tensor_digest(train, heldout)
        folders, results = {}, {}
        for p, bits in todo.items():
            key = self._key(p, bits, model_fp, data_fp, ctx)
            folders[p] = (Path(ctx.cache_dir) / "quantmla" / key, key)
        self._reuse(todo, folders, results, adapters)
        self.stored = {p: folder for p, (folder, _) in folders.items()}
        need = [p for p in todo if p not in results]
        self._live = [live_channels(a) for a in adapters]
        # One process computes an entry, the others reuse it. Each path is claimed alone, the first one
        # no other process is computing: two runs needing C4 and R4, and C2 and R4, compute C4 and C2 at
        # once, then one computes R4 while the other waits for it.
        pending, shared = {p: folders[p][0] for p in need}, {}
        while pending:
            with first_writer(pending, lambda p: f"QuantMLA {p} transforms {folders[p][1]}") as p:
                remove_stale_temps(pending.pop(p))
                self._reuse([p], folders, results, adapters)
                if p not in results:
                    with matmul_precision(self.config.matmul_precision):
                        self._train(model, adapters, ctx, train, heldout, todo, [p], folders, results, shared)
        transforms = [LayerTransform() for _ in adapters]
        for per_layer in results.values():
            for t, entries in zip(transforms, per_layer):
                for k, v in entries.items():
                    setattr(t, k, v.detach().float().cpu())
        return to_state(transforms)

    def _reuse(self, paths, folders: dict, results: dict, adapters) -> None:
        """Stored results of ``paths`` into ``results``."""
        d_c, d_r = adapters[0].dims.d_c, adapters[0].dims.d_r
        shapes = {"C": {"R_C": (d_c, d_c), "s_C": (d_c,)}, "P": {"theta_P": (d_r // 2,), "s_P": (d_r // 2,)}}
        for p in paths:
            cached = self._load(*folders[p], shapes[p], len(adapters))
            if cached is not None:
                results[p] = cached
                self.info[f"cached_{p}"] = 1
                log.info("QuantMLA %s path: reusing %s", p, folders[p][0])

    def _train(self, model, adapters, ctx, train, heldout, todo, need, folders, results, shared) -> None:
        """Learn the paths in ``need``, store each, and put their transforms into ``results``. ``shared``
        keeps the activation statistics and the held-out teacher for the next call of the same calibration."""
        cfg, spec, cal = self.config, ctx.spec, ctx.calibration
        devices = [placement.execution_device(a.module) for a in adapters]
        budget = cfg.teacher_cache_gb * 2**30
        if not shared:
            shared["stats"] = activation_percentiles(model, train, cal.batch_size, cfg.percentile / 100, ctx.progress)
            shared["held"] = Teacher(model, heldout, cal.batch_size, outputs=True, cache_bytes=budget)
        (a_C, a_P), held = shared["stats"], shared["held"]
        log_s0 = self._alpha_init(held, a_C, a_P, need, todo, spec, ctx.progress)
        for p in need:
            if p == "C":
                path = ContentPath(cfg, log_s0["C"], todo["C"], spec.group, devices, self._live)
            else:
                pairs = [rope_pairs(a)[1] for a in adapters]
                path = RopePath(cfg, log_s0["P"], pairs, todo["P"], spec.group, devices)
            folder, key = folders[p]
            report = train_path(
                path,
                Teacher(model, train, cal.batch_size, outputs=path.needs_outputs, cache_bytes=budget),
                held,
                cfg.schedule,
                cal.seed,
                checkpoint=folder / "checkpoint.pt",
                key=key,
                desc=f"QuantMLA {'content' if p == 'C' else 'RoPE'} path",
                progress=ctx.progress,
                on_step=self.on_step,
            )
            results[p] = path.transforms()
            self._save(folder, key, p, todo[p], results[p], report, ctx)
            (folder / "checkpoint.pt").unlink(missing_ok=True)
            self.info |= {
                f"step_{p}": report["step"],
                f"heldout_init_{p}": report["init_loss"],
                f"heldout_{p}": report["loss"],
                f"cached_{p}": 0,
            }

    def _alpha_init(self, held: Teacher, a_C, a_P, need, todo, spec, progress) -> dict:
        """The paper's eq. 37: per path, the α of the grid with the lowest held-out path objective (R = I, θ = 0)."""
        cfg = self.config
        logs = {
            "C": {
                al: [alpha_log_scales(a, al, cfg.log_scale_clip, v) for a, v in zip(a_C, self._live)]
                for al in cfg.alphas
            },
            "P": {al: [alpha_log_scales(a, al, cfg.log_scale_clip) for a in a_P] for al in cfg.alphas},
        }

        def fn(lb: LayerBatch) -> dict:
            out = {}
            for al in cfg.alphas:
                if "C" in need:
                    s = logs["C"][al][lb.index].exp()
                    out["C", al] = content_loss(lb, todo["C"], None, s, True, cfg.content_objective, spec.group)
                if "P" in need:
                    M, M_inv = rope_key_maps(lb.mla, LayerTransform(s_P=logs["P"][al][lb.index].exp()))
                    out["P", al] = rope_loss(lb, todo["P"], M, M_inv, cfg.rope_objective, spec.group)
            return out

        means = heldout_mean(held, fn, desc="QuantMLA α-grid", progress=progress)
        chosen = {}
        for p in need:
            alpha = min(cfg.alphas, key=lambda al: (means[p, al], al))  # ties go to the smaller α (0 first)
            chosen[p] = logs[p][alpha]
            self.info[f"alpha_{p}"] = alpha
        return chosen

    # -- fusion --------------------------------------------------------------------------------------
    def fuse(self, model, adapters, transforms: dict, ctx: MethodContext) -> None:
        for mla, t in zip(adapters, from_state(transforms, len(adapters))):
            fuse(mla, t)

    def apply(self, model, adapters, ctx: MethodContext) -> dict:
        transforms = self.calibrate(model, adapters, ctx)
        if not transforms:
            return transforms
        _, heldout = ctx.calibration.banks(ctx.tokenizer)
        ids = heldout[:1, :256]
        before = _nll(model, ids)
        self.fuse(model, adapters, transforms, ctx)
        drift = abs(_nll(model, ids) - before)
        self.info["fusion_nll_drift"] = drift
        # fused weights are stored in the model's dtype: 16-bit weights round each product (2^-8
        # relative in BF16), float32 ones do not; a wrong fusion moves the NLL by O(1) nats
        bound = 1e-2 if next(model.parameters()).dtype.itemsize >= 4 else 5e-2
        if drift > bound:
            raise RuntimeError(
                f"QuantMLA fusion changed the unquantized model: NLL drift {drift:.3g} nats/token > {bound:g}"
            )
        return transforms


@torch.no_grad()
def _nll(model, ids: torch.Tensor) -> float:
    ids = ids.to(placement.execution_device(model))
    logits = model(ids, use_cache=False).logits.float()
    return float(F.cross_entropy(logits[0, :-1], ids[0, 1:]))
