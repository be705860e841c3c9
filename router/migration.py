"""Mid-stream migration: what the client has of a streamed request (completions, chat, /generate), so
that a decode failing after tokens were streamed can be replaced by another prefill/decode pair.

1. The router asks the decode for token ids on each event (`pd_token_ids: true` in the body,
   common.http.TOKEN_IDS_KEY); the service puts them last in each event's JSON.
2. `StreamLedger.take(raw)` reads and strips them from every relayed event (bytes only, no JSON
   decode), so the client never sees them, and notes whether the finishing event passed.
3. On a decode failure (transport error, stream cut before `[DONE]`, a 5xx error event) the proxy
   re-issues `ledger.resumed(req)`: the same body plus `pd_resume` (ids so far, the stream's id and
   created), which the services turn into prompt + ids so far and the remaining token budget. The new
   stream continues the client's: no token lost or repeated, same id (/generate: its cumulative text
   and output_ids start with the earlier leg's). At most `limit` times.
"""

from __future__ import annotations

import dataclasses

from common.http import RESUME_KEY, TOKEN_IDS_KEY
from router.protocol import ProxyRequest
from router.sse import event_json

MIGRATABLE = ("/v1/completions", "/v1/chat/completions", "/generate")
_IDS = b', "' + TOKEN_IDS_KEY.encode() + b'": ['  # the service's json.dumps separators
_FINISHED = (b'"finish_reason": "', b'"finish_reason": {')  # OpenAI: a string; /generate: an object; not null


def migratable(req: ProxyRequest, limit: int) -> bool:
    """n > 1 streams interleave their choices' tokens: not migrated (one ledger holds one sequence)."""
    return limit > 0 and req.stream and req.endpoint in MIGRATABLE and req.n == 1


def with_token_ids(req: ProxyRequest) -> ProxyRequest:
    return dataclasses.replace(req, body={**req.body, TOKEN_IDS_KEY: True})


class StreamLedger:
    """Token ids, id and created of the stream the client sees, and how often it migrated."""

    def __init__(self, first: bytes, limit: int) -> None:
        obj = event_json(first)
        head = obj if isinstance(obj, dict) else {}
        self.response_id = head.get("id") if isinstance(head.get("id"), str) else ""
        self.created = head.get("created") if isinstance(head.get("created"), int) else None
        self.ids: list[int] = []
        self.finished = False
        self.migrations = 0
        self.limit = limit

    def take(self, raw: bytes) -> bytes:
        """The event without its token ids (noted here)."""
        i = raw.rfind(_IDS)
        if i < 0:
            return raw
        j = raw.find(b"]", i)
        if j < 0:
            return raw
        ids = raw[i + len(_IDS):j]
        if b"," not in ids:  # one token per event, the common case
            if ids.strip():
                self.ids.append(int(ids))
        else:
            self.ids.extend(map(int, ids.split(b",")))
        if any(f in raw for f in _FINISHED):
            self.finished = True
        return raw[:i] + raw[j + 1:]

    def can_migrate(self) -> bool:
        return self.migrations < self.limit and not self.finished

    def resumed(self, req: ProxyRequest) -> ProxyRequest:
        """The request that continues this stream on another pair (counts one migration)."""
        self.migrations += 1
        resume = {"output_ids": list(self.ids), "id": self.response_id, "created": self.created}
        return dataclasses.replace(
            req,
            body={**req.body, RESUME_KEY: resume},
            prompt_tokens=req.prompt_tokens + len(self.ids),
            max_new_tokens=max(1, req.max_new_tokens - len(self.ids)),
        )
