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


class Pieces:
    """Token id -> its text, decoded once per id (a request repeats tokens)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.cache: dict[int, str] = {}

    def __call__(self, t: int) -> str:
        s = self.cache.get(t)
        if s is None:
            s = self.cache[t] = self.tok.decode([t], skip_special_tokens=False)
        return s


def chat_content(piece: Pieces, entries: list[Entry]) -> list[dict[str, Any]]:
    def item(t: int, lp: float | None) -> dict[str, Any]:
        text = piece(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

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
