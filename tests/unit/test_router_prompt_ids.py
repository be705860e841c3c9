"""The router's token ids of text and chat prompts (router/prompt_ids.py, issue 52): equal to the ids the
workers' frontends compute (service/protocol.py on the embedded SmolLM2 tokenizer), the requests it leaves
to the approximate tree, the fallback when no tokenizer loads, the policy routing a text prompt by the KV
index, and the proxy step that adds the ids."""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack
import pytest

from common.kv_hashing import block_hashes, namespace
from engine.models.embedded import resolve_model_path
from router.config import EMBEDDED_TOKENIZER, RouterConfig, WorkerSpec
from router.kv_index import GPU, ExactPrompt, KVIndex
from router.policies import CacheAware
from router.prefix_index import PrefixIndex
from router.prompt_ids import PromptTokenizer, resolve, text_prompt
from router.protocol import parse_request
from router.registry import Worker
from service.protocol import Limits, parse_chat, parse_completion, parse_generate
from service.tokenizer import load_tokenizer

LIM = Limits(role="colocated", context_length=8192, vocab_size=49152, model_name="m")
PARSERS = {"/generate": parse_generate, "/v1/completions": parse_completion, "/v1/chat/completions": parse_chat}
TEXT = "Hello, world! <|im_start|>special tokens in text, unicode: héllo 你好 🙂\n\n  spaces\tand tabs"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "developer", "content": "Answer in French."},
    {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
    {"role": "assistant", "content": None},
    {"role": "assistant", "content": "Bonjour."},
    {"role": "user", "content": TEXT},
]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("embedded"))


@pytest.fixture(scope="module")
def frontend(model_dir: str):  # noqa: ANN201
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def router_tok(model_dir: str) -> PromptTokenizer:
    async def load() -> PromptTokenizer:
        tok = PromptTokenizer(EMBEDDED_TOKENIZER)
        tok.want({})
        await tok._task
        return tok

    tok = asyncio.run(load())
    assert tok.ready and tok.path == model_dir, tok.to_json()
    return tok


BODIES = [
    ("/generate", {"text": TEXT}),
    ("/v1/completions", {"model": "m", "prompt": TEXT}),
    ("/v1/completions", {"model": "m", "prompt": [TEXT[:20]]}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT}),
    ("/v1/chat/completions", {"model": "m", "messages": CHAT[-1:], "tools": [TOOL], "tool_choice": "none"}),
]


@pytest.mark.parametrize("endpoint,body", BODIES, ids=["generate", "completion", "completion-list", "chat",
                                                       "chat-tools-none"])
def test_router_ids_equal_the_frontends(endpoint: str, body: dict, frontend, router_tok: PromptTokenizer) -> None:  # noqa: ANN001
    want = PARSERS[endpoint](body, frontend, LIM).req.input_ids
    prompt = text_prompt(endpoint, body)
    assert prompt is not None
    got = router_tok.ids(prompt)
    assert got == list(want) and len(got) > 5


@pytest.mark.parametrize("endpoint,body", [
    ("/generate", {"input_ids": [1, 2, 3]}),  # token ids: router.protocol's exact, no tokenizer
    ("/generate", {"text": "hi", "image_data": "data:image/png;base64,AA=="}),
    ("/v1/completions", {"prompt": [5, 6]}),
    ("/v1/chat/completions", {"messages": CHAT[-1:], "tools": [TOOL]}),  # the frontend adds the tools
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,x"}}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]}),
])
def test_requests_left_to_the_approximate_tree(endpoint: str, body: dict) -> None:
    assert text_prompt(endpoint, body) is None


