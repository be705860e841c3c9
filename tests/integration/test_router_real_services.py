"""Acceptance 1: the `openai` client (chat and completions, streaming and not) through the router to
2 prefill + 2 decode real services (started by `pdserve up`, UCX transfer, embedded model) gets the
same greedy output as the colocated service. Then mid-stream migration (issue 17): a decode killed
(-9) while it streams a chat, a completions and a /generate answer; all three continue on the other
decode and equal an unfailed run token for token (chat and completions with one response id each,
/generate with the same cumulative text and output_ids), and every pool is back to 0.

The same services export traces to an OTLP/HTTP collector in this test and log JSON lines
(`pdserve up --otlp-endpoint ... --log-format json`), for issue 18 (tests at the end of the module):
one PD request is one connected trace, its JSON log line carries the trace id, and every query of the
Grafana dashboard names a metric these live services export.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from otlp_collector import Collector, render_tree
from pd_harness import read_sse
from router_harness import ROOT, Proc, free_port, wait_for

from common.http import TOKEN_HEADER
from loadtest.services import ALWAYS_PD

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
ENGINE = ["--max-total-tokens", "8192", "--device", "cpu"]
STARTED = re.compile(r"^started (\S+) pid \d+: (http://\S+) \(log (.+)\)$")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`pdserve up` (router, 2 prefill, 2 decode; traces to `collector`) and a colocated service."""
    collector = Collector()
    logs = tmp_path_factory.mktemp("up")
    colo_port, router_port = free_port(), free_port()
    colo = Proc(
        "colocated",
        [sys.executable, "-m", "pdserve", "colocated", "--port", str(colo_port), "--threads", "1", *ENGINE],
        f"http://127.0.0.1:{colo_port}",
    )
    # OTEL_BSP_SCHEDULE_DELAY: spans leave each process within 0.1 s
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OTEL_BSP_SCHEDULE_DELAY": "100"}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--prefill",
            "2",
            "--decode",
            "2",
            "--port",
            str(router_port),
            "--max-total-tokens",
            "8192",
            "--device",
            "cpu",
            "--transfer-backend",
            "ucx",
            "--worker-args",
            "--threads 1",
            "--decode-args",  # this suite checks the PD path (transfers, the prefill's spans): no local prefill
            " ".join(ALWAYS_PD),
            "--log-dir",
            str(logs),
            "--startup-timeout",
            "600",
            "--otlp-endpoint",
            collector.url,
            "--log-format",
            "json",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out: list[str] = []
        deadline = time.monotonic() + 660
        while not any("Ctrl-C stops everything" in ln for ln in out):
            line = up.stdout.readline()
            assert line or up.poll() is None, "pdserve up exited:\n" + "".join(out)
            assert time.monotonic() < deadline, "pdserve up not ready:\n" + "".join(out)
            out.append(line)
        colo.wait_healthy(600)
        children = {m.group(1): (m.group(2), m.group(3)) for ln in out if (m := STARTED.match(ln.strip()))}
        yield {"router": f"http://127.0.0.1:{router_port}", "colo": colo.url, "children": children,
               "collector": collector, "up_out": "".join(out), "logs": logs}
    finally:
        up.send_signal(2)
        colo.signal(signal.SIGTERM)  # drains beside `up`'s children; colo.stop() below waits for it
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        colo.stop()
        collector.close()


