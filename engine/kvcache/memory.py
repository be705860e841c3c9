"""KV memory: a page allocator, the device KV pool and the host (CPU) pool used for retraction.

Layout (docs/architecture.md): kv_pool[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], or for
MLA models a latent pool [num_pages, num_layers, page_size, kv_lora_rank + rope_dim]; page p is one
contiguous block. Page 0 of the device pool is reserved and never handed out, so a
zero in a padded page table is harmless. A request's tokens live in its own list of pages
(`Req.pages`), token i at slot (pages[i // page_size], i % page_size): that list is the
request -> token table.

`--kv-cache-dtype fp8_e4m3`: the pool is uint8 and each row (a token's K or V of one head, an MLA latent)
is stored as its float8_e4m3fn codes followed by its float32 scale (engine/kv_fp8.py), so the last dim
is D + 4 bytes; writes quantize, the layer views hand the attention backends these packed rows.
"""

from __future__ import annotations

import torch

from engine import hugepages, kv_fp8


class PageAllocator:
    """Free-list allocator of page indices. Pure Python, check-then-act:
    `can_allocate(n)` then `allocate(n)`; `free` refuses double frees and unknown pages."""

    def __init__(self, num_pages: int, reserved: int = 0) -> None:
        if num_pages <= reserved:
            raise ValueError(f"need more than {reserved} pages, got {num_pages}")
        self.num_pages = num_pages
        self.reserved = reserved
        self._free: list[int] = list(range(num_pages - 1, reserved - 1, -1))  # pop() gives low ids first
        self._used: set[int] = set()
        self.high_water = 0  # most pages ever in use at once (peak memory, including inside a step)

    @property
    def capacity(self) -> int:
        return self.num_pages - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        self.high_water = max(self.high_water, len(self._used))
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated (double free or foreign page)")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)

    def all_free(self) -> bool:
        return not self._used


def pages_for(tokens: int, page_size: int) -> int:
    return (tokens + page_size - 1) // page_size


