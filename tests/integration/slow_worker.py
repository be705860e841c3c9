"""`pdserve decode` or `pdserve colocated` whose every forward takes at least STEP_S seconds, for tests
that need a request to stay running for a known least time on any machine (a long stream holds a
decode's memory in tests/integration/test_decode_queue.py, an adapter in test_lora_service.py).

The slowness is injected, not built in: the worker is the real `run_decode_worker` /
`run_colocated_worker` given a runner factory whose runner sleeps before each forward (inside the
step's forward, where a big batch's forward would spend the time; transfers and heartbeats move
meanwhile). Any flag of the role works:

    python -m tests.integration.slow_worker decode --port 30002 --device cpu
    python -m tests.integration.slow_worker colocated --port 30000 --device cpu
"""

from __future__ import annotations

import sys
import time

from colocated_service.worker import run_colocated_worker
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


def run_slow_colocated_worker(cfg: ServerConfig) -> None:
    run_colocated_worker(cfg, make_runner=SlowStepRunner)


def main(argv: list[str]) -> int:
    role = argv[0] if argv and argv[0] in ("decode", "colocated") else "decode"
    rest = argv[1:] if argv and argv[0] == role else argv
    return run_main(role, f"tests.integration.slow_worker:run_slow_{role}_worker", rest, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
