"""What every HTTP answer of pdserve shares: the OpenAI-style error body and the internal-token header."""

from __future__ import annotations

from typing import Any

TOKEN_HEADER = "x-pdserve-token"  # router -> worker requests carry the internal token here

# Mid-stream migration (router <-> service, internal: the router strips both before the client sees them)
TOKEN_IDS_KEY = "pd_token_ids"  # body flag: each stream event carries its tokens' ids under this key, last
RESUME_KEY = "pd_resume"  # body field: {"output_ids": [...], "id": str, "created": int} continues a stream
# Conditional disaggregation (router -> decode, internal): the picked prefill is busy, prefill here if room
PREFILL_HERE_KEY = "pd_prefill_here"
# E/P/D: the router tells a prefill which encoder sends its request's image rows (the room is the request's)
ENCODER_HOST_KEY = "encoder_bootstrap_host"
ENCODER_PORT_KEY = "encoder_bootstrap_port"


def error_body(message: str, status: int, err_type: str | None = None, fault: str = "",
               retry_after: int = 0) -> dict[str, Any]:
    """`{"error": {"message", "type", "code"[, "fault"][, "retry_after"]}}`; type defaults by status (4xx
    client, 5xx server); `fault` (PD) names the role whose failure caused it, for the router;
    `retry_after` (an overloaded worker's 503): seconds the client should wait, as its Retry-After header."""
    if err_type is None:
        err_type = "invalid_request_error" if status < 500 else "server_error"
    err: dict[str, Any] = {"message": message, "type": err_type, "code": status}
    if fault:
        err["fault"] = fault
    if retry_after:
        err["retry_after"] = retry_after
    return {"error": err}
