"""The waiting policy: the one order in which waiting requests are admitted, for every scheduler.

`waiting_order(reqs, cfg, now, prefix_len)` is the order; the colocated scheduler (its `waiting`),
the PD prefill's planner (its waiting rooms), the PD decode's admission (its prealloc queue together
with the requests its scheduler retracted) and preemption (`first_new`: the candidate) all take it
from here. Two layers, both read from the config:

1. `--schedule-policy` (`order_by_policy`): fcfs keeps arrival order; sjf (shortest uncomputed prompt
   first) and lpm (longest cached prefix first, SGLang's policy) put prompts already started first,
   then every prompt that has waited `--schedule-aging` or longer, oldest first, then the rest by
   the policy's key, ties by arrival.
2. `--enable-priority-scheduling`: that order stable-sorted by urgency (engine.scheduling.priority.rank:
   a request that has waited `--priority-aging` ranks above every priority, oldest first).

A retracted request (KV in the host pool) takes its place in the order like any other: nothing new
is admitted behind it (`first_new`), so it is reloaded before anything less urgent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.config import EngineConfig
from engine.request import Req
from engine.scheduling.priority import rank

PrefixLen = Callable[[Req], int]


def order_by_policy(reqs: Iterable[Req], policy: str, aging_s: float, now: float,
                    prefix_len: PrefixLen | None = None) -> list[Req]:
    """`reqs` in the order of `policy` (fcfs, sjf or lpm; lpm reads `prefix_len(req)`, the tokens a
    prefix-cache match would give it)."""
    reqs = list(reqs)
    if policy == "fcfs":
        return reqs

    def key(r: Req) -> tuple:
        if r.kv.kv_len > 0:
            return (0, r.created, 0)
        if now - r.created >= aging_s:
            return (1, r.created, 0)
        if policy == "lpm":
            return (2, -(prefix_len(r) if prefix_len is not None else 0), r.created)
        return (2, r.num_prompt_tokens - r.kv.kv_len, r.created)

    return sorted(reqs, key=key)


def waiting_order(reqs: Iterable[Req], cfg: EngineConfig, now: float,
                  prefix_len: PrefixLen | None = None) -> list[Req]:
    """THE waiting order: `--schedule-policy`, then, with `--enable-priority-scheduling`, by urgency
    (stable: the policy's order within a priority)."""
    order = order_by_policy(reqs, cfg.schedule_policy, cfg.schedule_aging_s, now, prefix_len)
    if cfg.enable_priority_scheduling:
        order.sort(key=lambda r: rank(r, cfg, now))
    return order


def first_new(order: Iterable[Req]) -> Req | None:
    """The first request of a waiting order that holds nothing yet (the next one to admit, and the
    candidate of preemption), or None when a retracted request comes before it (it is reloaded
    first: nothing new is admitted behind it). Prompts already started are passed over."""
    for r in order:
        if r.is_retracted:
            return None
        if not r.kv.pages:
            return r
    return None
