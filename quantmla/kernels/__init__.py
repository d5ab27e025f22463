"""The quantized-MLA core: paged low-bit latent cache, fused writer, decode and teacher-forced attention.

Usable on its own (a serving engine could call it) and used by the harness for every run:

- :mod:`~quantmla.kernels.layout`: the physical cache of the paper's App. C.5 (:class:`PageFormat`,
  :class:`PagedLayer`), block tables, protection buffers;
- :func:`write`: quantize + pack + scatter new tokens into their pages (the paper's fused writer);
- :func:`decode`: one query per request over its pages, split-KV with an LSE merge (the paper's §3.3, App. C.5);
- :func:`prefill`: teacher-forced causal attention with the decode-faithful protection rule;
- :func:`attend`: teacher-forced attention over dense latents (quantized into temporary
  pages first), what evaluation and :func:`quantmla.attention.layer_output` use.

Each runs as a Triton kernel (:mod:`~quantmla.kernels.triton_write`, :mod:`~quantmla.kernels.triton_prefill`;
decode on the kernel :mod:`~quantmla.kernels.dispatch` chooses) or as the float32 torch reference
(:mod:`quantmla.kernels.reference`), chosen by ``backend``: ``auto`` takes
Triton for CUDA tensors and the reference on CPU; ``triton`` and ``reference`` force one
(``triton`` on CPU only under ``TRITON_INTERPRET=1``). Triton kernels have no backward, so
``auto`` takes the reference when autograd must flow through the call. Every wrapper checks
its inputs and raises before any kernel is launched.
"""

from __future__ import annotations

import os

import torch

from quantmla.kernels import reference
from quantmla.kernels.layout import PAGE, PagedLayer, PageFormat, check_block_table

BACKENDS = ("auto", "triton", "reference")

__all__ = [
    "BACKENDS",
    "PAGE",
    "PageFormat",
    "PagedLayer",
    "attend",
    "check_backend",
    "decode",
    "prefill",
    "resolve_backend",
    "write",
]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend(backend: str, device: torch.device | str | None = None) -> str:
    """Validate a backend name (and that it can run on ``device``); returns it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend '{backend}' is not one of {', '.join(BACKENDS)}")
    if backend == "triton" and device is not None and torch.device(device).type != "cuda" and not _interpreting():
        raise ValueError("backend=triton needs a CUDA device (or TRITON_INTERPRET=1 for the Triton interpreter on CPU)")
    return backend


def resolve_backend(backend: str, device: torch.device, grad: bool = False, dtype: torch.dtype | None = None) -> str:
    """``triton`` or ``reference`` for a call on ``device`` (``grad``: autograd must flow through it;
    ``dtype``: the cache dtype, float64 has no kernel)."""
    check_backend(backend, device)
    if backend == "auto":
        return "triton" if device.type == "cuda" and not grad and dtype != torch.float64 else "reference"
    if backend == "triton" and dtype == torch.float64:
        raise ValueError(
            "the Triton kernels take bfloat16, float16 or float32 caches; float64 runs on backend=reference"
        )
    return backend


def traced(*tensors) -> bool:
    """Whether any tensor is wrapped by a torch.func transform (vmap, grad, vjp, jvp): such tensors
    have no storage a Triton kernel could read, so ``auto`` takes the reference for them."""
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(t is not None and is_wrapped(t) for t in tensors)


def needs_grad(*tensors) -> bool:
    """Whether autograd must flow through a call on ``tensors`` (then ``auto`` takes the reference)."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) or traced(*tensors)


def _same_device(*tensors) -> None:
    devs = {t.device for t in tensors if t is not None}
    if len(devs) > 1:
        raise ValueError(f"tensors are on different devices: {sorted(map(str, devs))}")


def _check_rows(name: str, x: torch.Tensor, width: int, dtype: torch.dtype) -> None:
    if x.dtype != dtype:
        raise TypeError(f"{name} is {x.dtype} but the cache holds {dtype}: cast it first")
    if x.shape[-1] != width:
        raise ValueError(f"{name} has width {x.shape[-1]}; the cache layout holds {width}")


def _check_queries(q_lat, q_pe, fmt_or_dims) -> None:
    d_c, d_r = fmt_or_dims
    if not (q_lat.is_floating_point() and q_pe.is_floating_point()):
        raise TypeError(
            f"q_lat and q_pe must be floating point (they are cast to the cache dtype), got {q_lat.dtype}, {q_pe.dtype}"
        )
    if q_lat.shape[-1] != d_c or q_pe.shape[-1] != d_r or q_lat.shape[:-1] != q_pe.shape[:-1]:
        raise ValueError(
            f"queries {tuple(q_lat.shape)} / {tuple(q_pe.shape)} do not match latent widths d_c={d_c}, d_r={d_r}"
        )


