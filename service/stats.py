"""The typed worker stats carried by `StatsOut` (service/messages.py), and their /server_info view.

A worker answers each StatsReq with one `WorkerStats`: queue lengths, KV levels, prefix cache,
counters (totals since the worker started), and on PD workers its transfer totals and link state.
Role-specific parts are None where the role has none (a prefill has no host KV pool, a colocated
worker no transfers). The metric of every field is declared once, with its type, in
service/metrics.py; `internal_state` gives /server_info the dict it has always shown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from common.metrics import Histogram, snapshot
from engine.extras.speculative.stats import SpecStats
from engine.stats import PrefixCacheStats, SchedulerStats
from transfer.stats import LinkStats

__all__ = ["STATS_PARTS", "Counters", "Histo", "KVStats", "LinkStats", "PrefixCacheStats", "TransferTotals",
           "WorkerStats", "internal_state"]


@dataclass
class Histo:
    """A histogram as plain data: cumulative counts per finite bound `le`, then sum and count."""

    le: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, h: Histogram) -> Histo:
        return cls(**snapshot(h))


@dataclass
class KVStats:
    used_tokens: int = 0  # level
    total_tokens: int = 0  # level (the pool's size)
    host_used_pages: int | None = None  # colocated/decode, level: host (offload) pool pages in use
    usage: float | None = None  # decode, level: used / total (0..1), an autoscaling signal
    state_slots_used: int | None = None  # hybrid models, level: recurrent-state slots in use (None: no state pool)


@dataclass
class Counters:
    """Totals since the worker started (each one the counter pdserve_worker_<field>_total); None:
    not counted by this role."""

    retractions: int | None = None
    reloads: int | None = None
    forward_tokens: int | None = None
    window_freed_pages: int | None = None
    prefills_local: int | None = None  # decode: prompts prefilled here (short enough)
    prefills_local_busy_prefill: int | None = None  # decode: prefilled here, the prefill was busy
    prefills_remote: int | None = None  # decode: prompts a prefill computed
    prefills_remote_decode_busy: int | None = None  # decode: short, but this decode was busy
    kv_pages_reused_on_decode: int | None = None  # decode: prompt pages its prefix cache held
    kv_prefix_refused_by_prefill: int | None = None  # decode: prefix offers the prefill refused
    rooms_prefilled_on_decode: int | None = None  # prefill: rooms the decode took over
    # overload (docs/reliability.md): requests ended because they outgrew the whole KV pool (finish
    # reason "length"), by the watchdog (no progress), and on a PD decode refused by its full queue or
    # past its queue deadline (503 with Retry-After); rooms a prefill kept waiting past its bootstrap
    # timeout because their decode said they were queued
    pool_truncated: int | None = None
    watchdog_ended: int | None = None
    queue_rejected: int | None = None
    queue_timed_out: int | None = None
    rooms_kept_queued: int | None = None
    kv_events_dropped: int | None = None  # KV cache events dropped on a full queue (--kv-events-endpoint)
    images_encoded: int | None = None  # vision-language models: images the vision tower ran for
    image_cache_hits: int | None = None  # ... and images whose tower output came from the cache (by content hash)

    def present(self) -> dict[str, int]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass
class TransferTotals:
    """KV transfers of a PD worker (service.pd.TransferStats): totals and latency histograms."""

    bytes: int = 0  # total
    rooms_succeeded: int = 0  # total
    rooms_failed: int = 0  # total
    seconds: Histo = field(default_factory=Histo)  # room ready to transfer done
    tail_seconds: Histo = field(default_factory=Histo)  # prefill: last chunk sent to the decode's SUCCESS
    reused_bytes: int | None = None  # decode, total: KV not moved because its prefix cache held it


@dataclass
class WorkerStats:
    queues: dict[str, int] = field(default_factory=dict)  # levels by queue name (role-specific names)
    kv: KVStats = field(default_factory=KVStats)
    prefix: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    counters: Counters = field(default_factory=Counters)
    time: float = 0.0  # the worker's clock when it answered (time.time())
    queued_prompt_tokens: int | None = None  # prefill, level: prompt tokens still to prefill (autoscaling)
    running_requests: int | None = None  # decode, level: requests in the decode batch (autoscaling)
    active_rooms: int | None = None  # PD, level: transfer rooms created and not yet released
    transfer: TransferTotals | None = None  # PD
    link: LinkStats | None = None  # PD: TransferManager.stats()
    spec: SpecStats | None = None  # speculative decoding totals (None: --speculative off)

    @classmethod
    def from_scheduler(cls, s: SchedulerStats) -> WorkerStats:
        """A scheduler's report as worker stats (colocated; the decode adds its parts)."""
        return cls(queues={"waiting": s.waiting, "running": s.running, "retracted": s.retracted},
                   kv=KVStats(used_tokens=s.kv_used_tokens, total_tokens=s.kv_total_tokens,
                              host_used_pages=s.host_kv_used_pages, state_slots_used=s.state_slots_used),
                   prefix=s.prefix,
                   counters=Counters(retractions=s.retractions, reloads=s.reloads, forward_tokens=s.forward_tokens,
                                     window_freed_pages=s.window_freed_pages, pool_truncated=s.pool_truncated,
                                     images_encoded=s.images_encoded, image_cache_hits=s.image_cache_hits),
                   spec=s.spec if s.spec.method else None)


