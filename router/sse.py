"""Server-sent events, as far as the router reads them: split a byte stream into events, spot the two
events that matter to the relay without decoding the others, and decode one when it must be read.

Hot path: `SSEReader` splits chunks on blank lines; `is_done` and `may_be_error` look at bytes only
(`[DONE]` is a short event; an error event is a JSON object with an `"error"` key, so its bytes hold
`"error"`). Only an event that may be an error is decoded (`event_json`), so a token event costs a
substring scan. A reader of each event's content (the token ids of mid-stream migration,
router/migration.py) hooks in at `Proxy._relay_leg`, where each raw event passes once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

DONE = "[DONE]"
ERROR_KEY = b'"error"'  # in the bytes of every error event (see may_be_error)


class SSEReader:
    """Splits a byte stream (an async iterator of bytes, or `next_chunk()` returning bytes and None at
    its end) into raw events: the bytes between blank lines, without them; CRLF line ends become LF."""

    def __init__(self, source: AsyncIterator[bytes] | Callable[[], Awaitable[bytes | None]]) -> None:
        if isinstance(source, AsyncIterator):
            it = source

            async def next_chunk() -> bytes | None:
                try:
                    return await it.__anext__()
                except StopAsyncIteration:
                    return None

            source = next_chunk
        self._next_chunk = source
        self._buf = b""
        self._events: deque[bytes] = deque()
        self._eof = False

    def _split(self, chunk: bytes) -> None:
        if not self._buf and chunk.endswith(b"\n\n") and chunk.find(b"\n\n") == len(chunk) - 2:
            if b"\r" not in chunk and chunk[:-2].strip():  # the common case: one whole event
                self._events.append(chunk[:-2])
                return
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        self._events.extend(e for e in events if e.strip())

    async def _fill(self) -> bool:
        """Read until at least one event is queued; False at the end of the stream."""
        while not self._events:
            if self._eof:
                return False
            chunk = await self._next_chunk()
            if chunk is None:
                self._eof = True
                tail, self._buf = self._buf, b""
                if tail.strip():  # a trailing partial event without its blank line
                    self._events.append(tail)
            else:
                self._split(chunk)
        return True

    async def next_event(self) -> bytes | None:
        """The next non-empty raw event, or None at the end of the stream."""
        return self._events.popleft() if await self._fill() else None

    async def next_events(self) -> list[bytes] | None:
        """Every event received so far (waiting for at least one), or None at the end of the stream."""
        if not await self._fill():
            return None
        events = list(self._events)
        self._events.clear()
        return events


def is_done(raw: bytes) -> bool:
    """True for the `data: [DONE]` event."""
    return len(raw) < 24 and raw.startswith(b"data:") and raw[5:].strip() == b"[DONE]"


def may_be_error(raw: bytes) -> bool:
    """False when the event surely is no error object (no `"error"` in its bytes)."""
    return ERROR_KEY in raw


def event_data(raw: bytes) -> bytes | None:
    """The joined `data:` lines of a raw event (None when it has none: a comment or keep-alive)."""
    if raw.startswith(b"data:") and b"\n" not in raw:
        return raw[5:].lstrip(b" ")
    lines = [ln[5:].lstrip(b" ") for ln in raw.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def event_json(raw: bytes) -> Any:
    """The event's data parsed as JSON; DONE for `[DONE]`; None when it has no data or is not JSON."""
    data = event_data(raw)
    if data is None:
        return None
    if data.strip() == b"[DONE]":
        return DONE
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
