"""`pdserve prefill` whose first forward takes SLOW_S seconds longer, for tests/integration/test_transfer_progress.py.

The slowness is injected, not built in: the worker is the real `run_prefill_worker` given a runner
factory whose runner sleeps before its first forward (inside the step's forward, where a huge prompt's
forward would spend the time). Any flag of `pdserve prefill` works:

    python -m tests.integration.slow_prefill --port 30001 --bootstrap-port 8998 --device cpu
"""

from __future__ import annotations

import sys
import time

from engine.forward.model_runner import ForwardBatch, ForwardOutput, ModelRunner
from prefill_service.worker import run_prefill_worker
from service.config import ServerConfig
from service.launch import run_main

SLOW_S = 20.0


class SlowFirstForwardRunner(ModelRunner):
    """A ModelRunner whose first forward sleeps SLOW_S seconds before it computes."""

    slept = False

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if not self.slept:
            self.slept = True
            time.sleep(SLOW_S)
        return super().forward(batch)


def run_slow_prefill_worker(cfg: ServerConfig) -> None:
    run_prefill_worker(cfg, make_runner=SlowFirstForwardRunner)


def main(argv: list[str]) -> int:
    return run_main("prefill", "tests.integration.slow_prefill:run_slow_prefill_worker", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
