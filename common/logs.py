"""Process logging, as text lines or JSON lines (`--log-format json`), and the observability flags
every process shares (`--otlp-endpoint`, `--log-format`).

JSON lines: one object per record with `ts` (ISO 8601, UTC), `level`, `logger`, `process` (router,
prefill, prefill-worker...), `msg`, plus every field the call passed in `extra=` (a request's
`trace_id`, `rid`, `room`, `status`, `ttft`, ...), so log pipelines join a request's lines with its trace.
"""

from __future__ import annotations

import argparse
import json
import logging
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": self.process,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def setup_logging(level: str, fmt: str, process: str) -> None:
    """Configure the root logger of this process (replacing handlers set before)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def add_observability_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--otlp-endpoint", default="",
                   help="OpenTelemetry collector (OTLP/HTTP, e.g. http://otel-collector:4318): export request "
                        "traces there. Off by default; the standard OTEL_EXPORTER_OTLP_* variables turn it on too")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text lines, or JSON lines carrying each request's trace id (for log pipelines)")
