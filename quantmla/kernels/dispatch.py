"""Which decode kernel runs a decode, with which tiles and splits.

Three kernels compute decode attention over the paged cache, each a module with the same small
interface: ``NAME``; ``supports(case)``, None where it takes a :class:`~.splits.Case` and else the
reason why not; ``split(case)``, how it cuts the case's context into splits
(:mod:`.splits`); and ``launch(case, split, ...)``, which writes the partial outputs that
:func:`.splits.merge` combines. In order of preference:

- :mod:`.exact_decode` (Gluon, sm_90): attention over the exactly dequantized cache, the only one
  that computes it; it takes nothing else;
- :mod:`.gluon_decode` (Gluon, sm_90): C4R4 and C2R4 above 16 heads, the tile reconstruction
  overlapped with the tensor cores;
- :mod:`.triton_decode`: every other decode, in the Triton interpreter too.

:func:`plan` asks each in turn and takes the first that supports the case; where none does (an
``exact`` decode the exact kernel does not take), :func:`decode` runs the exact torch reference and
says why once in the log. The tiles and split count come from :data:`TILES` and
:func:`default_config`, which a caller's config overrides key by key (keys:
:data:`quantmla.kernels.DECODE_CONFIG`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from quantmla.kernels import fit, reference, splits, triton_decode
from quantmla.kernels._tiles import INTERPRET
from quantmla.kernels.layout import PAGE
from quantmla.kernels.splits import Case, Split

TILES = {
    # (H > 16, quantized) -> tiles, warps, pipeline depth, content chunks: the fastest of
    # bench/decode.py --tune on the H200 (docs/kernels.md). Four-warp programs run two per SM.
    # Above 16 heads, P enters P·V as one BF16 tile (FlashMLA's precision): that is what lets
    # 64-head programs compile to wgmma, one program per 64 heads reconstructing each tile once.
    # Four content chunks cut the registers a reconstructed tile holds. Where the Gluon Hopper
    # kernel takes the case (C4R4 and C2R4, see gluon_decode.supports), it runs instead (config
    # gluon). At up to 16 heads the default keeps the hi/lo P (float32 accuracy).
    (False, False): dict(block_h=16, block_n=64, num_warps=4, num_stages=2, chunks=4),
    (False, True): dict(block_h=16, block_n=64, num_warps=4, num_stages=2, chunks=4),
    (True, False): dict(block_h=64, block_n=64, num_warps=8, num_stages=2, pv_split=False),
    (True, True): dict(block_h=64, block_n=64, num_warps=8, num_stages=2, pv_split=False, chunks=4, gluon=True),
}


def default_config(B: int, H: int, max_len: int, layer, device, config: dict | None = None) -> dict:
    """Tiles, warps and splits for one decode shape over ``layer``; ``config`` overrides any of them.

    One request's heads share each tile. Splits fill the GPU (SMs × programs per SM) at small
    batch and vanish at large batch; they are counted for the work tiles :func:`.splits.split_work`
    cuts (page tiles and protected tiles alike).
    """
    key = tuple(sorted((config or {}).items()))
    return dict(_config(B, H, max_len, layer.fmt, splits.protected(layer), device, key))


@functools.lru_cache(maxsize=4096)
def _config(B: int, H: int, max_len: int, fmt, prot, device, key: tuple) -> dict:
    """Cached body of :func:`default_config` (the split search stays off the per-step host path)."""
    config = dict(key)
    if INTERPRET:
        block_h = max(16, triton.next_power_of_2(min(H, 64)))
        base = dict(block_h=block_h, block_n=64, num_splits=2, num_warps=4, num_stages=1, pv_split=H <= 16)
        return base | config
    cfg = dict(TILES[(H > 16, fmt.quantized)])
    cfg["block_h"] = min(cfg["block_h"], max(16, triton.next_power_of_2(H)))
    if fmt.dtype.itemsize == 4:  # twice the bytes per stage: keep the tiles within shared memory
        cfg.update(block_h=min(cfg["block_h"], 32), block_n=32, num_stages=2)
    cfg |= config
    if "num_splits" not in cfg:
        heads = triton.cdiv(H, cfg["block_h"])
        tiles = max(1, sum(splits.work(max_len, cfg["block_n"], prot)))
        slots = splits.programs_per_sm(cfg) * splits.sms(device)
        cfg["num_splits"] = splits.split_count(B, heads, tiles, slots)
    return cfg


@functools.cache
def kernels() -> tuple:
    """The decode kernel modules, in order of preference; the Gluon ones only where this Triton has
    a (compatible) Gluon."""
    found = []
    try:
        from quantmla.kernels import exact_decode

        found.append(exact_decode)
    except (ImportError, AttributeError):
        pass
    try:
        from quantmla.kernels import gluon_decode

        found.append(gluon_decode)
    except (ImportError, AttributeError):
        pass
    return (*found, triton_decode)


class Plan(NamedTuple):
    """What :func:`decode` launches: the kernel module and its :class:`~.splits.Split`."""

    kernel: object
    split: Split

    @property
    def name(self) -> str:
        return self.kernel.NAME


def refusals(case: Case) -> dict[str, str]:
    """Each kernel's reason for not taking ``case`` (kernels that take it are left out)."""
    out = {k.NAME: why for k in kernels() if (why := k.supports(case)) is not None}
    if case.exact and "exact" not in {k.NAME for k in kernels()}:
        out["exact"] = "this Triton has no (compatible) Gluon for the exact kernel"
    return out