@pytest.fixture(scope="module")
def services(stack):
    return stack["router"], stack["colo"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _chat(c: openai.OpenAI, model: str, stream: bool) -> str:
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    kw = {"model": model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        return c.chat.completions.create(**kw).choices[0].message.content
    return "".join(
        ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True) if ch.choices
    )


def _complete(c: openai.OpenAI, model: str, stream: bool) -> str:
    kw = {"model": model, "prompt": "The capital of France is", "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        return c.completions.create(**kw).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True) if ch.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_through_router_matches_colocated(services, stream):
    router_url, colo_url = services
    via, colo = _client(router_url), _client(colo_url)
    model = via.models.list().data[0].id
    for _ in range(2):  # twice: least_load spreads the requests over both pairs
        expected = _chat(colo, model, stream)
        assert expected and _chat(via, model, stream) == expected
        expected = _complete(colo, model, stream)
        assert expected and _complete(via, model, stream) == expected


def _chat_logprobs(c: openai.OpenAI, model: str, stream: bool) -> list:
    kw = {"model": model, "messages": [{"role": "user", "content": "Name three primary colors."}],
          "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    if not stream:
        return list(c.chat.completions.create(**kw).choices[0].logprobs.content)
    return [t for ch in c.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.content]


def _close(a: list, b: list) -> None:
    assert [t.token for t in a] == [t.token for t in b]
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) < 1e-3 and len(x.top_logprobs) == len(y.top_logprobs) == 5
        assert [t.token for t in x.top_logprobs][0] == x.token  # greedy: the chosen token is the best
        assert max(abs(p.logprob - q.logprob) for p, q in zip(x.top_logprobs, y.top_logprobs)) < 1e-3


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_through_router_match_colocated(services, stream):
    """Issue 16 part 3: top_logprobs=5 (the first token's from the prefill, the rest from the decode)."""
    router_url, colo_url = services
    via, colo = _client(router_url), _client(colo_url)
    model = via.models.list().data[0].id
    _close(_chat_logprobs(via, model, stream), _chat_logprobs(colo, model, stream))


def test_echo_and_native_logprobs_through_router_match_colocated(services):
    """Completions echo with prompt logprobs (the prefill's, joined by the router), SGLang's
    top_logprobs_num and logprob_start_len, and a bad top_logprobs refused with a 400."""
    router_url, colo_url = services
    via, colo = _client(router_url), _client(colo_url)
    model = via.models.list().data[0].id
    kw = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
          "logprobs": 2, "echo": True}
    got, want = via.completions.create(**kw), colo.completions.create(**kw)
    assert got.choices[0].text == want.choices[0].text and got.choices[0].text.startswith(kw["prompt"])
    g, w = got.choices[0].logprobs, want.choices[0].logprobs
    assert g.tokens == w.tokens and g.text_offset == w.text_offset and g.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(g.token_logprobs[1:], w.token_logprobs[1:])) < 1e-3
    chunks = [ch.choices[0] for ch in via.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(c.text for c in chunks) == want.choices[0].text  # the echoed prompt first, then the deltas
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == w.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == w.text_offset
    got, want = (c.completions.create(**{**kw, "max_tokens": 0}).choices[0] for c in (via, colo))
    assert got.text == want.text == kw["prompt"] and got.finish_reason == "length"  # echo only: a prompt's score
    assert got.logprobs.tokens == want.logprobs.tokens and len(got.logprobs.tokens) < len(w.tokens)
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    metas = [httpx.post(url + "/generate", json=body, timeout=300).json()["meta_info"] for url in services]
    for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs"):
        assert len(metas[0][key]) == len(metas[1][key]) > 0, key
    assert metas[0]["input_token_logprobs"][0][0] is None
    assert max(abs(a[0] - b[0]) for a, b in zip(metas[0]["input_token_logprobs"][1:],
                                               metas[1]["input_token_logprobs"][1:])) < 1e-3
    bad = httpx.post(router_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50})
    assert bad.status_code == 400 and "top_logprobs" in bad.json()["error"]["message"]


# ---- issue 16 parts 5 and 6: structured output and tools --------------------------------------------
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colors"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                          "parameters": {"type": "object", "properties": {}}}}


def _person(c: openai.OpenAI, model: str, sampled: bool) -> str:
    kw = {"temperature": 0.8, "seed": 11} if sampled else {"temperature": 0}
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        **kw)
    assert r.choices[0].finish_reason == "stop"
    return r.choices[0].message.content


