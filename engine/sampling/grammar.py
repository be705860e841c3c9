"""Structured output with xgrammar: grammar specs, a bounded cache of compiled grammars, and the
per-request matcher the sampler masks logits with.

A request asks for a grammar with one of SamplingParams' `json_schema`, `regex` or `ebnf` (SGLang's
sampling params; OpenAI's response_format and tool calls are turned into a JSON schema by the
frontend). `GrammarSpec.of(sp)` names it; `Grammars.compile(spec)` compiles it once per spec (LRU,
`capacity` entries) and raises `GrammarError` with xgrammar's message for a bad one. The frontend
compiles at parse time (a bad grammar is a 400 before any KV is allocated); the worker compiles
again from its own cache on the request's first sample.

Matcher lifecycle (`Grammars.matcher`): built lazily when a request is first sampled, after
accepting every token the request already generated (`engine.sampling.sampler.generated`): the first token
a prefill sampled (PD decode) and a migrated stream's `resumed_tokens`. The sampler then masks the
row (`mask_rows`) and accepts each token it picks (`accept`). A matcher that accepted its grammar's
end (EOS after a complete value) is terminated: the StopChecker finishes the request ("stop").

JSON is compiled without free whitespace (compact separators), so a small model cannot pad an
answer with blank lines until max_tokens.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

log = logging.getLogger("pdserve.grammar")
KINDS = ("json_schema", "regex", "ebnf")
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(error\.empty\(\)\) is false:\s*)?")


def _xgr() -> Any:
    """xgrammar, imported on first use: its import takes over a second and brings transformers, which a
    process whose requests carry no grammar never needs (`Grammars.warm` pays it on a background thread)."""
    import xgrammar

    return xgrammar


class Matcher(Protocol):
    """What the engine calls on a request's grammar matcher (xgrammar's GrammarMatcher)."""

    def is_terminated(self) -> bool: ...  # it accepted its grammar's end
    def accept_token(self, token_id: int) -> bool: ...  # False: the grammar forbids the token
    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any: ...  # row `index`: allowed tokens


class GrammarError(ValueError):
    """A grammar that does not compile; the message is xgrammar's, without its source location."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # json_schema | regex | ebnf
    text: str

    @classmethod
    def of(cls, sp: Any) -> GrammarSpec | None:
        """The grammar a SamplingParams asks for, or None."""
        for kind in KINDS:
            text = getattr(sp, kind, None)
            if text is not None:
                return cls(kind, text)
        return None


def clean_error(e: BaseException) -> str:
    """xgrammar's message, first line, without its source location or an echo of the input."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = _XGR_PREFIX.sub("", text).splitlines()[0].split(" The JSON string is:")[0].strip()
    return line[:500]


class Grammars:
    """Compiles grammars for one model's tokenizer and vocabulary, caching the compiled ones.

    `model_path`: the HF model directory (its tokenizer); `vocab_size` is the model's (the logits'
    width; the tokenizer's may be shorter); `stop_ids`: the model's EOS ids, the grammar's end
    tokens. The tokenizer info (seconds: transformers, the vocabulary scan) is built once per
    process, on a background thread started by `warm()` or on the first compile, so a worker never
    stalls its loop on it unless a grammar request arrives in its first seconds."""

    def __init__(self, model_path: str, vocab_size: int, stop_ids: Sequence[int], capacity: int = 256) -> None:
        self.key = (str(model_path), vocab_size, tuple(stop_ids))
        self.capacity = capacity
        self._compiler: Any = None
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()  # the frontend compiles from a thread pool
        self._warming: threading.Thread | None = None
        self.compiles = 0

    def warm(self) -> None:
        """Start building the tokenizer info in the background (idempotent; a model directory without
        a tokenizer, like the tests' tiny models, is left alone: its requests carry no grammar)."""
        if self._warming is None and (Path(self.key[0]) / "tokenizer_config.json").exists():
            self._warming = threading.Thread(target=_warm, args=self.key, daemon=True, name="grammar-warm")
            self._warming.start()

    def _xgr_compiler(self) -> Any:
        if self._compiler is None:
            self._compiler = _xgr().GrammarCompiler(tokenizer_info(*self.key), max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (cached); GrammarError naming the problem if it is bad."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            c = self._xgr_compiler()
            try:
                if spec.kind == "json_schema":
                    g = c.compile_json_schema(spec.text, any_whitespace=False)
                elif spec.kind == "regex":
                    g = c.compile_regex(spec.text)
                elif spec.kind == "ebnf":
                    g = c.compile_grammar(spec.text)
                else:
                    raise GrammarError(f"unknown grammar kind {spec.kind!r}")
            except RuntimeError as e:
                raise GrammarError(f"invalid {spec.kind}: {clean_error(e)}") from e
            self.compiles += 1
            self._cache[spec] = g
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return g

    def matcher(self, spec: GrammarSpec, accepted: Sequence[int]) -> Matcher:
        """A fresh matcher for `spec` that has accepted `accepted` (tokens generated before)."""
        m = _xgr().GrammarMatcher(self.compile(spec))
        for t in accepted:
            if m.is_terminated() or not m.accept_token(int(t)):
                break
        return m


@functools.lru_cache(maxsize=4)
def tokenizer_info(model_path: str, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """xgrammar's view of the model's tokenizer, built once per process (and key)."""
    return _xgr().TokenizerInfo.from_huggingface(load_hf_tokenizer(model_path), vocab_size=vocab_size,
                                              stop_token_ids=list(stop_ids) or None)


def _warm(model_path: str, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
    """Build the tokenizer info ahead of use; a failure is logged here and raised again by the first
    compile (lru_cache keeps no exception), where it fails that request."""
    try:
        tokenizer_info(model_path, vocab_size, stop_ids)
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        log.warning("grammar tokenizer info for %s not built ahead: %s", model_path, e)


@functools.lru_cache(maxsize=4)
def load_hf_tokenizer(model_path: str) -> Any:
    """The model directory's HF tokenizer, loaded once per process (the roles of a test share it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def mask_rows(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
    """Set to -inf, in place, every token the row's matcher forbids. logits: fp32 [n, V] (CPU), one
    matcher per row (None: no grammar). A terminated matcher's row is left alone (the request ends on that token)."""
    xgr = _xgr()
    live = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not live:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # int32 [n, ceil(V/32)]
    for i in live:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=live)


def accept(matcher: Matcher, token: int) -> None:
    """Advance the matcher past a sampled token (a token the mask allowed always is accepted)."""
    if not matcher.is_terminated():
        matcher.accept_token(int(token))
