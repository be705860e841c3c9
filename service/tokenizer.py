"""Tokenizer loading, chat templates and the incremental detokenizer (frontend process only).

`load_tokenizer(model_dir)` wraps a transformers tokenizer (tokenizer.json + tokenizer_config.json,
chat template from tokenizer_config.json or chat_template.jinja) behind the small `Tokenizer` API the
frontend needs: encode, decode, chat prompt -> ids. `bounded(n)` is a view that refuses, before
tokenizing, a text whose characters alone prove it has more than n tokens (PromptTooLong).

`IncrementalDetokenizer` turns a growing list of output ids into text deltas. It decodes a short
window (ids since the last settled point) so each step costs O(window), holds back text that ends
in U+FFFD (an incomplete multi-byte UTF-8 character), and on `finish` reconciles with a decode of
all ids so the concatenated deltas equal `decode(all_ids)`.

`TextStream` adds stop-string handling on top: with stop strings it holds back the last
`len(longest stop) - 1` characters (they may be the start of a stop string) and, when the worker
reports the matched stop, trims the text at its first occurrence (OpenAI: the stop is not returned).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's chat template (-> HTTP 400)."""


class PromptTooLong(ValueError):
    """A text whose characters alone prove it holds more tokens than a bounded view allows (-> 400)."""


def max_token_chars(hf_tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None where no safe bound is known.

    Safe only for byte-level BPE without a normalizer: every character is at least one byte, every
    vocabulary entry's string is one character per byte, and an added token matches its own
    characters (unless it strips whitespace around it: then no bound); so a text of C characters has
    at least C / max_token_chars tokens."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or "ByteLevel" not in repr(backend.pre_tokenizer):
        return None
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None
    return max((len(k) for k in backend.get_vocab(with_added_tokens=True)), default=0) or None


class Tokenizer:
    """The frontend's view of an HF tokenizer."""

    def __init__(self, hf_tokenizer: Any, path: str) -> None:
        self._tok = hf_tokenizer
        self.path = path
        eos = hf_tokenizer.eos_token_id
        self.eos_token_id: int | None = eos
        self.vocab_size: int = len(hf_tokenizer)
        template = getattr(hf_tokenizer, "chat_template", None)
        self.has_chat_template = bool(template)
        # the template renders OpenAI `tools` itself (else service.tools' system prompt does)
        self.template_takes_tools = isinstance(template, str) and "tools" in template
        self.max_token_chars = max_token_chars(hf_tokenizer)
        self._fast = getattr(hf_tokenizer, "backend_tokenizer", None)  # the Rust tokenizer, when there is one
        self.max_tokens: int | None = None  # set on a `bounded` view only

    def bounded(self, max_tokens: int) -> Tokenizer:
        """A view of this tokenizer whose `encode` (and chat prompts) raise PromptTooLong, without
        tokenizing, for a text whose length alone proves it has more than `max_tokens` tokens. It
        never refuses a text that fits; where no safe bound is known it refuses nothing."""
        view = copy.copy(self)
        view.max_tokens = max_tokens
        return view

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, no special tokens added (prompts carry their own if they need them)."""
        bound = self.max_token_chars
        if self.max_tokens is not None and bound and len(text) > self.max_tokens * bound:
            at_least = -(-len(text) // bound)
            raise PromptTooLong(f"the prompt has at least {at_least} tokens ({len(text)} characters, at most "
                                f"{bound} per token); at most {self.max_tokens} prompt tokens fit")
        if self._fast is not None:  # the same ids; encode_batch lets other threads run meanwhile (encode holds
            return self._fast.encode_batch([text], add_special_tokens=False)[0].ids  # the GIL throughout)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        tok = self._tok.convert_ids_to_tokens(int(token_id))
        return tok if isinstance(tok, str) else ""

    def apply_chat_template(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        """Render [{"role", "content": str}, ...] (and `tools`, for a template that takes them) with
        the generation prompt; returns ids."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions or /generate")
        try:
            extra = {"tools": tools} if tools else {}
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        return self.encode(text)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of an HF model directory (slow: imports transformers, ~2-5 s)."""
    from transformers import AutoTokenizer

    path = str(model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        jinja = Path(path) / "chat_template.jinja"
        if jinja.exists():
            tok.chat_template = jinja.read_text()
    return Tokenizer(tok, path)


class IncrementalDetokenizer:
    """Output ids -> text deltas that never split a UTF-8 character.

    Invariant: `prefix_offset <= read_offset <= len(ids)`; the text of `ids[:read_offset]` has
    been emitted; `ids[prefix_offset:read_offset]` is decoded again as left context so that
    tokenizers whose decoding depends on the previous token (leading-space rules) stay right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = ""

    def push(self, new_ids: list[int]) -> str:
        """Add ids; return the newly settled text (maybe "")."""
        self.ids.extend(int(i) for i in new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR) or not full.startswith(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.emitted += delta
        return delta

    def finish(self) -> str:
        """Flush: the rest of decode(all ids) (including a trailing U+FFFD if the ids end mid-char)."""
        final = self.tok.decode(self.ids, self.skip)
        if not final.startswith(self.emitted):
            log.warning("detokenizer window diverged from the full decode; keeping the streamed text")
            return ""
        delta = final[len(self.emitted):]
        self.emitted = final
        self.read_offset = self.prefix_offset = len(self.ids)
        return delta


class TextStream:
    """Detokenizer + stop strings: `push` gives safe deltas, `finish` the last one; `text` is all."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # what has been handed out

    def _release(self, upto_end: bool) -> str:
        pending = self.detok.emitted
        for s in self.stop:  # a stop already in the text (the worker should have finished on it)
            i = pending.find(s)
            if i >= 0:
                pending = pending[:i]
                upto_end = True
        end = len(pending) if upto_end else max(len(self.text), len(pending) - self.hold)
        delta = pending[len(self.text):end]
        self.text += delta
        return delta

    def push(self, new_ids: list[int]) -> str:
        self.detok.push(new_ids)
        return self._release(upto_end=False)

    def finish(self, matched_stop: str | int | None = None) -> str:
        """End of output: flush everything, cut at the matched stop string (not included)."""
        self.detok.finish()
        full = self.detok.emitted
        if isinstance(matched_stop, str) and matched_stop:
            i = full.find(matched_stop)
            if i >= 0:
                full = full[:i]
        for s in self.stop:
            i = full.find(s)
            if i >= 0:
                full = full[:i]
        if not full.startswith(self.text):
            log.warning("stop trimming cut into text already streamed")
            return ""
        delta = full[len(self.text):]
        self.text = full
        return delta
