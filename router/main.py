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

import uvicorn

from common import tracing
from common.configs import add_flags, build, named_values, specs
from common.logs import add_observability_args, setup_logging
from common.secrets import read_secret, read_secret_lines
from router.app import create_app
from router.config import K8sConfig, RouterConfig, load_yaml, parse_worker_flag


def build_parser() -> argparse.ArgumentParser:
    """The router's flags: the workers and the config file, then RouterConfig's (K8sConfig's as --k8s-*),
    generated from their fields, then the observability flags (common.logs)."""
    p = argparse.ArgumentParser(prog="pdserve router", description=__doc__)
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,bootstrap_port=N]",
                   help="a prefill worker (repeatable); without bootstrap_port it is read from /server_info")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)")
    p.add_argument("--encoder", action="append", default=[], metavar="URL[,bootstrap_port=N]",
                   help="a vision encoder worker (repeatable): requests with images go encoder -> prefill -> decode; "
                   "without bootstrap_port it is read from /server_info")
    p.add_argument("--config", default=None, help="YAML file with workers and settings (flags win over it)")
    add_flags(p, list(specs(RouterConfig)))
    add_observability_args(p)
    return p


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    """RouterConfig from the parsed flags over the --config file: each field from the flag of its name
    (common.configs; a flag left unset parses as None and keeps the file's value, else the default),
    K8sConfig from the --k8s-* flags by name. Derived: the workers of --prefill/--decode/--encoder (replacing the
    file's), the API keys and internal token read from their files, request_log from --log-format json.
    ValueError (naming the flag) from the configs' validation."""
    kw = load_yaml(ns.config) if ns.config else {}
    workers = [parse_worker_flag(u, role) for role in ("prefill", "decode", "encoder") for u in getattr(ns, role)]
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


def app_from_env():  # noqa: ANN201 (a FastAPI app)
    """uvicorn app factory for `--workers N`: each process builds its config from the same flags."""
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
