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

import argparse
from typing import Any

from common.api_requests import MAX_RID_LEN as MAX_KEY
from engine.config import EngineConfig
from service.messages import GenerateReq


def apply(req: GenerateReq, body: dict[str, Any], kind: str) -> None:
    """Set `req`'s priority and cache salt from `body`; service.protocol.RequestError (400) naming
    the field when they conflict or do not apply to this endpoint."""
    from service.protocol import RequestError  # service.protocol imports this module

    salt, vllm_salt = body.get("extra_key"), body.get("cache_salt")
    if vllm_salt is not None and not (isinstance(vllm_salt, str) and 0 < len(vllm_salt) <= MAX_KEY):
        raise RequestError(f"'cache_salt' must be a non-empty string of at most {MAX_KEY} characters")
    if kind != "generate" and body.get("session_params") is not None:
        raise RequestError("'session_params' is taken by /generate only (SGLang's sessions)")
    salts = [s for s in (salt, vllm_salt) if s is not None]
    req.extra_key = salts[0] if len(set(salts)) == 1 else "\x1f".join(salts)  # both and different: one salt
    req.priority = body.get("priority") or 0


def add_args(p: argparse.ArgumentParser, role: str) -> None:
    """Flags of priority scheduling (every role) and sessions (colocated); EngineConfig fields by name."""
    d = EngineConfig()
    g = p.add_argument_group("request priority and sessions")
    g.add_argument("--enable-priority-scheduling", action="store_true",
                   help="order waiting requests by their 'priority' (then --schedule-policy), and let a more urgent "
                        "arrival preempt running less urgent requests when KV memory is short (their KV moves to "
                        "the host pool and comes back: outputs unchanged). Off: 'priority' is ignored")
    g.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling: a lower 'priority' value is more urgent (default: higher)")
    g.add_argument("--priority-preemption-threshold", type=int, default=d.priority_preemption_threshold,
                   help="a running request is preempted only by an arrival at least this much more urgent")
    g.add_argument("--priority-max-preemptions", type=int, default=d.priority_max_preemptions,
                   help="times one request may be preempted by more urgent ones (then it keeps running)")
    g.add_argument("--priority-aging", type=float, default=d.priority_aging_s, dest="priority_aging_s",
                   metavar="PRIORITY_AGING",
                   help="seconds after which a waiting request ranks above every priority and is never "
                        "preempted (low priority never starves)")
    if role == "colocated":
        g.add_argument("--session-timeout", type=float, default=d.session_timeout_s, dest="session_timeout_s",
                       metavar="SESSION_TIMEOUT",
                       help="seconds a session (POST /open_session) may stay idle before it is closed and its "
                            "pinned KV released")
