"""The per-path calibration loop of spec §5.6: AdamW, warm-up + cosine, clipping, validation, best step.

One optimizer over all layers' parameters of a path; the loss of a step is the path objective
averaged over the batch's windows and the layers, plus the anchors (spec §9 items 3, 5). Each
step draws a batch of windows of the train bank in a seeded per-epoch order, takes the frozen
teacher's pieces (:class:`~quantmla.calibration.Teacher`) and back-propagates layer by layer (the layers are separable: each sees teacher
inputs), so memory holds one layer's graph. The held-out objective (no anchors) is evaluated
at step 0 and every ``val_every`` steps and at the end; the lowest one's parameters are kept.

A checkpoint (parameters, optimizer state, step, best so far, history) is written at every
validation and when the loop is interrupted (Ctrl-C), atomically; a later call with the same
key resumes from it. The learning rate is a pure function of the step, so nothing else is saved.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

from quantmla.calibration import LayerBatch, Teacher, heldout_mean

log = logging.getLogger(__name__)


class TrainablePath(Protocol):
    """What the loop needs from a path's trainable transform (see quantmla.methods.quantmla)."""

    needs_outputs: bool

    def param_groups(self) -> list[dict]: ...

    def loss(self, lb: LayerBatch, ste: bool) -> torch.Tensor: ...

    def anchor(self) -> torch.Tensor: ...

    def snapshot(self) -> dict[str, list[torch.Tensor]]: ...

    def restore(self, snap: dict[str, list[torch.Tensor]]) -> None: ...


@dataclass
class Schedule:
    steps: int = 300
    warmup: float = 0.1
    grad_clip: float = 1.0
    val_every: int = 20
    select: str = "best"  # or "last"

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup * self.steps)

    def lr_factor(self, k: int) -> float:
        """Multiplier of the base learning rate at update k (0-based): linear warm-up from 0, then cosine to 0."""
        w = self.warmup_steps
        if k < w:
            return (k + 1) / w
        return 0.5 * (1.0 + math.cos(math.pi * (k - w) / max(1, self.steps - w)))


def batch_indices(k: int, batch_size: int, n: int, seed: int) -> torch.Tensor:
    """Windows of update k: consecutive slots of a stream of per-epoch seeded permutations of range(n)."""
    pos = torch.arange(k * batch_size, (k + 1) * batch_size)
    out = torch.empty_like(pos)
    for e in pos.div(n, rounding_mode="floor").unique().tolist():
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
        sel = pos // n == e
        out[sel] = perm[pos[sel] % n]
    return out


def _save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_path(
    path: TrainablePath,
    train: Teacher,
    heldout: Teacher,
    schedule: Schedule,
    seed: int,
    checkpoint: Path | None = None,
    key: str = "",
    desc: str = "path",
    progress: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> dict:
    """Optimize ``path`` in place; returns the history and the selected step, whose parameters ``path`` holds."""
    params = [p for g in path.param_groups() for p in g["params"]]
    opt = torch.optim.AdamW(path.param_groups(), weight_decay=0.0)
    base_lr = [g["lr"] for g in opt.param_groups]
    state = {"step": 0, "best": None, "history": []}

    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
        if saved.get("key") == key:
            path.restore(saved["params"])
            opt.load_state_dict(saved["opt"])
            state = {k: saved[k] for k in ("step", "best", "history")}

    def validate(step: int) -> float:
        v = heldout_mean(heldout, lambda lb: {"L": path.loss(lb, ste=False)}, progress=False)["L"]
        state["history"].append((step, v))
        if state["best"] is None or v < state["best"]["loss"]:
            state["best"] = {"loss": v, "step": step, "params": path.snapshot()}
        return v

    def save() -> None:
        if checkpoint is not None:
            _save(checkpoint, {"key": key, "params": path.snapshot(), "opt": opt.state_dict(), **state})

    if state["step"] == 0 and not state["history"]:
        validate(0)
        save()
    bar = tqdm(range(state["step"], schedule.steps), desc=desc, unit="step", disable=not progress)
    last_val = state["history"][-1][1]
    try:
        for k in bar:
            for g, lr in zip(opt.param_groups, base_lr):
                g["lr"] = lr * schedule.lr_factor(k)
            opt.zero_grad(set_to_none=True)
            layers = list(train.layers(batch_indices(k, train.batch_size, len(train), seed)))
            total = 0.0
            for lb in layers:
                loss = path.loss(lb, ste=True).mean() / len(layers)
                loss.backward()
                total += float(loss.detach())
            anchor = path.anchor()
            anchor.backward()
            torch.nn.utils.clip_grad_norm_(params, schedule.grad_clip)
            opt.step()
            state["step"] = k + 1
            if state["step"] % schedule.val_every == 0 or state["step"] == schedule.steps:
                last_val = validate(state["step"])
                save()
                if not progress:  # no bar (a log file, a SLURM job): one line per validation
                    log.info(
                        "%s step %d/%d: train %.4g, held-out %.4g (best %.4g at step %d)",
                        desc, state["step"], schedule.steps, total, last_val,
                        state["best"]["loss"], state["best"]["step"],
                    )  # fmt: skip
            bar.set_postfix(loss=f"{total:.4g}", val=f"{last_val:.4g}", best=f"{state['best']['loss']:.4g}")
            if on_step is not None:
                on_step(state["step"])
    except KeyboardInterrupt:
        save()
        raise
    chosen = state["best"] if schedule.select == "best" else {"step": state["step"], "loss": state["history"][-1][1]}
    if schedule.select == "best":
        path.restore(state["best"]["params"])
    return {
        "step": chosen["step"],
        "loss": chosen["loss"],
        "init_loss": state["history"][0][1],
        "history": list(state["history"]),
    }