def write(
    layer: PagedLayer, block_table, C, K_P, req, pos, lens_after, backend: str = "auto", validate: bool = True
) -> None:
    """Quantize, pack and store tokens into ``layer``: C (T, d_c), K_P (T, d_r) in the cache dtype,
    ``req`` (T,) request of each token, ``pos`` (T,) its token index, ``lens_after`` (B,) each
    request's length once these tokens are in. See :func:`quantmla.kernels.reference.write`.
    ``validate=False`` skips the checks that read indices back from the device (page numbers,
    lengths, positions): for callers whose tables are valid by construction, such as the
    paged generation cache, so that a decode step does not wait for the GPU once per layer."""
    fmt = layer.fmt
    _same_device(layer.pool, block_table, C, K_P, req, pos, lens_after)
    _check_rows("C", C, fmt.d_c, fmt.dtype)
    _check_rows("K_P", K_P, fmt.d_r, fmt.dtype)
    if C.dim() != 2 or K_P.shape[0] != C.shape[0] or req.shape != (C.shape[0],) or pos.shape != (C.shape[0],):
        raise ValueError("write takes C (T, d_c), K_P (T, d_r), req (T,) and pos (T,)")
    check_block_table(block_table, lens_after, layer.num_pages, block_table.shape[0], values=validate)
    if layer.prot is not None and layer.prot.shape[0] < block_table.shape[0]:
        raise ValueError(
            f"protection buffers hold {layer.prot.shape[0]} requests, the block table {block_table.shape[0]}"
        )
    if validate and C.shape[0] and int(pos.max()) >= int(lens_after.max()):
        raise ValueError("a token index is not below its request's length after the write")
    C, K_P = C.contiguous(), K_P.contiguous()
    if resolve_backend(backend, C.device, dtype=fmt.dtype) == "reference":
        fn = reference.write
    else:
        from quantmla.kernels.triton_write import write as fn
    fn(layer, block_table, C, K_P, req, pos, lens_after)


def _check_out(out, shapes) -> None:
    if out is None:
        return
    for t, shape in zip(out, shapes):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"out tensors must be contiguous float32 of shapes {shapes}")


DECODE_CONFIG = {
    "block_h": "query heads per program (a power of two >= 16)",
    "block_n": "tokens per tile (a power of two >= 16 dividing the 64-token page)",
    "num_warps": "warps per program",
    "num_stages": "software-pipeline depth of the tile loads",
    "num_splits": "programs per (request, head block) along the context, merged by LSE",
    "max_len": "the batch's longest request (saves a device-to-host read per call)",
    "pv_split": "P·V with P as a hi/lo pair, float32 accuracy (True, the default up to 16 heads) or one BF16 tile (False, the default above)",
    "chunks": "column chunks (1, 2 or 4) the content path is read, reconstructed and multiplied in (1 where the format's d_c cannot be cut into whole groups)",
    "maxnreg": "registers per thread the compiler may use (more programs per SM, spills beyond); none by default",
    "gluon": "run the Gluon Hopper kernel where it takes the case (C4R4 or C2R4 in BF16, > 16 heads, P as one BF16 "
    "tile, 64-token tiles, sm_90; gluon_decode.supports): True by default above 16 heads",
    "prot_weight": "page tiles one protected tile counts for when the exact kernel cuts a request into splits "
    "(default exact_decode.PROT_WEIGHT)",
}
"""Tuning keys of :func:`decode`'s ``config``: none changes what is computed, beyond P's precision
(``pv_split``). What is computed is :func:`decode`'s ``exact``."""
PREFILL_CONFIG = {
    "block_m": "(query, head) rows per program",
    "block_n": "keys per tile",
    "num_warps": "warps per program",
    "num_stages": "software-pipeline depth of the key loads",
    "exact": "the stored rows as s·(q − z) unrounded (each a hi/lo pair of cache-dtype tiles) instead of rounded to "
    "the cache dtype; False by default (the reference's semantics); its reference is reference.prefill with the same key",
}


def _check_config(config, keys: dict, what: str) -> None:
    if config is None:
        return
    unknown = sorted(set(config) - set(keys))
    if unknown:
        raise ValueError(
            f"unknown {what} config keys {unknown}; known: " + "; ".join(f"{k} ({v})" for k, v in keys.items())
        )