STATS_PARTS = (WorkerStats, KVStats, PrefixCacheStats, Counters, TransferTotals, Histo, LinkStats,
               SpecStats)  # on the wire


def _histo_info(h: Histo) -> dict[str, Any]:
    return {"le": list(h.le), "counts": list(h.counts), "sum": h.sum, "count": h.count}


def _optional_levels(s: WorkerStats) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if s.kv.host_used_pages is not None:
        out["host_kv_used_pages"] = s.kv.host_used_pages
    for key, v in (("kv_usage", s.kv.usage), ("queued_prompt_tokens", s.queued_prompt_tokens),
                   ("running_requests", s.running_requests), ("active_rooms", s.active_rooms)):
        if v is not None:
            out[key] = v
    return out


def _spec_info(t: SpecStats) -> dict[str, Any]:
    """/server_info: speculative decoding totals and the two ratios (engine.extras.speculative.stats)."""
    return {**asdict(t), "acceptance_rate": round(t.acceptance_rate, 4),
            "mean_accepted_length": round(t.mean_accepted_length, 4)}


def _transfer_info(s: WorkerStats) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if s.link is not None:
        out["transfer"] = s.link.to_info()
    t = s.transfer
    if t is not None:
        out["transfer_bytes_total"] = t.bytes
        out["transfer_rooms"] = {"succeeded": t.rooms_succeeded, "failed": t.rooms_failed}
        out["histograms"] = {"transfer_seconds": _histo_info(t.seconds),
                             "transfer_tail_seconds": _histo_info(t.tail_seconds)}
        if t.reused_bytes is not None:
            out["transfer_bytes_reused_total"] = t.reused_bytes
    return out


def internal_state(info: dict[str, Any], s: WorkerStats | None) -> dict[str, Any]:
    """One worker's entry of /server_info `internal_states`: its static description (`info`) and
    its stats, keyed as they have always been (`queues`, `kv_used_tokens`, `counters`, ...)."""
    if s is None:
        return dict(info)
    return {
        **info,
        "queues": dict(s.queues),
        "kv_used_tokens": s.kv.used_tokens,
        "kv_total_tokens": s.kv.total_tokens,
        **_optional_levels(s),
        "counters": s.counters.present(),
        "prefix_cached_tokens": s.prefix.cached_tokens,
        "prefix_hit_tokens": s.prefix.hit_tokens,
        "prefix_evicted_tokens": s.prefix.evicted_tokens,
        **({"hicache": s.prefix.tiers} if s.prefix.tiers else {}),
        **({"prefix_state_snapshots": {"in_use": s.prefix.state_snapshots, "slots": s.prefix.state_snapshot_slots,
                                       "taken": s.prefix.state_snapshots_taken,
                                       "evicted": s.prefix.state_snapshots_evicted}}
           if s.prefix.state_snapshot_slots else {}),
        **_transfer_info(s),
        **({"speculative": _spec_info(s.spec)} if s.spec is not None else {}),
        "time": s.time,
    }
