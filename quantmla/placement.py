"""Models spread over devices (``model.device_map=auto``): the placement config and the weights of
modules that accelerate offloads.

With ``device_map=auto`` accelerate gives every decoder layer a device within ``max_memory``. A layer
that fits on no GPU lives in CPU memory (a ``cpu`` budget) or on disk (``offload_folder``) and
*computes* on the first GPU: its parameters sit on the ``meta`` device and a hook loads them for
each forward from accelerate's store, then drops them. Calling a module runs that hook; reading or
writing a weight directly does not, so the harness does both through this module:

- :func:`execution_device`: where a module computes (its hook's device, else its weights');
- :func:`loaded`: a module's own weights on that device for the duration of a block;
- :func:`write`: a new value for a weight, into the store when the module is offloaded;
- :func:`detached_copy`: a plain copy of a module, every weight loaded and no hooks.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

DEVICE_MAPS = ("auto",)


@dataclass(kw_only=True)
class Placement:
    """Where a model's weights live. ``device_map=None``: the whole model on the run's ``device``.
    ``auto``: spread by accelerate within ``max_memory`` (device → size, e.g. ``{0: "60GiB",
    "cpu": "200GiB"}``; None = 90 % of every visible GPU's free memory), a ``cpu`` entry letting
    layers live in CPU memory and ``offload_folder`` letting what is left go to disk."""

    device_map: str | None = None
    max_memory: dict | None = None
    offload_folder: str | None = None

    def __post_init__(self):
        if self.device_map not in (None, *DEVICE_MAPS):
            raise ValueError(f"model.device_map '{self.device_map}' is not one of: null, {', '.join(DEVICE_MAPS)}")
        if self.max_memory is not None:
            self.max_memory = memory_budget(self.max_memory)
        if self.device_map is None and (self.max_memory is not None or self.offload_folder is not None):
            raise ValueError("model.max_memory and model.offload_folder place a model spread by model.device_map=auto")

    def budget(self) -> dict:
        """The budget accelerate places the model in: ``max_memory``, or 90 % of each visible GPU's free memory."""
        if self.max_memory is not None:
            visible = torch.cuda.device_count()
            for k in self.max_memory:
                if k != "cpu" and k >= visible:
                    raise ValueError(f"model.max_memory names GPU {k}, and {visible} GPUs are visible")
            return dict(self.max_memory)
        from accelerate.utils import get_max_memory

        gpus = {k: int(0.9 * v) for k, v in get_max_memory().items() if isinstance(k, int)}
        if not gpus:
            raise ValueError("model.device_map=auto found no GPU: give a CPU budget (model.max_memory={cpu: 64GiB})")
        return gpus

    def check_fits(self, device_map: dict) -> None:
        """Refuse a placement that sends weights to disk without ``offload_folder``."""
        on_disk = [name for name, d in device_map.items() if d == "disk"]
        if on_disk and self.offload_folder is None:
            raise ValueError(
                f"the model does not fit in model.max_memory ({len(on_disk)} modules left over, e.g. {on_disk[0]}): "
                "raise the budget, add a cpu entry to it, or set model.offload_folder for disk offload"
            )


def memory_budget(max_memory) -> dict:
    """``max_memory`` with its keys as accelerate takes them (GPU indices as ints, ``cpu``) and its sizes checked."""
    from accelerate.utils import convert_file_size_to_int

    out = {}
    for key, size in dict(max_memory).items():
        k = str(key).strip().lower().removeprefix("cuda:")
        if k != "cpu" and not k.isdigit():
            raise ValueError(f"model.max_memory key '{key}' is neither a GPU index (0, 1, ...) nor cpu")
        try:
            ok = convert_file_size_to_int(size) >= 0 and not isinstance(size, bool)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"model.max_memory['{key}'] = '{size}' is not a size such as 20GiB, 500MB or a byte count")
        out["cpu" if k == "cpu" else int(k)] = size
    return out