def test_json_schema_outputs_validate_pd_and_colocated(services):
    """Greedy and seeded-sampled replies parse and validate; PD gives the colocated text (the prefill
    samples token 1 under the grammar, the decode's matcher continues from it)."""
    router_url, colo_url = services
    via, colo = _client(router_url), _client(colo_url)
    model = via.models.list().data[0].id
    for sampled in (False, True):
        want = _person(colo, model, sampled)
        jsonschema.validate(json.loads(want), PERSON)
        assert _person(via, model, sampled) == want
    body = {"text": "My phone number is", "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                              "regex": r" [0-9]{3}-[0-9]{4}"}}
    texts = [httpx.post(url + "/generate", json=body, timeout=300).json()["text"] for url in services]
    assert texts[0] == texts[1] and re.fullmatch(r" [0-9]{3}-[0-9]{4}", texts[0])


def _tool_call(c: openai.OpenAI, model: str, stream: bool, choice) -> tuple[str, str, str]:  # noqa: ANN001
    kw = {"model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
          "tools": [WEATHER, CLOCK], "tool_choice": choice, "max_tokens": 80, "temperature": 0}
    if not stream:
        ch = c.chat.completions.create(**kw).choices[0]
        assert ch.message.content is None and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        return call.function.name, call.function.arguments, ch.finish_reason
    name, args, finish = "", "", None
    for chunk in c.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        assert not d.content
        for tc in d.tool_calls or []:
            assert tc.index == 0
            name += tc.function.name or ""
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return name, args, finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_give_valid_calls(services, stream):
    router_url, colo_url = services
    via, colo = _client(router_url), _client(colo_url)
    model = via.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named) if not stream else ("required",):
        want = _tool_call(colo, model, stream, choice)
        name, args, finish = want
        assert finish == "tool_calls" and name in ("get_weather", "get_time")
        params = (WEATHER if name == "get_weather" else CLOCK)["function"]["parameters"]
        jsonschema.validate(json.loads(args), params)
        if choice is named:
            assert name == "get_weather"
        assert _tool_call(via, model, stream, choice) == want


def _chat_n(c: openai.OpenAI, model: str, stream: bool) -> list[str]:
    kw = {"model": model, "messages": [{"role": "user", "content": "Write a word."}], "max_tokens": 8,
          "temperature": 1.0, "seed": 11, "n": 3}
    if not stream:
        choices = c.chat.completions.create(**kw).choices
        assert [ch.index for ch in choices] == [0, 1, 2]
        return [ch.message.content for ch in choices]
    texts = ["", "", ""]
    for ch in c.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    return texts


def _complete_n(c: openai.OpenAI, model: str, stream: bool) -> list[str]:
    kw = {"model": model, "prompt": "My favourite animal is", "max_tokens": 8, "temperature": 1.0, "seed": 5,
          "n": 3}
    if not stream:
        res = c.completions.create(**kw)
        # the prompt (5 tokens) counted once, the completion tokens of all three choices summed
        assert res.usage.prompt_tokens <= 8 and 3 <= res.usage.completion_tokens <= 24
        return [ch.text for ch in sorted(res.choices, key=lambda ch: ch.index)]
    texts = ["", "", ""]
    for ch in c.completions.create(**kw, stream=True):
        for choice in ch.choices:
            texts[choice.index] += choice.text
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_through_router_match_colocated(services, stream):
    """Issue 16 part 1: n=3, seeded: three different choices by index, the same PD (the prefill computes
    the prompt once and samples the three first tokens, the decode forks the received KV) and colocated."""
    router_url, colo_url = services
    via, colo = _client(router_url), _client(colo_url)
    model = via.models.list().data[0].id
    for fn in (_chat_n, _complete_n):
        want = fn(colo, model, stream)
        assert len(set(want)) == 3, want
        assert fn(via, model, stream) == want


def test_bad_structured_requests_are_400_and_services_stay_healthy(services):
    router_url, colo_url = services
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        ("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, 'Unsupported type "objekt"'),
        ("/generate", {"text": "hi", "sampling_params": {"regex": "(ab"}}, "invalid regex"),
        ("/v1/chat/completions", {"messages": msgs, "tools": [WEATHER],
                                  "tool_choice": {"type": "function", "function": {"name": "launch"}}},
         "names function 'launch', which is not in 'tools'"),
        ("/v1/chat/completions", {"messages": msgs, "n": 0}, "'n' (choices per request) must be an integer"),
        ("/v1/completions", {"prompt": "hi", "n": 10000}, "1..64"),
        ("/generate", {"text": "hi", "sampling_params": {"n": "2"}}, "'n'"),
    ]
    for url in services:
        for path, body, match in bad:
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 400 and match in r.json()["error"]["message"], (url, path, r.text)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        ok = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=300)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


