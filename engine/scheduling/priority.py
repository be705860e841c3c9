"""Request priority (`--enable-priority-scheduling`): urgency, and preemption of running requests
that are less urgent than a waiting arrival.

Urgency: a request's `priority` value, larger = more urgent, or smaller = more urgent with
`--schedule-low-priority-values-first` (SGLang's flag). Off (the default), nothing here runs and
`priority` is ignored.

Order (`rank`, the key engine.scheduling.policy.waiting_order sorts by after the schedule policy):
most urgent first. A request that has waited `priority_aging_s` since it arrived ranks above every
priority (oldest first): a stream of urgent arrivals delays a low-priority request by at most that
long plus the work ahead of it, never forever.

Preemption (`preempt`): when the candidate (the first new request in the waiting order: the
colocated scheduler's, or a PD decode's prealloc queue) is not admitted now (the admission rule,
engine.kvcache.kv_manager.KVManager.can_admit, as the caller asks it), running requests less urgent
than it by at least `priority_preemption_threshold` are retracted (KV to the host pool, reloaded
later, never recomputed, so their outputs are unchanged), least urgent first and newest first among
equals, until it is. A request is retracted at most `priority_max_preemptions` times
(`KVState.retractions`), and never when the host pool cannot take its KV or once it has aged: a
low-priority request always finishes. The running batch is kept most urgent first (`sort_running`),
so a memory retraction (newest at the end) takes the least urgent too.

Nothing here knows a scheduler: preemption is handed the running requests, the candidate, the
admission rule and the retraction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.request import Req


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


def sort_running(running: list[Req], cfg: EngineConfig) -> None:
    """Most urgent first (stable): retraction takes the newest at the end, the least urgent."""
    running.sort(key=lambda r: -urgency(r, cfg))


def victims(cand: Req, running: Sequence[Req], cfg: EngineConfig, now: float) -> list[Req]:
    """The running requests `cand` may preempt, in the order they go: less urgent by at least the
    threshold, neither aged nor preempted the most times already; least urgent, then newest, first."""
    top = urgency(cand, cfg)
    found = [(urgency(r, cfg), -i, r) for i, r in enumerate(running)
             if top - urgency(r, cfg) >= cfg.priority_preemption_threshold and not aged(r, cfg, now)
             and r.kv.retractions < cfg.priority_max_preemptions]
    found.sort(key=lambda v: v[:2])
    return [r for _, _, r in found]


def preempt(cand: Req, running: Sequence[Req], admits: Callable[[], bool], retract: Callable[[Req], bool],
            cfg: EngineConfig, now: float) -> int:
    """Retract running requests less urgent than `cand` until `admits()` (the admission rule for
    cand, as its scheduler asks it) holds; returns how many were retracted. `retract(r)` retracts r
    to the host pool and returns True, or returns False and does nothing (the host pool cannot take
    it: a preemption never ends a request)."""
    if admits():
        return 0
    done = 0
    for r in victims(cand, running, cfg, now):
        if done and admits():
            break
        done += retract(r)
    return done
