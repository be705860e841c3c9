"""Per-request scheduling and cache options of every generation endpoint (issue 40), read from a body
common/api_requests.py already validated (types and ranges, 400 naming the field):

  priority      int: the waiting order and preemption with --enable-priority-scheduling
                (engine.scheduling.priority); ignored without it
  extra_key     cache salt (vLLM: `cache_salt`, accepted on every endpoint; both given and different:
                the salt is the pair): requests share cached
                prefix pages only with requests of the same salt, on every role (Req.cache_namespace;
                a PD decode's reuse hash includes it, transfer.messages.prefix_hash)
  routing_key   read by the router only (router.protocol: its cache_aware policy keeps one key on
                one worker); a service ignores it
  session_params  /generate on a colocated service only (service/sessions.py); refused elsewhere
"""

from __future__ import annotations

from typing import Any

from common.api_requests import MAX_RID_LEN as MAX_KEY
from engine.request_groups import NO_OPTIONS, ReqOptions
from service.parsed import RequestError


def options(body: dict[str, Any], kind: str, lora: str = "") -> ReqOptions:
    """The request's options group: priority and cache salt from `body`, the LoRA adapter the caller
    resolved (the session is added by service.sessions.attach_session); service.parsed.RequestError
    (400) naming the field when they conflict or do not apply to this endpoint."""
    salt, vllm_salt = body.get("extra_key"), body.get("cache_salt")
    if vllm_salt is not None and not (isinstance(vllm_salt, str) and 0 < len(vllm_salt) <= MAX_KEY):
        raise RequestError(f"'cache_salt' must be a non-empty string of at most {MAX_KEY} characters")
    if kind != "generate" and body.get("session_params") is not None:
        raise RequestError("'session_params' is taken by /generate only (SGLang's sessions)")
    salts = [s for s in (salt, vllm_salt) if s is not None]
    salt = salts[0] if len(set(salts)) == 1 else "\x1f".join(salts)  # both and different: one salt
    priority = body.get("priority") or 0
    return ReqOptions(priority, salt, "", lora) if priority or salt or lora else NO_OPTIONS
