"""Kernel configurations that fit the device: launch the first of a ladder that the GPU can run.

A tile choice tuned for one dtype or width can ask for more shared memory than a block may use
(float32 latents of width 512 take twice the bytes of BF16 ones). Triton knows only once it has
compiled the kernel, so :func:`launch` tries the configurations in order, remembers per shape
which one launched, and says once in the log when it had to step down. Nothing else is caught:
a wrong result or any other error still raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from triton.runtime.errors import OutOfResources

log = logging.getLogger("quantmla.kernels")

_chosen: dict[tuple, int] = {}
_said: set[tuple] = set()


def say_once(key: tuple, msg: str, *args) -> None:
    """Log ``msg`` at WARNING the first time ``key`` is seen in this process."""
    if key not in _said:
        _said.add(key)
        log.warning(msg, *args)


def launch(what: str, key: tuple, ladder: Sequence[dict], run: Callable[[dict], None]) -> dict:
    """Call ``run(cfg)`` with the first ``cfg`` of ``ladder`` whose kernel fits the device's
    resources; ``key`` names the shape (the same key starts where the last success did).
    Returns the configuration that ran; raises the last ``OutOfResources`` if none fits."""
    start = _chosen.get(key, 0)
    err = None
    for i in range(start, len(ladder)):
        try:
            run(ladder[i])
        except OutOfResources as e:
            err = e
            continue
        if i and err is not None:
            say_once(
                (what, key, i),
                "%s: %s does not fit this GPU (%s); running %s instead",
                what,
                _short(ladder[0]),
                err,
                _short(ladder[i]),
            )
        _chosen[key] = i
        return ladder[i]
    raise OutOfResources(getattr(err, "required", 0), getattr(err, "limit", 0), f"{what}: every tile choice") from err


def _short(cfg: dict) -> str:
    return ", ".join(
        f"{k}={v}" for k, v in cfg.items() if k in ("block_m", "block_h", "block_n", "num_warps", "num_stages")
    )


def smaller(cfg: dict, steps: Sequence[dict]) -> list[dict]:
    """``cfg`` followed by each of ``steps`` applied on top of the previous one, skipping repeats."""
    out = [dict(cfg)]
    for s in steps:
        nxt = out[-1] | {k: min(v, out[-1].get(k, v)) for k, v in s.items()}
        if nxt != out[-1]:
            out.append(nxt)
    return out
