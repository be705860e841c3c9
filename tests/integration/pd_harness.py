"""Real prefill/decode/colocated services for integration tests, and the router's part of a PD
request played by the test: the same body, with bootstrap fields, posted to both at once."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import sys
from dataclasses import dataclass

import httpx
from router_harness import Proc, free_port, wait_for

from loadtest.services import ALWAYS_PD  # these tests are about the PD path: every prompt disaggregated

COMMON = ["--device", "cpu", "--threads", "1", "--host-kv-tokens", "16384", "--log-level", "warning"]


def start_service(role: str, *extra: str, env: dict | None = None, module: str = "pdserve") -> tuple[Proc, int | None]:
    """Start `pdserve <role>` (with `env` added to its environment; `module` another entry point taking
    the role first, e.g. tests.integration.slow_worker); returns (process, bootstrap port for a prefill
    else None). A decode gets ALWAYS_PD before `extra` (a later flag wins)."""
    port = free_port()
    pinned = list(ALWAYS_PD) if role == "decode" else []
    args = [sys.executable, "-m", module, role, "--port", str(port), *COMMON, *pinned, *extra]
    boot = None
    if role == "prefill" and "--bootstrap-port" not in extra:
        boot = free_port()
        args += ["--bootstrap-port", str(boot)]
    return Proc(f"{role}-{port}", args, f"http://127.0.0.1:{port}", env=env), boot


@dataclass
class Pair:
    prefill: Proc
    decode: Proc
    boot_port: int

    def fields(self, room: int | None = None) -> dict:
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.boot_port,
                "bootstrap_room": room if room is not None else random.getrandbits(63)}


def read_sse(resp: httpx.Response) -> list[dict]:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def call(url: str, path: str, body: dict, timeout: float = 300.0) -> tuple[int, object]:
    """POST; returns (status, parsed JSON or list of SSE events)."""
    with httpx.Client(timeout=timeout) as c:
        if body.get("stream"):
            with c.stream("POST", url + path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return r.status_code, r.json()
                return 200, read_sse(r)
        r = c.post(url + path, json=body)
        return r.status_code, r.json()


def pd_call(pair: Pair, path: str, body: dict, room: int | None = None,
            timeout: float = 300.0) -> tuple[tuple[int, object], tuple[int, object]]:
    """What a router does: the body plus bootstrap fields to prefill and decode at once."""
    full = {**body, **pair.fields(room)}
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(call, pair.prefill.url, path, full, timeout)
        fd = ex.submit(call, pair.decode.url, path, full, timeout)
        return fp.result(), fd.result()


def text_of(path: str, status_body: tuple[int, object]) -> str:
    """The generated text of a response of any endpoint, streamed or not."""
    status, body = status_body
    assert status == 200, body
    if isinstance(body, list):  # SSE events
        assert not any("error" in e for e in body), body
        if path == "/generate":
            return body[-1]["text"]
        if path == "/v1/completions":
            return "".join(e["choices"][0]["text"] for e in body if e.get("choices"))
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in body if e.get("choices"))
    if path == "/generate":
        return body["text"]
    if path == "/v1/completions":
        return body["choices"][0]["text"]
    return body["choices"][0]["message"]["content"]


def info(proc: Proc) -> dict:
    """The worker's state from /server_info (the first internal state)."""
    r = httpx.get(proc.url + "/server_info", timeout=10)
    r.raise_for_status()
    return r.json()["internal_states"][0]


def wait_idle(proc: Proc, timeout: float = 60.0) -> dict:
    """Wait until the worker holds no KV and no rooms; returns its state."""
    last: dict = {}

    def idle() -> bool:
        nonlocal last
        last = info(proc)
        return last["kv_used_tokens"] == 0 and last.get("active_rooms", 0) == 0 and \
            last.get("host_kv_used_pages", 0) == 0

    try:
        wait_for(idle, timeout, f"{proc.name} to free its KV", interval=0.2)
    except TimeoutError as e:
        raise AssertionError(f"{e}: {last}") from None
    return last
