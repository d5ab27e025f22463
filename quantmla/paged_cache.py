"""A transformers ``Cache`` over the paged latent cache, so ``model.generate`` runs through the core.

Pass ``quantmla.attention.new_cache(model, batch, max_len)`` to ``generate`` (under the keyword
``quantmla.attention.cache_keyword()`` names: ``cache`` or ``past_key_values``). Every
:class:`~quantmla.attention.LatentAttention` layer then writes its new tokens with the fused
writer and attends with the core:

- a first chunk (prompt prefill) is written into pages and attended teacher-forced, each
  (query, key) pair following the decode-faithful protection rule;
- a single new token per request (decode) is written, then attended by the decode kernel
  over the pages and the protection buffers;
- several new tokens after a prefix are processed one at a time (write, decode), which is
  what the protection rule means for them.

With ``spec.exact`` on a quantized spec both steps read the stored rows unrounded (prefill config
``exact``, decode argument ``exact``; the decode then runs on :mod:`quantmla.kernels.exact_decode`).

Padding columns (from the attention mask) are not stored: a request's pages hold its own
tokens, so token indices for protection count only real tokens. Beam search and cache
cropping are not supported (a clear error says so).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from quantmla import kernels
from quantmla.kernels.layout import PAGE, PagedLayer, PageFormat


class LatentCacheLayer(CacheLayerMixin):
    """Bookkeeping seen by transformers for one layer (columns seen so far); data lives in the pages."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.columns = 0
        self.paged: PagedLayer | None = None
        self.lengths: list[int] = []
        self.lengths_dev: torch.Tensor | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError(
            "the paged latent cache is written by quantmla's LatentAttention; install it first "
            "(quantmla.attention.install(model, spec))"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.columns = 0
        self.paged = None
        self.lengths = []
        self.lengths_dev = None
        self.is_initialized = False

    def _unsupported(self, what: str):
        if self.columns:
            raise NotImplementedError(f"{what} is not supported by the paged latent cache (greedy/sampling only)")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            self._unsupported("cropping the cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("expanding the batch of a filled cache")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("selecting requests of a filled cache")


class LatentCache(Cache):
    """Paged latent cache for ``num_layers`` decoder layers (one block table shared by all)."""

    def __init__(self, num_layers: int, batch_size: int | None = None, max_length: int | None = None, backend="auto"):
        super().__init__(layers=[LatentCacheLayer() for _ in range(num_layers)])
        self.max_length = max_length
        self.backend = kernels.check_backend(backend)
        self.pages: list[list[int]] = []
        self.next_page = 0
        self.block_table: torch.Tensor | None = None  # on the host; each device reads its own copy
        self._tables: dict[torch.device, torch.Tensor] = {}
        self.capacity = 0
        self.batch_hint = batch_size
        # Facts of the current step that every layer shares, computed by the first layer that
        # needs them (each computation reads the device back): (mask, shape, key validity) and
        # (key validity, n, per-request counts of new tokens).
        self.step_validity: tuple | None = None
        self._step_counts: tuple | None = None
        self._rows: dict[torch.device, torch.Tensor] = {}
        # After reserve(): the capacity every request's pages hold
        self.static: int | None = None

    def reset(self) -> None:
        """Empty the cache for a new batch (every layer's pages go; the page numbering restarts)."""
        super().reset()
        self.pages, self.next_page, self.block_table, self._tables = [], 0, None, {}
        self.step_validity = self._step_counts = None
        self.static = None

    # ----- static decoding (a step that can be captured in a CUDA graph) -------------------------
    def reserve(self, max_length: int) -> None:
        """Give every request pages for ``max_length`` tokens now and fix the decode steps' shape, so
        that a decode step reads nothing from the host that changes between steps: no page is
        allocated later, each layer's lengths advance in place on the device, and the decode kernel
        is planned for ``max_length`` (a request's own length bounds what it reads). After this the
        cache takes decode steps of one new token per request only, each followed by
        :meth:`advance` (which keeps the host's counts, outside whatever a graph captured)."""
        held = [layer for layer in self.layers if layer.paged is not None]
        if not self.pages or not held:
            raise ValueError("reserve() follows the prompt's prefill: the layers must hold their requests first")
        longest = max(max(layer.lengths, default=0) for layer in held)
        if max_length < longest + 1:
            raise ValueError(f"reserve({max_length}): a request already holds {longest} tokens")
        self._ensure_pages([max_length] * len(self.pages))
        for layer in held:
            if layer.paged.num_pages < self.next_page:
                layer.paged.grow(self.next_page)
        self.static = max_length

    def advance(self) -> None:
        """The host's side of one static decode step (see :meth:`reserve`): every layer holds one more
        column (the requests' lengths on the host stay those at :meth:`reserve`; the device's advance)."""
        for layer in self.layers:
            if layer.paged is not None:
                layer.columns += 1

    # ----- page allocation (shared by all layers) ----------------------------------------------
    def _ensure_pages(self, lengths: list[int]) -> None:
        B = len(lengths)
        if not self.pages:
            self.pages = [[] for _ in range(B)]
        grew = False
        for b, L in enumerate(lengths):
            while len(self.pages[b]) * PAGE < L:
                self.pages[b].append(self.next_page)
                self.next_page += 1
                grew = True
        if grew or self.block_table is None:
            width = max(1, max(len(p) for p in self.pages))
            table = torch.zeros(B, width, dtype=torch.int32)
            for b, p in enumerate(self.pages):
                table[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
            self.block_table, self._tables = table, {}

    def _table(self, device: torch.device) -> torch.Tensor:
        """The block table on ``device`` (layers of a model spread over GPUs each read their own copy)."""
        if device not in self._tables:
            self._tables[device] = self.block_table.to(device)
        return self._tables[device]

    def _layer(self, idx: int, spec, C: torch.Tensor, K_P: torch.Tensor) -> LatentCacheLayer:
        layer = self.layers[idx]
        if layer.paged is None:
            B = C.shape[0]
            fmt = PageFormat.from_spec(spec, C.shape[-1], K_P.shape[-1], C.dtype)
            pages = max(self.next_page, B * -(-(self.max_length or 256) // PAGE))
            sink, recent = (spec.sink, spec.recent) if spec.protected else (0, 0)
            layer.paged = PagedLayer(fmt, pages, C.device, batch=B, sink=sink, recent=recent)
            layer.lengths = [0] * B
            layer.lengths_dev = torch.zeros(B, dtype=torch.int64, device=C.device)
            layer.is_initialized = True
        return layer

    # ----- attention through the core ------------------------------------------------------------
    def attend(self, layer_idx: int, spec, q_lat, q_pe, C, K_P, key_valid, tau: float, backend: str | None = None):
        """Write this layer's new tokens and attend: o_lat (B, H, n, d_c) float32.

        C (B, 1, n, d_c) and K_P (B, 1, n, d_r) are the new latents, q_lat/q_pe (B, H, n, ·)
        their queries, ``key_valid`` (B, columns) the mask's key validity (None: all valid).
        """
        backend = backend or self.backend
        C, K_P = C[:, 0], K_P[:, 0]
        B, n = C.shape[0], C.shape[1]
        if self.static is not None:
            return self._static_step(layer_idx, spec, q_lat, q_pe, C, K_P, key_valid, tau, backend)
        layer = self._layer(layer_idx, spec, C, K_P)
        if len(layer.lengths) != B:
            raise ValueError(f"the cache holds {len(layer.lengths)} requests but the batch has {B}")
        new_valid = key_valid[:, -n:] if key_valid is not None else None  # None: all are real
        counts = [n] * B if new_valid is None else self._new_counts(key_valid, new_valid)
        before = list(layer.lengths)
        after = [a + c for a, c in zip(before, counts)]
        self._ensure_pages(after)
        if layer.paged.num_pages < self.next_page:
            layer.paged.grow(max(self.next_page, 2 * layer.paged.num_pages))
        paged, bt = layer.paged, self._table(C.device)
        layer.columns += n
        if n > 1 and not any(before):
            if new_valid is None:
                new_valid = torch.ones(B, n, dtype=torch.bool, device=C.device)
            o = self._prefill(layer, bt, spec, q_lat, q_pe, C, K_P, new_valid, counts, tau, backend)
        else:
            # Token by token; the cache built the block table and knows every length on the host,
            # so the core's device-reading checks are skipped and the longest length is passed in.
            dense = all(c == n for c in counts)  # no padding among the new tokens (every decode step)
            config, exact = {"max_len": max(after, default=0)}, spec.exact_rows
            outs = []
            for i in range(n):
                if dense:
                    rows, pos, lens = self._all_rows(B, C.device), layer.lengths_dev, layer.lengths_dev + 1
                    C_i, K_i = C[:, i], K_P[:, i]
                else:
                    v = new_valid[:, i]
                    r = v.nonzero().squeeze(1)
                    rows, pos, lens = r.to(torch.int32), layer.lengths_dev[r], layer.lengths_dev + v.long()
                    C_i, K_i = C[r, i], K_P[r, i]
                kernels.write(paged, bt, C_i, K_i, rows, pos, lens, backend, validate=False)
                layer.lengths_dev = lens
                o_i, _ = kernels.decode(
                    paged, bt, lens, q_lat[:, :, i], q_pe[:, :, i], tau, backend, config, validate=False, exact=exact
                )
                outs.append(o_i if dense else o_i * v[:, None, None])
            o = outs[0].unsqueeze(2) if n == 1 else torch.stack(outs, 2)
        layer.lengths = after
        return o

    def _static_step(self, layer_idx: int, spec, q_lat, q_pe, C, K_P, key_valid, tau: float, backend: str):
        """A decode step after :meth:`reserve`: write and attend one token per request, changing
        nothing on the host (a CUDA graph of the step replays exactly this)."""
        B, n = C.shape[0], C.shape[1]
        layer = self.layers[layer_idx]
        if n != 1 or key_valid is not None or len(layer.lengths) != B:
            raise ValueError("after reserve() the cache takes one new token for each of its requests per step")
        paged, bt = layer.paged, self._table(C.device)
        pos = layer.lengths_dev
        lens = pos + 1
        kernels.write(paged, bt, C[:, 0], K_P[:, 0], self._all_rows(B, C.device), pos, lens, backend, validate=False)
        o, _ = kernels.decode(
            paged, bt, lens, q_lat[:, :, 0], q_pe[:, :, 0], tau, backend, {"max_len": self.static},
            validate=False, exact=spec.exact_rows,
        )  # fmt: skip
        pos.copy_(lens)
        return o.unsqueeze(2)

    def _new_counts(self, key_valid, new_valid) -> list[int]:
        """New real tokens per request; read back once per step (the layers share ``key_valid``)."""
        n = new_valid.shape[1]
        memo = self._step_counts
        if memo is None or memo[0] is not key_valid or memo[1] != n:
            memo = self._step_counts = (key_valid, n, new_valid.sum(1).tolist())
        return memo[2]

    def _all_rows(self, B: int, device) -> torch.Tensor:
        rows = self._rows.get(device)
        if rows is None or rows.shape[0] != B:
            rows = self._rows[device] = torch.arange(B, dtype=torch.int32, device=device)
        return rows

    def _prefill(self, layer, bt, spec, q_lat, q_pe, C, K_P, new_valid, counts, tau, backend):
        B, n = new_valid.shape
        dev = C.device
        kv_len = torch.tensor(counts, dtype=torch.int64, device=dev)
        pos = (new_valid.cumsum(1) - 1)[new_valid]
        req = torch.arange(B, device=dev).unsqueeze(1).expand(B, n)[new_valid].to(torch.int32)
        kernels.write(layer.paged, bt, C[new_valid], K_P[new_valid], req, pos, kv_len, backend, validate=False)
        layer.lengths_dev = kv_len.clone()
        sink, recent = (spec.sink, spec.recent) if spec.protect else (0, 0)
        if not spec.quantized:
            return kernels.attend(
                q_lat, q_pe, C, K_P, None if bool(new_valid.all()) else new_valid, spec, tau, backend
            )[0]
        # the pages just written are the stored copies; the chunk itself gives the cache-dtype rows
        order = torch.sort((~new_valid).to(torch.int8), dim=1, stable=True).indices
        Cc = C.gather(1, order.unsqueeze(-1).expand(B, n, C.shape[-1]))
        Kc = K_P.gather(1, order.unsqueeze(-1).expand(B, n, K_P.shape[-1]))
        H = q_lat.shape[1]
        qc = q_lat.gather(2, order[:, None, :, None].expand(B, H, n, q_lat.shape[-1]))
        qpc = q_pe.gather(2, order[:, None, :, None].expand(B, H, n, q_pe.shape[-1]))
        config = {"exact": True} if spec.exact_rows else None
        o, _ = kernels.prefill(qc, qpc, Cc, Kc, kv_len, kv_len, tau, sink, recent, layer.paged, bt, backend, config)
        rank = (new_valid.cumsum(1) - 1).clamp_min(0)
        o = o.gather(2, rank[:, None, :, None].expand(B, H, n, o.shape[-1]))
        return o * new_valid[:, None, :, None]
