"""The worker process side shared by every role: the step loop, token reports, the Role protocol.

Loop (`run_loop`): take messages -> `role.step()` (schedule, run one forward, process results)
-> report tokens; a role with nothing to compute blocks in `role.wait()`. Roles live in their
services (colocated_service, prefill_service, decode_service) and receive their collaborators
(runner, KV manager, transfer manager) in their constructors, so tests can step them in-process.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import replace
from typing import Protocol

from common import tracing
from common.logs import setup_logging
from engine.extras.features import make_features, report
from engine.kvcache.kv_manager import KVManager
from engine.request import Bootstrap, FinishReason, LogprobState, Req
from engine.scheduling.parallel import add_choices
from service import embeddings, lora
from service import messages as m
from service.channels import WorkerChannels
from service.config import ServerConfig
from service.stats import WorkerStats
from service.tracing import ReqTrace

log = logging.getLogger("pdserve.worker")


def req_from_msg(msg: m.GenerateReq, role: str = "worker") -> Req:
    """The engine's request for an already-validated GenerateReq (traced when it carries a traceparent
    and tracing is on in this process); with n > 1 it carries choices 1..n-1 (engine.scheduling.parallel)."""
    req = Req(
        rid=msg.rid, token_ids=msg.input_ids, sampling=msg.sampling, stream=msg.stream,
        logprobs=LogprobState(on=msg.return_logprob, top_k=msg.top_logprobs_num, start_len=msg.logprob_start_len),
        pd=Bootstrap(msg.bootstrap_host, msg.bootstrap_port, msg.bootstrap_room),
        trace=ReqTrace.for_msg(msg.traceparent, role), resumed_tokens=msg.resumed_tokens,
        priority=msg.priority, extra_key=msg.extra_key, session_id=msg.session_id, lora=msg.lora,
    )
    if msg.return_hidden_states or msg.input_embeds or msg.token_ids_logprob:  # engine.extras.features
        req.features = make_features(msg.return_hidden_states, msg.input_embeds, len(msg.input_ids),
                                     msg.token_ids_logprob)
    add_choices(req, msg.n)
    return req


def token_out(r: Req) -> m.TokenOut:
    """What r produced since the last report; marks it reported (and ends its spans once finished)."""
    if r.trace is not None and r.finished:
        r.trace.annotate("running", completion_tokens=r.num_output_tokens, retractions=r.kv.retractions,
                         finish_reason=r.finish_reason.value if r.finish_reason else "")
        r.trace.close(r.error if r.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) else None)
    sent = r.sent_tokens
    r.sent_tokens = r.num_output_tokens
    out = m.TokenOut(
        rid=r.choice.group or r.rid, index=r.choice.index, new_token_ids=r.token_ids[r.num_prompt_tokens + sent :],
        finished=r.finished, finish_reason=r.finish_reason.value if r.finish_reason else None,
        matched_stop=r.matched_stop, error=r.error, error_code=r.error_code, fault=r.error_fault,
        prompt_tokens=r.num_prompt_tokens, completion_tokens=r.num_output_tokens, cached_tokens=r.kv.cached_tokens,
    )
    if r.logprobs.on:
        _logprobs_out(r.logprobs, sent, out)
    for k, v in report(r.features).items():  # hidden states, token_ids_logprob (engine.extras.features)
        setattr(out, k, v)
    return out


def _logprobs_out(lp: LogprobState, sent: int, out: m.TokenOut) -> None:
    out.new_logprobs = lp.output[sent:]
    out.new_top_logprobs = [[ids, lps] for ids, lps in lp.output_top[sent:]]
    if lp.input_done and not lp.input_sent:  # once, by whoever computed the prompt
        lp.input_sent = True
        out.input_start = lp.start_len
        out.input_logprobs = list(lp.input)
        out.input_top_logprobs = [[ids, lps] for ids, lps in lp.input_top]


def error_out(rid: str, message: str, code: int) -> m.TokenOut:
    return m.TokenOut(rid=rid, new_token_ids=[], finished=True, finish_reason=FinishReason.ERROR.value,
                      error=message, error_code=code)


class Role(Protocol):
    kv: KVManager  # the role's KV manager (its prefix cache, when on)

    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]: ...
    def abort(self, msg: m.AbortReq) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[m.TokenOut]: ...
    def stats(self) -> WorkerStats: ...  # typed numbers for a StatsOut (the loop sets `time`)
    def busy(self) -> int: ...  # requests held anywhere in the role (0: idle, the cache may be flushed)
    def wait(self, io: WorkerChannels) -> None: ...  # block until a message, a transfer event or a timer
    def close(self) -> None: ...


def setup_process(cfg: ServerConfig) -> None:
    """Logging (text or JSON lines) and tracing of a worker process."""
    setup_logging(cfg.log_level, cfg.log_format, f"{cfg.role}-worker")
    tracing.setup(f"pdserve-{cfg.role}", cfg.otlp_endpoint)


def flush_cache(role: Role, token: int) -> m.FlushCacheOut:
    """Empty the prefix cache when nothing is in flight (a request holds locks and pages mid-way)."""
    busy, kv = role.busy(), role.kv
    if busy:
        return m.FlushCacheOut(token=token, ok=False, message=f"cannot flush the prefix cache while {busy} "
                               "request(s) are in flight; retry when idle")
    freed = kv.flush() * kv.page_size
    log.info("prefix cache flushed: %d tokens freed", freed)
    return m.FlushCacheOut(token=token, ok=True, message="prefix cache flushed" if kv.cache is not None
                           else "no prefix cache on this worker", freed_tokens=freed)


def handle(role: Role, msg: m.GenerateReq | m.AbortReq | m.CloseSessionReq) -> list[m.TokenOut]:
    """Hand one frontend message to the role (StatsReq is answered by the loop; a session's close
    goes to roles that keep sessions, engine.scheduling.sessions)."""
    if isinstance(msg, m.GenerateReq):
        return role.add(msg)
    if isinstance(msg, m.CloseSessionReq):
        close = getattr(role, "close_session", None)
        if close is not None:
            close(msg.session_id)
        return []
    role.abort(msg)
    return []


def run_loop(cfg: ServerConfig, role: Role, info: dict) -> None:
    io = WorkerChannels(cfg.endpoints)
    stopping = False

    def on_term(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend owns Ctrl-C and stops us
    # the frontend that spawned us, as recorded at spawn time: it may be gone before the model has
    # loaded, and then os.getppid() here would already name init and never change
    spawner = mp.parent_process()
    parent = spawner.pid if spawner is not None else os.getppid()
    io.outbox.send(m.StatsOut(token=-1, info={**info, "ready": True}))
    log.info("worker ready: %s", {k: info[k] for k in ("role", "model_path", "max_total_tokens") if k in info})
    try:
        while not stopping and os.getppid() == parent:
            if not role.has_work():
                role.wait(io)
            outs: list[m.TokenOut] = []
            for msg in io.inbox.recv_all():
                if isinstance(msg, m.StatsReq):
                    io.outbox.send(m.StatsOut(token=msg.token, info=info,
                                              stats=replace(role.stats(), time=time.time())))
                elif isinstance(msg, m.FlushCacheReq):
                    io.outbox.send(flush_cache(role, msg.token))
                elif isinstance(msg, m.EmbedReq):  # service/embeddings.py: one forward per input, now
                    io.outbox.send(embeddings.handle_worker(role, msg, cfg.engine.chunked_prefill_size))
                elif isinstance(msg, m.LoraReq):  # service/lora.py: load/unload on every TP rank
                    io.outbox.send(lora.handle_worker(role.runner, msg))  # type: ignore[attr-defined]
                else:
                    outs.extend(handle(role, msg))
            outs.extend(role.step())
            if outs:
                io.outbox.send(m.TokenBatch(outs=outs))
    finally:
        role.close()
        io.close()
        tracing.shutdown()
