"""`POST /v1/embeddings` (OpenAI's shape) on every service: the final hidden states of each input
(after the final norm, as engine.extras.features), pooled (`--embedding-pooling`: the last token's, or the
mean over the input's tokens), truncated to `dimensions` when asked, then L2-normalised.

1. frontend (`route`): the body is checked (`parse`, 400 naming the field) and its strings
   tokenized (no special tokens added) on the parse thread; an EmbedReq goes to the worker
2. worker (`handle_worker`, between two scheduler steps): each input runs alone over pages taken
   from the free pool (chunks of --chunked-prefill-size), freed at once; nothing is cached
3. the answer: {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
   "usage": {"prompt_tokens", "total_tokens"}}; `encoding_format: "base64"` sends little-endian
   float32 bytes in base64 (OpenAI's client default)

Through the router, the body goes untouched to a worker of the pool `--embeddings-pool` names. The
router's OpenAPI document and the services' show the one model `parse` validates with
(common/api_embeddings.py).
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from common import api_embeddings
from common.api_embeddings import EmbeddingRequest
from common.api_requests import RequestInvalid, validate
from common.checks import is_int
from common.http import error_body
from engine.extras.features import CAPTURE
from engine.forward.forward_batch import LOGITS_NONE, Segment, forward_segments
from engine.kvcache.memory import pages_for
from service.messages import EmbedOut, EmbedReq
from service.protocol import parse_json_body


class EmbedError(ValueError):
    """A body /v1/embeddings refuses (400)."""


@dataclass
class EmbedJob:
    inputs: list[list[int]]
    dimensions: int
    base64: bool


def _inputs(raw: Any, tok: Any, vocab: int, max_tokens: int) -> list[list[int]]:
    """`input` (its shape checked by EmbeddingRequest) -> id lists, each within the vocabulary and context."""
    if isinstance(raw, str) or all(is_int(t) for t in raw):
        raw = [raw]
    out = []
    for i, item in enumerate(raw):
        ids = tok.encode(item) if isinstance(item, str) else item
        if not ids:
            raise EmbedError(f"'input[{i}]' is empty")
        if len(ids) > max_tokens:
            raise EmbedError(f"'input[{i}]' has {len(ids)} tokens; at most {max_tokens} fit this model's context")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise EmbedError(f"'input[{i}]' holds token id {bad[0]} outside the vocabulary [0, {vocab})")
        out.append(list(ids))
    return out


def parse(body: Any, tok: Any, vocab: int, context_length: int, hidden_size: int) -> EmbedJob:
    """The body of a /v1/embeddings request: EmbeddingRequest (the model the OpenAPI document shows)
    first, then the vocabulary, the context and the hidden size (EmbedError naming the field)."""
    try:
        req = validate(EmbeddingRequest, body)
    except RequestInvalid as e:
        raise EmbedError(str(e)) from None
    if req.dimensions is not None and req.dimensions > hidden_size:
        raise EmbedError(f"'dimensions' must be an integer in 1..{hidden_size} (this model's hidden size)")
    return EmbedJob(_inputs(req.input, tok, vocab, context_length - 1), req.dimensions or 0,
                    req.encoding_format == "base64")


# ---- worker ---------------------------------------------------------------------------------------
def pool(hidden: torch.Tensor, pooling: str, dimensions: int) -> list[float]:
    """hidden fp32 [n, H] -> one normalised vector (the last row or the mean; the first `dimensions`)."""
    v = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    if dimensions:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=0).tolist()


def embed_one(runner: Any, kv: Any, ids: list[int], chunk: int) -> torch.Tensor:
    """Final hidden states fp32 [len(ids), H] of one input, over pages freed before returning."""
    pages = kv.allocate(pages_for(len(ids), kv.page_size))
    states = getattr(kv, "states", None)
    slot = -1 if states is None else states.allocate(1)[0]  # a hybrid model's recurrent state
    try:
        rows = []
        for s in range(0, len(ids), chunk):
            out = forward_segments(runner, [Segment(pages, s, ids[s : s + chunk], LOGITS_NONE, 0, (CAPTURE,), slot)])
            rows.append(out.hidden[0])  # type: ignore[index]
        return torch.cat(rows)
    finally:
        kv.pool.allocator.free(pages)
        if states is not None:
            states.free([slot])


def handle_worker(role: Any, msg: EmbedReq, chunk: int) -> EmbedOut:
    """The worker's answer to an EmbedReq (an error answer when the KV pool cannot hold an input now)."""
    kv, data = role.kv, []
    for ids in msg.inputs:
        if pages_for(len(ids), kv.page_size) > kv.free_pages or not kv.slots_free_for_scratch():
            return EmbedOut(msg.token, [], f"an input of {len(ids)} tokens does not fit the free KV pages now; "
                            "retry later", 503)
        data.append(pool(embed_one(role.runner, kv, ids, max(1, chunk)), msg.pooling, msg.dimensions))
    return EmbedOut(msg.token, data)


# ---- frontend -------------------------------------------------------------------------------------
async def round_trip(bridge: Any, msg: EmbedReq, timeout: float = 300.0) -> EmbedOut | None:
    """Send an EmbedReq (its token set here) and wait for the EmbedOut; None when the worker is not
    running or does not answer in time."""
    if not bridge.usable:
        return None
    msg.token = next(bridge.tokens)
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    bridge.stats_waiters[msg.token] = fut
    try:
        await bridge.send(msg)
        return await asyncio.wait_for(fut, timeout)
    except asyncio.TimeoutError:
        return None
    finally:
        bridge.stats_waiters.pop(msg.token, None)


def answer(job: EmbedJob, out: EmbedOut, model: str) -> dict[str, Any]:
    """OpenAI's embeddings response."""
    def encode(v: list[float]) -> Any:
        if not job.base64:
            return v
        return base64.b64encode(torch.tensor(v, dtype=torch.float32).numpy().astype("<f4").tobytes()).decode()

    tokens = sum(len(ids) for ids in job.inputs)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(out.data)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def add_route(app: Any, state: Any) -> None:
    """POST /v1/embeddings on a service's FastAPI app (`state`: service.frontend.FrontendState)."""
    def error(message: str, status: int) -> JSONResponse:
        return JSONResponse(error_body(message, status), status_code=status)

    async def embeddings(request: Request) -> JSONResponse:
        if not state.bridge.usable:
            return error("the worker is not running or still loading the model", 503)
        raw = await request.body()
        lim = state.limits()
        try:
            body = parse_json_body(raw)
            job = await asyncio.get_running_loop().run_in_executor(
                state.parse_pool, parse, body, state.tokenizer, lim.vocab_size, lim.context_length, lim.hidden_size)
        except EmbedError as e:
            return error(str(e), 400)
        out = await round_trip(state.bridge, EmbedReq(0, job.inputs, state.config.embedding_pooling, job.dimensions))
        if out is None:
            return error("the worker did not answer", 503)
        if out.error:
            return error(out.error, out.status or 500)
        return JSONResponse(answer(job, out, lim.model_name))

    app.post("/v1/embeddings", **api_embeddings.route_docs(400, 401, 500, 503))(embeddings)
