"""A busy decode keeps its queue (issue 53, part 2): real prefill and decode processes, real UCX over
TCP loopback, a tiny random model; the test plays the router (pd_harness.pd_call).

Each decode runs one request at a time (--max-running-requests 1) and every forward of it lasts at
least tests/integration/slow_worker.py's STEP_S, so a 1000-token stream holds it for 5 s or more on
any machine; the prefill's bootstrap timeout is 2 s. Requests sent behind that stream wait in the
decode's prealloc queue, and their rooms wait at the prefill past its bootstrap timeout because the
decode says, in its heartbeats, that it holds them queued (the prefill counts them: rooms_kept_queued).
A decode with --max-queued-requests 1 --queue-timeout 3 refuses the request past each bound with a
503 naming the bound and a retry_after, its prefill ends those rooms too, and both end holding
nothing. Every wait is on a condition (/server_info), never a sleep."""

from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
from pathlib import Path

import pytest
from pd_harness import COMMON, Pair, info, pd_call, start_service, wait_idle
from router_harness import Proc, free_port, wait_for

from loadtest.services import ALWAYS_PD

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

ENV = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}
BOOTSTRAP_S = 2  # the prefill's; the decodes get it too, so they say "queued" every 2/3 s
LONG_TOKENS = 1000  # >= 5 s on the slow decode: the queued rooms outlive the bootstrap timeout
SHORT_TOKENS = 8
QUEUE_TIMEOUT_S = 3


def _body(seed: int, tokens: int) -> dict:
    return {"input_ids": [(37 * i + 11 * seed) % 250 + 1 for i in range(24)],
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}


def _start_slow_decode(model: Path, *extra: str) -> Proc:
    """`pdserve decode` (flags as pd_harness.start_service gives them) with slow forwards, one request at
    a time."""
    port = free_port()
    args = [sys.executable, "-m", "tests.integration.slow_worker", "decode", "--port", str(port), *COMMON, *ALWAYS_PD,
            "--model", str(model), "--bootstrap-timeout", str(BOOTSTRAP_S), "--max-running-requests", "1", *extra]
    return Proc(f"slow-decode-{port}", args, f"http://127.0.0.1:{port}", env=ENV)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """One prefill and two decodes of it (started at once): one with the default queue bounds, one with
    tight ones."""
    tiny = make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("queue") / "tiny"), max_position_embeddings=2048)
    procs: list[Proc] = []
    try:
        pre, boot = start_service("prefill", "--model", str(tiny), "--bootstrap-timeout", str(BOOTSTRAP_S), env=ENV)
        procs.append(pre)
        procs.append(_start_slow_decode(tiny))
        procs.append(_start_slow_decode(tiny, "--max-queued-requests", "1", "--queue-timeout", str(QUEUE_TIMEOUT_S)))
        for p in procs:
            p.wait_healthy(300)
        yield {"roomy": Pair(pre, procs[1], boot), "bounded": Pair(pre, procs[2], boot)}
    finally:
        stops = [threading.Thread(target=p.stop, args=(5.0,)) for p in procs]
        for t in stops:  # at once: each may take its grace period
            t.start()
        for t in stops:
            t.join()


def _counter(proc: Proc, name: str) -> int:
    return info(proc)["counters"].get(name, 0)


def _queue(proc: Proc, name: str) -> int:
    return info(proc)["queues"].get(name, 0)


def _start_long(ex: cf.ThreadPoolExecutor, pair: Pair, seed: int) -> cf.Future:
    """The long request, once it runs on the decode (the requests sent after it queue behind it)."""
    long = ex.submit(pd_call, pair, "/generate", _body(seed, LONG_TOKENS))
    wait_for(lambda: info(pair.decode).get("running_requests") == 1, 60, "the long request to run on the decode")
    return long


def _assert_idle(pair: Pair) -> None:
    """Neither side holds a page, a room or a queued request."""
    wait_idle(pair.decode)
    wait_idle(pair.prefill)
    assert not any(info(pair.decode)["queues"].values()), info(pair.decode)["queues"]
    assert not any(info(pair.prefill)["queues"].values()), info(pair.prefill)["queues"]


def test_requests_queued_behind_a_long_one_outlive_the_bootstrap_timeout_and_finish(stack):
    pair = stack["roomy"]
    kept = _counter(pair.prefill, "rooms_kept_queued")
    with cf.ThreadPoolExecutor(4) as ex:
        long = _start_long(ex, pair, 0)
        shorts = [ex.submit(pd_call, pair, "/generate", _body(i, SHORT_TOKENS)) for i in (1, 2, 3)]
        wait_for(lambda: _queue(pair.decode, "prealloc") == 3, 60, "three requests queued on the decode")
        wait_for(lambda: _queue(pair.prefill, "queued_at_decode") == 3, 60, "the prefill to hear they are queued")
        # while the long stream still runs: the queued rooms outlive the prefill's bootstrap timeout
        wait_for(lambda: _counter(pair.prefill, "rooms_kept_queued") > kept, 60,
                 "a queued room kept past the bootstrap timeout")
        assert info(pair.decode).get("running_requests") == 1 and not long.done()
        results = [f.result(timeout=300) for f in (long, *shorts)]
    for (pre, dec), tokens in zip(results, (LONG_TOKENS, SHORT_TOKENS, SHORT_TOKENS, SHORT_TOKENS)):
        assert pre[0] == 200, pre
        assert dec[0] == 200 and len(dec[1]["output_ids"]) == tokens, dec
    assert _counter(pair.prefill, "rooms_kept_queued") - kept == 3  # each waited >= 5 s behind the long one
    _assert_idle(pair)


def test_requests_past_the_queue_bounds_get_503_with_retry_after_and_nothing_leaks(stack):
    pair = stack["bounded"]
    before = {k: _counter(pair.decode, k) for k in ("queue_rejected", "queue_timed_out")}
    with cf.ThreadPoolExecutor(2) as ex:
        long = _start_long(ex, pair, 10)
        queued = ex.submit(pd_call, pair, "/generate", _body(11, SHORT_TOKENS))
        wait_for(lambda: _queue(pair.decode, "prealloc") == 1, 60, "a request queued on the decode")
        full = pd_call(pair, "/generate", _body(12, SHORT_TOKENS))  # the queue is full: refused at once
        late = queued.result(timeout=300)  # refused once it waited --queue-timeout
        assert not long.done()  # the long stream held the decode throughout
        (p_long, d_long) = long.result(timeout=300)
    for (p_res, d_res), why in ((full, "decode queue full: 1 queued for KV memory (--max-queued-requests 1)"),
                                (late, f"waited {QUEUE_TIMEOUT_S} s for decode KV memory (--queue-timeout)")):
        assert d_res[0] == 503, d_res
        err = d_res[1]["error"]
        assert err["code"] == 503 and err["message"] == why and err["retry_after"] >= 1, err
        # the prefill ended its room too, with the same Retry-After and the decode named: a router takes
        # whichever answer comes first as the decode's refusal, never as a failure
        p_err = p_res[1]["error"]
        assert p_res[0] == 503 and p_err["message"] == why and p_err["fault"] == "decode", p_res
        assert p_err["retry_after"] == err["retry_after"], (p_err, err)
    assert d_long[0] == 200 and len(d_long[1]["output_ids"]) == LONG_TOKENS, d_long
    assert p_long[0] == 200, p_long
    assert {k: _counter(pair.decode, k) - v for k, v in before.items()} == {"queue_rejected": 1, "queue_timed_out": 1}
    _assert_idle(pair)
