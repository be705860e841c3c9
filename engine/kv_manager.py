"""Page bookkeeping for requests: grow, free, offload to host (retraction) and reload, and the
admission rule.

All page movement of a request goes through here, so "every page and host copy is freed" has one
place to hold. The admission rule (`reservation`, `can_admit`) is written here once and used by the
colocated scheduler, the PD decode's pre-allocation and the extend planner alike.

Sliding-window models (`window` > 0: every layer attends to at most that many tokens back) never
read a page again once it lies wholly before the next query's window: `trim` frees such pages while
the request runs and leaves 0 (the reserved page) in their place in `req.pages`, which stays indexed
by position; `req.dropped_pages` counts them. A long generation then holds O(window) pages, and
retraction offloads only the live ones.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.memory import HostKVPool, KVPool, pages_for
from engine.request import Req


def reservation(reqs: Iterable[Req], ratio: float, page_size: int) -> int:
    """Pages kept back for the future tokens of `reqs`: for each, new_token_ratio of the tokens it
    may still generate, rounded up to whole pages (ratio 0 reserves nothing: admit greedily and rely
    on retraction)."""
    return sum(pages_for(int(ratio * (r.sampling.max_new_tokens - len(r.output_ids))), page_size) for r in reqs)


class KVManager:
    def __init__(self, pool: KVPool, host_pool: HostKVPool, window: int = 0) -> None:
        self.pool = pool
        self.host = host_pool
        self.page_size = pool.page_size
        self.window = window  # tokens the widest layer looks back; 0 = some layer sees everything
        self.retractions = 0
        self.reloads = 0
        self.trimmed_pages = 0  # pages freed because they fell out of every layer's window

    def extra_pages(self, req: Req, new_tokens: int) -> int:
        """Pages req still needs so that kv_len + new_tokens tokens fit."""
        return max(0, pages_for(req.kv_len + new_tokens, self.page_size) - len(req.pages))

    def grow(self, req: Req, new_tokens: int) -> None:
        n = self.extra_pages(req, new_tokens)
        if n:
            req.pages.extend(self.pool.allocator.allocate(n))

    def window_start(self, kv_len: int) -> int:
        """Index of the first page a query at position kv_len (or later) can read: pages before it
        lie wholly outside every layer's window. 0 without a sliding window."""
        if not self.window:
            return 0
        return min(max(0, kv_len - self.window + 1) // self.page_size, max(0, pages_for(kv_len, self.page_size) - 1))

    def peak_pages(self, prompt_tokens: int, chunk: int) -> int:
        """Most pages a request holds at once while its prompt is computed in chunks of at most
        `chunk` tokens and its next token decoded. With a sliding window the pages behind the window
        are trimmed after each step, so the peak is the window plus one chunk (plus the page each end
        straddles), not the whole prompt."""
        whole = pages_for(prompt_tokens + 1, self.page_size)
        if not self.window:
            return whole
        return min(whole, pages_for(self.window + max(1, chunk), self.page_size) + 1)

    def capacity_error(self, prompt_tokens: int, chunk: int = 0) -> str | None:
        """Why a prompt can never fit this pool (its live KV plus one token), or None. `chunk` is the
        largest prompt chunk one step computes (0: the whole prompt at once)."""
        cap = self.pool.allocator.capacity
        if self.peak_pages(prompt_tokens, chunk or prompt_tokens) > cap:
            return f"the prompt has {prompt_tokens} tokens; the KV pool holds {cap * self.page_size}"
        return None

    def can_admit(self, need: int, own: int, reserved: int, busy: bool) -> bool:
        """Admission: a new request's `need` pages now plus its `own` reservation must fit in the free
        pages less `reserved` (the reservations of requests already admitted). With nothing else
        holding pages (`busy` False) it only needs `need` free pages."""
        free = self.free_pages
        return need <= free and (not busy or need + own <= free - reserved)

    @property
    def free_pages(self) -> int:
        return self.pool.allocator.num_free

    def trim(self, req: Req) -> int:
        """Free the pages no future query of `req` can see (sliding window); returns how many."""
        if not self.window or req.host_pages:
            return 0
        keep_from = min(self.window_start(req.kv_len), len(req.pages))  # the next query sits at kv_len
        if keep_from <= req.dropped_pages:
            return 0
        gone = req.pages[req.dropped_pages : keep_from]
        self.pool.allocator.free(gone)
        req.pages[req.dropped_pages : keep_from] = [0] * len(gone)
        req.dropped_pages = keep_from
        self.trimmed_pages += len(gone)
        return len(gone)

    def release(self, req: Req) -> None:
        """Free every device page and host copy the request holds (idempotent)."""
        if req.pages:
            self.pool.allocator.free(req.pages[req.dropped_pages :])
            req.pages = []
        if req.host_pages:
            self.host.free(req.host_pages)
            req.host_pages = []

    def can_offload(self, req: Req) -> bool:
        return self.host.can_hold(len(req.pages) - req.dropped_pages)

    def offload(self, req: Req) -> None:
        """Retract: copy the request's live KV pages to the host pool and free the device pages."""
        live = req.pages[req.dropped_pages :]
        assert live and not req.host_pages
        req.host_pages = self.host.offload(self.pool, live)
        self.pool.allocator.free(live)
        req.pages = []
        req.retractions += 1
        self.retractions += 1

    def can_reload(self, req: Req, extra_tokens: int = 1) -> bool:
        need = pages_for(req.kv_len + extra_tokens, self.page_size) - req.dropped_pages
        return self.pool.allocator.can_allocate(need)

    def reload(self, req: Req) -> None:
        """Bring a retracted request's KV back into fresh device pages; host pages are freed."""
        assert req.host_pages and not req.pages
        pages = self.pool.allocator.allocate(len(req.host_pages))
        self.host.reload(self.pool, req.host_pages, pages)
        req.pages = [0] * req.dropped_pages + pages
        req.host_pages = []
        self.reloads += 1

    def all_free(self) -> bool:
        return self.pool.allocator.all_free() and self.host.all_free()
