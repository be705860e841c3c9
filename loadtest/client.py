"""One streaming OpenAI request -> RequestResult, with the arrival time of every content chunk.

Bodies ask for an exact output length: `max_tokens` plus `"ignore_eos": true` (an extra field the
pdserve services accept), and `stream_options.include_usage` so the last chunk carries the server's
token counts. A chunk counts as a token arrival when it carries non-empty text (`choices[0].text`
for completions, `choices[0].delta.content` for chat); the role-only first chat chunk does not.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from loadtest.metrics import RequestResult
from loadtest.workload import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    timeout_s: float = 300.0
    ignore_eos: bool = True
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.base_url!r}")
        if self.timeout_s <= 0:
            raise ValueError("--timeout must be > 0")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_body(cfg: ClientConfig, spec: RequestSpec) -> dict:
    body: dict = {
        "model": cfg.model,
        "max_tokens": spec.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = list(spec.messages) if spec.messages else [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def chunk_text(chunk: dict, endpoint: str) -> str | None:
    """The text a streamed chunk carries, None when it has no choice (e.g. the usage-only chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if endpoint == "chat":
        return (c.get("delta") or {}).get("content")
    return c.get("text")


async def send(client: httpx.AsyncClient, cfg: ClientConfig, spec: RequestSpec, index: int,
               t0: float) -> RequestResult:
    """POST one streaming request; never raises for HTTP or protocol failures (-> result.error)."""
    res = RequestResult(index=index, prompt_len=spec.prompt_len, output_len=spec.output_len,
                        start=time.monotonic() - t0, tag=spec.tag)
    chunks = 0
    try:
        async with client.stream("POST", cfg.url, json=build_body(cfg, spec), headers=cfg.headers(),
                                 timeout=cfg.timeout_s) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {resp.status_code}: {body}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return res
                text = chunk_text(chunk, cfg.endpoint)
                if text:
                    res.chunk_times.append(time.monotonic() - t0)
                    res.text += text
                    chunks += 1
                usage = chunk.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.server_prompt_tokens = usage.get("prompt_tokens")
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if not res.output_tokens:
            res.output_tokens = chunks
        if not res.chunk_times:
            res.error = "stream ended without any token"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        res.end = time.monotonic() - t0
    return res


async def fetch_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model id from GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s) as c:
        r = await c.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        r.raise_for_status()
        data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
