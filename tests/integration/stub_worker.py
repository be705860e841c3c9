"""A stand-in prefill/decode/encoder/colocated worker speaking the services' HTTP API, for router tests.

Run: `python tests/integration/stub_worker.py --role prefill --port N [--host 127.0.0.1] [--token T]`.

Output is deterministic: `max_tokens` words derived from a hash of the prompt, so a PD pair and a
colocated stub give the same text. PD coupling is real enough to test room handling: a prefill marks
its room done (GET /_room/{room}); a decode polls the prefill named by `bootstrap_host:bootstrap_port`
(the stub's bootstrap port is its HTTP port) until the room is done, aborted, or `--waiting-timeout`.
An encoder (E/P/D) answers 200 JSON at once and marks its room done; a prefill whose body names
`encoder_bootstrap_host`/`encoder_bootstrap_port` first waits for that encoder's room the same way (else it
answers a 500 whose error blames the encoder, `fault: encoder`).

Test controls: POST /_control {"mode": ok|fail|fail503|reject|busy|hang|die|die_midstream|unhealthy[,
"retry_after": N]}, GET /_state (rooms seen, rooms aborted, the last 200 request bodies). `die` exits the
process on the next request, `die_midstream` after 2 streamed tokens (a stream resumed past them,
`pd_resume`, goes on); `hang` waits until the room is aborted; `fail` answers 500, `fail503` a plain 503,
`reject` a 400; `busy` refuses as an overloaded service does (a 503 whose error names `retry_after`, N
seconds, default 2; a stream gets it as its first event, HTTP status 200).
A request with max_tokens > 1000 gets a 400 (a client error the router must relay).
With `pd_token_ids` each stream event ends with its word's id; `pd_resume` continues after its ids.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import sys
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


class Stub:
    def __init__(
        self,
        role: str,
        port: int,
        token: str | None,
        token_delay: float,
        waiting_timeout: float,
        prefill_delay: float = 0.0,
    ):
        self.role, self.port, self.token, self.prefill_delay = role, port, token, prefill_delay
        self.token_delay, self.waiting_timeout = token_delay, waiting_timeout
        self.mode = "ok"
        self.retry_after = 2  # seconds a `busy` refusal names
        self.rooms: list[int] = []
        self.done_rooms: set[int] = set()
        self.aborted: list[int] = []
        self.bodies: collections.deque[dict] = collections.deque(maxlen=200)  # the last request bodies
        self.abort_events: dict[int, asyncio.Event] = {}
        self.http = httpx.AsyncClient(timeout=5.0)

    def abort_event(self, room: int) -> asyncio.Event:
        return self.abort_events.setdefault(room, asyncio.Event())


def _err(status: int, message: str, retry_after: int = 0, fault: str = "") -> JSONResponse:
    return JSONResponse(_err_obj(status, message, retry_after, fault), status_code=status)


def _err_obj(status: int, message: str, retry_after: int = 0, fault: str = "") -> dict:
    err = {"message": message, "type": "stub", "code": status}
    if fault:
        err["fault"] = fault
    return {"error": {**err, "retry_after": retry_after} if retry_after else err}


def _busy(st: Stub, stream: bool):
    """An overload refusal as service/frontend.py answers it: a 503 naming retry_after, or for a stream
    (whose status is 200 by then) an error event first."""
    message = f"{st.role} stub is busy: queue full"
    if not stream:
        return _err(503, message, st.retry_after)

    async def events():
        yield f"data: {json.dumps(_err_obj(503, message, st.retry_after))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _prompt_and_max(path: str, body: dict) -> tuple[str, int]:
    if path == "/generate":
        prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
        return json.dumps(prompt), int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
    prompt = body.get("messages") if path.endswith("chat/completions") else body.get("prompt")
    return json.dumps(prompt), int(body.get("max_tokens") or 16)


def word_ids(prompt: str, n: int) -> list[int]:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big")
    return [(h + 7 * i) % 997 for i in range(n)]


def words(prompt: str, n: int) -> list[str]:
    return [f"w{i}" for i in word_ids(prompt, n)]


def _chunk(path: str, piece: str, text_so_far: str, finish: str | None, n_prompt: int) -> dict:
    base = {"id": "stub-1", "created": int(time.time()), "model": "stub-model"}
    if path == "/generate":
        meta = {"id": "stub-1", "prompt_tokens": n_prompt, "finish_reason": finish and {"type": finish}}
        return {"text": text_so_far, "meta_info": meta}
    if path.endswith("chat/completions"):
        choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
        return {**base, "object": "chat.completion.chunk", "choices": [choice]}
    return {
        **base,
        "object": "text_completion",
        "choices": [{"index": 0, "text": piece, "finish_reason": finish}],
    }


def _full(path: str, text: str, n_prompt: int, n_out: int, input_lp: list | None) -> dict:
    base = {"id": "stub-1", "created": int(time.time()), "model": "stub-model"}
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if path == "/generate":
        meta = {
            "id": "stub-1",
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "finish_reason": {"type": "length"},
        }
        if input_lp is not None:
            meta["input_token_logprobs"] = input_lp
        return {"text": text, "meta_info": meta}
    if path.endswith("chat/completions"):
        msg = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": msg, "finish_reason": "length"}
        return {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
    choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    return {**base, "object": "text_completion", "choices": [choice], "usage": usage}


async def _wait_for_prefill(st: Stub, body: dict, room: int, prefix: str = "") -> str | None:
    """Decode side (prefill side with `prefix` "encoder_": its encoder): poll the peer's /_room until done; an
    error message otherwise."""
    url = f"http://{body[prefix + 'bootstrap_host']}:{body[prefix + 'bootstrap_port']}/_room/{room}"
    deadline = time.monotonic() + st.waiting_timeout
    ev = st.abort_event(room)
    while time.monotonic() < deadline:
        if ev.is_set():
            return "aborted"
        try:
            r = await st.http.get(url)
            if r.json().get("state") == "done":
                return None
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.01)
    return "KV transfer timed out"


def build_app(st: Stub) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if (
            st.token
            and not request.url.path.startswith("/_")
            and request.headers.get("x-pdserve-token") != st.token
        ):
            return _err(401, "bad internal token")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return _err(503, "unhealthy") if st.mode == "unhealthy" else JSONResponse({"status": "ok"})

    @app.get("/server_info")
    async def server_info():
        info = {
            "role": st.role,
            "model": "stub",
            "served_model_name": "stub-model",
            "page_size": 16,
            "max_total_tokens": 8192,
        }
        if st.role in ("prefill", "encoder"):
            info["bootstrap_port"] = st.port
        return info

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": "stub"}]}

    @app.post("/_control")
    async def control(request: Request):
        body = await request.json()
        st.mode, st.retry_after = body["mode"], int(body.get("retry_after", 2))
        return {"mode": st.mode}

    @app.get("/_state")
    async def state():
        return {"rooms": st.rooms, "aborted": st.aborted, "mode": st.mode, "pid": os.getpid(),
                "bodies": list(st.bodies)}

    @app.get("/_room/{room}")
    async def room_state(room: int):
        return {"state": "done" if room in st.done_rooms else "pending"}

    @app.post("/abort_request")
    async def abort(request: Request):
        room = (await request.json()).get("bootstrap_room")
        st.aborted.append(room)
        st.abort_event(room).set()
        return {"aborted": room}

    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, _handler(st, path), methods=["POST"])
    return app


def _handler(st: Stub, path: str):
    async def handle(request: Request):
        body = await request.json()
        st.bodies.append(body)
        prompt, n_out = _prompt_and_max(path, body)
        if n_out > 1000:
            return _err(400, "max_tokens too large for this stub")
        room = body.get("bootstrap_room")
        if st.role != "colocated":
            if not isinstance(room, int):
                return _err(400, "bootstrap_room missing")
            st.rooms.append(room)
        if st.mode == "die":
            os._exit(1)
        if st.mode == "fail":
            return _err(500, "stub told to fail")
        if st.mode == "fail503":
            return _err(503, "stub told to fail with 503")
        if st.mode == "reject":
            return _err(400, f"{st.role} stub told to reject the request")
        if st.mode == "busy":
            return _busy(st, bool(body.get("stream")))
        if st.mode == "hang":
            await st.abort_event(room).wait()
            return _err(500, "aborted")
        n_prompt = len(prompt) // 4
        input_lp = [[-0.5, i, None] for i in range(3)] if body.get("return_logprob") else None
        if st.role == "encoder":  # the embeddings were "sent": the prefill waiting on this room goes on
            st.done_rooms.add(room)
            return JSONResponse({"bootstrap_room": room, "images_sent": True})
        if st.role == "prefill" and body.get("encoder_bootstrap_host"):
            problem = await _wait_for_prefill(st, body, room, "encoder_")
            if problem:
                return _err(500, f"image embeddings never came: {problem}", fault="encoder")
        if st.role == "prefill":
            await asyncio.sleep(st.prefill_delay)
            st.done_rooms.add(room)
            return JSONResponse(_full(path, "", n_prompt, 0, input_lp))
        if st.role == "decode":
            problem = await _wait_for_prefill(st, body, room)
            if problem:
                return _err(500, problem)
        toks = words(prompt, n_out)
        if not body.get("stream"):
            await asyncio.sleep(st.token_delay * n_out)
            return JSONResponse(_full(path, " ".join(toks), n_prompt, n_out, [] if input_lp else None))
        resume = body.get("pd_resume") or {}  # migration: continue after these ids, with this stream id
        ids = word_ids(prompt, n_out) if body.get("pd_token_ids") else None
        return StreamingResponse(_stream(st, path, toks, n_prompt, ids, resume), media_type="text/event-stream")

    return handle


async def _stream(st: Stub, path: str, toks: list[str], n_prompt: int, ids: list[int] | None, resume: dict):
    text = ""
    for i in range(len(resume.get("output_ids", [])), len(toks)):
        if st.mode == "die_midstream" and i == 2 and not resume:
            os._exit(1)
        piece = toks[i] if i == 0 else " " + toks[i]
        text += piece
        finish = "length" if i == len(toks) - 1 else None
        chunk = _chunk(path, piece, text, finish, n_prompt)
        if resume.get("id"):
            chunk["id"] = resume["id"]
        if ids is not None:
            chunk["pd_token_ids"] = [ids[i]]  # last, as the services put it
        yield f"data: {json.dumps(chunk)}\n\n"
        await asyncio.sleep(st.token_delay)
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    """Flags of its own, or the pdserve worker command line (`prefill|decode|colocated --port N
    --internal-token-file F ...`, other flags ignored) so `pdserve up --worker-cmd` can run it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("prefill", "decode", "encoder", "colocated"):
        argv = ["--role", *argv]
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--role", choices=("prefill", "decode", "encoder", "colocated"), required=True, help="worker role")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, required=True, help="HTTP port (also the prefill's bootstrap port)")
    p.add_argument("--token", default=None, help="required x-pdserve-token")
    p.add_argument("--internal-token-file", default=None, help="file holding the required x-pdserve-token")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token")
    p.add_argument("--waiting-timeout", type=float, default=10.0, help="decode: seconds to wait for prefill")
    p.add_argument("--prefill-delay", type=float, default=0.0, help="prefill: seconds before a room is done")
    p.add_argument(
        "--bootstrap-port", type=int, default=0, help="prefill/encoder: also serve on this port (default: --port)"
    )
    a, _unknown = p.parse_known_args(argv)
    token = a.token or (open(a.internal_token_file).read().strip() if a.internal_token_file else None)
    bootstrap = a.bootstrap_port if a.role in ("prefill", "encoder") and a.bootstrap_port else a.port
    st = Stub(a.role, bootstrap, token, a.token_delay, a.waiting_timeout, a.prefill_delay)
    app = build_app(st)
    ports = sorted({a.port, bootstrap})
    servers = [uvicorn.Server(uvicorn.Config(app, host=a.host, port=p, log_level="warning")) for p in ports]
    asyncio.run(_serve(servers))


async def _serve(servers: list) -> None:
    """Serve on every port; when one server stops (a signal reaches only one), stop them all."""
    tasks = [asyncio.ensure_future(s.serve()) for s in servers]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    main()
