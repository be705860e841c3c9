"""The PD request lifecycle end to end: real prefill, decode and colocated services (separate
processes, zmq inside each service, real UCX between prefill and decode, the embedded model).

The test plays the router: it posts the same body with bootstrap fields to a prefill and a decode.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import re

import httpx
import pytest
from pd_harness import Pair, call, info, pd_call, start_service, text_of, wait_idle
from router_harness import wait_for

from common.procs import stop_all

pytestmark = pytest.mark.slow

BIG = ["--max-total-tokens", "8192"]
# The loaded pairs below run 32 concurrent prompts of up to ~1,500 tokens through one prefill thread.
# These tests check outputs, not liveness (the heartbeat rules have their own tests in
# test_transfer_faults, test_transfer_timeouts and test_transfer_progress, where a 20 s forward keeps
# its room with default heartbeats now that transfers progress on a thread during forwards), so
# their pairs allow 30 s x 3 as a margin on a busy box.
PATIENT = ["--heartbeat-interval", "30"]
SMALL_DECODE_TOKENS = 1536  # about a quarter of RETRACT_LOAD below (prompts + outputs)
SHORT_TIMEOUT = 4.0


@pytest.fixture(scope="module")
def svc():
    """All services of this module: the colocated one first, then the others at once (model loading
    overlaps), and while they load, `alone`'s outputs on the colocated service (one core computes them
    one at a time, the other loads the services; nothing else reaches the colocated service before the
    fixture yields, so each output is computed alone)."""
    procs: dict = {}
    try:
        procs["colo"], _ = start_service("colocated", *BIG)
        procs["colo"].wait_healthy(600)
        procs["pre"], boot = start_service("prefill", *BIG, *PATIENT, "--bootstrap-timeout", "600")
        procs["dec"], _ = start_service("decode", *BIG, *PATIENT, "--waiting-timeout", "600")
        procs["small"], _ = start_service("decode", *PATIENT, "--max-total-tokens", str(SMALL_DECODE_TOKENS),
                                          "--new-token-ratio", "0", "--waiting-timeout", "600")
        procs["pre_short"], boot_short = start_service(
            "prefill", *BIG, "--bootstrap-timeout", str(SHORT_TIMEOUT), "--chunked-prefill-size", "64")
        procs["dec_short"], _ = start_service("decode", *BIG, "--waiting-timeout", str(SHORT_TIMEOUT))
        alone = _alone(procs["colo"])
        for p in procs.values():
            p.wait_healthy(600)
        yield {
            "colo": procs["colo"],
            "alone": alone,
            "pair": Pair(procs["pre"], procs["dec"], boot),
            "small": Pair(procs["pre"], procs["small"], boot),
            "short": Pair(procs["pre_short"], procs["dec_short"], boot_short),
        }
    finally:
        stop_all(list(procs.values()), 20)  # all at once: each drains and stops its worker in parallel
        for p in procs.values():
            p.stop()  # gone already: removes its log


def _body(path: str, stream: bool, max_tokens: int = 16) -> dict:
    if path == "/generate":
        return {"text": "The three primary colors are", "stream": stream,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
    if path == "/v1/completions":
        return {"model": "x", "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0,
                "stream": stream}
    return {"model": "x", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": "You are brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Name a large "},
                                                      {"type": "text", "text": "ocean."}]}]}


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_pd_greedy_equals_colocated(svc, path):
    want = text_of(path, call(svc["colo"].url, path, _body(path, False)))
    assert want.strip(), "the colocated service produced no text"
    for stream in (False, True):
        pre, dec = pd_call(svc["pair"], path, _body(path, stream))
        assert pre[0] == 200, pre
        assert text_of(path, dec) == want, f"stream={stream}"
    for p in (svc["pair"].prefill, svc["pair"].decode):
        wait_idle(p)


# ---- concurrency and retraction ------------------------------------------------------------------

SENTENCES = [
    "The river bends twice before it reaches the old mill.", "Prices rose sharply in the spring.",
    "She kept a notebook of every bird she saw.", "The committee met on Tuesday to review the plan.",
    "Rain is expected across the northern valleys tonight.", "A small bakery opened next to the station.",
    "The engine was rebuilt with parts from three different cars.", "Our team finished the survey early.",
    "He wrote letters to his grandmother every week.", "The library extended its opening hours.",
]


def _prompts(n: int, seed: int = 7, longest: int = 1500, out: tuple[int, int] = (8, 32)) -> list[tuple[str, int]]:
    """n prompts of about 10 to `longest` tokens (log-uniform, both ends included) and max_tokens."""
    rng = random.Random(seed)
    lengths = [10, longest] + [int(10 * (longest / 10) ** rng.random()) for _ in range(n - 2)]
    prompts = []
    for i, tokens in enumerate(lengths):
        words: list[str] = []
        while len(words) * 1.3 < tokens:
            words += rng.choice(SENTENCES).split()
        text = f"Note {i}: " + " ".join(words[: max(3, int(tokens / 1.3))]) + "\nSummary:"
        prompts.append((text, rng.randint(*out)))
    return prompts


LOAD = _prompts(32)
# short prompts, long outputs: many requests decode at once, so a small pool must retract
RETRACT_LOAD = _prompts(32, seed=11, longest=300, out=(32, 48))


def _sp(max_tokens: int) -> dict:
    # fixed lengths (ignore_eos) so every request decodes long enough to need new pages
    return {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _alone(colo) -> list[list[int]]:  # noqa: ANN001
    """Each prompt's greedy output from the colocated service, one at a time."""
    outs = []
    for text, max_tokens in LOAD:
        status, body = call(colo.url, "/generate", {
            "text": text, "sampling_params": _sp(max_tokens)})
        assert status == 200, body
        outs.append(body["output_ids"])
    return outs


