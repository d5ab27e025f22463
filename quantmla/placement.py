"""Layers that accelerate offloads: where a module computes, and reading or writing its weights.

A model spread by accelerate gives every decoder layer a device. A layer that fits on no GPU lives in
CPU memory or on disk and *computes* on a GPU: its parameters sit on the ``meta`` device and a hook
loads them for each forward from accelerate's store, then drops them. Calling a module runs that
hook; reading or writing a weight directly does not, so the harness does both through this module:

- :func:`execution_device`: where a module computes (its hook's device, else its weights');
- :func:`loaded`: a module's own weights on that device for the duration of a block;
- :func:`write`: a new value for a weight, into the store when the module is offloaded;
- :func:`detached_copy`: a plain copy of a module, every weight loaded and no hooks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn


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
