"""The router's hot-path HTTP client (router.http1) against a tiny asyncio server: keep-alive reuse,
chunked streaming, a stale pooled connection, read timeouts; and the byte-level SSE checks."""

from __future__ import annotations

import asyncio

import pytest

from router.http1 import ConnectError, Pool, ReadTimeout
from router.sse import SSEReader, event_json, is_done, may_be_error


async def _server(handler):
    """Start a server calling `handler(reader, writer)` per connection; returns (server, base url)."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


async def test_keep_alive_connection_is_reused_and_body_arrives_whole():
    connections, seen = [], []

    async def handler(reader, writer):
        connections.append(writer)
        while True:
            try:
                req = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            seen.append(req)
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{"a": 1}\n')

    server, url = await _server(handler)
    pool = Pool({"x-pdserve-token": "t"}, 1.0, 1.0)
    try:
        for _ in range(3):
            resp = await pool.post(url, "/generate", b'{"text":"hi"}')
            assert (resp.status, await resp.read()) == (200, b'{"a": 1}\n')
        assert len(connections) == 1  # one keep-alive connection for all three
        assert b"POST /generate HTTP/1.1" in seen[0] and b"x-pdserve-token: t" in seen[0]
        assert seen[0].endswith(b'{"text":"hi"}')
    finally:
        pool.close()
        server.close()


async def test_chunked_stream_comes_chunk_by_chunk_and_stale_connection_is_retried():
    calls = []

    async def handler(reader, writer):
        calls.append(1)
        await _read_request(reader)
        if len(calls) == 1:  # answer, then close the keep-alive connection behind the client's back
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for ev in (b'data: {"i":1}\n\n', b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")

    server, url = await _server(handler)
    pool = Pool(None, 1.0, 1.0)
    try:
        assert await (await pool.post(url, "/generate", b"{}")).read() == b"{}"
        while not all(c.closed for idle in pool._idle.values() for c in idle):  # the server closed it
            await asyncio.sleep(0.01)
        resp = await pool.post(url, "/generate", b"{}")
        reader = SSEReader(resp.next_chunk)
        assert [await reader.next_event(), await reader.next_event(), await reader.next_event()] == [
            b'data: {"i":1}',
            b"data: [DONE]",
            None,
        ]
    finally:
        pool.close()
        server.close()


class _ClosedHandle:
    """A transport as uvloop leaves it when the peer closed it before the protocol heard: not yet marked
    closing, and writing to it raises RuntimeError."""

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    def close(self) -> None:
        self.real.close()


async def test_a_pooled_connection_closed_under_it_is_replaced_not_raised():
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    server, url = await _server(handler)
    pool = Pool(None, 1.0, 1.0)
    try:
        assert await (await pool.post(url, "/generate", b"{}")).read() == b"{}"
        (conn,) = [c for idle in pool._idle.values() for c in idle]
        conn.transport.close()  # closing, its protocol not yet told: skipped, a new connection is made
        assert await (await pool.post(url, "/generate", b"{}")).read() == b"{}"
        (conn,) = [c for idle in pool._idle.values() for c in idle]
        conn.transport = _ClosedHandle(conn.transport)  # writing raises: retried on a new connection
        assert await (await pool.post(url, "/generate", b"{}")).read() == b"{}"
        assert len(connections) == 3
    finally:
        pool.close()
        server.close()


async def test_read_timeout_and_connect_error_are_named():
    async def handler(reader, writer):
        await _read_request(reader)
        await asyncio.sleep(5)

    server, url = await _server(handler)
    pool = Pool(None, 1.0, 0.1)
    try:
        with pytest.raises(ReadTimeout):
            await pool.post(url, "/generate", b"{}")
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectError):
            await pool.post(url, "/generate", b"{}")
    finally:
        pool.close()


def test_sse_byte_checks():
    assert is_done(b"data: [DONE]") and is_done(b"data:[DONE] ")
    assert not is_done(b'data: {"text":"[DONE]"}')
    err = b'data: {"error": {"message": "boom", "code": 503}}'
    assert may_be_error(err) and event_json(err)["error"]["code"] == 503
    assert not may_be_error(b'data: {"text":"x","meta_info":{"completion_tokens":1}}')
