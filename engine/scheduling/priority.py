"""Request priority (`--enable-priority-scheduling`): the waiting order, and preemption of running
requests that are less urgent than a waiting arrival.

Urgency: a request's `priority` value, larger = more urgent, or smaller = more urgent with
`--schedule-low-priority-values-first` (SGLang's flag). Off (the default), nothing here runs and
`priority` is ignored.

Order (`order`): the policy's order (engine.scheduling.scheduler.order_waiting) stable-sorted by urgency, the
most urgent first. A request that has waited `priority_aging_s` since it arrived ranks above every
priority (oldest first): a stream of urgent arrivals delays a low-priority request by at most that
long plus the work ahead of it, never forever.

Preemption (`preempt`, the colocated/decode scheduler, before each step's planning): when the first
new request in the waiting order does not fit now (the admission rule, counting every running
request's next token), running requests less urgent than it by at least
`priority_preemption_threshold` are retracted (the scheduler's retraction: KV to the host pool,
reloaded later, never recomputed, so their outputs are unchanged), least urgent first and newest
first among equals, until it fits. A request is retracted at most `priority_max_preemptions` times
(`KVState.retractions`), and never when the host pool cannot take its KV or once it has aged: a
low-priority request always finishes. The running batch is kept most urgent first, so a memory
retraction (newest at the end) takes the least urgent too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.kvcache.kv_manager import reservation
from engine.kvcache.memory import pages_for
from engine.request import Req

if TYPE_CHECKING:
    from engine.scheduling.scheduler import Scheduler


def urgency(r: Req, cfg: EngineConfig) -> int:
    """Larger = more urgent (the flag says which end of `priority` values goes first)."""
    return -r.priority if cfg.schedule_low_priority_values_first else r.priority


def aged(r: Req, cfg: EngineConfig, now: float) -> bool:
    return now - r.created >= cfg.priority_aging_s


def rank(r: Req, cfg: EngineConfig, now: float) -> tuple:
    """Sort key, smallest first: aged requests (oldest first), then by urgency."""
    if aged(r, cfg, now):
        return (0, r.created)
    return (1, -urgency(r, cfg))


def order(reqs: list[Req], cfg: EngineConfig, now: float) -> list[Req]:
    """`reqs` (in the policy's order) by rank; ties keep the policy's order."""
    return sorted(reqs, key=lambda r: rank(r, cfg, now))


def sort_running(sched: Scheduler) -> None:
    """Most urgent first (stable): retraction takes the newest at the end, the least urgent."""
    sched.running.sort(key=lambda r: -urgency(r, sched.cfg))


def _candidate(sched: Scheduler) -> Req | None:
    """The first new request of the waiting order, unless a retracted one comes before it (it is
    reloaded first; nothing new is admitted behind it)."""
    for r in sched.waiting:
        if r.is_retracted:
            return None
        if not r.kv.pages:
            return r
    return None


def fits(sched: Scheduler, r: Req) -> bool:
    """Whether r's first prompt chunk would be admitted now beside the running batch, each running
    request growing by one token (the planner's rule, with r's cached prefix counted as free)."""
    cfg, kv = sched.cfg, sched.kv
    if len(sched.running) >= cfg.max_running_requests:
        return False
    ps = kv.page_size
    prefix = kv.prefix_len(r)
    chunk = min(r.num_prompt_tokens - prefix, cfg.chunked_prefill_size)
    need = pages_for(prefix + chunk, ps) - prefix // ps
    own = reservation([r], cfg.new_token_ratio, ps)
    reserved = reservation(sched.running, cfg.new_token_ratio, ps) + \
        sum(kv.extra_pages(x, 1) for x in sched.running)
    return kv.can_admit(need, own, reserved, busy=bool(sched.running))


def preempt(sched: Scheduler, now: float) -> int:
    """Retract running requests less urgent than the first waiting arrival until it fits; returns
    how many were retracted (the caller re-sorts the waiting queue)."""
    cfg = sched.cfg
    cand = _candidate(sched)
    if cand is None or fits(sched, cand):
        return 0
    top = urgency(cand, cfg)
    victims = [(urgency(r, cfg), -i, r) for i, r in enumerate(sched.running)
               if top - urgency(r, cfg) >= cfg.priority_preemption_threshold and not aged(r, cfg, now)
               and r.kv.retractions < cfg.priority_max_preemptions]
    victims.sort(key=lambda v: v[:2])
    done = 0
    for _, _, r in victims:
        if fits(sched, cand):
            break
        if not sched.kv.can_offload(r):  # retraction would end it (host pool full): never for priority
            continue
        sched.retract(r)
        done += 1
    return done
