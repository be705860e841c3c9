"""HiCache: host-memory and disk tiers under the radix prefix cache (docs/architecture.md, "Host tier").

`HiCacheSpec.from_config` reads the --hicache-* flags (None when --hicache-host-tokens is 0, the
default: the plain RadixCache, unchanged); `build_cache` makes the tiered tree over a device pool.
Modules: tree.py (HiRadixCache: residence, eviction, loads), host.py (the host buffer and its
copies), disk.py (page files keyed by chained page hash, checksummed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.kvcache.hicache.disk import DiskTier
from engine.kvcache.hicache.host import HostTier
from engine.kvcache.hicache.tree import HiRadixCache
from engine.kvcache.memory import KVPool

__all__ = ["HiCacheSpec", "HiRadixCache", "build_cache", "spec_for_server"]

@dataclass(frozen=True)
class HiCacheSpec:
    host_tokens: int
    write_policy: str = "write_back"
    disk_dir: str = ""  # "": no disk tier; else this worker's own directory (emptied at start)
    disk_bytes: int = 1 << 30

    @classmethod
    def from_config(cls, cfg: EngineConfig, worker: str = "") -> HiCacheSpec | None:
        """The spec of an EngineConfig's --hicache-* fields (declared, with their help, in engine/config.py;
        None: off). `worker` names this worker's subdirectory of --hicache-dir (one directory per worker:
        each empties its own)."""
        if not cfg.hicache_host_tokens:
            return None
        root, sub = cfg.hicache_dir, worker or f"worker-{os.getpid()}"
        return cls(host_tokens=cfg.hicache_host_tokens, write_policy=cfg.hicache_write_policy,
                   disk_dir=os.path.join(root, sub) if root else "", disk_bytes=cfg.hicache_disk_bytes)


def spec_for_server(cfg: Any) -> HiCacheSpec | None:  # noqa: ANN401 (a service.config.ServerConfig)
    """The spec of a service's ServerConfig: its disk subdirectory named `ROLE-PORT` (the pid when
    the port is 0), so the workers of one machine never share files and a restart finds its own."""
    return HiCacheSpec.from_config(cfg.engine, f"{cfg.role}-{cfg.port or os.getpid()}")


def build_cache(spec: HiCacheSpec, pool: KVPool, tier: Callable[[KVPool, int], HostTier] = HostTier,
                free_states: Callable[[list[int]], None] | None = None) -> HiRadixCache:
    """The tiered prefix cache over `pool`: a host tier of spec.host_tokens (made by `tier`: under TP, rank 0's
    runner passes one whose copies run on every rank), a disk tier if a dir is set. `free_states`: a hybrid
    model's (its nodes hold state snapshots)."""
    host = tier(pool, spec.host_tokens)
    disk = None
    if spec.disk_dir:
        layout = f"{tuple(pool.buffer.shape[1:])}/{pool.buffer.dtype}"
        disk = DiskTier(spec.disk_dir, spec.disk_bytes, layout)
    return HiRadixCache(pool.page_size, pool.allocator, host, disk, write_through=spec.write_policy == "write_through",
                        free_states=free_states)
