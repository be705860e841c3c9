"""Health checking: every `health_interval` each worker's GET /health is probed. A passing probe
admits (or re-admits) the worker; `health_failures` failures in a row (probes and proxied requests
both count) eject it; the last eligible worker of a role is ejected by failed probes only. A prefill
(or an encoder) whose bootstrap port is unknown also has its /server_info read (`bootstrap_port`, and
`advertise_host`/`bootstrap_host` when present) before it becomes eligible. With `on_server_info` set
(the KV index's subscribers, router/kv_index.py), /server_info is read at every admission (a restarted
worker may publish its KV events elsewhere) and handed to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from router import lora
from router.client import WorkerClient
from router.config import BOOTSTRAP_ROLES
from router.registry import Registry, Worker

ServerInfoHook = Callable[[Worker, dict], None]

log = logging.getLogger("router.health")
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::", "::1")


class HealthChecker:
    def __init__(self, registry: Registry, client: WorkerClient, interval_s: float,
                 on_server_info: ServerInfoHook | None = None) -> None:
        self.registry = registry
        self.on_server_info = on_server_info
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = min(max(interval_s, 1.0), 5.0)
        self._task: asyncio.Task | None = None

    async def probe(self, w: Worker) -> bool:
        """Probe one worker and record the result; True when it passed."""
        try:
            r = await self.client.http.get(f"{w.url}/health", timeout=self.timeout_s)
            ok = r.status_code == 200
            reason = f"/health answered {r.status_code}"
            if ok:
                w.loras = lora.adapters_of(r)
            if ok and (not w.served_model_name or (w.role in BOOTSTRAP_ROLES and w.bootstrap_port is None)):
                info = await self.client.server_info(w, self.timeout_s)
                self._apply_server_info(w, info)
                if self.on_server_info is not None:
                    self.on_server_info(w, info)
            elif ok and self.on_server_info is not None and not w.healthy:
                await self._read_info_for_hook(w)
        except (httpx.HTTPError, ValueError) as e:
            ok, reason = False, repr(e)
        if ok:
            self.registry.record_success(w)
        else:
            self.registry.record_failure(w, reason, probe=True)
        return ok

    async def _read_info_for_hook(self, w: Worker) -> None:
        """/server_info at a re-admission, for `on_server_info` only: a failure does not keep the worker out."""
        try:
            info = await self.client.server_info(w, self.timeout_s)
        except (httpx.HTTPError, ValueError) as e:
            log.info("%s/server_info failed at admission: %r", w.url, e)
            return
        assert self.on_server_info is not None
        self.on_server_info(w, info)

    def _apply_server_info(self, w: Worker, info: dict) -> None:
        w.served_model_name = str(info.get("served_model_name") or info.get("model") or "")
        role = info.get("role")
        if role not in (None, w.role):
            log.warning("worker %s registered as %s reports role %r", w.url, w.role, role)
        if w.role not in BOOTSTRAP_ROLES:
            return
        host = str(info.get("bootstrap_host") or info.get("advertise_host") or "")
        if host and host not in _LOCAL_HOSTS:  # a loopback advertise host is only right on one node
            w.bootstrap_host = host
        if w.bootstrap_port is None:
            port = info.get("bootstrap_port")
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"{w.url}/server_info has no valid bootstrap_port: {port!r}")
            w.bootstrap_port = port

    async def probe_all(self) -> None:
        workers = self.registry.all()
        if workers:
            await asyncio.gather(*(self.probe(w) for w in workers))

    async def _loop(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="health-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
