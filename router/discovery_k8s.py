"""Kubernetes pod discovery through the API server's REST API (list, then watch), no client library.

Pods matching `--k8s-selector` in `--k8s-namespace` become workers when they are Running, Ready, have
a pod IP, are not being deleted, and carry the role label (`pdserve.io/role`: prefill, decode or encoder).
Worker URL: `http://<podIP>:<--k8s-port>`; a prefill's (or an encoder's) bootstrap port comes from the
annotation `pdserve.io/bootstrap-port` (else from its /server_info). A pod that stops qualifying, or is
deleted, is removed. The watch resumes from the last resourceVersion and relists on 410 Gone or
any error (with backoff). Only workers this discovery added are ever removed by it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import httpx

from router.config import BOOTSTRAP_ROLES, WORKER_ROLES, K8sConfig, WorkerSpec
from router.health import HealthChecker
from router.registry import Registry

log = logging.getLogger("router.k8s")
MAX_BACKOFF_S = 30.0


def pod_worker(pod: dict, cfg: K8sConfig) -> WorkerSpec | None:
    """The worker a pod stands for, or None when it should not take requests."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    role = (meta.get("labels") or {}).get(cfg.role_label)
    ip = status.get("podIP")
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if role not in WORKER_ROLES or not ip or not ready or status.get("phase") != "Running":
        return None
    if meta.get("deletionTimestamp"):
        return None
    port = None
    raw = (meta.get("annotations") or {}).get(cfg.bootstrap_port_annotation)
    if role in BOOTSTRAP_ROLES and raw is not None:
        try:
            port = int(raw)
        except ValueError:
            log.warning(
                "pod %s: annotation %s=%r is not a port", meta.get("name"), cfg.bootstrap_port_annotation, raw
            )
            return None
    host = f"[{ip}]" if ":" in ip else ip
    try:
        return WorkerSpec(url=f"http://{host}:{cfg.worker_port}", role=role, bootstrap_port=port)
    except ValueError as e:
        log.warning("pod %s: %s", meta.get("name"), e)
        return None


class K8sDiscovery:
    def __init__(self, cfg: K8sConfig, registry: Registry, health: HealthChecker) -> None:
        self.cfg = cfg
        self.registry = registry
        self.health = health
        self._pods: dict[str, str] = {}  # pod name -> worker URL
        self._task: asyncio.Task | None = None
        self.synced = asyncio.Event()  # set after the first successful list

    def _api_base(self) -> str:
        if self.cfg.api_server:
            return self.cfg.api_server.rstrip("/")
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        if not host:
            raise ValueError("no --k8s-api-server and KUBERNETES_SERVICE_HOST is unset (not in a cluster)")
        return f"https://{host}:{port}"

    def _http(self) -> httpx.AsyncClient:
        headers = {}
        token = Path(self.cfg.token_file)
        if token.is_file():
            headers["Authorization"] = f"Bearer {token.read_text().strip()}"
        verify: bool | str = self.cfg.ca_file if Path(self.cfg.ca_file).is_file() else True
        return httpx.AsyncClient(headers=headers, verify=verify, timeout=httpx.Timeout(30.0, read=None))

    def apply(self, name: str, pod: dict | None) -> None:
        """Bring the registry in line with one pod's state (None: the pod is gone)."""
        spec = pod_worker(pod, self.cfg) if pod is not None else None
        old = self._pods.get(name)
        if old is not None and (
            spec is None
            or spec.url != old
            or self.registry.get(old) is None
            or self.registry.get(old).spec != spec
        ):
            self.registry.remove(old)
            del self._pods[name]
        if spec is not None and name not in self._pods:
            self._pods[name] = spec.url
            w = self.registry.add(spec, source="k8s")
            asyncio.get_running_loop().create_task(self.health.probe(w))

    def _pods_path(self) -> str:
        return f"/api/v1/namespaces/{self.cfg.namespace}/pods"

    async def _list(self, http: httpx.AsyncClient, base: str) -> str:
        r = await http.get(base + self._pods_path(), params={"labelSelector": self.cfg.selector})
        r.raise_for_status()
        body = r.json()
        seen = {}
        for pod in body.get("items") or []:
            seen[pod["metadata"]["name"]] = pod
        for name in list(self._pods):
            if name not in seen:
                self.apply(name, None)
        for name, pod in seen.items():
            self.apply(name, pod)
        self.synced.set()
        return str((body.get("metadata") or {}).get("resourceVersion", ""))

    async def _watch(self, http: httpx.AsyncClient, base: str, rv: str) -> None:
        """Follow the watch stream until it ends; raises on a 410 Gone (or other error) event."""
        params = {
            "labelSelector": self.cfg.selector,
            "watch": "1",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
        }
        async with http.stream("GET", base + self._pods_path(), params=params) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise RuntimeError(f"watch error: {obj.get('code')} {obj.get('message')}")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    name = obj["metadata"]["name"]
                    self.apply(name, None if kind == "DELETED" else obj)

    async def _run(self) -> None:
        backoff = 1.0
        async with self._http() as http:
            while True:
                try:
                    base = self._api_base()
                    rv = await self._list(http, base)
                    backoff = 1.0
                    await self._watch(http, base, rv)
                except (httpx.HTTPError, ValueError, KeyError, RuntimeError) as e:
                    log.warning("kubernetes discovery: %r; retrying in %.0fs", e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="k8s-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