def dispatch(model: nn.Module, placement: Placement) -> nn.Module:
    """Spread a model built in memory as ``from_pretrained(device_map="auto", ...)`` spreads a checkpoint."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = getattr(model, "_no_split_modules", None)
    budget = get_balanced_memory(model, max_memory=placement.budget(), no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split)
    placement.check_fits(device_map)
    folder = None
    if "disk" in device_map.values():  # a fresh folder: accelerate reuses the weights of one it finds filled
        os.makedirs(placement.offload_folder, exist_ok=True)
        folder = tempfile.mkdtemp(prefix="offload-", dir=placement.offload_folder)
        weakref.finalize(model, shutil.rmtree, folder, ignore_errors=True)
    return dispatch_model(model, device_map, offload_dir=folder)


def describe(model: nn.Module) -> str:
    """The placement of a spread model as 'device: modules' ('' for a model on one device)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    by_device: dict[str, int] = {}
    for d in device_map.values():
        by_device[str(d)] = by_device.get(str(d), 0) + 1
    return ", ".join(f"{d}: {n}" for d, n in by_device.items())


# ----- weights of offloaded modules ---------------------------------------------------------------
def _hook_device(module: nn.Module):
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or [hook]:  # accelerate's SequentialHook holds several
        if getattr(h, "execution_device", None) is not None:
            return h.execution_device
    return None


def execution_device(module: nn.Module) -> torch.device:
    """The device ``module`` computes on: its accelerate hook's, else that of its first weight not on
    ``meta`` (submodules in order). A whole spread model gives the device its inputs go to."""
    for m in module.modules():
        d = _hook_device(m)
        if d is not None:
            return torch.device(d)
        for p in m.parameters(recurse=False):
            if p.device.type != "meta":
                return p.device
    return torch.device("cpu")


def offloaded(module: nn.Module) -> bool:
    """Whether accelerate keeps ``module``'s own weights in an offload store (on ``meta`` between forwards)."""
    return bool(getattr(getattr(module, "_hf_hook", None), "offload", False))  # accelerate's AlignDevicesHook


@contextmanager
def loaded(*modules: nn.Module) -> Iterator[None]:
    """Each module's own weights on its execution device inside the block: offloaded ones are loaded
    from the store and dropped again after (a tensor taken from them stays valid); nothing happens to
    any other module. Nested use is fine. Do not call a loaded module inside the block (its hook would
    drop the weights)."""
    pending = [m for m in modules if offloaded(m) and any(p.is_meta for p in m.parameters(recurse=False))]
    if not pending:
        yield
        return
    from accelerate.utils import align_module_device

    with ExitStack() as stack:
        for m in pending:
            stack.enter_context(align_module_device(m))
        yield


def named_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` with the values of offloaded weights, loaded one module at a time
    (each is valid while its entry is being consumed)."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in own)
        if own:
            with loaded(module):
                for n, _ in own:
                    yield (f"{prefix}.{n}" if prefix else n), getattr(module, n)


@torch.no_grad()
def write(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set ``module``'s parameter ``name`` to ``value`` (cast to its dtype). An offloaded module's
    value goes into accelerate's store, where its next forward loads it from; a weight that was on
    disk is kept in CPU memory from then on."""
    param = getattr(module, name)
    if param.device.type != "meta":
        param.copy_(value.to(device=param.device, dtype=param.dtype))
    if offloaded(module):
        _store(module._hf_hook.weights_map, name, value.detach().to(device="cpu", dtype=param.dtype))


def _store(weights_map, key: str, value: torch.Tensor) -> None:
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset

    if isinstance(weights_map, PrefixedDataset):
        return _store(weights_map.dataset, weights_map.prefix + key, value)
    if isinstance(weights_map, OffloadedWeightsLoader):  # its in-memory dict comes before its disk index
        return _store(weights_map.state_dict, key, value)
    if isinstance(weights_map, dict):
        if key in weights_map:
            weights_map[key].copy_(value)
        else:
            weights_map[key] = value
        return None
    raise TypeError(f"cannot write '{key}' into an accelerate offload store of type {type(weights_map).__name__}")


def detached_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with every weight loaded (on its execution device) and no accelerate
    hooks: a plain module that can be converted and differentiated freely. The store behind offloaded
    weights is not copied."""
    from accelerate.hooks import ModelHook, remove_hook_from_module

    mods = list(module.modules())
    memo = {id(m._hf_hook): ModelHook() for m in mods if hasattr(m, "_hf_hook")}  # the copy's hooks do nothing
    with loaded(*mods):
        twin = copy.deepcopy(module, memo)
    return remove_hook_from_module(twin, recurse=True)
