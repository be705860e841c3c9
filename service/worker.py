"""The worker process side shared by every role: the step loop, token reports, the Role protocol.

Loop (`run_loop`): take messages (`Dispatch`: a table from message type to the Role call that takes
it) -> `role.step()` (schedule, run one forward, process results) -> report tokens; a role with
nothing to compute blocks in `role.wait()`. Roles live in their
services (colocated_service, prefill_service, decode_service) and receive their collaborators
(runner, KV manager, transfer manager) in their constructors, so tests can step them in-process.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from common import tracing
from common.logs import setup_logging
from engine.extras import multimodal
from engine.extras.features import make_features, report
from engine.forward.model_runner import ModelRunner
from engine.kvcache.kv_manager import KVManager
from engine.request import FinishReason, LogprobState, Req
from engine.scheduling.parallel import add_choices
from service import embeddings, kv_events, lora
from service import messages as m
from service.channels import WorkerChannels
from service.config import ServerConfig
from service.stats import WorkerStats
from service.tracing import ReqTrace
from service.watchdog import Progress, Watchdog

log = logging.getLogger("pdserve.worker")


def req_from_msg(msg: m.GenerateReq, role: str = "worker") -> Req:
    """The engine's request for an already-validated GenerateReq (traced when it carries a traceparent
    and tracing is on in this process); with n > 1 it carries choices 1..n-1 (engine.scheduling.parallel)."""
    req = Req(  # the message's groups as they are (engine.request_groups)
        rid=msg.rid, token_ids=msg.input_ids, sampling=msg.sampling, stream=msg.stream,
        logprobs=LogprobState(msg.logprobs), pd=msg.pd, options=msg.options,
        trace=ReqTrace.for_msg(msg.traceparent, role), resumed_tokens=msg.resumed_tokens,
    )
    x = msg.extras
    if x.any:  # engine.extras.features: the embeddings' bytes become a tensor
        req.features = make_features(x.hidden_states, x.input_embeds, len(msg.input_ids), x.token_ids_logprob)
    if msg.images:  # the image spans' ids become their pad values (the prefix cache's key)
        req.mm = multimodal.attach(req.token_ids, msg.images)
    add_choices(req, msg.n)
    for f in req.choice.forks:
        f.mm = req.mm
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
        retry_after=r.retry_after,
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
    """What the worker loop (and the control messages it answers) may ask of a role."""

    kv: KVManager  # the role's KV manager (its prefix cache, when on)
    runner: ModelRunner  # its model (embeddings run a forward on it; LoRA loads go to every TP rank)

    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]: ...
    def abort(self, msg: m.AbortReq) -> None: ...
    def close_session(self, session_id: str) -> None: ...  # a role that keeps no sessions ignores it
    def has_work(self) -> bool: ...
    def step(self) -> list[m.TokenOut]: ...
    def stats(self) -> WorkerStats: ...  # typed numbers for a StatsOut (the loop sets `time`)
    def busy(self) -> int: ...  # requests held anywhere in the role (0: idle, the cache may be flushed)
    def wait(self, io: WorkerChannels) -> None: ...  # block until a message, a transfer event or a timer
    def progress(self) -> Iterable[Progress]: ...  # every request held, its stage and mark (service.watchdog)
    def fail(self, req: Req, why: str) -> None: ...  # end a request the watchdog found stuck (a 503)
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


Msg = TypeVar("Msg")
Reply = m.StatsOut | m.FlushCacheOut | m.EmbedOut | m.LoraOut


class Dispatch:
    """The worker's message table: each frontend message type -> the Role call that takes it.
    Requests (generate, abort, a session's close: engine.scheduling.sessions) report through the
    role's steps; a control message (stats, flush, embeddings, LoRA) is answered at once (`reply`)."""

    def __init__(self, cfg: ServerConfig, role: Role, info: dict, reply: Callable[[Reply], None],
                 watchdog: Watchdog | None = None, events: kv_events.ZmqEventPublisher | None = None) -> None:
        self.reply = reply
        self.table: dict[type, Callable[[Any], list[m.TokenOut]]] = {}
        self.on(m.GenerateReq, role.add)
        self.on(m.AbortReq, _reported_later(role.abort))
        self.on(m.CloseSessionReq, _reported_later(lambda msg: role.close_session(msg.session_id)))
        self.answer(m.StatsReq, lambda msg: m.StatsOut(token=msg.token, info=info,
                                                       stats=_stats(role, watchdog, events)))
        self.answer(m.FlushCacheReq, lambda msg: flush_cache(role, msg.token))
        chunk = cfg.engine.chunked_prefill_size  # service/embeddings.py: one forward per input, now
        self.answer(m.EmbedReq, lambda msg: embeddings.handle_worker(role, msg, chunk))
        self.answer(m.LoraReq, lambda msg: lora.handle_worker(role.runner, msg))  # on every TP rank
        if getattr(role, "language_model", True) is False:  # an encoder: a vision tower alone, nothing to flush,
            # embed or adapt
            self.answer(m.FlushCacheReq, lambda msg: m.FlushCacheOut(msg.token, True, "no prefix cache on this worker"))
            self.answer(m.EmbedReq, lambda msg: m.EmbedOut(msg.token, [], "an encoder has no language model", 400))
            self.answer(m.LoraReq, lambda msg: m.LoraOut(msg.token, False, 400, "an encoder has no language model"))

    def on(self, kind: type[Msg], handler: Callable[[Msg], list[m.TokenOut]]) -> None:
        self.table[kind] = handler

    def answer(self, kind: type[Msg], handler: Callable[[Msg], Reply]) -> None:
        def send(msg: Msg) -> list[m.TokenOut]:
            self.reply(handler(msg))
            return []

        self.table[kind] = send

    def __call__(self, msgs: Iterable[object]) -> list[m.TokenOut]:
        """Hand each message to its handler; returns the token reports they produced."""
        outs: list[m.TokenOut] = []
        for msg in msgs:
            handler = self.table.get(type(msg))
            if handler is None:
                log.warning("ignored a message of unknown type %s", type(msg).__name__)
                continue
            outs.extend(handler(msg))
        return outs


def _stats(role: Role, watchdog: Watchdog | None, events: kv_events.ZmqEventPublisher | None = None) -> WorkerStats:
    """The role's stats, stamped with the worker's clock, the watchdog's and the KV events' drop counts."""
    s = replace(role.stats(), time=time.time())
    if watchdog is not None:
        s.counters = replace(s.counters, watchdog_ended=watchdog.ended)
    if events is not None:
        s.counters = replace(s.counters, kv_events_dropped=events.recorder.dropped)
    return s


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def _reported_later(call: Callable[[Msg], object]) -> Callable[[Msg], list[m.TokenOut]]:
    """A role call that reports nothing now (what it ends is reported by the role's next step)."""

    def run(msg: Msg) -> list[m.TokenOut]:
        call(msg)
        return []

    return run


def run_loop(cfg: ServerConfig, role: Role, info: dict) -> None:
    """The worker's loop: take messages -> `role.step()` (schedule, run one forward, postprocess)
    -> report tokens, until SIGTERM or the frontend that spawned it is gone."""
    io = WorkerChannels(cfg.endpoints)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend owns Ctrl-C and stops us
    # the frontend that spawned us, as recorded at spawn time: it may be gone before the model has
    # loaded, and then os.getppid() here would already name init and never change
    spawner = mp.parent_process()
    parent = spawner.pid if spawner is not None else os.getppid()
    watchdog = Watchdog(cfg.watchdog_timeout_s)
    events = kv_events.start(cfg, role.kv)  # None: --kv-events-endpoint off (docs/kv_events.md)
    if events is not None:
        info = {**info, **events.info(info.get("advertise_host") or _reachable(cfg.host))}
    dispatch = Dispatch(cfg, role, info, io.outbox.send, watchdog, events)
    io.outbox.send(m.StatsOut(token=-1, info={**info, "ready": True}))
    log.info("worker ready: %s", {k: info[k] for k in ("role", "model_path", "max_total_tokens") if k in info})
    try:
        while not stopping.is_set() and os.getppid() == parent:
            if not role.has_work():
                role.wait(io)
            outs = dispatch(io.inbox.recv_all())  # take messages
            outs.extend(role.step())  # schedule -> run -> postprocess
            watchdog.check(role.progress, role.fail, time.monotonic())  # what it ends, the next step reports
            if outs:
                io.outbox.send(m.TokenBatch(outs=outs))  # report
    finally:
        role.close()
        if events is not None:
            events.close()
        io.close()
        tracing.shutdown()