def test_exact_in_the_thread_with_namespaces(router_tok: PromptTokenizer, frontend) -> None:  # noqa: ANN001
    long = TEXT * 200  # ~15k characters: over inline_chars, tokenized in the tokenizer thread
    before = router_tok.in_thread
    got = asyncio.run(router_tok.exact("/v1/completions", {"prompt": long}, "salt", "ad"))
    assert got == ExactPrompt(frontend.encode(long), "salt", "ad")
    assert router_tok.in_thread == before + 1
    req = parse_request("/v1/chat/completions", {"model": "ad", "cache_salt": "s", "messages": CHAT})
    got = asyncio.run(router_tok.exact(req.endpoint, req.body, "s", "ad"))
    assert got is not None and got.cache_salt == "s" and got.adapter == "ad"


def test_no_tokenizer_keeps_the_approximate_tree(tmp_path, caplog) -> None:  # noqa: ANN001
    async def go() -> PromptTokenizer:
        tok = PromptTokenizer()
        tok.want({"tokenizer_path": str(tmp_path / "absent")})
        await tok._task
        tok.want({"tokenizer_path": str(tmp_path / "absent")})  # tried once
        assert tok._task.done()
        assert await tok.exact("/generate", {"text": "hello"}, "", "") is None
        return tok

    with caplog.at_level(logging.WARNING, "router.prompt_ids"):
        tok = asyncio.run(go())
    assert tok.state == "failed" and tok.error, tok.to_json()
    lines = [r for r in caplog.records if r.name == "router.prompt_ids"]
    assert len(lines) == 1 and "approximate prefix tree" in lines[0].getMessage()
    # the request goes on untouched: routed by the tree, never failed
    kv = KVIndex()
    kv.worker("http://a:1", "tcp://a:1", 4)
    req = parse_request("/generate", {"text": "hello"})
    assert asyncio.run(tok.with_ids(req, kv)) is req


def _worker(url: str) -> Worker:
    return Worker(spec=WorkerSpec(url, "prefill", bootstrap_port=1), healthy=True)


def test_text_prompt_routed_by_the_index(router_tok: PromptTokenizer) -> None:
    """The chat prompt went to A first (the tree says A); A evicted it and B computed it, under the
    request's salt: the router's ids hash to B's blocks and the policy picks B."""
    a, b = _worker("http://a:1"), _worker("http://b:1")
    kv = KVIndex()
    for w in (a, b):
        kv.worker(w.url, f"tcp://{w.url[7:8]}:1", 4)
    req = parse_request("/v1/chat/completions", {"model": "m", "cache_salt": "s", "messages": CHAT})
    assert asyncio.run(router_tok.with_ids(req, KVIndex())) is req  # no worker publishes events: not tokenized
    assert asyncio.run(router_tok.with_ids(parse_request("/v1/chat/completions", {
        "messages": CHAT, "routing_key": "k"}), kv)).exact is None  # a routing key routes by itself
    req = asyncio.run(router_tok.with_ids(req, kv))
    assert req.exact is not None and req.prompt_tokens == len(req.exact.token_ids)
    h = block_hashes(req.exact.token_ids, 4, namespace("", "s"))
    stored = ["BlockStored", h, None, req.exact.token_ids[:4 * len(h)], 4, None, GPU, None]
    kv.apply_batch(a.url, 0, msgpack.packb([time.time(), [stored, ["BlockRemoved", h, GPU]], 0]))
    kv.apply_batch(b.url, 0, msgpack.packb([time.time(), [stored], 0]))
    ca = CacheAware(PrefixIndex(block_chars=8), kv=kv)
    ca.index.insert(a.url, ca.index.chain(req.prefix))
    assert ca.pick([a, b], req.prefix) is a  # the tree alone
    assert ca.pick([a, b], req.prefix, req.exact) is b


def test_embedded_tokenizer_flag(model_dir: str) -> None:
    assert resolve(EMBEDDED_TOKENIZER) == model_dir  # where the workers convert the embedded model
    assert resolve("/some/dir") == "/some/dir"
    with pytest.raises(ValueError, match="embedded tokenizer is"):
        RouterConfig(tokenizer="embedded:other")
