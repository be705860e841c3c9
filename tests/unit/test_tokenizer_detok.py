"""Incremental detokenizer, stop trimming and chat templates with the embedded model's real tokenizer."""

from __future__ import annotations

import random

import pytest

from engine.config import EMBEDDED_MODEL
from service.tokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    PromptTooLong,
    TextStream,
    Tokenizer,
    load_tokenizer,
)

TEXTS = [
    "Hello, world! How are you today?",
    "naïve café — déjà vu; 日本語のテキスト、中文字符。",
    "emoji: 🙂🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵 mixed with ascii",
    "  leading spaces\n\n\tand tabs\r\nand newlines  ",
    "<|im_start|>user\nspecial tokens inside<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from engine.models.embedded import resolve_model_path

    return load_tokenizer(resolve_model_path(EMBEDDED_MODEL))


def _stream_all(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    deltas, i = [], 0
    for n in chunk_sizes:
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_equals_full_decode(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=skip)
    rng = random.Random(len(text))
    for sizes in ([1] * len(ids), [rng.randint(1, 4) for _ in range(len(ids))]):
        deltas = _stream_all(IncrementalDetokenizer(tok, skip), ids, sizes)
        assert "".join(deltas) == full
        # no delta before the last carries half a character
        assert not any(REPLACEMENT_CHAR in d for d in deltas[:-1])


def test_multibyte_character_is_held_back_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("🚀")
    assert len(ids) > 1, "the byte-level BPE splits this emoji into several tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🚀"


def test_text_stream_trims_matched_stop_and_never_streams_it(tok: Tokenizer) -> None:
    text = "The answer is 42.\n\nUser: next question"
    ids = tok.encode(text)
    stop = "\n\nUser:"
    end = text.index(stop) + len(stop)
    # the worker stops at the token that completes the stop string
    n = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    assert len(tok.decode(ids[:n])) >= end
    ts = TextStream(tok, [stop, "never"])
    streamed = "".join(ts.push([t]) for t in ids[:n])
    assert stop[0] not in streamed[len("The answer is 42."):]  # nothing of the stop leaked
    streamed += ts.finish(matched_stop=stop)
    assert streamed == ts.text == "The answer is 42."


def test_text_stream_without_stop_releases_everything(tok: Tokenizer) -> None:
    ids = tok.encode(TEXTS[1])
    ts = TextStream(tok)
    out = "".join(ts.push([t]) for t in ids) + ts.finish(matched_stop=None)
    assert out == tok.decode(ids)


def test_stop_token_id_match_leaves_text(tok: Tokenizer) -> None:
    ids = tok.encode("abc def")
    ts = TextStream(tok, ["zzz"])
    out = "".join(ts.push([t]) for t in ids) + ts.finish(matched_stop=ids[-1])
    assert out == "abc def"


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_id == 2 and tok.vocab_size >= 49152


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, text: str) -> None:
    """The Rust fast path (encode_batch, which lets the event loop run) gives transformers' ids."""
    assert tok.encode(text) == list(tok._tok.encode(text, add_special_tokens=False))


def test_bounded_view_refuses_only_texts_that_cannot_fit(tok: Tokenizer) -> None:
    bound = tok.max_token_chars
    assert bound is not None  # byte-level BPE, no normalizer: the safe bound applies
    longest = max(tok._tok.backend_tokenizer.get_vocab(with_added_tokens=True), key=len)
    densest = tok.decode(tok._tok.convert_tokens_to_ids([longest]) * 50, skip_special_tokens=False)
    n = len(tok.encode(densest))  # the most characters per token this vocabulary allows
    assert len(densest) <= n * bound
    assert tok.bounded(n).encode(densest) == tok.encode(densest)  # it fits exactly: never refused early
    with pytest.raises(PromptTooLong, match="at least"):
        tok.bounded(10).encode("x" * (10 * bound + 1))
    with pytest.raises(PromptTooLong):
        tok.bounded(10).apply_chat_template([{"role": "user", "content": "y" * (10 * bound)}])
    assert tok.max_tokens is None  # the view is a copy; the shared tokenizer stays unbounded
