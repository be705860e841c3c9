"""Router configuration: one frozen `RouterConfig`, built once in `main` from CLI flags and an optional
YAML file, then passed explicitly. Validation raises ValueError naming the flag.

Worker flag syntax: `--prefill http://host:port[,bootstrap_port=N]`, `--decode http://host:port`.
YAML file (`--config`), every key optional, flags given on the command line win over it:

    prefill:
      - url: http://10.0.0.1:30000
        bootstrap_port: 8998          # optional: else read from the worker's /server_info
    decode:
      - url: http://10.0.0.2:30000
    prefill_policy: cache_aware
    decode_policy: least_load
    request_timeout: 600
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from common.checks import need

POLICIES = ("round_robin", "least_load", "cache_aware")
WORKER_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerSpec:
    """A worker the router may use. `bootstrap_port` only matters for prefill; None = ask /server_info."""

    url: str
    role: str
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"worker role must be prefill or decode, got {self.role!r}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"worker URL must look like http://host:port, got {self.url!r}")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"worker URL must not carry a path or query, got {self.url!r}")
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port must be in 1..65535, got {self.bootstrap_port}")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""


@dataclass(frozen=True)
class K8sConfig:
    """Kubernetes pod discovery (enabled when `selector` is set)."""

    selector: str = ""
    namespace: str = "default"
    api_server: str = ""  # "" = in-cluster, from KUBERNETES_SERVICE_HOST/PORT
    role_label: str = "pdserve.io/role"
    bootstrap_port_annotation: str = "pdserve.io/bootstrap-port"
    worker_port: int = 30000
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

    def __post_init__(self) -> None:
        if not 0 < self.worker_port < 65536:
            raise ValueError("--k8s-port must be in 1..65535")

    @property
    def enabled(self) -> bool:
        return bool(self.selector)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[WorkerSpec, ...] = ()
    prefill_policy: str = "least_load"
    decode_policy: str = "least_load"
    embeddings_pool: str = "prefill"  # POST /v1/embeddings goes to a worker of this role (router.embeddings)
    request_timeout_s: float = 600.0  # per attempt; for streams: until the first token, then between events
    connect_timeout_s: float = 5.0
    max_retries: int = 2  # extra attempts on another pair when a side fails before the first token
    migration_limit: int = 2  # times a completions/chat stream may move to another pair mid-stream
    local_prefill_queue_tokens: int = 0  # ask the decode to prefill when the prefill has this many queued; 0 off
    health_interval_s: float = 2.0
    health_failures: int = 3  # consecutive failures (probes or requests) that eject a worker
    worker_wait_s: float = 15.0  # a request waits this long for an eligible worker of a role, then 503
    api_keys: frozenset[str] = frozenset()  # empty = no client auth
    internal_token: str | None = None  # sent to workers in header x-pdserve-token
    cache_threshold: float = 0.3  # cache_aware: least share of the prompt a worker's tree must hold
    cache_tree_chars: int = 4_000_000  # cache_aware: prompt characters remembered per worker (LRU)
    balance_abs_threshold: int = 4  # cache_aware falls back to load when the gap exceeds both
    balance_rel_threshold: float = 1.5
    k8s: K8sConfig = field(default_factory=K8sConfig)
    log_level: str = "info"
    request_log: bool = False  # one JSON line per finished request (--log-format json), router.reqlog
    processes: int = 1  # router processes sharing the port (--workers); each keeps its own state

    def __post_init__(self) -> None:
        need(0 <= self.port < 65536, "--port must be in 0..65535")
        need(self.prefill_policy in POLICIES, f"--prefill-policy must be one of {POLICIES}")
        need(self.decode_policy in POLICIES, f"--decode-policy must be one of {POLICIES}")
        need(self.embeddings_pool in WORKER_ROLES, f"--embeddings-pool must be one of {WORKER_ROLES}")
        need(self.request_timeout_s > 0, "--request-timeout must be > 0")
        need(self.connect_timeout_s > 0, "connect timeout must be > 0")
        need(self.max_retries >= 0, "--max-retries must be >= 0")
        need(self.migration_limit >= 0, "--migration-limit must be >= 0")
        need(self.local_prefill_queue_tokens >= 0, "--local-prefill-queue-tokens must be >= 0")
        need(self.health_interval_s > 0, "--health-interval must be > 0")
        need(self.health_failures >= 1, "--health-failures must be >= 1")
        need(self.worker_wait_s >= 0, "--worker-wait must be >= 0")
        need(0.0 <= self.cache_threshold <= 1.0, "--cache-threshold must be in 0..1")
        need(self.cache_tree_chars >= 64, "--cache-tree-chars must be >= 64")
        need(self.balance_abs_threshold >= 0, "--balance-abs-threshold must be >= 0")
        need(self.balance_rel_threshold >= 1.0, "--balance-rel-threshold must be >= 1")
        need(self.processes >= 1, "--workers must be >= 1")
        urls = [w.url for w in self.workers]
        dup = {u for u in urls if urls.count(u) > 1}
        need(not dup, f"worker URL listed twice: {sorted(dup)}")


def parse_worker_flag(text: str, role: str) -> WorkerSpec:
    """`http://h:p[,bootstrap_port=N]` -> WorkerSpec (ValueError on a bad option)."""
    url, *opts = [s.strip() for s in text.split(",")]
    port = None
    for opt in opts:
        key, _, value = opt.partition("=")
        if key != "bootstrap_port" or not value.isdigit():
            raise ValueError(f"bad worker option {opt!r} in {text!r} (expected bootstrap_port=N)")
        if role != "prefill":
            raise ValueError(f"bootstrap_port only applies to --prefill workers: {text!r}")
        port = int(value)
    return WorkerSpec(url=url, role=role, bootstrap_port=port)


def load_yaml(path: str | Path) -> dict:
    """Read a router YAML file into RouterConfig keyword arguments (workers as WorkerSpec)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: top level must be a mapping")
    out: dict = {}
    workers: list[WorkerSpec] = []
    for role in WORKER_ROLES:
        for item in data.pop(role, None) or []:
            if isinstance(item, str):
                item = {"url": item}
            if not isinstance(item, dict) or "url" not in item:
                raise ValueError(f"--config {path}: each {role} entry needs a url")
            workers.append(
                WorkerSpec(url=str(item["url"]), role=role, bootstrap_port=item.get("bootstrap_port"))
            )
    if workers:
        out["workers"] = tuple(workers)
    aliases = {
        "request_timeout": "request_timeout_s",
        "health_interval": "health_interval_s",
        "worker_wait": "worker_wait_s",
    }
    known = {f.name for f in fields(RouterConfig)} - {"workers", "k8s", "api_keys", "internal_token"}
    for key, value in data.items():
        name = aliases.get(key, key)
        if name not in known:
            raise ValueError(f"--config {path}: unknown key {key!r}")
        out[name] = value
    return out
