"""One TP group in a test: rank 0's runner in this process, ranks 1..N-1 real `spawn` processes over
gloo (engine/distributed/tp_ranks.py), the way a service starts them. Shared by the engine's TP tests
(test_tp.py, test_deepseek_tp.py, test_hybrid_gdn.py, test_hybrid_pd_tp.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from engine.config import EngineConfig


@contextlib.contextmanager
def tp_runner(cfg: EngineConfig, tp: int = 2) -> Iterator:
    """Rank 0's runner (a TPRunner) of `cfg` at `tp` ranks (this process holds the rendezvous store); on exit the group
    is closed and every other rank must have exited 0."""
    from engine.distributed import tp_ranks
    from engine.distributed.tp_runner import make_runner

    cfg, store = tp_ranks.host_rendezvous(dataclasses.replace(cfg, tp=tp, dist_init_addr=""))
    procs = tp_ranks.spawn_ranks(cfg)
    try:
        runner = make_runner(cfg)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    try:
        yield runner
    finally:
        runner.close()
        for p in procs:
            p.join(30)
        del store
    for p in procs:
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
