"""Reasoning output (`--reasoning-parser`): a chat reply's thinking, between `<think>` and `</think>`,
goes to `message.reasoning_content` (streamed as `delta.reasoning_content`), the rest to `content`,
as vLLM's and SGLang's parsers do.

Styles:
  qwen3        the reply is reasoning only when it opens with `<think>` (whitespace before it
               allowed); otherwise all of it is content
  deepseek-r1  the reply starts inside reasoning (its template opened the tag in the prompt): an
               opening `<think>` is dropped if the model writes one; everything before `</think>` is
               reasoning, all of it when the tag never comes

`ReasoningSplitter` is incremental: text arrives in arbitrary pieces (a tag may be split across
them); it holds back only a tail that may still become a tag, so the concatenated outputs equal
`split(whole text)`. After `</think>` everything is content (a later tag is plain text).
"""

from __future__ import annotations

STYLES = ("qwen3", "deepseek-r1")
OPEN, CLOSE = "<think>", "</think>"


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may complete later)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One reply's text -> (reasoning, content) pieces, as they can be told apart."""

    def __init__(self, style: str) -> None:
        if style not in STYLES:
            raise ValueError(f"unknown reasoning parser {style!r}; one of {STYLES}")
        self.style = style
        self.opened = False  # the start was decided (an open tag taken, or none can come)
        self.inside = style == "deepseek-r1"
        self.buf = ""

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        """Add text; returns (reasoning, content) that are settled. `final`: nothing more comes, so
        a held tail is released as what it is."""
        self.buf += text
        reasoning = content = ""
        if not self.opened:
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.buf, self.opened, self.inside = head[len(OPEN):], True, True
            elif OPEN.startswith(head) and not final:
                return "", ""  # may still be the open tag (or only whitespace so far)
            else:
                self.opened = True
        if self.inside:
            end = self.buf.find(CLOSE)
            if end < 0:
                keep = 0 if final else _partial_tail(self.buf, CLOSE)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf, self.inside = self.buf[:end], self.buf[end + len(CLOSE):], False
        content, self.buf = self.buf, ""
        return reasoning, content


def split(text: str, style: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    return ReasoningSplitter(style).push(text, final=True)
