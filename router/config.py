"""Router configuration: one frozen `RouterConfig`, built once in `main` from CLI flags and an optional
YAML file, then passed explicitly. Each field declares its flag (common.configs.option: help, choices;
router.main generates the parser from them). Validation raises ValueError naming the flag.

Worker flag syntax: `--prefill http://host:port[,bootstrap_port=N]`, `--decode http://host:port`,
`--encoder http://host:port[,bootstrap_port=N]` (a vision encoder, E/P/D: router/proxy.py).
YAML file (`--config`), every key optional, flags given on the command line win over it:

    prefill:
      - url: http://10.0.0.1:30000
        bootstrap_port: 8998          # optional: else read from the worker's /server_info
    decode:
      - url: http://10.0.0.2:30000
    encoder:                          # optional: image requests go encoder -> prefill -> decode
      - url: http://10.0.0.3:30000
        bootstrap_port: 8998          # optional, as for a prefill
    prefill_policy: cache_aware
    decode_policy: least_load
    request_timeout: 600
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from common.checks import need
from common.configs import nested, option

POLICIES = ("round_robin", "least_load", "cache_aware")
WORKER_ROLES = ("prefill", "decode", "encoder")
EMBEDDED_TOKENIZER = "embedded:smollm2-135m"  # the embedded model's (engine/config.py: EMBEDDED_MODEL)
BOOTSTRAP_ROLES = ("prefill", "encoder")  # roles that serve a bootstrap server (their peers connect to it)
EMBEDDINGS_POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerSpec:
    """A worker the router may use. `bootstrap_port` only matters for a prefill or an encoder (BOOTSTRAP_ROLES);
    None = ask /server_info."""

    url: str
    role: str
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"worker role must be one of {', '.join(WORKER_ROLES)}, got {self.role!r}")
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
    """Kubernetes pod discovery (enabled when `selector` is set); its flags are RouterConfig's, `--k8s-*`."""

    selector: str = option("", "discover worker pods by this label selector")
    namespace: str = option("default", "namespace of the worker pods")
    api_server: str = option("", "Kubernetes API URL (default: in-cluster, with the service account token)")
    role_label: str = option("pdserve.io/role", "pod label holding the role (prefill/decode/encoder)")
    bootstrap_port_annotation: str = option("pdserve.io/bootstrap-port", "pod annotation holding a prefill's "
                                            "(or an encoder's) bootstrap port")
    worker_port: int = option(30000, "HTTP port of the worker pods", name="--k8s-port")
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
    """The router's settings; each field declares its flag (common.configs.option). The flags a --config file
    may also set parse as None when not given (cli_default=None), so the file's value stays."""

    host: str = option("127.0.0.1", "HTTP bind address")
    port: int = option(8000, "HTTP port")
    workers: tuple[WorkerSpec, ...] = ()  # --prefill / --decode / --encoder (router.main), or the --config file's
    prefill_policy: str = option("least_load", "how a prefill worker is picked (default {default})", choices=POLICIES,
                                 cli_default=None)
    decode_policy: str = option("least_load", "how a decode worker is picked (default {default})", choices=POLICIES,
                                cli_default=None)
    embeddings_pool: str = option(
        "prefill", "POST /v1/embeddings is forwarded, body untouched, to the least loaded healthy worker of this pool "
        "(default {default}): a forward without generation, like a prefill's", choices=EMBEDDINGS_POOLS,
        cli_default=None)  # router.embeddings
    cache_threshold: float = option(
        0.3, "cache_aware: a worker wins on its prefix tree when that tree holds at least this share of the prompt "
        "(default {default:g}); below it, the least loaded worker", cli_default=None)
    cache_tree_chars: int = option(
        4_000_000, "cache_aware: prompt characters remembered per worker, least recently routed dropped first "
        "(default {default})", cli_default=None)
    kv_events: str = option(
        "auto", "cache_aware: auto subscribes to the KV cache events of every worker whose /server_info advertises "
        "them and scores those workers by what they hold (docs/kv_events.md); off keeps the approximate tree "
        "for all (default {default})", choices=("auto", "off"), cli_default=None)
    tokenizer: str = option(
        "", "cache_aware with KV events: the tokenizer the router hashes text and chat prompts with, as the workers' "
        f"frontends tokenize them: an HF directory or {EMBEDDED_TOKENIZER} (default: the tokenizer_path the first "
        "worker with KV events reports in /server_info; loaded then, in the background; when it cannot be loaded "
        "text and chat prompts keep the approximate tree)", cli_default=None)
    balance_abs_threshold: int = option(
        4, "cache_aware: fall back to least_load when the chosen worker has this many more outstanding requests "
        "than the least loaded one (default {default}) ...", cli_default=None)
    balance_rel_threshold: float = option(1.5, "... and more than this multiple of its requests (default "
                                          "{default:g})", cli_default=None)
    local_prefill_queue_tokens: int = option(
        0, "conditional disaggregation: when the picked prefill already has this many prompt tokens outstanding, "
        "ask the decode to prefill the request itself (it does when it has room; a decode that does not know the "
        "hint ignores it). Default {default} (0: never)", cli_default=None)
    k8s: K8sConfig = nested(K8sConfig, "k8s_")
    api_keys: frozenset[str] = option(frozenset(), "file with client API keys, one per line; when set, requests need "
                                      "'Authorization: Bearer'", name="--api-key-file", dest="api_key_file",
                                      cli_default=None)  # empty = no client auth
    internal_token: str | None = option(None, "file with the token sent to workers in header x-pdserve-token",
                                        name="--internal-token-file", dest="internal_token_file")
    request_timeout_s: float = option(
        600.0, "seconds per attempt; streams: until the first token and between events (default {default:g})",
        name="--request-timeout", cli_default=None)
    connect_timeout_s: float = 5.0
    max_retries: int = option(2, "extra attempts on another pair when a side fails before the first token "
                              "(default {default})", cli_default=None)
    migration_limit: int = option(
        2, "times a streamed completions/chat request whose decode fails after tokens were streamed is moved to "
        "another prefill/decode pair, with the prompt plus the tokens so far, continuing the client's stream "
        "(default {default}; 0: end the stream with an error event)", cli_default=None)
    health_interval_s: float = option(2.0, "seconds between health probes (default {default:g})",
                                      name="--health-interval", cli_default=None)
    health_failures: int = option(
        3, "consecutive failures that eject a worker (default {default}); failed requests alone never eject the "
        "last eligible worker of a role, only failed health probes do", cli_default=None)
    worker_wait_s: float = option(
        15.0, "seconds a request waits for an eligible worker of a role when none is, before it gets a 503 with "
        "Retry-After (default {default:g}; 0: answer 503 at once)", name="--worker-wait", cli_default=None)
    processes: int = option(
        1, "router processes sharing the port (default {default}); each keeps its own worker health, load counts "
        "and metrics, and /admin/workers cannot change workers when > 1", name="--workers", cli_default=None)
    log_level: str = option("info", "debug, info, warning or error")
    request_log: bool = False  # one JSON line per finished request (--log-format json), router.reqlog

    def __post_init__(self) -> None:
        need(0 <= self.port < 65536, "--port must be in 0..65535")
        need(self.prefill_policy in POLICIES, f"--prefill-policy must be one of {POLICIES}")
        need(self.decode_policy in POLICIES, f"--decode-policy must be one of {POLICIES}")
        need(self.embeddings_pool in EMBEDDINGS_POOLS, f"--embeddings-pool must be one of {EMBEDDINGS_POOLS}")
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
        need(self.kv_events in ("auto", "off"), "--kv-events must be auto or off")
        need(not self.tokenizer.startswith("embedded:") or self.tokenizer == EMBEDDED_TOKENIZER,
             f"--tokenizer {self.tokenizer!r}: the embedded tokenizer is {EMBEDDED_TOKENIZER}")
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
        if role not in BOOTSTRAP_ROLES:
            raise ValueError(f"bootstrap_port only applies to --prefill and --encoder workers: {text!r}")
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