@pytest.fixture(scope="module")
def alone(svc):
    """Each prompt's greedy output from the colocated service, one at a time (computed by svc)."""
    return svc["alone"]


def _run_load(pair: Pair, load: list[tuple[str, int]] = LOAD) -> list[list[int]]:
    def one(i: int) -> list[int]:
        text, max_tokens = load[i]
        pre, dec = pd_call(pair, "/generate",
                           {"text": text, "sampling_params": _sp(max_tokens)})
        assert pre[0] == 200 and dec[0] == 200, (i, pre, dec)
        return dec[1]["output_ids"]

    with cf.ThreadPoolExecutor(len(load)) as ex:
        return list(ex.map(one, range(len(load))))


def test_concurrent_requests_match_one_at_a_time(svc, alone):
    prompt_tokens = [len(t) for t, _ in LOAD]
    assert max(prompt_tokens) > 5000  # characters; ~1,500 tokens
    got = _run_load(svc["pair"])
    mismatched = [i for i in range(len(LOAD)) if got[i] != alone[i]]
    assert not mismatched, [(i, got[i], alone[i]) for i in mismatched]
    for p in (svc["pair"].prefill, svc["pair"].decode):
        wait_idle(p)


def test_small_decode_pool_retracts_and_completes(svc):
    """The same load through a decode with a pool of ~1/4 of its KV and through one with room for all
    of it: the small one retracts (offload to host, reload) and every output is unchanged."""
    big_before = info(svc["pair"].decode)["counters"]["retractions"]
    want = _run_load(svc["pair"], RETRACT_LOAD)
    assert info(svc["pair"].decode)["counters"]["retractions"] == big_before  # no memory pressure there
    before = info(svc["small"].decode)["counters"]
    got = _run_load(svc["small"], RETRACT_LOAD)
    mismatched = [i for i in range(len(RETRACT_LOAD)) if got[i] != want[i]]
    assert not mismatched, [(i, got[i], want[i]) for i in mismatched]
    after = wait_idle(svc["small"].decode)
    assert after["counters"]["retractions"] > before["retractions"], after["counters"]
    assert after["counters"]["reloads"] > before["reloads"], after["counters"]
    metrics = httpx.get(svc["small"].decode.url + "/metrics", timeout=10).text
    assert "# TYPE pdserve_worker_retractions_total counter" in metrics
    assert re.search(r"^pdserve_worker_retractions_total [1-9]", metrics, re.M), metrics[-2000:]
    wait_idle(svc["small"].prefill)