def decode(
    layer: PagedLayer,
    block_table,
    lengths,
    q_lat,
    q_pe,
    tau: float,
    backend: str = "auto",
    config=None,
    out=None,
    validate: bool = True,
    *,
    exact: bool = False,
):
    """Decode attention: (o_lat (B, H, d_c), lse (B, H)) float32 for q_lat (B, H, d_c), q_pe (B, H, d_r)
    over each request's ``lengths[b]`` cached tokens (into ``out`` when given). ``config``
    overrides the kernel's tile/split choice (keys: :data:`DECODE_CONFIG`; the defaults are
    the tuned table of :mod:`~quantmla.kernels.dispatch`). ``validate=False`` skips the
    block-table checks that read the device, as in :func:`write`; with ``config["max_len"]``
    given too, the call does not wait for the GPU.

    ``exact``: attention over the exactly dequantized cache, s·(q − z) without the rounding of the
    reconstructed rows to the cache dtype, P in FP16 (the exact_decode Gluon kernel: C4R4 or C2R4 in
    BF16, <= 16 heads, sm_90; elsewhere the exact torch reference, said once in the log). False by
    default: the reference's function, :func:`quantmla.kernels.reference.decode`, whose ``exact``
    is the same switch."""
    _check_config(config, DECODE_CONFIG, "decode")
    fmt = layer.fmt
    _same_device(layer.pool, block_table, lengths, q_lat, q_pe)
    _check_queries(q_lat, q_pe, (fmt.d_c, fmt.d_r))
    if q_lat.dim() != 3 or q_lat.shape[1] < 1:
        raise ValueError(f"decode takes q_lat (B, H, d_c) with H >= 1, got {tuple(q_lat.shape)}")
    check_block_table(block_table, lengths, layer.num_pages, q_lat.shape[0], values=validate)
    if layer.prot is not None and layer.prot.shape[0] < q_lat.shape[0]:
        raise ValueError(f"protection buffers hold {layer.prot.shape[0]} requests, the batch is {q_lat.shape[0]}")
    B, H = q_lat.shape[:2]
    _check_out(out, ((B, H, fmt.d_c), (B, H)))
    if resolve_backend(backend, q_lat.device, dtype=fmt.dtype) == "reference":
        return reference.decode(layer, block_table, lengths, q_lat, q_pe, tau, config, out, exact=exact)
    from quantmla.kernels import dispatch

    return dispatch.decode(layer, block_table, lengths, q_lat, q_pe, tau, config, out, exact=exact)


def prefill(
    q_lat,
    q_pe,
    C,
    K_P,
    kv_len,
    q_len,
    tau: float,
    sink: int,
    recent: int,
    layer: PagedLayer | None = None,
    block_table=None,
    backend: str = "auto",
    config=None,
    out=None,
    validate: bool = True,
):
    """Teacher-forced attention with the decode-faithful rule; see :func:`quantmla.kernels.reference.prefill`.
    ``config`` overrides the kernel's tiles (keys: :data:`PREFILL_CONFIG`). ``validate=False`` skips
    the checks that read lengths and page numbers back from the device, for callers whose tables
    are valid by construction (:func:`attend`), so that a layer does not wait for the GPU."""
    _check_config(config, PREFILL_CONFIG, "prefill")
    _same_device(q_lat, q_pe, C, K_P, kv_len, q_len, block_table, layer.pool if layer is not None else None)
    d_c, d_r = C.shape[-1], K_P.shape[-1]
    _check_queries(q_lat, q_pe, (d_c, d_r))
    B, L = C.shape[0], C.shape[1]
    if q_lat.dim() != 4 or q_lat.shape[0] != B or K_P.shape[:2] != (B, L):
        raise ValueError("prefill takes q_lat (B, H, n, d_c), q_pe (B, H, n, d_r), C (B, L, d_c), K_P (B, L, d_r)")
    if K_P.dtype != C.dtype:
        raise TypeError(f"C is {C.dtype} but K_P is {K_P.dtype}")
    for name, t in (("kv_len", kv_len), ("q_len", q_len)):
        if t.dtype not in (torch.int32, torch.int64) or t.shape != (B,):
            raise ValueError(f"{name} must be an int tensor of shape ({B},)")
    if validate and B and (int(kv_len.max()) > L or int(q_len.max()) > q_lat.shape[2] or bool((q_len > kv_len).any())):
        raise ValueError("need q_len <= kv_len, kv_len <= L and q_len <= n")
    if layer is not None:
        if layer.fmt.dtype != C.dtype or (layer.fmt.d_c, layer.fmt.d_r) != (d_c, d_r):
            raise TypeError(
                f"pages hold {layer.fmt.dtype} rows of {layer.fmt.d_c}+{layer.fmt.d_r}; keys are {C.dtype} {d_c}+{d_r}"
            )
        if block_table is None:
            raise ValueError("a paged layer needs its block table")
        check_block_table(block_table, kv_len, layer.num_pages, B, values=validate)
    _check_out(out, (tuple(q_lat.shape[:3]) + (d_c,), tuple(q_lat.shape[:3])))
    if resolve_backend(backend, q_lat.device, needs_grad(q_lat, q_pe, C, K_P), C.dtype) == "reference":
        fn = reference.prefill
    else:
        from quantmla.kernels.triton_prefill import prefill as fn
    C, K_P = C.contiguous(), K_P.contiguous()
    return fn(q_lat, q_pe, C, K_P, kv_len, q_len, tau, sink, recent, layer, block_table, config, out)


