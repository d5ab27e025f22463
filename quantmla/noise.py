"""The noise floor: a run repeated under a change that should not change its result.

Quantization turns float round-off into different codes, and different codes into different
numbers, so two computations that are the same on paper score a configuration differently. A
noise-floor run is an ordinary run with ``noise.perturb`` and ``noise.seed`` set; analysis groups
it with the runs that differ from it only in ``noise`` and reports the spread of each metric
(docs/noise.md). ``noise.seed`` = k numbers the variant:

- ``none``: nothing changes; k > 0 is a plain repeat (it measures nondeterminism).
- ``backend``: the attention core on the other backend (``reference`` ↔ ``triton``) than the one
  ``backend`` resolves to on the device; k numbers repeats.
- ``batch``: the evaluation batch size is the (k+1)-th of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32 that
  differs from the configured one; a separate generation batch (``generate_batch_size``) and a
  token budget of the scoring batches (``scoring_tokens``) change in the same proportion (rounded, at
  least 1).
- ``order``: the evaluation's items in a random order drawn with seed k (perplexity windows).
- ``seed``: the calibration banks drawn with ``calibration.seed`` + 1 + k (methods that read data).

The config of the record keeps the values asked for; what was changed is written into the
record's metrics (``noise``).
"""

from __future__ import annotations

import dataclasses

PERTURBATIONS = ("none", "backend", "batch", "order", "seed")
BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def perturb(noise: dict, backend: str, device, ev, calibration, method):
    """``(backend, eval, calibration, what changed)`` for the run's ``noise`` settings; ValueError
    for a perturbation that this run has nothing to vary with."""
    kind, k = noise.get("perturb", "none"), int(noise.get("seed", 0))
    if kind not in PERTURBATIONS:
        raise ValueError(f"noise.perturb '{kind}' is not one of {', '.join(PERTURBATIONS)}")
    if k < 0:
        raise ValueError(f"noise.seed must be at least 0, got {k}")
    name = getattr(ev, "name", type(ev).__name__)
    if kind == "none":
        return backend, ev, calibration, f"none (repeat {k})" if k else ""
    if kind == "backend":
        from quantmla.kernels import check_backend, resolve_backend

        was = resolve_backend(backend, device)
        other = "reference" if was == "triton" else "triton"
        try:
            check_backend(other, device)
        except ValueError as e:
            raise ValueError(f"noise.perturb=backend: {e}") from None
        return other, ev, calibration, f"backend {was} -> {other}"
    if kind == "batch":
        if not hasattr(ev, "batch_size"):
            raise ValueError(f"noise.perturb=batch: eval {name} has no batch size")
        sizes = [s for s in BATCH_SIZES if s != ev.batch_size]
        size = sizes[k % len(sizes)]
        changed, said = {"batch_size": size}, f"eval.batch_size {ev.batch_size} -> {size}"
        for key in ("generate_batch_size", "scoring_tokens"):  # sizes beside batch_size, scaled with it
            was = getattr(ev, key, None)
            if was is not None and isinstance(ev.batch_size, int):
                changed[key] = max(1, round(was * size / ev.batch_size))
                said += f", eval.{key} {was} -> {changed[key]}"
        return backend, dataclasses.replace(ev, **changed), calibration, said
    if kind == "order":
        if not hasattr(ev, "order_seed"):
            raise ValueError(
                f"noise.perturb=order: eval {name} has no evaluation order to vary (lm-eval sorts its requests "
                "itself); use backend or batch"
            )
        return backend, dataclasses.replace(ev, order_seed=k), calibration, f"items in random order (seed {k})"
    if not method.needs_data:
        raise ValueError(f"noise.perturb=seed varies the calibration banks, and method {method.config.name} reads none")
    seed = calibration.seed + 1 + k
    return backend, ev, dataclasses.replace(calibration, seed=seed), f"calibration.seed {calibration.seed} -> {seed}"
