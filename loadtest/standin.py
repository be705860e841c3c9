"""A tiny deterministic OpenAI SSE server: stands in for a pdserve router in bench tests and harness
dry runs (no model). Token i of every reply is "t{i} "; the first token after `ttft` seconds plus
`prefill_per_token` per prompt word, then one token every `itl` seconds.

    python -m loadtest.standin --host 127.0.0.1 --port 8123 --itl 0.005

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming or not), /health,
/server_info (kv_used_tokens / kv_total_tokens: prompt + output words of requests in flight), /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "standin"


@dataclass(frozen=True)
class StandinConfig:
    ttft_s: float = 0.01
    itl_s: float = 0.002
    prefill_per_token_s: float = 0.0
    kv_total_tokens: int = 1 << 20
    fail_every: int = 0  # every Nth request gets HTTP 500 (0: never)

    def __post_init__(self) -> None:
        if min(self.ttft_s, self.itl_s, self.prefill_per_token_s) < 0 or self.fail_every < 0:
            raise ValueError("stand-in delays and --fail-every must be >= 0")


def _bad(msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, status_code=400)


def make_app(cfg: StandinConfig) -> FastAPI:
    app = FastAPI()
    state = {"requests": 0, "kv_used": 0, "tokens_out": 0}

    def prompt_words(body: dict, chat: bool) -> int | None:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                return None
            return sum(len(str(m.get("content", "")).split()) for m in msgs if isinstance(m, dict))
        prompt = body.get("prompt")
        return len(prompt.split()) if isinstance(prompt, str) else None

    def chunk(i: int, chat: bool, rid: str) -> dict:
        text = f"t{i} "
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return {"id": rid, "object": "chunk", "model": MODEL, "choices": [choice | {"finish_reason": None}]}

    async def generate(request: Request, chat: bool):
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _bad("body is not JSON")
        n_in = prompt_words(body, chat)
        n_out = body.get("max_tokens", 16)
        if n_in is None:
            return _bad("messages or prompt missing")
        if not isinstance(n_out, int) or n_out < 1:
            return _bad("max_tokens must be a positive integer")
        state["requests"] += 1
        rid = f"req-{state['requests']}"
        if cfg.fail_every and state["requests"] % cfg.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        state["kv_used"] += n_in + n_out
        start = time.monotonic()

        async def tokens():
            try:
                await asyncio.sleep(cfg.ttft_s + cfg.prefill_per_token_s * n_in)
                for i in range(n_out):
                    if i:  # pace against the start so the event loop's lateness does not accumulate
                        await asyncio.sleep(max(0.0, start + cfg.ttft_s + i * cfg.itl_s - time.monotonic()))
                    state["tokens_out"] += 1
                    yield i
            finally:
                state["kv_used"] -= n_in + n_out

        if not body.get("stream"):
            text = "".join([f"t{i} " async for i in tokens()])
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
                {"index": 0, "text": text}
            return {"id": rid, "model": MODEL, "choices": [choice | {"finish_reason": "length"}],
                    "usage": {"prompt_tokens": n_in, "completion_tokens": n_out}}

        async def sse():
            if chat:
                first = {"id": rid, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                yield f"data: {json.dumps(first)}\n\n"
            async for i in tokens():
                yield f"data: {json.dumps(chunk(i, chat, rid))}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
                yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/server_info")
    async def server_info():
        return {"kv_used_tokens": state["kv_used"], "kv_total_tokens": cfg.kv_total_tokens}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE pdserve_standin_requests_total counter\n"
            f"pdserve_standin_requests_total {state['requests']}\n"
            f"pdserve_standin_output_tokens_total {state['tokens_out']}\n")

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.standin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8123, help="HTTP port")
    p.add_argument("--ttft", type=float, default=0.01, help="seconds before the first token")
    p.add_argument("--itl", type=float, default=0.002, help="seconds between tokens")
    p.add_argument("--prefill-per-token", type=float, default=0.0, help="extra TTFT seconds per prompt word")
    p.add_argument("--fail-every", type=int, default=0, help="every Nth request fails with HTTP 500")
    args = p.parse_args(argv)

    try:
        cfg = StandinConfig(args.ttft, args.itl, args.prefill_per_token, fail_every=args.fail_every)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    uvicorn.run(make_app(cfg), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