# ---- issue 18: traces, JSON request logs, dashboard queries ----------------------------------------
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
PROMPT = ("Name the three primary colors of light and explain, in one short sentence each, how a screen mixes "
          "them into white light.")
WANT_SPANS = {
    "pdserve-router": {"router.request", "router.attempt", "router.pick", "router.stream"},
    "pdserve-prefill": {"prefill.request", "prefill.bootstrap_queue", "prefill.waiting_queue", "prefill.chunk",
                        "prefill.kv_transfer"},
    "pdserve-decode": {"decode.request", "decode.admission", "decode.kv_transfer", "decode.running"},
}


def test_prefix_cache_usage_and_flush(stack):
    """Issue 14: a repeated prompt reports cached_tokens in usage (colocated, and PD through the
    router, where a decode that saw it before receives only its uncached pages), with the same
    greedy text; /flush_cache empties the cache when idle, on the colocated
    service and on every PD worker."""
    colo = stack["colo"]
    msgs = [{"role": "user", "content": "Describe a lighthouse at night in a few calm sentences. " * 4}]
    body = {"model": "m", "messages": msgs, "max_tokens": 4, "temperature": 0}

    def chat(url: str) -> dict:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        return r.json()

    first, second = chat(colo), chat(colo)
    # the chat template's default system prompt may already be cached from earlier tests; the rest is new
    before = first["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert before < cached < second["usage"]["prompt_tokens"] and cached % 16 == 0  # whole pages, not the last
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    via = [chat(stack["router"]) for _ in range(3)]  # 2 prefills: some prefill sees the prompt twice
    assert {v["choices"][0]["message"]["content"] for v in via} == {first["choices"][0]["message"]["content"]}
    assert max(v["usage"]["prompt_tokens_details"]["cached_tokens"] for v in via) == cached
    metrics = httpx.get(colo + "/metrics").text
    assert re.search(r"^pdserve_worker_prefix_hit_tokens_total [1-9]", metrics, re.M), metrics[-2000:]

    flushed = httpx.post(colo + "/flush_cache", timeout=30)  # idle (the 409 while busy: test_prefix_cache.py)
    assert flushed.status_code == 200 and flushed.json()["freed_tokens"] >= cached, flushed.text
    assert chat(colo)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the cache was emptied
    token = (Path(stack["logs"]) / "internal-token").read_text().strip()
    # decode-side reuse: 3 requests over 2 decodes, so one decode saw the prompt again and held its
    # pages (over UCX, with the same text as above)
    reused = 0.0
    for name, (url, _) in stack["children"].items():
        if name.startswith("decode"):
            text = httpx.get(url + "/metrics", headers={TOKEN_HEADER: token}, timeout=30).text
            found = re.search(r'^pdserve_worker_kv_pages_reused_on_decode_total (\S+)', text, re.M)
            reused += float(found.group(1)) if found else 0.0
    assert reused > 0
    for name, (url, _) in stack["children"].items():
        if name.startswith(("prefill", "decode")):
            r = httpx.post(url + "/flush_cache", headers={TOKEN_HEADER: token}, timeout=30)
            assert r.status_code == 200 and r.json()["success"], (name, r.text)


@pytest.fixture(scope="module")
def traced(stack):
    """One streamed chat completion through the router, sent with the client's own traceparent."""
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "x", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=300) as c, c.stream(
            "POST", stack["router"] + "/v1/chat/completions", json=body,
            headers={"traceparent": f"00-{trace_id}-{client_span}-01"}) as r:
        assert r.status_code == 200, r.read()
        events = read_sse(r)
    assert events and not any("error" in e for e in events), events
    col = stack["collector"]

    def complete() -> bool:
        have = {(s.service, s.name) for s in col.trace(trace_id)}
        return all((svc, n) in have for svc, names in WANT_SPANS.items() for n in names)

    try:
        wait_for(complete, 60, "every span of the request at the collector", interval=0.1)
    except TimeoutError:
        raise AssertionError(render_tree(col.trace(trace_id))) from None
    return trace_id, client_span


