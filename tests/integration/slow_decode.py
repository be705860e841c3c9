"""`pdserve decode` whose every forward takes at least STEP_S seconds, for
tests/integration/test_decode_queue.py: a long stream then lasts a known least time on any machine.

The slowness is injected, not built in: the worker is the real `run_decode_worker` given a runner
factory whose runner sleeps before each forward (inside the step's forward, where a big batch's
forward would spend the time; transfers and heartbeats move meanwhile). Any flag of `pdserve decode`
works:

    python -m tests.integration.slow_decode --port 30002 --device cpu
"""

from __future__ import annotations

import sys
import time

from decode_service.worker import run_decode_worker
from engine.forward.model_runner import ForwardBatch, ForwardOutput, ModelRunner
from service.config import ServerConfig
from service.launch import run_main

STEP_S = 0.005  # a 1000-token stream takes 5 s at least


class SlowStepRunner(ModelRunner):
    """A ModelRunner whose forwards each sleep STEP_S seconds before they compute."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        time.sleep(STEP_S)
        return super().forward(batch)


def run_slow_decode_worker(cfg: ServerConfig) -> None:
    run_decode_worker(cfg, make_runner=SlowStepRunner)


def main(argv: list[str]) -> int:
    return run_main("decode", "tests.integration.slow_decode:run_slow_decode_worker", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
