"""A small pooled HTTP/1.1 client for the router's hot path (POSTs to workers, JSON or SSE answers).

Why not httpx there: per request it costs several times what the router does itself (measured in
docs/benchmarks.md). This client keeps idle keep-alive connections per worker, writes a request as
one pre-built header block plus the body, and parses answers with httptools (llhttp, C).

Contract:
- `Pool.post(url, path, body, traceparent="")` -> `Response` once the status line and headers arrived; then either
  `await resp.read()` (the whole body) or `await resp.next_chunk()` until it returns None (the body as
  it arrives, for SSE). `resp.close()` hands a finished keep-alive connection back to the pool and
  closes any other; it is idempotent and safe at any point.
- Failures raise `TransportError` subclasses whose names say what happened (`ConnectError`,
  `ConnectTimeout`, `ReadTimeout`, `RemoteProtocolError`); "Timeout" in the name means a timeout.
  `read_timeout_s` bounds each wait for bytes (headers, then every chunk), like httpx's read timeout.
- A reused connection that the server closed before answering a byte is retried once on a new one
  (the server never saw the request, e.g. its keep-alive timer fired as we wrote).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

import httptools


class TransportError(Exception):
    """The request did not get a complete HTTP answer."""


class ConnectError(TransportError):
    pass


class ConnectTimeout(TransportError):
    pass


class ReadTimeout(TransportError):
    pass


class RemoteProtocolError(TransportError):
    pass


_PAUSE_BYTES = 1 << 20  # stop reading a streamed answer while this much is buffered unread


class _Conn(asyncio.Protocol):
    """One connection and the answer in progress on it (one request at a time)."""

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._parser = httptools.HttpResponseParser(self)
        self._timer: asyncio.TimerHandle | None = None  # one lazy read-timeout timer per connection
        self._deadline = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.got_bytes = False
        self.error: TransportError | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future | None = None

    # ---- asyncio.Protocol ----
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(RemoteProtocolError(f"bad HTTP answer: {e}"))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(RemoteProtocolError("server disconnected without a complete answer"))

    # ---- httptools callbacks ----
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        if not self._parser.should_keep_alive():
            self._close()
        self._wake()

    # ---- helpers ----
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: TransportError) -> None:
        if self.error is None:
            self.error = err
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(err)

    def _close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.close()

    async def wait(self, timeout_s: float) -> None:
        """Wait for the next parser event (headers, a chunk, the end, a failure), at most `timeout_s`.

        The timer is armed once and moved lazily: a stream's events only push the deadline forward,
        and the timer, when it fires early, re-arms itself for the deadline."""
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._on_timer, timeout_s)
        self._waiter = w = loop.create_future()
        try:
            await w
        finally:
            self._waiter = None

    def _on_timer(self, timeout_s: float) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return  # no wait in progress: the next wait arms a new timer
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:
            self._timer = loop.call_at(self._deadline, self._on_timer, timeout_s)
            return
        w.set_exception(ReadTimeout(f"no answer within {timeout_s:g}s"))
        self._close()

    def take(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data


class Response:
    """A worker's answer: `status` is known; the body is read with `read` or `next_chunk`."""

    __slots__ = ("status", "_conn", "_pool", "_timeout_s")

    def __init__(self, conn: _Conn, pool: Pool, timeout_s: float) -> None:
        self.status = conn.status
        self._conn: _Conn | None = conn
        self._pool = pool
        self._timeout_s = timeout_s

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    async def next_chunk(self) -> bytes | None:
        """The body bytes received since the last call (waiting for some), or None at its end."""
        conn = self._conn
        if conn is None:
            return None
        while not conn._chunks:
            if conn.complete:
                self.close()
                return None
            await conn.wait(self._timeout_s)
        return conn.take()

    async def read(self) -> bytes:
        conn = self._conn
        if conn is None:
            return b""
        while not conn.complete:
            await conn.wait(self._timeout_s)
        data = conn.take()
        self.close()
        return data

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn)


class Pool:
    """Idle keep-alive connections per (host, port); at most `max_idle` kept per worker."""

    def __init__(
        self,
        headers: dict[str, str] | None,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_idle: int = 256,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self._extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._heads: dict[tuple[str, str], tuple[tuple[str, str, int], bytes]] = {}
        self._ssl: ssl.SSLContext | None = None  # made on the first https worker

    def _head(self, url: str, path: str) -> tuple[tuple[str, str, int], bytes]:
        """(scheme, host, port) and the request head up to Content-Length, built once per worker and path."""
        cached = self._heads.get((url, path))
        if cached is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConnectError(f"worker URL must be http:// or https://, got {url!r}")
            key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                "Accept: */*\r\n"
            ).encode("latin-1")
            cached = self._heads[(url, path)] = (key, head + self._extra + b"Content-Length: ")
        return cached

    async def _connect(self, key: tuple[str, str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        scheme, host, port = key
        tls: dict = {}
        if scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            tls = {"ssl": self._ssl, "server_hostname": host}
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(key), host, port, **tls), self.connect_timeout_s
            )
        except asyncio.TimeoutError as e:
            raise ConnectTimeout(f"connecting to {host}:{port} took over {self.connect_timeout_s:g}s") from e
        except OSError as e:  # ssl.SSLError included
            raise ConnectError(f"cannot connect to {host}:{port}: {e}") from e
        return conn

    def _acquire_idle(self, key: tuple[str, str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    def _release(self, conn: _Conn) -> None:
        if conn.complete and not conn.closed and conn.error is None:
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < self.max_idle:
                conn._reset()
                idle.append(conn)
                return
        conn._close()

    async def post(self, url: str, path: str, body: bytes, traceparent: str = "") -> Response:
        key, head = self._head(url, path)
        if traceparent:
            data = b"%s%d\r\ntraceparent: %s\r\n\r\n%s" % (head, len(body), traceparent.encode(), body)
        else:
            data = b"%s%d\r\n\r\n%s" % (head, len(body), body)
        for _ in range(2):
            conn = self._acquire_idle(key) or await self._connect(key)
            try:
                try:
                    conn.transport.write(data)
                except RuntimeError as e:  # the peer closed it and the loop closed its handle (uvloop)
                    raise RemoteProtocolError(f"connection closed before the request was sent: {e}") from e
                while not conn.headers_done:
                    await conn.wait(self.read_timeout_s)
            except RemoteProtocolError:
                conn._close()
                if conn.reused and not conn.got_bytes:
                    continue  # a stale keep-alive connection: the server never read the request
                raise
            except BaseException:
                conn._close()
                raise
            return Response(conn, self, self.read_timeout_s)
        raise RemoteProtocolError("server closed two connections without answering")

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn._close()
        self._idle.clear()