def test_one_pd_request_is_one_connected_trace(stack, traced) -> None:
    trace_id, client_span = traced
    spans = stack["collector"].trace(trace_id)
    print(f"\ntrace {trace_id} ({len(spans)} spans):\n{render_tree(spans)}")
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans)
    roots = [s for s in spans if s.parent_id not in ids]
    assert [(s.name, s.parent_id) for s in roots] == [("router.request", client_span)], "one tree under the client"
    assert not [s for s in spans if s.error], "no span failed"
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    parent = {s.span_id: s for s in spans}
    attempt = by_name["router.attempt"][0]
    assert attempt.attributes["attempt"] == 0 and attempt.attributes["room"]
    assert {p.attributes["role"] for p in by_name["router.pick"]} == {"prefill", "decode"}
    for role in ("prefill", "decode"):  # each frontend continues the router's attempt span
        (req,) = by_name[f"{role}.request"]
        assert parent[req.parent_id].name == "router.attempt"
    chunks = by_name["prefill.chunk"]  # one or more (several chunks: tests/unit/test_pd_inprocess.py)
    assert chunks and sum(c.attributes["tokens"] for c in chunks) == by_name[
        "prefill.bootstrap_queue"][0].attributes["prompt_tokens"]
    for side in ("prefill", "decode"):
        (x,) = by_name[f"{side}.kv_transfer"]
        assert x.attributes["bytes"] > 0 and x.attributes["room"] == attempt.attributes["room"]
        assert parent[x.parent_id].name == f"{side}.request"
    assert by_name["decode.running"][0].attributes["completion_tokens"] == 6
    assert by_name["router.stream"][0].attributes["outcome"] == "200"


def test_json_request_logs_carry_the_trace_id(stack, traced) -> None:
    trace_id, _ = traced

    def finished_line() -> dict | None:
        for name, (_, log) in stack["children"].items():
            if name.startswith("decode"):
                for line in Path(log).read_text().splitlines():
                    if line.startswith("{") and '"finished rid=' in line:
                        rec = json.loads(line)
                        if rec.get("trace_id") == trace_id:
                            return rec
        return None

    rec = wait_for(finished_line, 30, "the decode's JSON finished line")
    assert rec["status"] == 200 and rec["completion_tokens"] == 6 and rec["process"] == "decode"
    router_log = Path(stack["children"]["router"][1])
    lines = [json.loads(ln) for ln in router_log.read_text().splitlines() if ln.startswith("{")]
    (mine,) = [r for r in lines if r.get("trace_id") == trace_id]
    assert mine["logger"] == "router.requests" and mine["status"] == "200" and mine["stream"] is True
    assert mine["room"] == rec["room"] and mine["events"] == 7


def _exported_names(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            names.update({"counter": [name + "_total"],
                          "histogram": [name + s for s in ("_bucket", "_sum", "_count")]}.get(kind, []))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_dashboard_queries_name_exported_metrics(stack, traced) -> None:
    exported: set[str] = set()
    urls = [url for url, _ in stack["children"].values()]
    assert len(urls) == 5, stack["children"]  # router, 2 prefill, 2 decode
    for url in urls:  # /metrics needs no internal token
        r = httpx.get(url + "/metrics", timeout=10)
        r.raise_for_status()
        exported |= _exported_names(r.text)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    missing = {}
    for e in exprs:
        used = set(re.findall(r"\bpdserve_[a-z0-9_]+", e))
        assert used, f"no pdserve metric in {e!r}"
        if used - exported:
            missing[e] = sorted(used - exported)
    assert not missing, missing
    for metric in ("pdserve_worker_queued_prompt_tokens", "pdserve_worker_kv_usage", "pdserve_worker_running_requests"):
        assert metric in exported, f"autoscaling metric {metric} not exported"


# ---- issue 17: mid-stream migration ------------------------------------------------------------
MIGRATE_TOKENS = 24
MIGRATE_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]},
    "/v1/completions": {"prompt": "The history of the Roman empire begins"},
    "/generate": {"text": "A river runs through the valley and"},  # cumulative text and output_ids
}


