"""The prompt-chunk planner: which waiting prompts compute how many tokens this step, each chunk
admitted by the admission rule (engine.kvcache.kv_manager.KVManager.can_admit). One planner for
every role: the colocated scheduler and a PD decode's local prefill (reserve=True), and the PD
prefill (reserve=False). The waiting requests come in the waiting order (engine.scheduling.policy).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import EngineConfig
from engine.forward.batch import ExtendItem
from engine.kvcache.kv_manager import KVManager, reservation
from engine.request import Req
from engine.scheduling.parallel import choices


class ExtendPlanner:
    """Picks one step's prompt chunks, in the order given (the waiting order: the caller's
    engine.scheduling.policy.waiting_order): at most chunked_prefill_size tokens per request and
    max_prefill_tokens per batch; a partial chunk ends the batch, and so does the first request that
    does not fit. Pages are allocated for the chosen chunks (KVManager.grow).

    reserve=True (colocated, decode): the admission rule applies (`KVManager.can_admit` with the
    running requests' reservations), retracted requests are not planned here (nothing new is
    admitted behind one, but a prompt already started continues: its pages would otherwise stay
    held while the retracted request waits for them) and the running batch caps at
    max_running_requests. reserve=False (prefill): a request leaves once its prompt is
    computed, so only free pages count.

    A new request first takes its cached prefix (KVManager.match); if it is then not admitted, the
    match is undone (KVManager.unmatch), so a waiting request holds no lock.

    Hybrid models with the prefix cache: a chunk ends at the deepest state snapshot point inside it
    (KVManager.snapshot_cut), so the state there can be snapshotted after the forward. Its pages are
    still allocated for the whole chunk (the rest runs next step: nothing admitted behind it can take
    them), and a chunk cut only there does not end the batch.
    """

    def __init__(self, kv: KVManager, cfg: EngineConfig, reserve: bool = True) -> None:
        self.kv, self.cfg, self.reserve = kv, cfg, reserve

    def plan(self, waiting: Iterable[Req], running: list[Req] | None = None) -> list[ExtendItem]:
        cfg, kv, running = self.cfg, self.kv, running or []
        reserved = reservation(running, cfg.new_token_ratio, kv.page_size) if self.reserve else 0
        budget = cfg.max_prefill_tokens
        items: list[ExtendItem] = []
        behind_retracted = False
        for r in waiting:
            if self.reserve and r.is_retracted:
                behind_retracted = True  # reloads first: nothing new is admitted behind it
                continue
            new = not r.kv.pages and not r.kv.host_pages  # a new admission
            if budget <= 0 or (new and behind_retracted) or \
                    (self.reserve and len(running) + len(items) >= cfg.max_running_requests):
                break
            if new:
                kv.match(r)
            n = min(len(r.token_ids) - r.kv.kv_len, cfg.chunked_prefill_size, budget)
            if n <= 0 or not self.admits(r, n, reserved, bool(items or running), new):
                if new:
                    kv.unmatch(r)
                break
            kv.grow(r, n)
            reserved += self.promised(r, n, new)  # the forks' pages are taken right after this step's forward
            cut = kv.snapshot_cut(r, n)  # n, or fewer: the chunk ends at a state snapshot point
            budget -= cut
            items.append(ExtendItem(r, cut))
            if r.kv.kv_len + n < len(r.token_ids):  # a partial chunk (cut by a limit) ends the batch
                break
        return items

    def admits(self, r: Req, n: int, reserved: int, busy: bool, new: bool, prefix: int = 0) -> bool:
        """The admission rule (KVManager.can_admit) for r's next `n` prompt tokens beside requests
        holding `reserved` pages: the pages those tokens add (`prefix`: the tokens of a cached prefix
        r would match, counted as held) and, with `reserve`, its forks' pages once the chunk completes
        the prompt and, for a `new` request, its reservation."""
        kv = self.kv
        need = kv.extra_pages(r, n, prefix) + (fork_need(kv, r, prefix + n) if self.reserve else 0)
        ratio = self.cfg.new_token_ratio if self.reserve and new else 0.0
        return kv.can_admit(r, need, reserved, ratio, busy)

    def promised(self, r: Req, n: int, new: bool) -> int:
        """Pages kept for r once its chunk of `n` is admitted (reserve only): its forks' pages and, when
        `new`, the reservation of r and its choices."""
        if not self.reserve:
            return 0
        own = reservation(choices(r), self.cfg.new_token_ratio, self.kv.page_size) if new else 0
        return own + fork_need(self.kv, r, n)


def fork_need(kv: KVManager, r: Req, n: int) -> int:
    """Pages r's forks (n > 1) take once a chunk of n tokens completes its prompt (0 before)."""
    if not r.choice.forks or r.kv.kv_len + n < len(r.token_ids):
        return 0
    return len(r.choice.forks) * kv.fork_pages(r.num_prompt_tokens)
