"""Transfer progress does not wait for the forward (issue 15, part 3): a prefill whose first forward
takes 20 s beside a decode, both with the default heartbeat (5 s; 3 missed = 15 s = the peer is
lost). The progress thread keeps answering heartbeats during the forward, so the room succeeds;
without it both sides declared each other lost.

The long forward is injected, not a hook in production code: the prefill service runs the real
worker with a runner that sleeps 20 s in its first forward (tests/integration/slow_prefill.py)."""

from __future__ import annotations

import sys
import time

import pytest
from pd_harness import COMMON, Pair, pd_call, start_service, text_of, wait_idle
from router_harness import Proc, free_port

from common.procs import stop_all
from tests.integration.slow_prefill import SLOW_S

pytestmark = pytest.mark.slow


def _start_slow_prefill() -> tuple[Proc, int]:
    """`pdserve prefill` (every flag as pd_harness.start_service gives it) with the slow first forward."""
    port, boot = free_port(), free_port()
    args = [sys.executable, "-m", "tests.integration.slow_prefill", "--port", str(port), *COMMON,
            "--bootstrap-port", str(boot)]
    return Proc(f"slow-prefill-{port}", args, f"http://127.0.0.1:{port}"), boot


def test_room_survives_a_20s_forward_with_default_heartbeats():
    pre, boot = _start_slow_prefill()
    dec, _ = start_service("decode")
    try:
        pre.wait_healthy(600)
        dec.wait_healthy(600)
        body = {"text": "The capital of France is", "stream": False,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        t0 = time.monotonic()
        p_res, d_res = pd_call(Pair(pre, dec, boot), "/generate", body)
        elapsed = time.monotonic() - t0
        assert p_res[0] == 200, p_res
        assert text_of("/generate", d_res).strip()
        assert elapsed >= SLOW_S, f"the injected runner did not slow the forward ({elapsed:.1f}s)"
        wait_idle(pre)
        wait_idle(dec)
    finally:
        stop_all([pre, dec], 20)  # both at once
        pre.stop()  # gone already: removes its log
        dec.stop()
