"""The host tier's memory: a page-granular copy of evicted prefix-cache pages in host RAM.

Its own buffer and allocator, apart from retraction's HostKVPool (docs/architecture.md, "Host
tier"): a retraction must find its host pages whenever `can_offload` said so, and cached pages are
evictable at any time, so one budget would make retraction evict the cache first and tie the two
policies together; apart, the tier off costs nothing and retraction behaves as before.

Copies (CUDA: pinned host memory, so both directions are asynchronous DMA):
- store (device -> host, at eviction or write-through) runs on the current stream: the freed
  device page's next writer (a later forward on that stream) is ordered after the copy.
- load (host -> device, before a matched request's extend) runs on a side stream that first waits
  for the work already queued (a freshly allocated page may still be read by it); the current
  stream then waits on the load's event, so the next forward sees the pages while the CPU never
  blocks: it goes on scheduling, and a PD decode's transfer of the uncached rest lands meanwhile.
- `page_bytes_of` (for the disk tier) synchronizes first: the CPU reads a page only once every
  queued store into it has finished.
On the CPU every copy is a plain memcpy.
"""

from __future__ import annotations

import torch

from engine.kvcache.memory import KVPool, PageAllocator, _runs


class HostTier:
    """`tokens // page_size` host pages shaped like one device page each."""

    def __init__(self, pool: KVPool, tokens: int) -> None:
        self.pool = pool
        self.num_pages = max(tokens // pool.page_size, 1)
        dev = pool.buffer.device
        self.cuda = dev.type == "cuda"
        self.page_shape = tuple(pool.buffer.shape[1:])
        self.buffer = torch.empty((self.num_pages, *self.page_shape), dtype=pool.buffer.dtype, pin_memory=self.cuda)
        self.allocator = PageAllocator(self.num_pages, reserved=0)
        self.page_bytes = pool.page_bytes
        self.stream = torch.cuda.Stream(device=dev) if self.cuda else None

    @property
    def used_pages(self) -> int:
        return self.allocator.num_used

    def store(self, dev_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (already allocated), on the current stream."""
        for d, h, n in _runs(dev_pages, host_pages):
            self.buffer[h : h + n].copy_(self.pool.buffer[d : d + n], non_blocking=True)

    def load(self, host_pages: list[int], dev_pages: list[int]) -> None:
        """Copy host pages into device pages; the host pages stay allocated (the node keeps both)."""
        if self.stream is None:
            self._copy_in(host_pages, dev_pages)
            return
        main = torch.cuda.current_stream(self.pool.buffer.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            self._copy_in(host_pages, dev_pages)
            done = torch.cuda.Event()
            done.record(self.stream)
        main.wait_event(done)

    def _copy_in(self, host_pages: list[int], dev_pages: list[int]) -> None:
        for h, d, n in _runs(host_pages, dev_pages):
            self.pool.buffer[d : d + n].copy_(self.buffer[h : h + n], non_blocking=True)

    def page_bytes_of(self, host_page: int) -> bytes:
        """One host page's bytes (for the disk tier)."""
        if self.cuda:
            torch.cuda.current_stream(self.pool.buffer.device).synchronize()
        return self.buffer[host_page].contiguous().view(torch.uint8).numpy().tobytes()

    def write_device(self, dev_page: int, data: bytes) -> None:
        """Fill one device page from bytes read back from the disk tier (len(data) == page_bytes)."""
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.buffer.dtype).view(self.page_shape)
        self.pool.buffer[dev_page].copy_(t)
