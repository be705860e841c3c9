"""Kubernetes discovery against a local HTTP server that serves the API server's pod list and watch
JSON (no API server can run here). Pods are stub workers on 127.0.0.2 / 127.0.0.3 (same port, as pods
have), the role comes from the pod label and the bootstrap port from the pod annotation."""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from router_harness import free_port, start_router, start_stub, wait_for

pytestmark = pytest.mark.slow


def _pod(name: str, ip: str, role: str, ready: bool, bootstrap_port: int | None = None) -> dict:
    meta = {"name": name, "namespace": "serving", "labels": {"app": "pdserve", "pdserve.io/role": role}}
    if bootstrap_port:
        meta["annotations"] = {"pdserve.io/bootstrap-port": str(bootstrap_port)}
    cond = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": meta, "status": {"phase": "Running", "podIP": ip, "conditions": cond}}


class FakeApiServer:
    """GET /api/v1/namespaces/serving/pods: the list; with watch=1: events pushed through `emit`."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods
        self.events: queue.Queue = queue.Queue()
        self.queries: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                q = {k: v[0] for k, v in parse_qs(parts.query).items()}
                outer.queries.append(q)
                if parts.path != "/api/v1/namespaces/serving/pods":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                if q.get("watch") != "1":
                    body = {"kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": outer.pods}
                    self.wfile.write(json.dumps(body).encode())
                    return
                while (event := outer.events.get()) is not None:
                    self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def emit(self, kind: str, pod: dict) -> None:
        self.events.put({"type": kind, "object": pod})

    def close(self) -> None:
        self.events.put(None)
        self.server.shutdown()


def test_k8s_discovery_list_watch_and_requests():
    port = free_port()
    prefill = _pod("pd-prefill-0", "127.0.0.2", "prefill", True, bootstrap_port=port)
    decode = _pod("pd-decode-0", "127.0.0.3", "decode", False)
    other = _pod("something-else", "127.0.0.4", "router", True)
    api = FakeApiServer([prefill, decode, other])
    stubs = [
        start_stub("prefill", port=port, host="127.0.0.2"),
        start_stub("decode", port=port, host="127.0.0.3"),
    ]
    router = start_router(
        [
            "--k8s-api-server",
            api.url,
            "--k8s-namespace",
            "serving",
            "--k8s-selector",
            "app=pdserve",
            "--k8s-port",
            str(port),
            "--worker-wait",
            "0",  # the request without a prefill below gets its 503 at once, within the client's timeout
        ]
    )
    try:
        for s in stubs:
            s.wait_healthy(60)
        router.wait_healthy(60, path="/livez")

        def workers() -> dict:
            return {w["url"]: w for w in httpx.get(router.url + "/admin/workers").json()["workers"]}

        p_url, d_url = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"
        wait_for(lambda: workers().get(p_url, {}).get("eligible"), 20, "prefill pod discovered")
        assert workers()[p_url]["bootstrap_port"] == port and workers()[p_url]["source"] == "k8s"
        assert set(workers()) == {p_url}  # not-ready decode and the unlabelled pod are ignored
        assert httpx.get(router.url + "/health").status_code == 503
        assert any(q.get("labelSelector") == "app=pdserve" for q in api.queries)

        api.emit("MODIFIED", _pod("pd-decode-0", "127.0.0.3", "decode", True))
        wait_for(lambda: httpx.get(router.url + "/health").status_code == 200, 20, "decode pod ready")
        assert workers()[d_url]["eligible"] and workers()[d_url]["role"] == "decode"
        r = httpx.post(
            router.url + "/generate", json={"text": "k8s", "sampling_params": {"max_new_tokens": 3}}
        )
        assert r.status_code == 200 and len(r.json()["text"].split()) == 3

        api.emit("DELETED", prefill)
        wait_for(lambda: p_url not in workers(), 20, "deleted prefill pod removed")
        assert httpx.get(router.url + "/health").status_code == 503
        r = httpx.post(
            router.url + "/generate", json={"text": "k8s", "sampling_params": {"max_new_tokens": 3}}
        )
        assert r.status_code == 503 and "no healthy prefill" in r.json()["error"]["message"]
    finally:
        router.stop()
        for s in stubs:
            s.stop()
        api.close()
