"""Typed numbers the engine reports about itself (the service wraps them in its stats message).

Plain dataclasses of ints: no torch, no service types (the engine must not import service). Each
field says whether it is a level (may go up and down) or a total (only grows while the process
lives); service/metrics.py declares the metric of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.extras.speculative.stats import SpecStats


@dataclass
class PrefixCacheStats:
    """The radix prefix cache of one KV pool (all 0 without a cache)."""

    cached_tokens: int = 0  # level: tokens of pages the cache holds
    hit_tokens: int = 0  # total: prompt tokens served from the cache
    evicted_tokens: int = 0  # total: tokens of pages evicted from the cache
    # host/disk tiers (engine/kvcache/hicache): {stat: {tier: value}} for hit_tokens, loaded_bytes, load_seconds,
    # evictions (totals) and bytes_in_use (level); empty without tiers
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)
    # hybrid models (engine.kvcache.kv_manager, state snapshots): slots holding a snapshot (in the tree or held by
    # running requests until they end) out of state_snapshot_slots (--state-cache-slots; levels), snapshots taken
    # and dropped (totals)
    state_snapshots: int = 0
    state_snapshot_slots: int = 0
    state_snapshots_taken: int = 0
    state_snapshots_evicted: int = 0


@dataclass
class SchedulerStats:
    """What a `Scheduler` reports: queue lengths and KV levels, then totals since start."""

    waiting: int = 0  # level: requests queued (retracted ones included)
    running: int = 0  # level: requests in the running batch
    retracted: int = 0  # level: waiting requests that were retracted (KV offloaded or dropped)
    kv_used_tokens: int = 0  # level
    kv_total_tokens: int = 0  # level (constant: the pool's size)
    host_kv_used_pages: int = 0  # level: pages of the host (offload) pool in use
    state_slots_used: int | None = None  # level: hybrid models' state slots requests hold (None: no state pool)
    retractions: int = 0  # total
    reloads: int = 0  # total: retracted requests whose KV came back from the host pool
    forward_tokens: int = 0  # total: tokens run through the model
    window_freed_pages: int = 0  # total: pages freed because they slid out of every window
    pool_truncated: int = 0  # total: requests ended at the KV pool's end (finish reason length)
    images_encoded: int | None = None  # total: images the vision tower ran for (None: no image yet)
    image_cache_hits: int | None = None  # total: images whose tower output came from the cache by hash
    prefix: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding totals (engine/extras/speculative)
