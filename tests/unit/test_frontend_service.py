"""The frontend as a real service: `serve()` with the stub worker (tests/stub_worker.py) in a child
process, real uvicorn on a free port, real zmq. Two services per module: a colocated one and a
prefill-role one with an internal token. The drain and worker-crash tests run last (file order)."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest

from common.procs import Child, free_port, wait_until
from engine.config import CPU_DEFAULT_TOKENS
from tests.stub_worker import make_tokenizer_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"
LONG = {"max_new_tokens": 3000, "ignore_eos": True}
BOOT = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}


def wait_for(cond, timeout: float = 30.0, what: str = "condition"):  # noqa: ANN001, ANN201
    return wait_until(cond, timeout, what)


class Service:
    def __init__(self, role: str, model_dir: Path, log: Path, extra: list[str], headers: dict) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "tests.stub_worker", "--role", role, "--model", str(model_dir),
               "--device", "cpu", "--dtype", "float32", "--port", str(self.port), "--context-length", "4096",
               "--log-level", "info", "--drain-grace", "20", *extra]
        env = {"PDSERVE_STUB_DELAY_S": "0.01", "PYTHONPATH": str(ROOT)}
        self.child = Child(role, cmd, log, url=self.url, env=env, cwd=ROOT)
        self.proc = self.child.popen
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def healthy(self) -> bool:
        assert self.proc.poll() is None, f"service exited early:\n{self.log.read_text()[-3000:]}"
        try:
            return self.client.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.child.stop(grace=30)
        self.client.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tokmodel"))


@pytest.fixture(scope="module")
def services(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    tmp = tmp_path_factory.mktemp("svc")
    (tmp / "token").write_text(TOKEN + "\n")
    colo = Service("colocated", model_dir, tmp / "colocated.log", [], {})
    pre = Service("prefill", model_dir, tmp / "prefill.log",
                  ["--internal-token-file", str(tmp / "token"), "--transfer-backend", "fake"],
                  {"x-pdserve-token": TOKEN})
    try:
        wait_for(lambda: colo.healthy() and pre.healthy(), 180, "both services healthy")
        yield colo, pre
    finally:
        colo.stop()
        pre.stop()


@pytest.fixture(scope="module")
def colo(services) -> Service:  # noqa: ANN001
    return services[0]


@pytest.fixture(scope="module")
def pre(services) -> Service:  # noqa: ANN001
    return services[1]


@pytest.fixture(scope="module")
def tok(model_dir: Path):  # noqa: ANN201
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def sse_events(resp: httpx.Response) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def ids_for_output(tok, text: str) -> list[int]:  # noqa: ANN001
    """The stub emits the prompt reversed: this prompt makes it generate `text`."""
    return list(reversed(tok.encode(text, add_special_tokens=False).ids))


def running(svc: Service) -> int:
    info = svc.client.get("/server_info").json()
    return info["internal_states"][0]["queues"]["running"] + info["in_flight"]


def test_info_endpoints(colo: Service) -> None:
    c = colo.client
    assert c.get("/health").json()["status"] == "ok"
    for path in ("/server_info", "/get_server_info"):
        info = c.get(path).json()
        assert info["role"] == "colocated" and info["context_length"] == 4096 and info["stub"] is True
        assert info["internal_states"][0]["kv_total_tokens"] == CPU_DEFAULT_TOKENS  # the CPU default pool
    for path in ("/model_info", "/get_model_info"):
        assert c.get(path).json()["is_generation"] is True
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 4096
    r = c.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert 'pdserve_worker_queues{name="running"}' in r.text
    assert "pdserve_worker_transfer_seconds_bucket" in r.text and "pdserve_worker_up 1" in r.text
    assert "# TYPE pdserve_worker_retractions_total counter" in r.text


def test_generate_native(colo: Service, tok) -> None:  # noqa: ANN001
    ids = ids_for_output(tok, "Hello there, general")
    r = colo.client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 64, "temperature": 0}})
    body = r.json()
    assert r.status_code == 200, body
    assert body["text"] == "Hello there, general" and body["output_ids"] == ids[::-1]
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and meta["completion_tokens"] == len(ids)
    assert len(meta["output_token_logprobs"]) == len(ids) and meta["e2e_latency"] > 0
    with colo.client.stream("POST", "/generate", json={"text": "one two three", "stream": True}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert texts == sorted(texts, key=len) and texts[-1] == " three twoone"  # cumulative; reversed ids


def test_openai_client_completions_and_chat(colo: Service, tok) -> None:  # noqa: ANN001
    import openai

    client = openai.OpenAI(base_url=colo.url + "/v1", api_key="none")
    prompt = ids_for_output(tok, "abc def")
    cmp = client.completions.create(model="m", prompt=prompt, max_tokens=50)
    assert cmp.choices[0].text == "abc def" and cmp.usage.completion_tokens == len(prompt)
    chat = client.chat.completions.create(
        model="m", max_tokens=5,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"},
                                               {"type": "text", "text": "x"}]}])
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(model="m", max_tokens=7, stream=True,
                                            messages=[{"role": "user", "content": "hey"}],
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage.completion_tokens == 7
    assert text == chat_text(colo, "hey", 7)


def test_n_choices_stream_and_not(colo: Service, tok) -> None:  # noqa: ANN001
    """n=3 with the openai client: three choices by index (the stub's choice i is the reversed
    prompt rotated by i), usage counts the prompt once; streamed chunks carry their index; /generate
    answers a list."""
    import openai

    client = openai.OpenAI(base_url=colo.url + "/v1", api_key="none")
    prompt = ids_for_output(tok, "abc def")
    want = [tok.decode(list(reversed(prompt))[i:] + list(reversed(prompt))[:i]) for i in range(3)]
    cmp = client.completions.create(model="m", prompt=prompt, max_tokens=len(prompt), n=3)
    assert [c.index for c in cmp.choices] == [0, 1, 2] and [c.text for c in cmp.choices] == want
    assert cmp.usage.prompt_tokens == len(prompt) and cmp.usage.completion_tokens == 3 * len(prompt)
    chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=len(prompt), n=3, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == want and chunks[-1].usage.completion_tokens == 3 * len(prompt)
    msgs = [{"role": "user", "content": "hey"}]
    chat = client.chat.completions.create(model="m", max_tokens=4, n=3, messages=msgs)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 3
    streamed = {i: "" for i in range(3)}
    for ch in client.chat.completions.create(model="m", max_tokens=4, n=3, messages=msgs, stream=True):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[i] for i in range(3)] == [c.message.content for c in chat.choices]
    r = colo.client.post("/generate", json={"input_ids": prompt, "sampling_params": {"n": 2, "max_new_tokens": 3,
                                                                                 "ignore_eos": True}})
    assert [b["index"] for b in r.json()] == [0, 1] and all(len(b["output_ids"]) == 3 for b in r.json())
    r = colo.client.post("/v1/completions", json={"prompt": "[[stub:error]]", "n": 3})  # choice 0 fails: all do
    assert r.status_code == 500 and "refused" in r.json()["error"]["message"]
    wait_for(lambda: running(colo) == 0, 10, "no choice left running")


def chat_text(svc: Service, content: str, n: int) -> str:
    r = svc.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                      "max_tokens": n})
    return r.json()["choices"][0]["message"]["content"]


def test_stop_strings_trimmed_stream_and_not(colo: Service, tok) -> None:  # noqa: ANN001
    body = {"prompt": ids_for_output(tok, "Hello STOP world and more"), "stop": ["STOP"], "max_tokens": 50}
    r = colo.client.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["text"] == "Hello " and r.json()["choices"][0]["finish_reason"] == "stop"
    with colo.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = sse_events(s)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello "


def test_utf8_stream_deltas_never_split_characters(colo: Service, tok) -> None:  # noqa: ANN001
    want = "emoji 🚀🙂 and 日本語 naïve"
    body = {"prompt": ids_for_output(tok, want), "max_tokens": 100, "stream": True}
    with colo.client.stream("POST", "/v1/completions", json=body) as s:
        events = sse_events(s)
    deltas = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(deltas) == want and not any("\ufffd" in d for d in deltas)


BAD = [
    ("/generate", b"{not json", "malformed"),
    ("/generate", b"[1,2]", "JSON object"),
    ("/generate", {"text": ""}, "empty"),
    ("/generate", {"text": 12}, "string"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10**12}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1] * 5000}, "context length"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, "max_new_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "10"}, "max_new_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "'n'"),
    ("/v1/completions", {"prompt": "a", "n": 10000}, "'n'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": "3"}, "'n'"),
    ("/generate", {"text": "a", "sampling_params": {"n": -1}}, "'n'"),
    ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "logprobs": 9}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "a " * 5000}, "context length"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "boolean"),
    ("/abort_request", {}, "rid"),
]


@pytest.mark.parametrize("path,body,match", BAD)
def test_bad_input_is_4xx_with_message(colo: Service, path: str, body, match: str) -> None:  # noqa: ANN001
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = colo.client.post(path, headers={"content-type": "application/json"}, **kw)
    assert 400 <= r.status_code < 500, r.text
    assert match in r.json()["error"]["message"]
    assert colo.client.get("/health").status_code == 200


def test_openapi_documents_the_generation_endpoints(colo: Service) -> None:
    from tests.unit.test_openapi import check_openapi

    r = colo.client.get("/openapi.json")
    assert r.status_code == 200
    check_openapi(r.json())
    assert colo.client.get("/docs").status_code == 200
    # the one parse stays protocol.py's: its message, not a pydantic validation error
    bad = colo.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "logprobs": True, "top_logprobs": 50})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "'top_logprobs' must be in 0..20, got 50"


def test_unknown_path_and_method_are_json_errors(colo: Service) -> None:
    assert colo.client.get("/nope").json()["error"]["code"] == 404
    assert colo.client.get("/generate").status_code == 405


def test_worker_error_maps_to_status(colo: Service) -> None:
    r = colo.client.post("/generate", json={"text": "[[stub:error]]"})
    assert r.status_code == 500 and "refused" in r.json()["error"]["message"]
    body = {"prompt": "[[stub:error]]", "stream": True}
    with colo.client.stream("POST", "/v1/completions", json=body) as s:
        events = sse_events(s)
    assert events[0]["error"]["code"] == 500 and events[-1] == "[DONE]"


def test_abort_by_rid(colo: Service, tok) -> None:  # noqa: ANN001
    result = {}

    def long_request() -> None:
        body = {"text": "spin", "rid": "abort-me", "sampling_params": LONG}
        result["r"] = colo.client.post("/generate", json=body)

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: running(colo) >= 2, 20, "the request to run")
    dup = colo.client.post("/generate", json={"text": "x", "rid": "abort-me"})
    assert dup.status_code == 400 and "already running" in dup.json()["error"]["message"]
    assert colo.client.post("/abort_request", json={"rid": "abort-me"}).json() == {"success": True}
    t.join(20)
    assert result["r"].status_code == 499
    wait_for(lambda: running(colo) == 0, 10, "the worker to drop the request")


def test_client_disconnect_aborts_stream(colo: Service) -> None:
    body = {"text": "go", "stream": True, "sampling_params": LONG}
    with colo.client.stream("POST", "/generate", json=body) as s:
        lines = s.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data: "))
    # the connection is closed now: the frontend must abort the rid in the worker
    wait_for(lambda: running(colo) == 0, 15, "the abort after disconnect")
    assert 'status="499"' in colo.client.get("/metrics").text


def test_prefill_needs_token_and_bootstrap_fields(pre: Service) -> None:
    bare = httpx.Client(base_url=pre.url, timeout=30)
    assert bare.get("/health").status_code == 200
    assert bare.get("/server_info").status_code == 401
    r = bare.post("/generate", json={"text": "a", **BOOT}, headers={"x-pdserve-token": "no"})
    assert r.status_code == 401 and "x-pdserve-token" in r.json()["error"]["message"]
    bare.close()
    c = pre.client
    for path, base in (("/generate", {"text": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = c.post(path, json=base)
        assert r.status_code == 400 and "bootstrap_host" in r.json()["error"]["message"]
        for patch in ({"bootstrap_port": 0}, {"bootstrap_port": "x"}, {"bootstrap_room": -5},
                      {"bootstrap_room": 2**64}, {"bootstrap_host": ""}):
            r = c.post(path, json={**base, **BOOT, **patch})
            assert r.status_code == 400 and next(iter(patch)) in r.json()["error"]["message"]
    r = c.post("/generate", json={"text": "hello world", "return_logprob": True, "logprob_start_len": 0, **BOOT})
    body = r.json()
    assert r.status_code == 200 and len(body["output_ids"]) == 1
    assert body["meta_info"]["bootstrap_room"] == 12345
    assert len(body["meta_info"]["input_token_logprobs"]) == body["meta_info"]["prompt_tokens"]
    assert c.get("/health").status_code == 200


def test_worker_crash_turns_service_503(pre: Service) -> None:
    r = pre.client.post("/generate", json={"text": "[[stub:crash]]", **BOOT})
    assert r.status_code == 503 and "worker" in r.json()["error"]["message"]
    health = pre.client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "worker dead"
    assert pre.client.post("/generate", json={"text": "a", **BOOT}).status_code == 503


def test_sigterm_drains_in_flight_then_exits_0(colo: Service) -> None:
    body = {"text": "drain me", "stream": True, "sampling_params": {**LONG, "max_new_tokens": 150}}
    with colo.client.stream("POST", "/generate", json=body) as s:
        lines = s.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))
        colo.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: colo.client.get("/health").status_code == 503, 10, "health 503 while draining")
        r = colo.client.post("/generate", json={"text": "late"})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][len("data: "):])
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["completion_tokens"] == 150
    assert colo.proc.wait(30) == 0