class KVPool:
    """The device KV cache plus its allocator. With `latent_dim` > 0 (MLA, DeepSeek) it is a latent pool:
    buffer [P, L, ps, latent_dim] (kv_lora_rank + rope_dim: one vector per token and layer, one "head",
    num_kv_heads and head_dim unused); allocator, page copies and host offload are the same.

    kv_cache_dtype "fp8_e4m3": the buffer is uint8 and every row is D + 4 bytes (codes, then the float32
    scale; engine/kv_fp8.py): [P, L, 2, ps, Hkv, D + 4] or latent [P, L, ps, latent_dim + 4]. `dtype` stays
    the model's (what a read dequantizes to); `buffer.dtype` is what a page copy moves."""

    def __init__(self, num_pages: int, num_layers: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device, latent_dim: int = 0,
                 kv_cache_dtype: str = "auto") -> None:
        if kv_cache_dtype not in kv_fp8.KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {kv_fp8.KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        self.page_size = page_size
        self.num_layers = num_layers
        self.latent_dim = latent_dim
        self.dtype = dtype
        self.fp8 = kv_cache_dtype == "fp8_e4m3"
        # "fp8_e4m3", or the model dtype's name ("float32", "bfloat16", ...) for auto
        self.kv_cache_dtype = "fp8_e4m3" if self.fp8 else str(dtype).removeprefix("torch.")
        row = latent_dim or head_dim
        if self.fp8:
            if row % 4:
                raise ValueError(f"--kv-cache-dtype fp8_e4m3 needs a KV row size (head_dim, or MLA's kv_lora_rank + "
                                 f"rope dim) divisible by 4, got {row}")
            row += kv_fp8.SCALE_BYTES
        # [P, L, 2, ps, Hkv, D], or latent [P, L, ps, latent_dim]; FP8: the last dim + 4 scale bytes, uint8
        shape = (num_pages, num_layers, page_size, row) if latent_dim else \
            (num_pages, num_layers, 2, page_size, num_kv_heads, row)
        self.buffer = hugepages.zeros(shape, dtype=torch.uint8 if self.fp8 else dtype, device=device)
        self.allocator = PageAllocator(num_pages, reserved=1)

    def latent(self, layer: int) -> torch.Tensor:
        """A latent pool's layer view [P, ps, latent_dim], page stride L*ps*latent_dim (FP8: uint8 rows
        [P, ps, latent_dim + 4]; kv_fp8.dequantize turns gathered rows into values)."""
        return self.buffer[:, layer]

    def write_latent(self, layer: int, page_idx: torch.Tensor, offset: torch.Tensor, latent: torch.Tensor) -> None:
        """Store new tokens' latents (MLA). page_idx, offset: int64 [T]; latent: [T, latent_dim]."""
        self.buffer[page_idx, layer, offset] = kv_fp8.quantize(latent) if self.fp8 else latent

    @property
    def page_bytes(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer: each [P, ps, Hkv, D], page stride L*2*ps*Hkv*D (FP8: uint8 rows
        [P, ps, Hkv, D + 4], which every attention backend but cpu reads; engine/attention/base.py)."""
        return self.buffer[:, layer, 0], self.buffer[:, layer, 1]

    def write(self, layer: int, page_idx: torch.Tensor, offset: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. page_idx, offset: int64 [T]; k, v: [T, Hkv, D] (FP8: quantized per row)."""
        if self.fp8:
            k, v = kv_fp8.quantize(k), kv_fp8.quantize(v)
        self.buffer[page_idx, layer, 0, offset] = k
        self.buffer[page_idx, layer, 1, offset] = v

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy the KV of pages src[i] into dst[i] (a forked choice's own copy of a page it writes)."""
        for a, b in zip(src, dst):
            self.buffer[b].copy_(self.buffer[a])  # [num_layers, 2, page_size, num_kv_heads, head_dim]

    @property
    def used_tokens(self) -> int:
        return self.allocator.num_used * self.page_size

    @property
    def total_tokens(self) -> int:
        return self.allocator.capacity * self.page_size


class HostKVPool:
    """Host copy of KV pages for retracted requests (pinned on CUDA for async copies)."""

    def __init__(self, num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.buffer = torch.empty((max(num_pages, 1), *page_shape), dtype=dtype, pin_memory=pin)  # touched on use
        self.allocator = PageAllocator(max(num_pages, 1), reserved=0) if num_pages > 0 else None

    def can_hold(self, n: int) -> bool:
        return self.allocator is not None and self.allocator.can_allocate(n)

    def offload(self, device: KVPool, pages: list[int]) -> list[int]:
        """Copy device pages to freshly allocated host pages; the caller frees the device pages.

        On CUDA the copies are asynchronous into pinned memory, on the current stream: a later
        kernel that reuses the freed device pages, and the reload, are ordered after them, and the
        host copy is never read by the CPU."""
        assert self.allocator is not None
        host = self.allocator.allocate(len(pages))
        for d, h, n in _runs(pages, host):
            self.buffer[h : h + n].copy_(device.buffer[d : d + n], non_blocking=True)
        return host

    def reload(self, device: KVPool, host: list[int], pages: list[int]) -> None:
        """Copy host pages back into device pages (async from pinned memory on CUDA); frees the
        host pages, whose next writer is ordered after this copy on the same stream."""
        assert self.allocator is not None and len(host) == len(pages)
        for h, d, n in _runs(host, pages):
            device.buffer[d : d + n].copy_(self.buffer[h : h + n], non_blocking=True)
        self.allocator.free(host)

    def free(self, host: list[int]) -> None:
        if self.allocator is not None:
            self.allocator.free(host)

    def all_free(self) -> bool:
        return self.allocator is None or self.allocator.all_free()


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for stretches where both page lists count up by one."""
    out: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((a, b, 1))
    return out
