"""Typed zmq channels between a service's frontend and its worker; they own serialization.

    Endpoints      the two ipc addresses, derived once from ServerConfig.ipc_dir (`config.endpoints`)
    WorkerChannels worker side: binds PULL `to_worker`, connects PUSH to `to_frontend` (blocking zmq)
    FrontendChannels  frontend side: binds PULL `to_frontend`, connects PUSH to `to_worker` (asyncio)

A channel sends and receives only service messages (service.messages, common.codec); a frame that
does not decode is logged and dropped, never handed on half-read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Generic, TypeVar

import zmq
import zmq.asyncio

from service import messages as m

log = logging.getLogger("pdserve.channels")

ToWorker = m.GenerateReq | m.AbortReq | m.StatsReq | m.FlushCacheReq | m.LoraReq
ToFrontend = m.TokenBatch | m.StatsOut | m.FlushCacheOut | m.LoraOut
T = TypeVar("T")


@dataclass(frozen=True)
class Endpoints:
    to_worker: str  # bound by the worker's PULL
    to_frontend: str  # bound by the frontend's PULL

    @classmethod
    def in_dir(cls, ipc_dir: str) -> Endpoints:
        if not ipc_dir:
            raise ValueError("the ipc directory is not set (service.launch resolves it before the worker starts)")
        return cls(to_worker=f"ipc://{ipc_dir}/worker.sock", to_frontend=f"ipc://{ipc_dir}/frontend.sock")


def _socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


def _decode(data: bytes) -> object | None:
    try:
        return m.decode(data)
    except ValueError as e:
        log.error("dropping a malformed message: %s", e)
        return None


class PushChannel(Generic[T]):
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False) -> None:
        self.socket = _socket(ctx, zmq.PUSH, addr, bind)

    def send(self, msg: T) -> None:
        self.socket.send(m.encode(msg))


class PullChannel(Generic[T]):
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = True) -> None:
        self.socket = _socket(ctx, zmq.PULL, addr, bind)

    def recv_all(self) -> list[T]:
        """Every message waiting now (never blocks)."""
        out: list[T] = []
        while True:
            try:
                data = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = _decode(data)
            if msg is not None:
                out.append(msg)  # type: ignore[arg-type]


class AsyncPushChannel(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, bind: bool = False) -> None:
        self.socket = _socket(ctx, zmq.PUSH, addr, bind)

    async def send(self, msg: T) -> None:
        await self.socket.send(m.encode(msg))


class AsyncPullChannel(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, bind: bool = True) -> None:
        self.socket = _socket(ctx, zmq.PULL, addr, bind)

    async def recv(self) -> T:
        """The next message that decodes."""
        while True:
            msg = _decode(await self.socket.recv())
            if msg is not None:
                return msg  # type: ignore[return-value]


class WorkerChannels:
    """The worker's end: `inbox` (requests, aborts, stats asks), `outbox` (tokens, stats)."""

    def __init__(self, ends: Endpoints) -> None:
        self.ctx = zmq.Context()
        self.inbox: PullChannel[ToWorker] = PullChannel(self.ctx, ends.to_worker, bind=True)
        self.outbox: PushChannel[ToFrontend] = PushChannel(self.ctx, ends.to_frontend, bind=False)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.socket, zmq.POLLIN)

    def wait(self, timeout_ms: int) -> None:
        """Block until a message arrives or timeout_ms passes."""
        self.poller.poll(timeout_ms)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class FrontendChannels:
    """The frontend's end (asyncio): `inbox` from the worker, `outbox` to it."""

    def __init__(self, ends: Endpoints) -> None:
        self.ctx = zmq.asyncio.Context()
        self.inbox: AsyncPullChannel[ToFrontend] = AsyncPullChannel(self.ctx, ends.to_frontend, bind=True)
        self.outbox: AsyncPushChannel[ToWorker] = AsyncPushChannel(self.ctx, ends.to_worker, bind=False)

    def close(self) -> None:
        self.inbox.socket.close(0)
        self.outbox.socket.close(0)
        self.ctx.term()
