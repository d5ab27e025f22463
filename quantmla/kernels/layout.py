"""The physical latent cache of the paper's App. C.5: pages of 64 tokens, packed codes + metadata.

Per layer the cache is one ``uint8`` pool of pages. A page holds 64 consecutive tokens of
one request; a block table maps a request's logical page ``p`` (tokens ``64p .. 64p+63``)
to a physical page. Inside a page the regions come one after the other, codes first and
metadata after (the paper's kernel keeps them in separate buffers)::

    C codes    64 × d_c·w_C/8  B   (w = container bits: 2 → 2, 3 and 4 → 4, 8 → 8)
    K_P codes  64 × d_r·w_R/8  B
    C scales   64 × d_c/g × 2  B   (BF16)
    C zeros    64 × d_c/g      B   (uint8)
    K_P scales 64 × d_r/g × 4  B   (FP32)
    K_P zeros  64 × d_r/g      B   (uint8)

A path kept at 16 bits stores its rows in the cache dtype instead of codes and metadata
(``C16R16`` is the plain BF16 page of 64 × 576 × 2 = 73,728 B). Codes are packed as
:func:`quantmla.quant.pack` packs them: element ``2k`` in the low nibble, four 2-bit codes
per byte lowest index first. 3-bit codes travel in 4-bit containers. A codes region is
group-major: the bytes of quantization group 0 of the page's 64 tokens, then those of group 1,
and so on (64 × g·w/8 B per group), so that the codes of one group for consecutive tokens are
consecutive bytes (a warp copying a tile then touches 4 cache lines, not 16). Each page is
padded to a multiple of 4 KiB (a whole number of 64-byte units per token), which gives the
paper's 20,480 B C4R4 page: 317 B of codes and metadata per token, padded to 320.

Besides the pages a request owns a protection buffer per layer: the cache-dtype rows
``[C | K_P]`` of its first ``sink`` tokens and a ring of its ``recent`` latest tokens
(token ``t`` in ring row ``t mod recent``). Every token also has its packed copy, written
once at insertion: a token leaving the window falls back to that copy, never re-quantized.

All addressing is 64-bit: page numbers are widened before they are multiplied by the page
stride, so pools past 2^31 elements work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.quant import BITS, CONTAINER_BITS, CxRy

PAGE = 64
"""Tokens per page (the paper's App. C.5)."""

PAGE_ALIGN = 4096
"""Pages are padded to a multiple of this many bytes (64 B per token)."""

REVERSE_MAP_BYTES = 8
"""Bytes per page of the page → owner map (the paper's eq. 40)."""

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""Cache dtypes the layout holds (the dtype of the unquantized rows); float64 runs on the reference only."""

MAX_DIM = 1024


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class Region:
    name: str
    offset: int  # bytes from the start of the page
    width: int  # elements per token
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return PAGE * self.width * self.dtype.itemsize


@dataclass(frozen=True)
class PageFormat(CxRy):
    """Byte layout of one page for a CxRy cache of latent widths ``d_c`` and ``d_r``."""

    content_bits: int
    rope_bits: int
    d_c: int = 512
    d_r: int = 64
    group: int = 64
    dtype: torch.dtype = torch.bfloat16
    regions: dict = field(init=False, repr=False, compare=False)
    page_bytes: int = field(init=False, compare=False)

    def __post_init__(self):
        for what, b in (("content", self.content_bits), ("RoPE", self.rope_bits)):
            if b not in BITS:
                raise ValueError(f"{what} bits {b} are not supported by the cache layout; choose from {BITS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"cache dtype {self.dtype} is not supported; use bfloat16, float16, float32 or float64")
        if self.d_c % 16 or not 16 <= self.d_c <= MAX_DIM:
            raise ValueError(
                f"content latent width d_c={self.d_c} cannot be held by the cache layout "
                f"(needs a multiple of 16 in 16..{MAX_DIM})"
            )
        if not _is_pow2(self.d_r) or not 16 <= self.d_r <= MAX_DIM:
            raise ValueError(
                f"RoPE key width d_r={self.d_r} cannot be held by the cache layout (needs a power of two in 16..{MAX_DIM})"
            )
        if self.quantized and (not _is_pow2(self.group) or self.group < 16):
            raise ValueError(f"quantization group {self.group} must be a power of two >= 16 for the cache layout")
        for bits, d, what in ((self.content_bits, self.d_c, "d_c"), (self.rope_bits, self.d_r, "d_r")):
            if bits < 16 and d % self.group:
                raise ValueError(f"group {self.group} does not divide {what}={d}")
        regions, off = {}, 0

        def add(name, width, dtype):
            nonlocal off
            r = Region(name, off, width, dtype)
            regions[name] = r
            off += -(-r.nbytes // 64) * 64

        for p, bits, d in (("C", self.content_bits, self.d_c), ("R", self.rope_bits, self.d_r)):
            if bits == 16:
                add(f"{p}_rows", d, self.dtype)
            else:
                add(f"{p}_codes", d * CONTAINER_BITS[bits] // 8, torch.uint8)
        # metadata by path, each region at a multiple of its size at d_c 512, d_r 64, group 64 (1024, 512,
        # 256 and 64 B from the first: a kernel can view each within one copy of them all)
        if self.content_bits < 16:
            add("C_scale", self.d_c // self.group, torch.bfloat16)
            add("C_zero", self.d_c // self.group, torch.uint8)
        if self.rope_bits < 16:
            add("R_scale", self.d_r // self.group, torch.float32)
            add("R_zero", self.d_r // self.group, torch.uint8)
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "page_bytes", -(-off // PAGE_ALIGN) * PAGE_ALIGN)

    @classmethod
    def from_spec(cls, spec, d_c: int, d_r: int, dtype: torch.dtype) -> PageFormat:
        return cls(spec.content_bits, spec.rope_bits, d_c, d_r, spec.group, dtype)

    @property
    def bytes_per_token(self) -> int:
        """Page bytes per token, padding included (C4R4: 320; C16R16 BF16: 1152)."""
        return self.page_bytes // PAGE

    @property
    def payload_bytes_per_token(self) -> int:
        """Codes and metadata per token, before page padding (C4R4: 317)."""
        return sum(r.nbytes for r in self.regions.values()) // PAGE

    def protection_bytes(self, sink: int, recent: int) -> int:
        """Bytes of one request's protection buffer in one layer (4 + 128 rows: 152,064 B in BF16)."""
        return (sink + recent) * (self.d_c + self.d_r) * self.dtype.itemsize if self.quantized else 0

    def request_bytes(self, L: int, sink: int = 4, recent: int = 128) -> int:
        """The paper's eq. 40: persistent bytes of one request of ``L`` tokens in one layer."""
        pages = -(-L // PAGE)
        if not self.quantized:
            return pages * self.page_bytes
        return pages * (self.page_bytes + REVERSE_MAP_BYTES) + self.protection_bytes(sink, recent)


class PagedLayer:
    """One layer's pages (a ``uint8`` pool with typed views per region) and protection buffers.

    ``views[name]`` is a ``(num_pages, 64, width)`` tensor of the region's dtype aliasing the
    pool, except for codes: ``(num_pages, 64, groups, bytes per group)`` over the group-major
    bytes (``view[page, slot].flatten(-2)`` is a token's packed row). ``prot`` is
    ``(batch, sink + recent, d_c + d_r)`` in the cache dtype (None when the format is not
    quantized or protection is off).
    """

    def __init__(self, fmt: PageFormat, num_pages: int, device, batch: int = 0, sink: int = 0, recent: int = 0):
        if num_pages < 1:
            raise ValueError(f"a paged layer needs at least one page, got {num_pages}")
        if sink < 0 or recent < 0:
            raise ValueError(f"protection sizes must be >= 0, got sink={sink} recent={recent}")
        self.fmt = fmt
        self.sink, self.recent = (sink, recent) if fmt.quantized else (0, 0)
        self.pool = torch.empty(num_pages, fmt.page_bytes, dtype=torch.uint8, device=device)
        self.owner = torch.full((num_pages,), -1, dtype=torch.int64, device=device)  # reverse map
        self.views = self._views(self.pool)
        rows = self.sink + self.recent
        self.prot = None
        if rows and batch:
            self.prot = torch.empty(batch, rows, fmt.d_c + fmt.d_r, dtype=fmt.dtype, device=device)

    def _views(self, pool: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, r in self.fmt.regions.items():
            flat = pool[:, r.offset : r.offset + r.nbytes].view(r.dtype)
            if name.endswith("_codes"):
                groups = (self.fmt.d_c if name == "C_codes" else self.fmt.d_r) // self.fmt.group
                out[name] = flat.view(pool.shape[0], groups, PAGE, r.width // groups).transpose(1, 2)
            else:
                out[name] = flat.view(pool.shape[0], PAGE, r.width)
        return out

    @property
    def num_pages(self) -> int:
        return self.pool.shape[0]

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def page_stride(self, name: str) -> int:
        """Elements between consecutive pages in region ``name``'s view."""
        return self.views[name].stride(0)

    def grow(self, num_pages: int) -> None:
        """Enlarge the pool to ``num_pages`` pages, keeping every page's bytes."""
        if num_pages <= self.num_pages:
            return
        pool = torch.empty(num_pages, self.fmt.page_bytes, dtype=torch.uint8, device=self.device)
        pool[: self.num_pages] = self.pool
        owner = torch.full((num_pages,), -1, dtype=torch.int64, device=self.device)
        owner[: self.num_pages] = self.owner
        self.pool, self.owner = pool, owner
        self.views = self._views(pool)


def check_block_table(
    block_table: torch.Tensor, lengths: torch.Tensor, num_pages: int, batch: int, values: bool = True
) -> None:
    """Clear errors for a block table the kernels cannot use (checked on the host, before launch).
    ``values=False`` checks dtypes and shapes only: the lengths and page numbers are then not
    read back from the device (each read waits for the GPU to drain its queue)."""
    if block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block table must be int32 or int64, got {block_table.dtype}")
    if lengths.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"lengths must be int32 or int64, got {lengths.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block table must be (batch={batch}, pages), got {tuple(block_table.shape)}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be ({batch},), got {tuple(lengths.shape)}")
    if batch == 0 or not values:
        return
    lens = lengths.to("cpu", torch.int64)
    if int(lens.min()) < 0:
        raise ValueError("lengths must be >= 0")
    need = int(-(-int(lens.max()) // PAGE))
    if need > block_table.shape[1]:
        raise ValueError(
            f"a request of {int(lens.max())} tokens needs {need} pages; the block table has {block_table.shape[1]}"
        )
    if need == 0:
        return
    used = torch.arange(need) < (-(-lens // PAGE)).unsqueeze(1)
    pages = block_table[:, :need].to("cpu", torch.int64)[used]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise ValueError(
            f"block table points outside the pool: pages {int(pages.min())}..{int(pages.max())}, pool has {num_pages}"
        )
