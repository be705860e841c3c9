"""Server-sent events, as far as the router reads them: split a byte stream into events and pull out
an event's `data:` payload (decoded as JSON when it is not `[DONE]`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

DONE = "[DONE]"


class SSEReader:
    """Splits a byte stream into raw events (the bytes between blank lines, without them)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._eof = False

    async def next_event(self) -> bytes | None:
        """The next non-empty raw event, or None at the end of the stream (a trailing partial event
        without its blank line is still returned)."""
        while True:
            self._buf = self._buf.replace(b"\r\n", b"\n")
            head, sep, tail = self._buf.partition(b"\n\n")
            if sep:
                self._buf = tail
                if head.strip():
                    return head
                continue
            if self._eof:
                head, self._buf = self._buf, b""
                return head if head.strip() else None
            try:
                self._buf += await self._chunks.__anext__()
            except StopAsyncIteration:
                self._eof = True


def event_data(raw: bytes) -> str | None:
    """The joined `data:` lines of a raw event (None when it has none: a comment or keep-alive)."""
    lines = [ln[5:].lstrip(b" ") for ln in raw.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", "replace") if lines else None


def event_json(raw: bytes) -> Any:
    """The event's data parsed as JSON; DONE for `[DONE]`; None when it has no data or is not JSON."""
    data = event_data(raw)
    if data is None:
        return None
    if data.strip() == DONE:
        return DONE
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return None
