"""How a request ends and how what a step produced is reported: one function, one outbox type.

Every role (the colocated scheduler, the PD prefill, the PD decode) ends a request through
`finish_request`, whoever ends it (a stop, an abort, a failed transfer, a full pool), and collects
the requests with something to report in an `Outbox`, which its worker loop drains once per step.
"""

from __future__ import annotations

from engine.kvcache.kv_manager import KVManager
from engine.request import FinishReason, Req


class Outbox:
    """Requests with something to report since the last `drain`, each once, in the order first added
    (a request that produced a token and then finished in the same step is reported once)."""

    def __init__(self) -> None:
        self._reqs: dict[int, Req] = {}  # by identity: two requests may share a rid (a retried room)

    def add(self, r: Req) -> None:
        self._reqs.setdefault(id(r), r)

    def drain(self) -> list[Req]:
        """Everything added since the last drain, and empty the outbox."""
        out = list(self._reqs.values())
        self._reqs.clear()
        return out

    def __len__(self) -> int:
        return len(self._reqs)


def finish_request(r: Req, kv: KVManager, outbox: Outbox, reason: FinishReason | None = None,
                   error: str | None = None, code: int = 0, fault: str = "", forks: bool = True) -> None:
    """End `r`: record why, free every page and host copy it holds (`KVManager.release`, idempotent)
    and put it in `outbox`. The caller takes r out of its own queues.

    reason None: r finished itself (a stop or a length its last token hit). An ERROR or ABORT
    overrides a stop r's first token hit (the prefill reports its first token only once the KV is
    sent, so an abort or failed transfer before then wins). `forks` True: the choices still waiting
    on r's prompt (n > 1) end with it, reported too; False (the prefill): they are only dropped with
    r, since the decode reports every choice. `fault`: the PD role that caused an error, when it is
    the peer's."""
    if reason in (FinishReason.ERROR, FinishReason.ABORT) and r.finished:
        r.finish_reason, r.matched_stop = None, None
    if reason is not None:
        r.finish(reason, error, code, fault)
    for f in r.choice.forks:
        kv.release(f)  # a waiting choice holds nothing but, on a hybrid model, its state slot
        if forks:
            f.finish(r.finish_reason or FinishReason.ABORT, r.error, r.error_code, r.error_fault)
            outbox.add(f)
    if forks:
        r.choice.forks = []
    kv.release(r)
    outbox.add(r)
