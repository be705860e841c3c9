"""`pdserve router`: parse flags (and an optional YAML file) into one RouterConfig and serve the app.

With `--workers N` (N > 1) uvicorn runs N router processes on one listening socket; each rebuilds the
config from the same flags (`app_from_env`) and keeps its own state: registry, health probes, load
counts, metrics (docs/architecture.md, "Several router processes").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from common import tracing
from common.configs import build, named_values
from common.logs import add_observability_args, setup_logging
from common.secrets import read_secret, read_secret_lines
from router.config import POLICIES, K8sConfig, RouterConfig, load_yaml, parse_worker_flag


def build_parser() -> argparse.ArgumentParser:
    d, k = RouterConfig(), K8sConfig()
    p = argparse.ArgumentParser(prog="pdserve router", description=__doc__)
    p.add_argument("--host", default=d.host, help="HTTP bind address")
    p.add_argument("--port", type=int, default=d.port, help="HTTP port")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL[,bootstrap_port=N]",
        help="a prefill worker (repeatable); without bootstrap_port it is read from /server_info",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)"
    )
    p.add_argument("--config", default=None, help="YAML file with workers and settings (flags win over it)")
    p.add_argument(
        "--prefill-policy",
        choices=POLICIES,
        default=None,
        help=f"how a prefill worker is picked (default {d.prefill_policy})",
    )
    p.add_argument(
        "--decode-policy",
        choices=POLICIES,
        default=None,
        help=f"how a decode worker is picked (default {d.decode_policy})",
    )
    p.add_argument(
        "--embeddings-pool",
        choices=("prefill", "decode"),
        default=None,
        help=f"POST /v1/embeddings is forwarded, body untouched, to the least loaded healthy worker of this "
        f"pool (default {d.embeddings_pool}): a forward without generation, like a prefill's",
    )
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=None,
        help=f"cache_aware: a worker wins on its prefix tree when that tree holds at least this share of "
        f"the prompt (default {d.cache_threshold:g}); below it, the least loaded worker",
    )
    p.add_argument(
        "--cache-tree-chars",
        type=int,
        default=None,
        help=f"cache_aware: prompt characters remembered per worker, least recently routed dropped first "
        f"(default {d.cache_tree_chars})",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=None,
        help=f"cache_aware: fall back to least_load when the chosen worker has this many more outstanding "
        f"requests than the least loaded one (default {d.balance_abs_threshold}) ...",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=None,
        help=f"... and more than this multiple of its requests (default {d.balance_rel_threshold:g})",
    )
    p.add_argument(
        "--local-prefill-queue-tokens",
        type=int,
        default=None,
        help=f"conditional disaggregation: when the picked prefill already has this many prompt tokens "
        f"outstanding, ask the decode to prefill the request itself (it does when it has room; a decode "
        f"that does not know the hint ignores it). Default {d.local_prefill_queue_tokens} (0: never)",
    )
    p.add_argument("--k8s-selector", default="", help="discover worker pods by this label selector")
    p.add_argument("--k8s-namespace", default=k.namespace, help="namespace of the worker pods")
    p.add_argument(
        "--k8s-api-server",
        default="",
        help="Kubernetes API URL (default: in-cluster, with the service account token)",
    )
    p.add_argument(
        "--k8s-role-label", default=k.role_label, help="pod label holding the role (prefill/decode)"
    )
    p.add_argument(
        "--k8s-bootstrap-port-annotation",
        default=k.bootstrap_port_annotation,
        help="pod annotation holding a prefill's bootstrap port",
    )
    p.add_argument("--k8s-port", type=int, default=k.worker_port, dest="k8s_worker_port", metavar="K8S_PORT",
                   help="HTTP port of the worker pods")
    p.add_argument(
        "--api-key-file",
        default=None,
        help="file with client API keys, one per line; when set, requests need 'Authorization: Bearer'",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        help="file with the token sent to workers in header x-pdserve-token",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        dest="request_timeout_s",
        metavar="REQUEST_TIMEOUT",
        help=f"seconds per attempt; streams: until the first token and between events "
        f"(default {d.request_timeout_s:g})",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        default=None,
        help=f"extra attempts on another pair when a side fails before the first token "
        f"(default {d.max_retries})",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=None,
        help=f"times a streamed completions/chat request whose decode fails after tokens were streamed is "
        f"moved to another prefill/decode pair, with the prompt plus the tokens so far, continuing the "
        f"client's stream (default {d.migration_limit}; 0: end the stream with an error event)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=None,
        dest="health_interval_s",
        metavar="HEALTH_INTERVAL",
        help=f"seconds between health probes (default {d.health_interval_s:g})",
    )
    p.add_argument(
        "--health-failures",
        type=int,
        default=None,
        help=f"consecutive failures that eject a worker (default {d.health_failures}); failed requests "
        "alone never eject the last eligible worker of a role, only failed health probes do",
    )
    p.add_argument(
        "--worker-wait",
        type=float,
        default=None,
        dest="worker_wait_s",
        metavar="WORKER_WAIT",
        help=f"seconds a request waits for an eligible worker of a role when none is, before it gets a 503 "
        f"with Retry-After (default {d.worker_wait_s:g}; 0: answer 503 at once)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        dest="processes",
        metavar="WORKERS",
        help=f"router processes sharing the port (default {d.processes}); each keeps its own worker "
        "health, load counts and metrics, and /admin/workers cannot change workers when > 1",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    add_observability_args(p)
    return p


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    """RouterConfig from the parsed flags over the --config file: each field from the flag of its name
    (common.configs; a flag left unset parses as None and keeps the file's value, else the default),
    K8sConfig from the --k8s-* flags by name. Derived: the workers of --prefill/--decode (replacing the
    file's), the API keys and internal token read from their files, request_log from --log-format json.
    ValueError (naming the flag) from the configs' validation."""
    kw = load_yaml(ns.config) if ns.config else {}
    workers = [parse_worker_flag(u, "prefill") for u in ns.prefill] + [
        parse_worker_flag(u, "decode") for u in ns.decode
    ]
    if workers:
        kw["workers"] = tuple(workers)
    if ns.api_key_file:
        kw["api_keys"] = read_secret_lines(ns.api_key_file)
    if ns.internal_token_file:
        kw["internal_token"] = read_secret(ns.internal_token_file, "--internal-token-file")
    k8s = build(K8sConfig, ns, prefix="k8s_")
    cfg = RouterConfig(**(kw | named_values(RouterConfig, ns) | {"k8s": k8s, "request_log": ns.log_format == "json"}))
    if not cfg.workers and not k8s.enabled:
        logging.getLogger("router").warning("no workers given: add them with POST /admin/workers")
    return cfg


ARGV_ENV = "PDSERVE_ROUTER_ARGV"  # the flags, for the processes of --workers N


def _observability(ns: argparse.Namespace) -> None:
    """Logging and (when configured) tracing of this router process."""
    setup_logging(ns.log_level, ns.log_format, "router")
    tracing.setup("pdserve-router", ns.otlp_endpoint)


def app_from_env():
    """uvicorn app factory for `--workers N`: each process builds its config from the same flags."""
    from router.app import create_app

    ns = build_parser().parse_args(json.loads(os.environ[ARGV_ENV]))
    _observability(ns)
    return create_app(config_from_args(ns))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    setup_logging(ns.log_level, ns.log_format, "router")
    try:
        cfg = config_from_args(ns)
        if ns.otlp_endpoint:
            tracing.traces_url(ns.otlp_endpoint)  # a bad URL fails here, not in each process
    except (ValueError, OSError) as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from router.app import create_app

    serve = dict(
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level.lower(),
        access_log=cfg.log_level.lower() == "debug",
        timeout_graceful_shutdown=5,
        loop="uvloop" if sys.platform != "win32" else "asyncio",
        http="httptools",
        proxy_headers=False,  # the router reads no client address; X-Forwarded-* parsing costs per request
    )
    if cfg.processes == 1:
        tracing.setup("pdserve-router", ns.otlp_endpoint)
        uvicorn.run(create_app(cfg), **serve)
    else:
        os.environ[ARGV_ENV] = json.dumps(argv)
        uvicorn.run("router.main:app_from_env", factory=True, workers=cfg.processes, **serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
