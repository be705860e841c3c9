"""The frontend's link to its worker: per-request queues of TokenOut, stats round trips, worker death."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from service.channels import Endpoints, FrontendChannels
from service.messages import (
    AbortReq,
    EmbedOut,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    LoraOut,
    LoraReq,
    StatsOut,
    StatsReq,
    TokenBatch,
    TokenOut,
)

log = logging.getLogger("pdserve.launch")


class WorkerBridge:
    """The frontend's side of the zmq link: per-request queues of TokenOut, stats round trips."""

    def __init__(self, ends: Endpoints) -> None:
        self.io = FrontendChannels(ends)
        self.streams: dict[str, asyncio.Queue[TokenOut]] = {}
        self.stats_waiters: dict[int, asyncio.Future[Any]] = {}  # StatsOuts, FlushCacheOuts
        self.tokens = itertools.count(1)
        self.ready = asyncio.Event()
        self.info: dict[str, Any] = {}
        self.alive = True
        self.dead_reason = ""
        self._bg: set[asyncio.Task[Any]] = set()

    @property
    def usable(self) -> bool:
        return self.alive and self.ready.is_set()

    async def run(self) -> None:
        """Reader loop: route TokenOuts to their request queues, StatsOuts to their waiters."""
        while True:
            msg = await self.io.inbox.recv()
            if isinstance(msg, TokenBatch):
                for out in msg.outs:
                    q = self.streams.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, StatsOut):
                if msg.token == -1:
                    self.info = dict(msg.info)
                    self.ready.set()
                    log.info("worker ready: %s", {k: self.info.get(k) for k in ("model_path", "role")})
                else:
                    fut = self.stats_waiters.pop(msg.token, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
            elif isinstance(msg, (FlushCacheOut, LoraOut, EmbedOut)):
                fut = self.stats_waiters.pop(msg.token, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def open(self, rid: str) -> asyncio.Queue[TokenOut]:
        if rid in self.streams:
            raise KeyError(rid)
        q: asyncio.Queue[TokenOut] = asyncio.Queue()
        self.streams[rid] = q
        return q

    def close(self, rid: str) -> None:
        self.streams.pop(rid, None)

    async def send(self, msg: GenerateReq | AbortReq | StatsReq | FlushCacheReq) -> None:
        await self.io.outbox.send(msg)

    def send_soon(self, msg: GenerateReq | AbortReq | StatsReq) -> None:
        """Fire-and-forget send (from finally blocks of cancelled streams)."""
        task = asyncio.get_running_loop().create_task(self.send(msg))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def stats(self, timeout: float = 2.0) -> StatsOut | None:
        """Ask the worker for its stats; None when it is not running or does not answer in time."""
        if not self.usable:
            return None
        token = next(self.tokens)
        fut: asyncio.Future[StatsOut] = asyncio.get_running_loop().create_future()
        self.stats_waiters[token] = fut
        try:
            await self.send(StatsReq(token=token))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            log.warning("worker did not answer a stats request within %.1fs", timeout)
            return None
        finally:
            self.stats_waiters.pop(token, None)

    async def flush_cache(self, timeout: float = 10.0) -> FlushCacheOut | None:
        """Ask the worker to empty its prefix cache; None when it is not running or does not answer."""
        if not self.usable:
            return None
        token = next(self.tokens)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.stats_waiters[token] = fut
        try:
            await self.send(FlushCacheReq(token=token))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self.stats_waiters.pop(token, None)

    async def lora(self, msg: LoraReq, timeout: float = 60.0) -> LoraOut | None:
        """A LoRA load/unload round trip (msg.token is set here); None when the worker is not running
        or does not answer within `timeout`."""
        if not self.usable:
            return None
        msg.token = next(self.tokens)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.stats_waiters[msg.token] = fut
        try:
            await self.send(msg)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self.stats_waiters.pop(msg.token, None)

    def fail_all(self, reason: str) -> None:
        """The worker is gone: every pending request ends with a 503."""
        self.alive = False
        self.dead_reason = reason
        for rid, q in list(self.streams.items()):
            q.put_nowait(TokenOut(rid=rid, new_token_ids=[], finished=True, finish_reason="error",
                                  error=reason, error_code=503))

    def shutdown(self) -> None:
        self.io.close()
