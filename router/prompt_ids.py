"""Token ids of text and chat prompts, as the workers' frontends compute them, for the KV index
(docs/kv_events.md, "the router's index").

The cache_aware policy scores a worker that publishes KV events by the request's block hashes, and those
need the prompt's token ids exactly as the worker's frontend makes them (service/protocol.py with
service/tokenizer.py; tests/unit/test_router_prompt_ids.py holds the two side by side):

- /generate `text`, /v1/completions with a text prompt: the text encoded without special tokens added;
- /v1/chat/completions: each message as the frontend hands it to the template ({role, content}: text
  parts joined by "\\n", developer as system, an assistant's null content as ""), the model's chat
  template with the generation prompt, that text encoded without special tokens added.

Not replicated (`text_prompt` answers None; the approximate tree routes them, as before): images, tools
(`tools` with a tool_choice other than none), an assistant's earlier `tool_calls`, `input_embeds`, and
token-id prompts (they need no tokenizer: router.protocol's `exact`).

The tokenizer (`PromptTokenizer`): `--tokenizer` (an HF directory, or embedded:smollm2-135m) or else the
`tokenizer_path` that the first worker with KV events reports in /server_info (`model_path` for a worker that
reports none). It is loaded once, in a thread (transformers: seconds), when the first worker with KV events is
admitted: never with `--kv-events off` or without a cache_aware policy. A path that does not load is logged
once (one line) and requests keep the approximate tree. A prompt of more than `inline_chars` characters is
tokenized in a worker thread (the Rust tokenizer releases the GIL), so the event loop goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from router.config import EMBEDDED_TOKENIZER
from router.kv_index import ExactPrompt, KVIndex
from router.protocol import ProxyRequest, cache_keys

log = logging.getLogger("router.prompt_ids")

EMBEDDED_DIR = "smollm2-135m-instruct-v1"  # engine/models/embedded.py's converted directory (a test pins it)
INLINE_CHARS = 4096  # longer prompts go to the tokenizer thread (docs/kv_events.md: the measured costs)
LOAD_ERRORS = (OSError, ValueError, ImportError, KeyError, TypeError, AttributeError, RuntimeError)
Messages = list[dict[str, Any]]


def resolve(spec: str) -> str:
    """`--tokenizer`'s value as a directory: embedded:smollm2-135m is the directory the workers convert the
    embedded model into ($PDSERVE_CACHE, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve; `pdserve model`
    makes it); anything else is taken as a path."""
    if spec in (EMBEDDED_TOKENIZER, "embedded"):
        base = os.environ.get("PDSERVE_CACHE") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")
        return str(Path(base) / EMBEDDED_DIR)
    return spec


def text_prompt(endpoint: str, body: dict) -> str | Messages | None:
    """What the worker's frontend tokenizes for a validated body: the text of a text prompt, the chat messages
    as it renders them with the template, or None (token ids, images, tools, input_embeds: see the module)."""
    if endpoint == "/v1/chat/completions":
        return _chat_messages(body)
    if endpoint == "/generate":
        text = body.get("text")
        bare = not body.get("input_embeds") and not body.get("image_data")
        return text if isinstance(text, str) and text and bare else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) and prompt else None


def _chat_messages(body: dict) -> Messages | None:
    """service.protocol._message_text's rendering of the messages, for those without images or tool calls."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools and choice != "none":
        return None
    out: Messages = []
    for msg in body.get("messages") or ():
        role, content = msg.get("role"), msg.get("content")
        if msg.get("tool_calls"):
            return None
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                return None  # an image part (the frontend adds its placeholder tokens)
            content = "\n".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            return None
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out if any(m["content"] for m in out) else None


