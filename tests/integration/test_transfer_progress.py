"""Transfer progress does not wait for the forward (issue 15, part 3): a prefill whose first forward
takes 20 s (test hook PDSERVE_TEST_SLOW_FIRST_FORWARD_S) beside a decode, both with the default
heartbeat (5 s; 3 missed = 15 s = the peer is lost). The progress thread keeps answering heartbeats
during the forward, so the room succeeds; without it both sides declared each other lost."""

from __future__ import annotations

import time

import pytest
from pd_harness import Pair, pd_call, start_service, text_of, wait_idle

pytestmark = pytest.mark.slow

SLOW_S = 20.0


def test_room_survives_a_20s_forward_with_default_heartbeats():
    pre, boot = start_service("prefill", env={"PDSERVE_TEST_SLOW_FIRST_FORWARD_S": str(SLOW_S)})
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
        assert elapsed >= SLOW_S, f"the hook did not slow the forward ({elapsed:.1f}s)"
        wait_idle(pre)
        wait_idle(dec)
    finally:
        pre.stop()
        dec.stop()