# ---- abandoned rooms and aborts -------------------------------------------------------------------

def _gen(max_tokens: int = 4, text: str = "Hello there") -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}


def test_room_sent_only_to_decode_times_out(svc):
    pair = svc["short"]
    status, body = call(pair.decode.url, "/generate", {**_gen(), **pair.fields()})
    assert status == 408, body
    assert f"within {SHORT_TIMEOUT}s" in body["error"]["message"], body  # names the timeout that fired
    wait_idle(pair.decode)
    wait_idle(pair.prefill)
    assert info(pair.prefill)["transfer"]["early_infos"] == 0


def test_room_sent_only_to_prefill_times_out(svc):
    pair = svc["short"]
    status, body = call(pair.prefill.url, "/generate", {**_gen(), **pair.fields()})
    assert status == 408, body
    assert f"no TransferInfo from a decode within {SHORT_TIMEOUT}s" in body["error"]["message"], body
    wait_idle(pair.prefill)


LONG_PROMPT = " ".join(SENTENCES * 12)  # ~1,300 tokens: ~20 chunks of 64 on the short prefill


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_by_room_frees_both_sides(svc, side):
    pair = svc["short"]
    fields = pair.fields()
    room = fields["bootstrap_room"]
    body = {**_gen(64, LONG_PROMPT), **fields}
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(call, pair.prefill.url, "/generate", body)
        fd = ex.submit(call, pair.decode.url, "/generate", body)
        # abort while the prefill is computing the prompt chunk by chunk (both sides hold the room)
        wait_for(lambda: info(pair.prefill)["queues"]["waiting"] == 1, 60, "the prefill to start the room")
        target = pair.prefill if side == "prefill" else pair.decode
        r = httpx.post(target.url + "/abort_request", json={"bootstrap_room": room}, timeout=10)
        assert r.status_code == 200, r.text
        pre, dec = fp.result(), fd.result()
    assert pre[0] != 200 and dec[0] != 200, (pre, dec)
    for _status, resp in (pre, dec):
        assert "abort" in resp["error"]["message"].lower(), resp
    wait_idle(pair.prefill)
    wait_idle(pair.decode)


# ---- bad input ------------------------------------------------------------------------------------

BAD_BOOTSTRAP = [
    {},  # missing
    {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": -1},
    {"bootstrap_host": "127.0.0.1", "bootstrap_port": "x", "bootstrap_room": 5},
    {"bootstrap_host": "", "bootstrap_port": 8998, "bootstrap_room": 5},
    {"bootstrap_host": "127.0.0.1", "bootstrap_port": 70000, "bootstrap_room": 5},
    {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**64},
]


def test_bad_input_gets_4xx_and_services_stay_healthy(svc):
    pair = svc["pair"]
    ok = pair.fields()
    cases = [
        ("/generate", b"{not json", "content"),
        ("/generate", {"text": 5, **ok}, "json"),
        ("/generate", {"text": "", **ok}, "json"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}, **ok}, "json"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}, **ok}, "json"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}, **ok}, "json"),
        ("/generate", {"input_ids": list(range(100, 9100)), **ok}, "json"),  # over the context length
        ("/v1/completions", {"model": "x", "prompt": "hi", "max_tokens": -1, **ok}, "json"),
        ("/v1/chat/completions", {"model": "x", "messages": "hello", **ok}, "json"),
        ("/v1/chat/completions", {"model": "x", "messages": [], **ok}, "json"),
    ] + [("/generate", {"text": "hi", **b}, "json") for b in BAD_BOOTSTRAP]
    for proc in (pair.prefill, pair.decode):
        for path, payload, kind in cases:
            kw = {"content": payload, "headers": {"content-type": "application/json"}} if kind == "content" \
                else {"json": payload}
            r = httpx.post(proc.url + path, timeout=30, **kw)
            assert 400 <= r.status_code < 500, (proc.name, path, payload if kind == "json" else kind, r.text)
            assert r.json()["error"]["message"], r.text
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
        wait_idle(proc)
    # and they still serve
    pre, dec = pd_call(pair, "/generate", _gen())
    assert pre[0] == 200 and dec[0] == 200