def _sse(url: str, path: str, on_token=None) -> list[dict]:  # noqa: ANN001
    body = {**MIGRATE_BODIES[path], "model": "x", "max_tokens": MIGRATE_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if path == "/generate":
        sampling = {"max_new_tokens": MIGRATE_TOKENS, "temperature": 0, "ignore_eos": True}
        body = {**MIGRATE_BODIES[path], "sampling_params": sampling, "stream": True}
    events: list[dict] = []
    with httpx.Client(timeout=300) as c, c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if on_token is not None and (events[-1].get("choices") or "meta_info" in events[-1]):
                    on_token()
    return events


def _text(events: list[dict]) -> str:
    if "meta_info" in events[-1]:  # /generate: the last event holds the whole text
        return events[-1]["text"]
    out = ""
    for e in events:
        for ch in e.get("choices") or []:
            out += ch["text"] if "text" in ch else ch["delta"].get("content") or ""
    return out


def _admin(url: str) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(url + "/admin/workers").json()["workers"]}


def test_streams_migrate_off_a_killed_decode_and_equal_an_unfailed_run(stack):
    router_url, up_out, logs = stack["router"], stack["up_out"], stack["logs"]
    decodes = dict(re.findall(r"started decode-\d+ pid (\d+): (\S+)", up_out))  # pid -> url
    (victim_pid, victim), (_, survivor) = decodes.items()
    with ThreadPoolExecutor(len(MIGRATE_BODIES)) as ex:
        reference = dict(zip(MIGRATE_BODIES, ex.map(lambda p: _sse(router_url, p), MIGRATE_BODIES)))
    # both streams on one decode: take the other out of the router until they run, then kill theirs
    httpx.delete(router_url + "/admin/workers", params={"url": survivor}).raise_for_status()
    counts = {path: 0 for path in MIGRATE_BODIES}
    lock, running = threading.Lock(), threading.Event()

    def on_token(path: str) -> None:
        with lock:
            counts[path] += 1
            if min(counts.values()) >= 4 and not running.is_set():
                running.set()
                httpx.post(router_url + "/admin/workers", json={"url": survivor, "role": "decode"}).raise_for_status()
                os.killpg(int(victim_pid), signal.SIGKILL)

    with ThreadPoolExecutor(len(MIGRATE_BODIES)) as ex:
        migrated = dict(zip(MIGRATE_BODIES, ex.map(lambda p: _sse(router_url, p, lambda: on_token(p)),
                                                   MIGRATE_BODIES)))
    assert running.is_set(), "the streams ended before the kill"
    for path in MIGRATE_BODIES:
        ref, got = reference[path], migrated[path]
        assert not any("error" in e for e in got), got[-2:]
        print(f"{path}: unfailed {_text(ref)!r}\n{' ' * len(path)}  migrated {_text(got)!r}")
        assert not any("pd_token_ids" in e for e in got)
        if path == "/generate":
            counts_of = lambda e: {k: e["meta_info"][k] for k in ("prompt_tokens", "completion_tokens")}  # noqa: E731
            assert _text(got) == _text(ref) and got[-1]["output_ids"] == ref[-1]["output_ids"]
            assert counts_of(got[-1]) == counts_of(ref[-1])
            continue
        assert _text(got) == _text(ref)
        # the resumed leg may take the prompt from a prefix cache: token counts equal, cached_tokens may not
        assert {k: v for k, v in got[-1]["usage"].items() if k != "prompt_tokens_details"} == \
            {k: v for k, v in ref[-1]["usage"].items() if k != "prompt_tokens_details"}
        assert len({e["id"] for e in got}) == 1
    metrics = httpx.get(router_url + "/metrics").text
    assert f"pdserve_router_migrations_total {float(len(MIGRATE_BODIES))}" in metrics
    token = (Path(logs) / "internal-token").read_text().strip()

    def idle(url: str) -> bool:
        st = httpx.get(url + "/server_info", headers={TOKEN_HEADER: token}, timeout=10).json()["internal_states"][0]
        return st["kv_used_tokens"] == 0 and st.get("active_rooms", 0) == 0

    workers = [u for u, w in _admin(router_url).items() if u != victim]
    wait_for(lambda: all(idle(u) for u in workers), 60, "every pool back to 0", interval=0.2)
