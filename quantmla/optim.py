"""The per-path calibration loop of the paper's Table 7: AdamW, warm-up + cosine, clipping, validation, best step.

One optimizer over all layers' parameters of a path; the loss of a step is the path objective
averaged over the batch's windows and the layers, plus the anchors (a mean-squared deviation from
the initialization; the paper gives neither form). Each
step draws a batch of windows of the train bank in a seeded per-epoch order, takes the frozen
teacher's pieces (:class:`~quantmla.calibration.Teacher`) and back-propagates layer by layer (the layers are separable: each sees teacher
inputs), so memory holds one layer's graph. The held-out objective (no anchors) is evaluated
at step 0 and every ``val_every`` steps and at the end; the lowest one's parameters are kept.

A checkpoint (parameters, optimizer state, step, best so far, history) is written at every
validation and when the loop is interrupted (Ctrl-C, or SIGTERM as a scheduler sends it), atomically;
a later call with the same key resumes from it. A signal that arrives during an update is held until
the update ends (:func:`quantmla.tracking.held_signals`), so that checkpoint holds the last step
completed. The learning rate is a pure function of the step, so nothing else is saved. It is read
with ``torch.load(weights_only=True)``, which builds tensors and plain containers only and runs no
code from the file; a checkpoint that does not load, was written for another key or does not fit
the path is set aside (:func:`quantmla.files.set_aside`) and the path trained from the start.
"""

from __future__ import annotations

import logging
import math
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from quantmla.calibration import LayerBatch, Teacher, heldout_mean
from quantmla.files import reason, replacing, set_aside
from quantmla.progress import bar as progress_bar
from quantmla.progress import interactive
from quantmla.tracking import held_signals

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
    with replacing(path) as tmp:
        torch.save(state, tmp)


def _layout(snap) -> dict:
    """The names and shapes of a path's parameter snapshot (a dict of lists of tensors)."""
    if not isinstance(snap, dict):
        raise ValueError("its parameters are not a snapshot")
    return {k: [tuple(t.shape) for t in v] for k, v in snap.items()}


def _resume(checkpoint: Path, key: str, path: TrainablePath, opt: torch.optim.Optimizer) -> dict | None:
    """The loop state saved in ``checkpoint``, with ``path`` and ``opt`` restored from it; None (and
    ``path`` as it was) when there is none or it is damaged, which is then set aside."""
    if not checkpoint.exists():
        return None
    before = path.snapshot()
    try:
        saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
        if not isinstance(saved, dict) or saved.get("key") != key:
            raise ValueError("not a checkpoint of this calibration (its key differs)")
        state = {k: saved[k] for k in ("step", "best", "history")}
        if not isinstance(state["step"], int) or not state["history"] or state["best"] is None:
            raise ValueError("its step, history or best entry is missing")
        for snap in (saved["params"], state["best"]["params"]):
            if _layout(snap) != _layout(before):
                raise ValueError("its parameters do not fit this path (other layers or shapes)")
        path.restore(saved["params"])
        opt.load_state_dict(saved["opt"])
    except pickle.UnpicklingError as e:  # torch's advice to retry with weights_only=False is not taken
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        path.restore(before)
        set_aside(
            checkpoint, f"refused: it holds an object{what} other than tensors and containers, which could run code"
        )
        return None
    except Exception as e:  # noqa: BLE001 - any failure means the file cannot be trusted
        path.restore(before)
        set_aside(checkpoint, reason(e))
        return None
    return state


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
    resumed = _resume(checkpoint, key, path, opt) if checkpoint is not None else None
    if resumed is not None:
        state = resumed
        log.info("%s: resuming from step %d (%s)", desc, state["step"], checkpoint)

    def validate(step: int) -> float:
        v = heldout_mean(heldout, lambda lb: {"L": path.loss(lb, ste=False)}, progress=False)["L"]
        better = state["best"] is None or v < state["best"]["loss"]
        snap = path.snapshot() if better else None
        with held_signals():  # the history and the best entry change together
            state["history"].append((step, v))
            if better:
                state["best"] = {"loss": v, "step": step, "params": snap}
        return v

    def save() -> None:
        if checkpoint is not None:
            _save(checkpoint, {"key": key, "params": path.snapshot(), "opt": opt.state_dict(), **state})

    def due(step: int) -> bool:
        return step == 0 or step % schedule.val_every == 0 or step == schedule.steps

    if due(state["step"]) and (not state["history"] or state["history"][-1][0] != state["step"]):
        validate(state["step"])  # at the start, or where an interruption fell between an update and its validation
        save()
    bar = progress_bar(range(state["step"], schedule.steps), desc=desc, unit="step", enabled=progress)
    last_val = state["history"][-1][1]
    try:
        for k in bar:
            for g, lr in zip(opt.param_groups, base_lr):
                g["lr"] = lr * schedule.lr_factor(k)
            opt.zero_grad(set_to_none=True)
            layers = list(train.layers(batch_indices(k, train.batch_size, len(train), seed)))
            losses = []
            for lb in layers:
                loss = path.loss(lb, ste=True).mean() / len(layers)
                loss.backward()
                losses.append(loss.detach())  # read after the loop: reading each layer's would wait for it
            total = sum(float(v) for v in losses)
            anchor = path.anchor()
            anchor.backward()
            torch.nn.utils.clip_grad_norm_(params, schedule.grad_clip)
            with held_signals():  # the parameters, the optimizer state and the step change together
                opt.step()
                state["step"] = k + 1
            if due(state["step"]):
                last_val = validate(state["step"])
                save()
                if not (progress and interactive()):  # no bar on a terminal: one line per validation in the log
                    log.info(
                        "%s step %d/%d: train %.4g, held-out %.4g (best %.4g at step %d)",
                        desc, state["step"], schedule.steps, total, last_val,
                        state["best"]["loss"], state["best"]["step"],
                    )  # fmt: skip
            bar.set_postfix(loss=f"{total:.4g}", val=f"{last_val:.4g}", best=f"{state['best']['loss']:.4g}")
            if on_step is not None:
                on_step(state["step"])
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (quantmla.tracking.Terminated); never inside an update
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
