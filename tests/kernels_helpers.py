"""Shared set-up for the quantized-MLA core tests.

On a machine without CUDA the Triton kernels run in the interpreter: ``TRITON_INTERPRET=1``
is set here, before any kernel module is imported (they are imported lazily by
:mod:`quantmla.kernels`). With CUDA the same tests compile and run the kernels for real.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from quantmla.kernels import PAGE, PagedLayer, PageFormat  # noqa: E402
from quantmla.kernels import reference as ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TOL = 1e-3
"""Relative error bar of a kernel against the float32 reference (issue 3). The kernels keep
float32 accuracy: scores come from exact products of cache-dtype operands accumulated in
float32, and P·V takes P as a hi/lo pair (P = P_hi + P_lo in the cache dtype), so the
expected error is ~1e-6 (a single bf16 P would already sit near 1e-3 on random data). A
wrong row, page, scale or protection decision moves the output by O(1)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ over the finite entries of ``b`` (float64)."""
    a, b = a.double().cpu(), b.double().cpu()
    m = torch.isfinite(b)
    return float((a[m] - b[m]).norm() / b[m].norm().clamp_min(1e-30))


def same_inf(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isinf(a.cpu()), torch.isinf(b.cpu()))


def shuffled_table(B: int, per: int, spare: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """A block table (B, per) drawing distinct physical pages in random order from a pool of B·per + spare."""
    num = B * per + spare
    perm = torch.randperm(num, generator=gen)[: B * per]
    return perm.view(B, per).to(torch.int32), num


def latents(T: int, fmt: PageFormat, gen: torch.Generator, scale: float = 2.0):
    """Random non-zero rows (T, d_c), (T, d_r) in the cache dtype, with an offset so groups are not centred."""
    C = torch.randn(T, fmt.d_c, generator=gen) * scale + 0.5
    K = torch.randn(T, fmt.d_r, generator=gen) * scale - 0.25
    return C.to(fmt.dtype), K.to(fmt.dtype)


def filled_layer(fmt: PageFormat, lengths: list[int], gen: torch.Generator, sink=4, recent=128, spare=3):
    """A paged layer holding ``lengths[b]`` random tokens per request behind a shuffled block table,
    written by the reference writer; also returns the dense rows (B, Lmax, ·)."""
    B = len(lengths)
    per = max(1, -(-max(lengths) // PAGE))
    bt, num = shuffled_table(B, per, spare, gen)
    layer = PagedLayer(fmt, num, "cpu", batch=B, sink=sink, recent=recent)
    layer.pool.copy_(torch.randint(0, 256, layer.pool.shape, generator=gen, dtype=torch.uint8))
    Lmax = max(max(lengths), 1)
    C, K = latents(B * Lmax, fmt, gen)
    C, K = C.view(B, Lmax, -1), K.view(B, Lmax, -1)
    req = torch.cat([torch.full((L,), b, dtype=torch.int32) for b, L in enumerate(lengths)])
    pos = torch.cat([torch.arange(L) for L in lengths])
    lens = torch.tensor(lengths, dtype=torch.int64)
    ref.write(layer, bt, C[req.long(), pos], K[req.long(), pos], req, pos, lens)
    return to_device(layer), bt.to(DEVICE), lens.to(DEVICE), C.to(DEVICE), K.to(DEVICE)


def to_device(layer: PagedLayer) -> PagedLayer:
    if DEVICE.type == "cpu":
        return layer
    moved = PagedLayer(layer.fmt, layer.num_pages, DEVICE, batch=0, sink=layer.sink, recent=layer.recent)
    moved.pool.copy_(layer.pool)
    moved.prot = layer.prot.to(DEVICE) if layer.prot is not None else None
    return moved


def exact_rows(x: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """s·(q − z) of the quantizer's own codes, scales and zero-points (``quant.quantize``, independent
    of the pages), in float64 and unrounded; ``x`` itself at 16 bits."""
    from quantmla.quant import quantize

    if bits == 16:
        return x.double()
    t = quantize(x, bits, 64, scale_dtype=scale_dtype)
    q = t.codes.double().unflatten(-1, (-1, 64))
    return (t.scale.double().unsqueeze(-1) * (q - t.zero.double().unsqueeze(-1))).flatten(-2)
