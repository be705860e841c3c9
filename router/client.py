"""The router's HTTP clients to workers, the internal token on every call: `hot` (router.http1, pooled
keep-alive connections) carries proxied requests; `http` (httpx) the rest: probes, aborts,
/server_info, /v1/models. Tests may pass an httpx client (e.g. with a MockTransport) that then
carries everything."""

from __future__ import annotations

import asyncio
import logging

import httpx

from common.http import TOKEN_HEADER
from router.http1 import Pool, TransportError
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
        http: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {TOKEN_HEADER: internal_token} if internal_token else {}
        self.http = http or httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=256),
        )
        self.hot: Pool | HttpxHotPath = (
            HttpxHotPath(http) if http is not None else Pool(headers, connect_timeout_s, read_timeout_s)
        )
        self._background: set[asyncio.Task] = set()

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=ABORT_TIMEOUT_S)
        self.hot.close()
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


class HttpxResponse:
    """router.http1.Response's interface over a streamed httpx response."""

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self._chunks = resp.aiter_bytes()
        self.status = resp.status_code

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    async def next_chunk(self) -> bytes | None:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            return None

    async def read(self) -> bytes:
        try:
            return await self._resp.aread()
        finally:
            self.close()

    def close(self) -> None:
        if not self._resp.is_closed:
            asyncio.ensure_future(self._resp.aclose())


class HttpxHotPath:
    """router.http1.Pool's interface over an httpx client: slower, but any httpx transport works."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def post(self, url: str, path: str, body: bytes, traceparent: str = "") -> HttpxResponse:
        headers = {"content-type": "application/json"}
        if traceparent:
            headers["traceparent"] = traceparent
        request = self.http.build_request("POST", url + path, content=body, headers=headers)
        return HttpxResponse(await self.http.send(request, stream=True))

    def close(self) -> None:
        pass


# What a failed hot-path call raises (the httpx ones only through HttpxHotPath).
TRANSPORT_ERRORS = (TransportError, httpx.HTTPError)