def attend(q_lat, q_pe, C, K_P, key_valid, spec, tau: float, backend: str = "auto"):
    """Teacher-forced attention over dense latents, the way the cache would serve them
    (float32 outputs; float64 for float64 latents).

    q_lat (B, H, n, d_c), q_pe (B, H, n, d_r) are the queries of the last ``n`` columns of
    C (B, L, d_c) and K_P (B, L, d_r) (cache dtype). ``key_valid`` (B, L) marks real tokens
    (None: all); a request's tokens are its valid columns in order. With a quantized ``spec``
    every valid token is written into temporary pages and each pair follows the protection
    rule of ``spec`` (no protection when ``spec.protect`` is off). Returns (B, H, n, d_c) and
    (B, H, n) float32; columns that are not valid queries get 0 and -inf. ``spec.exact`` reads
    the stored rows unrounded (prefill config ``exact``).
    """
    B, H, n, d_c = q_lat.shape
    L, d_r = C.shape[1], K_P.shape[-1]
    dev = C.device
    if backend == "auto" and traced(q_lat, q_pe, C, K_P):
        backend = "reference"  # under torch.func the pages are written and read by the reference
    if key_valid is None and not spec.quantized:
        if resolve_backend(backend, dev, needs_grad(q_lat, q_pe, C, K_P), C.dtype) == "reference":
            return reference.dense(q_lat, q_pe, C.contiguous(), K_P.contiguous(), tau)
    if key_valid is None:
        kv_len = torch.full((B,), L, dtype=torch.int64, device=dev)
        q_len = torch.full((B,), n, dtype=torch.int64, device=dev)
        Cc, Kc, qc, qpc, qv = C, K_P, q_lat, q_pe, None
    else:
        key_valid = key_valid.to(dev, torch.bool)
        kv_len = key_valid.sum(1)
        qv = key_valid[:, L - n :]
        q_len = qv.sum(1)
        order = torch.sort((~key_valid).to(torch.int8), dim=1, stable=True).indices  # valid columns first
        Cc = C.gather(1, order.unsqueeze(-1).expand(B, L, d_c))
        Kc = K_P.gather(1, order.unsqueeze(-1).expand(B, L, d_r))
        qorder = torch.sort((~qv).to(torch.int8), dim=1, stable=True).indices
        qc = q_lat.gather(2, qorder[:, None, :, None].expand(B, H, n, d_c))
        qpc = q_pe.gather(2, qorder[:, None, :, None].expand(B, H, n, d_r))
    layer = bt = None
    sink = recent = 0
    if spec.quantized:
        fmt = PageFormat.from_spec(spec, d_c, d_r, C.dtype)
        pages = max(1, -(-L // PAGE))
        layer = PagedLayer(fmt, B * pages, dev)
        bt = torch.arange(B * pages, device=dev, dtype=torch.int32).view(B, pages)
        # Every column is written, the padding ones (past kv_len) into slots nothing reads, and the
        # tables are valid by construction: no boolean indexing and no checks that read the
        # device, each of which would wait for the GPU once per layer.
        req = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(L)
        pos = torch.arange(L, device=dev).repeat(B)
        full = torch.full((B,), L, dtype=torch.int64, device=dev)
        C_rows, K_rows = Cc.detach().reshape(B * L, d_c), Kc.detach().reshape(B * L, d_r)
        write(layer, bt, C_rows, K_rows, req, pos, full, backend, validate=False)
        if spec.protect:
            sink, recent = spec.sink, spec.recent
    config = {"exact": True} if spec.exact_rows else None
    o, lse = prefill(qc, qpc, Cc, Kc, kv_len, q_len, tau, sink, recent, layer, bt, backend, config, validate=False)
    if qv is not None:  # back to the input columns: query k of a request sits at its k-th valid column
        rank = (qv.cumsum(1) - 1).clamp_min(0)
        o = o.gather(2, rank[:, None, :, None].expand(B, H, n, d_c)) * qv[:, None, :, None]
        lse = lse.gather(2, rank[:, None, :].expand(B, H, n)).masked_fill(~qv[:, None, :], float("-inf"))
    return o, lse