def plan(case: Case) -> Plan:
    """The first kernel of :func:`kernels` that supports ``case``, and its split; raises ValueError
    with every kernel's reason where none does."""
    for k in kernels():
        if k.supports(case) is None:
            return Plan(k, k.split(case))
    raise ValueError("no decode kernel takes this case: " + "; ".join(f"{n}: {w}" for n, w in refusals(case).items()))


def decode(layer, block_table, lengths, q_lat, q_pe, tau: float, config: dict | None = None, out=None, exact=False):
    """Decode on the kernel :func:`plan` chooses; see :func:`quantmla.kernels.reference.decode` for the
    contract. ``exact``: attention over the exactly dequantized cache (the exact kernel, else the exact
    torch reference, said once in the log)."""
    fmt = layer.fmt
    B, H, _ = q_lat.shape
    dev = q_lat.device
    config = config or {}
    max_len = int(config["max_len"]) if "max_len" in config else (int(lengths.max()) if B else 0)
    cfg = default_config(B, H, max_len, layer, dev, config)
    block_h, block_n = cfg["block_h"], cfg["block_n"]
    if block_h < 16 or block_n < 16 or PAGE % block_n or (block_h & (block_h - 1)):
        raise ValueError(f"decode tiles: block_n must divide {PAGE}, both powers of two of at least 16; got {cfg}")
    case = Case(layer, H, max_len, dev, bool(exact), cfg)
    if case.exact:
        why = refusals(case).get("exact")
        if why is not None:
            fit.say_once(("exact decode", fmt, H, str(dev)),
                         "exact decode (exact=True): %s; running the torch reference on %s (slower)", why, dev)  # fmt: skip
            return reference.decode(layer, block_table, lengths, q_lat, q_pe, tau, None, out, exact=True)
    pl = plan(case)
    q = q_lat.to(fmt.dtype).contiguous()
    qpe = q_pe.to(fmt.dtype).contiguous()
    o, lse = out if out is not None else (torch.empty(B, H, fmt.d_c, dtype=torch.float32, device=dev), None)
    lse = lse if lse is not None else torch.empty(B, H, dtype=torch.float32, device=dev)
    if B == 0:
        return o, lse
    op, lsep = splits.partials(o, lse, pl.split.splits)
    pl.kernel.launch(case, pl.split, block_table, lengths, q, qpe, op, lsep, tau)
    splits.merge(op, lsep, o, lse)
    return o, lse


__all__ = ["TILES", "Plan", "decode", "default_config", "kernels", "plan", "refusals"]
