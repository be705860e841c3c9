"""How many CPUs this process may use, for choosing torch's thread count (stdlib only, no torch).

`cpu_budget()` = the CPUs in this process's affinity mask, capped by the cgroup CPU quota (v2
`cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`), at least 1. A container limited to 2 CPUs on
a 64-core node gets 2, where torch's own default would start 64 spinning OpenMP threads.
`threads_per_worker(n)` splits that budget among n workers started on one machine.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cgroup_quota_cpus(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 1.5), or None when unlimited/unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 = unlimited
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpu_budget(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may keep busy: affinity, capped by the cgroup quota (rounded down), >= 1."""
    cpus = _affinity_cpus()
    quota = cgroup_quota_cpus(root)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def threads_per_worker(workers: int, budget: int | None = None) -> int:
    """Torch threads for each of `workers` CPU workers sharing this machine: max(1, budget // workers)."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    return max(1, (cpu_budget() if budget is None else budget) // workers)
