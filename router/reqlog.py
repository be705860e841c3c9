"""One log line per finished router request, with its trace id: written only with `--log-format json`
(`RouterConfig.request_log`), where log pipelines read them; text logs stay quiet per request.

Unary requests and errors are logged by router.asgi when it answers, streams by the relay when they end.
"""

from __future__ import annotations

import logging
from typing import Any

from common import tracing

log = logging.getLogger("router.requests")


def finished(endpoint: str, status: int | str, e2e_s: float, trace: Any, **fields: Any) -> None:
    trace_id = tracing.trace_id(tracing.traceparent(trace))
    log.info("finished endpoint=%s status=%s e2e=%.3f trace_id=%s", endpoint, status, e2e_s, trace_id or "-",
             extra={"endpoint": endpoint, "status": status, "e2e": round(e2e_s, 4), "trace_id": trace_id, **fields})
