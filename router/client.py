"""The router's HTTP client to workers: one pooled httpx.AsyncClient, the internal token on every call,
and the small calls every module needs (abort a room, fetch /server_info)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from common.http import TOKEN_HEADER
from router.registry import Worker

log = logging.getLogger("router.client")

ABORT_TIMEOUT_S = 5.0


class WorkerClient:
    def __init__(
        self,
        internal_token: str | None,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int = 1024,
    ) -> None:
        headers = {TOKEN_HEADER: internal_token} if internal_token else {}
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=256),
        )
        self._background: set[asyncio.Task] = set()

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=ABORT_TIMEOUT_S)
        await self.http.aclose()

    async def abort_room(self, w: Worker, room: int) -> bool:
        """POST /abort_request {"bootstrap_room": room}; True when the worker answered 2xx."""
        try:
            r = await self.http.post(
                f"{w.url}/abort_request", json={"bootstrap_room": room}, timeout=ABORT_TIMEOUT_S
            )
        except httpx.HTTPError as e:
            log.info("abort of room %d on %s failed: %r", room, w.url, e)
            return False
        return r.is_success

    def abort_room_soon(self, w: Worker, room: int) -> None:
        """Fire-and-forget abort (kept referenced until done; awaited on close)."""
        task = asyncio.get_running_loop().create_task(self.abort_room(w, room))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def server_info(self, w: Worker, timeout_s: float) -> dict:
        r = await self.http.get(f"{w.url}/server_info", timeout=timeout_s)
        r.raise_for_status()
        info = r.json()
        if not isinstance(info, dict):
            raise ValueError(f"{w.url}/server_info is not a JSON object")
        return info