class PromptTokenizer:
    """The router's copy of the workers' tokenizer, loaded on demand (`want`), and the ids of a request's text
    or chat prompt (`exact`). `state`: idle (nothing asked yet), loading, ready or failed."""

    def __init__(self, spec: str = "", inline_chars: int = INLINE_CHARS) -> None:
        self.spec = spec
        self.inline_chars = inline_chars
        self.state = "idle"
        self.path = ""
        self.error = ""
        self.tokenized = 0  # prompts tokenized
        self.in_thread = 0  # of which in the tokenizer thread
        self.failed = 0  # chat templates that failed (the frontend answers those with a 400)
        self._tok: Any = None  # transformers' tokenizer
        self._fast: Any = None  # its Rust tokenizer, when it has one
        self._tried: set[str] = set()
        self._task: asyncio.Task | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def want(self, info: dict[str, Any]) -> None:
        """A worker with KV events was admitted (its /server_info): start loading the tokenizer if none is
        loaded or loading, from `--tokenizer` or else the path that worker reports (each path tried once)."""
        if self.state in ("loading", "ready"):
            return
        path = resolve(self.spec) if self.spec else str(info.get("tokenizer_path") or info.get("model_path") or "")
        if not path or path in self._tried:
            return
        self._tried.add(path)
        self.state, self.path = "loading", path
        self._task = asyncio.get_running_loop().create_task(self._load(path), name="router-tokenizer")

    async def _load(self, path: str) -> None:
        try:
            tok = await asyncio.to_thread(_load, path)
        except LOAD_ERRORS as e:
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            how = "" if self.spec else " (reported by a worker's /server_info; give --tokenizer)"
            log.warning("KV events routing: no tokenizer from %s%s: %s; text and chat prompts are routed by the "
                        "approximate prefix tree", path, how, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        self._tok, self._fast = tok, getattr(tok, "backend_tokenizer", None)
        self.state = "ready"
        log.info("KV events routing: tokenizer %s loaded; text and chat prompts are routed by the KV index", path)

    def ids(self, prompt: str | Messages) -> list[int] | None:
        """The frontend's ids of a text prompt or chat messages (None: the chat template refused them)."""
        if isinstance(prompt, list):
            if not getattr(self._tok, "chat_template", None):
                return None
            try:
                prompt = self._tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # a model's template may raise anything on a request's messages (jinja2's
                # TemplateError from its raise_exception, ValueError, TypeError...): the frontend answers a 400,
                # the router keeps the approximate tree for the request (counted: template_failures)
                self.failed += 1
                log.debug("chat template failed in the router: %r", e)
                return None
        if self._fast is not None:  # as service.tokenizer.Tokenizer.encode: no special tokens added
            return self._fast.encode_batch([prompt], add_special_tokens=False)[0].ids
        return list(self._tok.encode(prompt, add_special_tokens=False))

    async def exact(self, endpoint: str, body: dict, salt: str, adapter: str) -> ExactPrompt | None:
        """The request's ExactPrompt from its text or chat prompt, or None (not ready, nothing to tokenize, a
        refused template). A long prompt is tokenized in the tokenizer thread."""
        if self.state != "ready":
            return None
        prompt = text_prompt(endpoint, body)
        if prompt is None:
            return None
        size = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if size > self.inline_chars:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="router-tokenizer")
            self.in_thread += 1
            ids = await asyncio.get_running_loop().run_in_executor(self._pool, self.ids, prompt)
        else:
            ids = self.ids(prompt)
        if not ids:
            return None
        self.tokenized += 1
        return ExactPrompt(ids, salt, adapter)

    async def with_ids(self, req: ProxyRequest, kv: KVIndex | None) -> ProxyRequest:
        """`req` with `exact` set from its text or chat prompt when the KV index can score it (the tokenizer is
        loaded, a worker publishes events, the request has no token ids and no routing_key), its prompt_tokens (the
        load estimate) then the real count; else `req` itself."""
        if self.state != "ready" or req.exact is not None or not (kv and kv.workers):
            return req
        if req.body.get("routing_key") is not None:
            return req
        exact = await self.exact(req.endpoint, req.body, *cache_keys(req.endpoint, req.body))
        return req if exact is None else dataclasses.replace(req, exact=exact, prompt_tokens=len(exact.token_ids))

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "path": self.path, "error": self.error, "tokenized": self.tokenized,
                "in_thread": self.in_thread, "template_failures": self.failed}

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _load(path: str) -> Any:
    """transformers' tokenizer of `path`, with its chat template from chat_template.jinja when tokenizer_config.json
    has none (as service.tokenizer.load_tokenizer does)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        jinja = Path(path) / "chat_template.jinja"
        if jinja.exists():
            tok.chat_template = jinja.read_text()
    return tok
