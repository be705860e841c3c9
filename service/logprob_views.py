"""Logprobs as each API shows them. An `Entry` is one token: (id, logprob or None, top alternatives
as [ids, logprobs] or None); the first prompt token's logprob is None (nothing predicts it).

  chat         choices[].logprobs.content[]: token, logprob, bytes, top_logprobs[] (OpenAI)
  completions  choices[].logprobs: tokens, token_logprobs, top_logprobs ({token: logprob}, the chosen
               token included, as vLLM), text_offset (character offsets into the choice's text)
  /generate    meta_info lists of [logprob, id, null] (SGLang): output_token_logprobs,
               output_top_logprobs, input_token_logprobs, input_top_logprobs
"""

from __future__ import annotations

from typing import Any

Entry = tuple[int, float | None, list | None]


def prompt_entries(ids: list[int], start: int, lps: list[float], tops: list) -> list[Entry]:
    """Entries of prompt positions start.. from the worker's values (those of positions max(start, 1)..)."""
    out: list[Entry] = [(ids[0], None, None)] if start == 0 else []
    first = max(start, 1)
    return out + [(ids[first + j], lp, tops[j] if j < len(tops) else None) for j, lp in enumerate(lps)]


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's character -> byte map (printable bytes stand for themselves, the rest are
    shifted to U+0100..)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_LEVEL = _byte_level_table()


class Pieces:
    """Token id -> its text, decoded once per id (a request repeats tokens), and its bytes."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.cache: dict[int, str] = {}

    def __call__(self, t: int) -> str:
        s = self.cache.get(t)
        if s is None:
            s = self.cache[t] = self.tok.decode([t], skip_special_tokens=False)
        return s

    def bytes(self, t: int) -> list[int]:
        """The token's own bytes: a byte-level BPE token holding part of a UTF-8 character decodes to
        U+FFFD alone, so its bytes come from the token's symbols (OpenAI's `bytes` is for exactly that)."""
        text = self(t)
        if "\ufffd" in text:
            sym = self.tok.id_to_token(t)
            if sym and all(c in BYTE_LEVEL for c in sym):
                return [BYTE_LEVEL[c] for c in sym]
        return list(text.encode())


def chat_content(piece: Pieces, entries: list[Entry]) -> list[dict[str, Any]]:
    def item(t: int, lp: float | None) -> dict[str, Any]:
        return {"token": piece(t), "logprob": lp, "bytes": piece.bytes(t)}

    return [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in zip(*top)] if top else []}
            for t, lp, top in entries]


def completion_logprobs(piece: Pieces, entries: list[Entry], offset: int) -> tuple[dict[str, Any], int]:
    """(the `logprobs` object, the text offset after its last token)."""
    tokens, offsets, tops = [], [], []
    for t, lp, top in entries:
        text = piece(t)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            tops.append(None)
            continue
        alts = {piece(i): v for i, v in zip(*top)} if top else {}
        alts.setdefault(text, lp)
        tops.append(alts)
    body = {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}
    return body, offset


def native_lists(entries: list[Entry], prefix: str, top: bool) -> dict[str, Any]:
    """`{prefix}_token_logprobs` (and `{prefix}_top_logprobs` when top) for /generate's meta_info."""
    out: dict[str, Any] = {f"{prefix}_token_logprobs": [[lp, t, None] for t, lp, _ in entries]}
    if top:
        out[f"{prefix}_top_logprobs"] = [None if alts is None else [[v, i, None] for i, v in zip(*alts)]
                                         for _, _, alts in entries]
    return out
