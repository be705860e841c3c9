"""Rank 0's runner under tensor parallelism, and the choice between it and a plain ModelRunner.

`TPRunner` holds rank 0's ModelRunner shard and the Driver of the group's control channel; it answers
the same calls as a ModelRunner (`forward`, `collective`, `close`, `pool` / `host_pool` page moves,
`server_info` and the fields the scheduler, the transfer and the service read), sending each op that
touches model or KV data to ranks 1..N-1 first (engine/distributed/tp_ranks.py has the protocol). The
ModelRunner itself never imports this package. Ranks 1..N-1 run a plain ModelRunner
(`tp_ranks.run_rank`).

`make_runner(cfg)`: a ModelRunner for tp 1, else a TPRunner (its ranks started beforehand,
`tp_ranks.spawn_ranks`; service/launch.py does it for a service).
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig, ModelConfig
from engine.distributed import tp_ranks
from engine.forward.forward_batch import ForwardBatch, ForwardOutput
from engine.forward.model_runner import ModelRunner
from engine.models.embedded import resolve_model_path


class TPRunner:
    """Rank 0 of a TP group: its ModelRunner shard, driving the other ranks."""

    def __init__(self, cfg: EngineConfig) -> None:
        tp_ranks.check_model(ModelConfig.from_dir(resolve_model_path(cfg.model)), cfg.tp)
        tp, ctrl = tp_ranks.join(cfg, 0)
        self.driver = tp_ranks.Driver(ctrl)
        atexit.register(self.close)
        try:
            self.local = local = ModelRunner(cfg, tp_ranks.rank_shard(cfg, 0, tp, self.driver))
        except BaseException:  # a refusal (or a crash) at start-up: leave the group, nothing left for exit
            atexit.unregister(self.close)
            self.driver.closed = True  # the other ranks see the group go, not a "stop" they may never read
            tp_ranks.leave()
            raise
        # what the scheduler, the transfer and the service read of a runner (the pools send their page moves)
        self.cfg, self.model_cfg, self.model_path = local.cfg, local.model_cfg, local.model_path
        self.context_length, self.device, self.dtype = local.context_length, local.device, local.dtype
        self.tp, self.model, self.lora = local.tp, local.model, local.lora
        self.pool, self.host_pool = local.pool, local.host_pool
        self.states = local.states  # hybrid models: slots rank 0 hands out, moved on every rank (DrivenStatePool)
        self.host_tier = functools.partial(tp_ranks.DrivenHostTier, self.driver)  # the prefix cache's host tier

    @property
    def page_size(self) -> int:
        return self.local.page_size

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """The batch on every rank (each builds it from the same segments); logits from rank 0's."""
        self.driver.send(tp_ranks.run_segments, {"segments": batch.segments})
        return self.local.forward(batch)

    def collective(self, op: Callable[..., Any], **kwargs: Any) -> Any:
        """Run op(runner, **kwargs), a module-level function, on every rank (sent first, then run here);
        returns rank 0's result. tp_ranks.RankLost if a rank is gone."""
        self.driver.send(op, kwargs)
        return op(self.local, **kwargs)

    def close(self) -> None:
        """Stop the other ranks' loops and leave the group (idempotent). Called at exit too."""
        self.driver.close()
        tp_ranks.leave()

    def server_info(self) -> dict:
        return self.local.server_info()


AnyRunner = ModelRunner | TPRunner


def make_runner(cfg: EngineConfig) -> AnyRunner:
    """Rank 0's runner: a ModelRunner for tp 1, else a TPRunner (ranks 1..N-1 started by the caller)."""
    return ModelRunner(cfg) if cfg.tp == 1 else TPRunner(cfg)
