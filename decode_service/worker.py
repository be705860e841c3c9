"""Decode worker: reserve pages, receive a prompt's KV from its prefill, then decode with the rest.

Queues of one request:
  prealloc   waiting for KV pages for its prompt; admitted in the waiting order (arrival order, or
             most urgent first with --enable-priority-scheduling: engine.scheduling.policy) when the
             admission rule (KVManager.can_admit) admits it: the free pages cover the prompt plus the
             reservation (new_token_ratio of max_new_tokens) of every request already admitted;
             retracted requests ranked before it are reloaded first. With priority, a request that
             does not fit retracts less urgent running ones (engine.scheduling.priority.preempt)
             With the prefix cache (on unless --disable-prefix-cache), the prompt's longest cached
             page-aligned prefix (never its last token) is taken from this decode's own tree,
             locked, and pages are reserved only for the rest. Not for a hybrid recurrent model:
             the decode never has a prompt's state at a prefix's end (it receives only the final
             state), so it keeps no prefix cache for one (`decode_engine_config`)
             While it waits, its room is held (TransferManager.hold_room): the prefill hears that it
             is queued here and keeps it waiting, computing nothing, so its bootstrap timeout never
             ends a request this healthy decode will serve. Bounds: at most --max-queued-requests
             wait (one more is refused at once) and each waits at most --queue-timeout seconds;
             both refusals are 503 with Retry-After, and the prefill ends the room too
  transfer   a receiver for the room holds the pages; KV arrives from the prefill (waiting timeout);
             with --tp > 1 each message lands in a buffer of full pages that is scattered to every
             rank's pool, each rank its KV heads, as it lands (before the request joins running;
             engine/distributed/tp_kv.py).
             Decode-side reuse: the TransferInfo names the cached prefix (tokens + hash) and only
             the pages after it are sent; a prefill whose prompt hashes otherwise refuses it, and
             the request goes back to the head of prealloc to ask again for the whole prompt
  local      (conditional disaggregation) a prompt of at most --local-prefill-threshold uncached
             tokens is prefilled here instead (while the local queue, it included, stays within the
             threshold and fewer than --local-prefill-max-running requests decode or wait for a
             local step here), in chunks of at most --local-prefill-budget tokens per step
             beside the running decodes; so is one the router marks as "its prefill is busy" while
             its KV fits here now and the local queue stays within --local-prefill-max-queued
             tokens. Its prefill is told to end the room without computing
  running    the prefill's first token is committed (n > 1: each choice's first token from the
             metadata, and the choices fork the received KV: Scheduler.join_running); one token per
             decode step; when pages run out
             the newest running requests are retracted to the host pool and later reloaded
             (engine.scheduling.scheduler.Scheduler does the running part, as in colocated mode)

Finish, abort or failure frees every page and host copy the request holds (with the cache, its
prompt+output full pages go to the tree and its lock is dropped): engine.scheduling.lifecycle.finish_request,
into the Outbox this role shares with its scheduler, whose queues it only queries (load, full, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from engine.config import EngineConfig
from engine.distributed import tp_runner
from engine.distributed.tp_kv import scatter
from engine.extras.features import from_meta
from engine.forward.model_runner import ModelRunner
from engine.kvcache.hicache import spec_for_server
from engine.kvcache.kv_manager import KVManager, reservation
from engine.kvcache.memory import pages_for
from engine.request import FinishReason, Req
from engine.scheduling.lifecycle import Outbox, finish_request
from engine.scheduling.parallel import choices
from engine.scheduling.policy import waiting_order
from engine.scheduling.scheduler import Scheduler
from service import messages as m
from service.channels import WorkerChannels
from service.config import PDConfig, ServerConfig
from service.pd import StateWire, TransferStats, make_transfer_manager, pd_request, scatters_kv, transfer_error
from service.stats import WorkerStats
from service.tracing import scheduler_hook
from service.watchdog import QUEUED, WAITING_KV, Progress, scheduler_progress
from service.worker import error_out, run_loop, setup_process, token_out
from transfer import ErrorCode, KVPoll, KVReceiver, TransferError, TransferManager

RECENT_ADMISSIONS = 16  # admissions the Retry-After estimate of a refused request looks back on

log = logging.getLogger("pdserve.decode")


class DecodeRole:
    """The decode queues over an injected runner, KV manager and transfer manager."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, kv: KVManager, mgr: TransferManager,
                 local_threshold: int = 0, local_budget: int = PDConfig.local_prefill_budget, local_max_queued: int = 0,
                 local_max_running: int = 0, max_queued: int = PDConfig.max_queued_requests,
                 queue_timeout: float = PDConfig.queue_timeout_s) -> None:
        self.cfg, self.runner, self.kv, self.mgr = cfg, runner, kv, mgr
        # the prealloc queue's bounds: requests waiting for KV memory, and seconds each may wait
        self.max_queued, self.queue_timeout = max_queued, queue_timeout
        self.refused = {"queue_rejected": 0, "queue_timed_out": 0}
        self.admitted_at: deque[float] = deque(maxlen=RECENT_ADMISSIONS)  # when recent requests left prealloc
        # conditional disaggregation: prompts of at most local_threshold tokens are prefilled here,
        # at most local_budget prompt tokens per step beside the running decodes; so is a request the
        # router marks (its prefill is busy) while the local queue holds at most local_max_queued tokens;
        # a short prompt only while fewer than local_max_running requests are in its scheduler (0: no bound)
        self.local_threshold = local_threshold
        self.local_max_queued = local_max_queued
        self.local_max_running = local_max_running
        budget = dataclasses.replace(cfg, max_prefill_tokens=local_budget,
                                     chunked_prefill_size=min(cfg.chunked_prefill_size, local_budget))
        self.outbox = Outbox()  # shared with the scheduler: one drain reports both
        self.sched = Scheduler(runner, budget, kv, on_event=scheduler_hook(), outbox=self.outbox)
        self.prefills = {"local": 0, "local_busy_prefill": 0, "remote": 0, "remote_decode_busy": 0}
        self.page_bytes = mgr.wire_page_bytes  # all KV heads (a TP > 1 rank 0 holds fewer)
        self.prealloc: deque[Req] = deque()
        self.transfer: dict[int, tuple[Req, KVReceiver, float]] = {}  # room -> (req, receiver, start)
        self.staged = scatters_kv(runner)  # TP > 1: received pages are scattered to the ranks' pools
        self.wire = StateWire(runner)  # hybrid models: the prompt's state lands in pages after its KV
        self.landing: dict[int, list[int]] = {}  # room -> the pages its state lands in (freed once copied)
        self.tstats = TransferStats()
        self.whole: set[int] = set()  # rooms whose prefill refused our cached prefix: no reuse
        self.reuse = {"pages": 0, "refused": 0}  # pages not transferred thanks to reuse; refusals

    # ---- intake -------------------------------------------------------------------------------
    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]:
        req = pd_request(msg, self.kv, "decode", 1)
        if isinstance(req, m.TokenOut):  # its prompt can never fit here: a 400
            return [req]
        room = req.pd.room
        if room in self.transfer or any(r.pd.room == room for r in self.prealloc):
            return [error_out(msg.rid, f"room {room} is already in use on this decode", 409)]
        why = self._local_reason(req, msg.pd.prefill_here)
        if why:
            self._prefill_here(req, why)
            return []
        if len(self.prealloc) >= self.max_queued:
            self.refused["queue_rejected"] += 1
            self._end_queued(req, FinishReason.ERROR, f"decode queue full: {len(self.prealloc)} queued for KV memory "
                             f"(--max-queued-requests {self.max_queued})", 503, self._retry_after())
            return []
        try:
            self.mgr.hold_room(room, req.pd.addr)  # its prefill keeps the room waiting while it is queued here
        except ValueError as e:  # a bad bootstrap address
            return [error_out(msg.rid, str(e), 400)]
        self.prefills["remote"] += 1
        self.prealloc.append(req)
        if req.trace is not None:
            req.trace.begin("admission", room=room, prompt_tokens=req.num_prompt_tokens)
        return []

    def _local_reason(self, req: Req, hinted: bool) -> str:
        """Why this request is prefilled here ("" = it is not): a short uncached prompt (with the
        decode's prefix cache, a conversation's next turn costs only its new tokens) while the local
        prefill queue, this prompt included, stays within local_threshold tokens and this decode is
        not busy (fewer than local_max_running requests in its scheduler: decoding, queued for local
        prefill, or retracted; requests still waiting for their KV cost it no step yet), since under load
        its steps are worth more to the running streams than the round trip saved; or a busy prefill (the
        router's hint) while this decode has room: the prompt's KV fits now under the admission rule
        and the local prefill queue stays within local_max_queued tokens. A prompt with images never is: its
        prefill computes it (with its image cache, or the rows an encoder sent it), so a decode holds no tower
        input (its requests carry no pixels)."""
        if req.mm is not None:
            return ""
        new = req.num_prompt_tokens - self.kv.prefix_len(req)  # only what this decode's cache lacks is computed
        short = new <= self.local_threshold
        queued = self.sched.queued_prefill_tokens() if short or hinted else 0  # only these two rules read it
        load = self.sched.load()
        # the local queue holds at most one threshold of prompt tokens, so a local prompt's first chunk
        # waits at most threshold / budget steps (a burst of short prompts spills over to the prefill)
        if short and queued + new <= self.local_threshold and (not self.local_max_running
                                                                or load < self.local_max_running):
            return f"{new} uncached prompt tokens <= {self.local_threshold}"
        why = self._busy_prefill_reason(req, new, queued) if hinted else ""
        if short and not why:
            self.prefills["remote_decode_busy"] += 1  # short enough, but this decode is busy: PD
        return why

    def _busy_prefill_reason(self, req: Req, new: int, queued: int) -> str:
        """The router's hint (its prefill is busy) is taken while the prompt's KV fits here now and the
        local prefill queue (`queued` tokens) plus this prompt's new tokens stay within local_max_queued."""
        if queued + new > self.local_max_queued or not self._fits(req, busy=True):
            return ""
        self.prefills["local_busy_prefill"] += 1
        return "its prefill is busy (router's hint)"

    def _prefill_here(self, req: Req, why: str) -> None:
        """Conditional disaggregation: a short prompt costs less to compute here than its PD round
        trip, and a busy prefill would make it wait. Its prefill is told to end the room without
        computing (TransferInfo.local_prefill); the scheduler prefills it in chunks under the local
        budget, beside the running decodes."""
        try:
            self.mgr.decline_room(req.pd.room, req.pd.addr)
        except ValueError as e:  # a bad bootstrap address: the prefill never hears of this room either
            log.warning("rid=%s: %s", req.rid, e)
        self.prefills["local"] += 1
        log.info("rid=%s room=%d: prefilled on this decode: %s", req.rid, req.pd.room, why)
        self.sched.add(req)

    def abort(self, msg: m.AbortReq) -> None:
        def hit(r: Req) -> bool:
            return r.matches(msg.rid, msg.room, msg.abort_all)

        reason = msg.reason or "aborted"
        for r in [r for r in self.prealloc if hit(r)]:
            self.prealloc.remove(r)
            self._end_queued(r, FinishReason.ABORT, reason, 499)
        for room, (r, rx, _) in list(self.transfer.items()):
            if hit(r):
                rx.abort(reason)
                self._drop_transfer(room)
                self._report(r, FinishReason.ABORT, reason, 499)
        self.sched.abort(msg.rid, msg.room, msg.abort_all, reason)

    def close_session(self, session_id: str) -> None:
        """PD services refuse sessions (400): nothing is pinned here."""

    # ---- one iteration ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.sched.has_work() or bool(self.outbox)

    def wait(self, io: WorkerChannels) -> None:
        self.mgr.idle_wait(1.0, extra=(io.inbox.socket,))

    def step(self) -> list[m.TokenOut]:
        self.mgr.progress()
        self._poll_transfers()  # schedule: received prompts join the batch, failed rooms end
        self._end_queued_rooms()  # queued requests whose prefill ended their room, or past --queue-timeout
        self._admit()  # schedule: prealloc -> transfer
        if self.sched.has_work():
            with self.mgr.background():  # receives, acks and heartbeats move during the forward
                self.sched.step()  # run and postprocess
        self.mgr.progress()
        return [token_out(r) for r in self.outbox.drain()]

    def _end_queued_rooms(self) -> None:
        """End the prealloc requests whose room their prefill ended (it aborted, or it is lost), and those
        that waited --queue-timeout seconds for KV memory (503 with Retry-After; the prefill ends it too)."""
        ended = self.mgr.ended_rooms()
        now = time.monotonic()
        late = [r for r in self.prealloc if r.pd.room in ended or now - r.created > self.queue_timeout]
        for r in late:
            self.prealloc.remove(r)
            err = ended.get(r.pd.room)  # type: ignore[arg-type]
            if err is not None:
                message, code, fault = transfer_error(err, "decode")
                log.warning("rid=%s room=%d: %s", r.rid, r.pd.room, message)
                self._report(r, FinishReason.ERROR, message, code, fault)
            else:
                self.refused["queue_timed_out"] += 1
                self._end_queued(r, FinishReason.ERROR, f"waited {self.queue_timeout:g} s for decode KV memory "
                                 "(--queue-timeout)", 503, self._retry_after())

    def _retry_after(self) -> int:
        """Seconds after which a request this decode refuses now may find its queue moved: the mean gap
        between its recent admissions, or the time since the last one when longer (a stalled queue;
        --queue-timeout when none was admitted yet); 1 at least, --queue-timeout at most."""
        times, cap = self.admitted_at, math.ceil(self.queue_timeout)
        gap = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        stalled = time.monotonic() - times[-1] if times else cap
        return max(1, min(cap, math.ceil(max(gap, stalled))))

    def _end_queued(self, r: Req, reason: FinishReason, error: str, code: int, retry_after: int = 0) -> None:
        """End a request that holds no receiver (queued in prealloc, or refused before it): its prefill is
        told to end the room too; `retry_after` (an overload 503) goes to the client with every choice."""
        try:
            self.mgr.end_room(r.pd.room, r.pd.addr, error, code, retry_after)  # type: ignore[arg-type]
        except ValueError as e:  # a bad bootstrap address: its prefill never hears of this room
            log.warning("rid=%s: %s", r.rid, e)
        for c in choices(r):
            c.retry_after = retry_after
        log.info("rid=%s room=%d: %s", r.rid, r.pd.room, error)
        self._report(r, reason, error, code)

    def _reserved_pages(self) -> int:
        rooms = [r for r, _, _ in self.transfer.values()]
        pending = reservation((c for r in rooms for c in choices(r)), self.cfg.new_token_ratio, self.kv.page_size)
        return self.sched.reserved_pages() + pending + sum(self._fork_pages(r) for r in rooms)

    def _fork_pages(self, r: Req) -> int:
        """Pages r's choices 2..n take when its KV arrives (KVManager.fork)."""
        return len(r.choice.forks) * self.kv.fork_pages(r.num_prompt_tokens)

    def _fits(self, r: Req, busy: bool) -> bool:
        """The admission rule (KVManager.can_admit) for a whole prompt's KV now: its pages from the
        window's start on, less the cached prefix it already holds, plus its forks' pages."""
        n = r.num_prompt_tokens
        need = pages_for(n, self.kv.page_size) - max(self.kv.window_start(n), r.kv.shared_pages) + \
            self._fork_pages(r) + self.wire.pages
        return self.kv.can_admit(r, need, self._reserved_pages(), self.cfg.new_token_ratio, busy)

    def _busy(self) -> bool:
        return bool(self.sched.counts().running or self.transfer)

    def _admit(self) -> None:
        """Prealloc -> transfer, in the waiting order (engine.scheduling.policy) of the prealloc queue
        together with the requests the scheduler retracted: nothing new is admitted behind a retracted
        request ranked before it (it is reloaded first; without priority, every retracted one is)."""
        if not self.prealloc:
            return
        order = waiting_order([*self.sched.retracted(), *self.prealloc], self.cfg, time.monotonic(),
                              self.kv.prefix_len)
        self.prealloc = deque(r for r in order if not r.is_retracted)
        for r in order:
            if r.is_retracted or self.sched.full(pending=len(self.transfer)):
                return
            if not self._admit_one(r):
                return  # wait for memory

    def _admit_one(self, r: Req) -> bool:
        """Reserve r's pages and open its receiver if the admission rule admits its KV now, after
        retracting less urgent running requests when priority allows; False: r waits, holding nothing."""
        if r.pd.room not in self.whole:
            self.kv.match(r)  # decode-side reuse: the cached prefix's pages, locked (none: no cache)
        if not self._fits(r, self._busy()) and not self._preempt_for(r):
            self.kv.unmatch(r)
            return False
        assert self.prealloc[0] is r
        self.prealloc.popleft()
        self.admitted_at.append(time.monotonic())
        self._receive(r)
        return True

    def _preempt_for(self, r: Req) -> bool:
        """--enable-priority-scheduling: retract running requests less urgent than r (the scheduler's
        preemption, engine.scheduling.priority) until its KV fits; returns whether it fits now."""
        if not self.cfg.enable_priority_scheduling:
            return False

        def admits() -> bool:
            return self._fits(r, self._busy())

        return self.sched.preempt_for(r, admits, time.monotonic()) > 0 and admits()

    def _receive(self, r: Req) -> None:
        """Reserve r's uncached prompt pages and open the receiver for its room."""
        kv, n = r.kv, r.num_prompt_tokens
        kv.dropped_pages = self.kv.window_start(n)  # sliding window: pages no query will read
        if not kv.shared_pages:
            kv.pages = [0] * kv.dropped_pages  # 0 marks a page never held
        skip = len(kv.pages)  # pages not transferred: outside the window, or cached here
        need = pages_for(n, self.kv.page_size) - skip
        kv.pages = kv.pages + self.kv.allocate(need)
        self.kv.take_slots(r)  # hybrid models: r's state slot (and its choices'), filled from the landing pages
        landing = self.landing[r.pd.room] = self.kv.allocate(self.wire.pages)  # type: ignore[index]
        cached = r.token_ids[: kv.shared_pages * self.kv.page_size]
        try:
            rx = self.mgr.create_receiver(r.pd.room, r.pd.addr, kv.pages[skip:] + landing, cached,
                                          staged=self.staged, namespace=r.cache_namespace)
        except (TransferError, ValueError) as e:
            self._free_landing(r.pd.room)  # type: ignore[arg-type]
            code = int(e.code) if isinstance(e, TransferError) else 400
            self._end_queued(r, FinishReason.ERROR, getattr(e, "message", str(e)), code)
            return
        self.transfer[r.pd.room] = (r, rx, time.monotonic())  # type: ignore[index]
        if r.trace is not None:
            r.trace.end("admission", pages=need)
            r.trace.begin("kv_transfer", room=r.pd.room, pages=need)

    def _poll_transfers(self) -> None:
        for room, (r, rx, t0) in list(self.transfer.items()):
            if self.staged:  # every rank stores its heads of the pages landed so far (a collective)
                for pages, buf in rx.landed():
                    pages, buf = self.wire.keep(self.landing.get(room), pages, buf)  # hybrid: the state's pages
                    if pages:
                        scatter(self.runner, pages, buf)
            st = rx.poll()
            if st == KVPoll.FAILED and rx.error is not None and rx.error.code == ErrorCode.PREFIX_MISMATCH:
                self._ask_whole(room)
            elif st == KVPoll.SUCCESS:
                meta = rx.metadata or {}
                if self.landing.get(room):
                    self.wire.land(r, self.landing[room])
                self._drop_transfer(room, keep_pages=True)
                self.reuse["pages"] += r.kv.shared_pages
                nbytes = (len(r.kv.pages) - max(r.kv.dropped_pages, r.kv.shared_pages)) * self.page_bytes
                self.tstats.success(nbytes, time.monotonic() - t0)
                if r.trace is not None:
                    r.trace.end("kv_transfer", bytes=nbytes)
                self._commit(r, meta)
            elif st == KVPoll.FAILED:
                self.tstats.failed += 1
                message, code, fault = transfer_error(rx.error, "decode")
                log.warning("rid=%s room=%d: %s", r.rid, room, message)
                self._drop_transfer(room)
                self._report(r, FinishReason.ERROR, message, code, fault)

    def _ask_whole(self, room: int) -> None:
        """The prefill refused our cached prefix (its prompt hashes otherwise): give back the pages
        reserved for the rest, drop the lock, and ask again at the head of prealloc, for every page.
        Nothing was received, so no wrong KV can remain."""
        r, rx, _ = self.transfer.pop(room)
        self._free_landing(room)
        log.warning("rid=%s room=%d: %s; asking for the whole prompt", r.rid, room,
                    rx.error.message if rx.error else "cached prefix refused")
        rx.release()
        self.kv.unreserve(r)
        self.whole.add(room)
        self.reuse["refused"] += 1
        if r.trace is not None:
            r.trace.end("kv_transfer", refused="cached prefix")
            r.trace.begin("admission", room=room, prompt_tokens=r.num_prompt_tokens)
        self.mgr.hold_room(room, r.pd.addr)  # type: ignore[arg-type]  # queued again: its prefill keeps waiting
        self.prealloc.appendleft(r)

    def _commit(self, r: Req, meta: dict) -> None:
        """The prompt's KV is in place: take the prefill's first token and join the decode batch."""
        if "first_token" not in meta:
            self._report(r, FinishReason.ERROR, "the prefill sent no first token", 500)
            return
        firsts = [meta["first_token"], *(meta.get("fork_tokens") or [])]
        if len(firsts) != len(choices(r)):
            why = f"the prefill sent {len(firsts)} first tokens for n={len(choices(r))}"
            self._report(r, FinishReason.ERROR, why, 500)
            return
        # the forks' pages were counted at admission, but running requests may have grown into them
        # since: the scheduler retracts its newest running requests until they fit
        if not self.sched.make_room(self._fork_pages(r)):
            self._report(r, FinishReason.ERROR, "out of KV memory for the choices of n > 1", 503)
            return
        self.whole.discard(r.pd.room)  # type: ignore[arg-type]
        r.kv.kv_len = r.num_prompt_tokens
        r.kv.cached_tokens = int(meta.get("cached_tokens", 0))  # the prefill's hit: usage reports compute saved
        lps = [meta.get("first_logprob", 0.0), *(meta.get("fork_logprobs") or [])]
        tops = [meta.get("first_top_logprobs"), *(meta.get("fork_top_logprobs") or [])]
        for i, c in enumerate(choices(r)):
            c.append_token(int(firsts[i]))
            if c.logprobs.on:
                c.logprobs.output.append(float(lps[i] if i < len(lps) else 0.0))
                top = tops[i] if i < len(tops) else None
                if c.logprobs.top_k and top:
                    c.logprobs.output_top.append((list(top[0]), list(top[1])))
        from_meta(r.features, meta)  # hidden states, token_ids_logprob (engine.extras.features)
        self.sched.join_running(r)  # n > 1: the choices fork r's KV first

    def _free_landing(self, room: int) -> None:
        landing = self.landing.pop(room, None)
        if landing:
            self.wire.drop(landing)
            self.kv.pool.allocator.free(landing)

    def _drop_transfer(self, room: int, keep_pages: bool = False) -> None:
        r, rx, _ = self.transfer.pop(room)
        self._free_landing(room)
        rx.release()
        if not keep_pages:
            self.kv.release(r)

    def _report(self, r: Req, reason: FinishReason, error: str | None, code: int, fault: str = "") -> None:
        """End a request this role holds (prealloc or transfer): n > 1, its waiting choices with it."""
        self.whole.discard(r.pd.room)  # type: ignore[arg-type]
        finish_request(r, self.kv, self.outbox, reason, error, code, fault)

    # ---- reporting ----------------------------------------------------------------------------
    def busy(self) -> int:
        return len(self.prealloc) + len(self.transfer) + self.sched.load()

    def stats(self) -> WorkerStats:
        s = WorkerStats.from_scheduler(self.sched.stats())
        s.queues.update(prealloc=len(self.prealloc), transfer=len(self.transfer))
        s.counters = dataclasses.replace(s.counters, **{f"prefills_{k}": v for k, v in self.prefills.items()},
                                         kv_pages_reused_on_decode=self.reuse["pages"],
                                         kv_prefix_refused_by_prefill=self.reuse["refused"], **self.refused)
        # the decode pool's autoscaling signals (pdserve_worker_kv_usage, pdserve_worker_running_requests);
        # the prefix cache's unlocked pages count as free
        s.kv.usage = round(self.kv.used_tokens / max(1, self.kv.pool.total_tokens), 4)
        s.running_requests = self.sched.counts().running
        s.active_rooms, s.link = self.mgr.active_rooms(), self.mgr.stats()
        # KV not moved thanks to reuse; on /metrics: pdserve_worker_transfer_bytes_reused_total
        s.transfer = self.tstats.totals(reused_bytes=self.reuse["pages"] * self.page_bytes)
        return s

    def progress(self) -> Iterable[Progress]:
        """For the watchdog (service.watchdog): queued requests move with this worker (tokens computed,
        transfers ended), a transfer with its room's state and pages landed, the rest as the scheduler's."""
        worker = (self.sched.exec.forward_tokens, self.tstats.succeeded, self.tstats.failed)
        for r in self.prealloc:
            yield Progress(r, QUEUED, worker)
        for r, rx, _ in self.transfer.values():
            yield Progress(r, WAITING_KV, rx.moved)
        yield from scheduler_progress(self.sched.waiting, self.sched.running, worker)

    def fail(self, req: Req, why: str) -> None:
        """End a request the watchdog found stuck, wherever it is held (its room aborted at the prefill)."""
        if req in self.prealloc:
            self.prealloc.remove(req)
            self._end_queued(req, FinishReason.ERROR, why, 503)  # its room is held: the prefill ends it too
        elif req.pd.room in self.transfer and self.transfer[req.pd.room][0] is req:
            self.transfer[req.pd.room][1].abort(why)
            self._drop_transfer(req.pd.room)  # type: ignore[arg-type]
            self._report(req, FinishReason.ERROR, why, 503)
        else:
            self.sched.fail(req, why)

    def close(self) -> None:
        for r in self.prealloc:
            self.mgr.end_room(r.pd.room, r.pd.addr, "decode worker shutting down", 503)  # type: ignore[arg-type]
        for _, rx, _ in self.transfer.values():
            rx.abort("decode worker shutting down")
        self.mgr.close()


def decode_engine_config(cfg: EngineConfig) -> EngineConfig:
    """The engine config a decode builds its runner with: no state slots for prefix-cache snapshots
    (a hybrid model's state arrives only at the prompt's end, so decode-side reuse, which would need
    it at a cached prefix's end, is off for them: their KVManager here has no cache)."""
    return dataclasses.replace(cfg, state_cache_slots=0)


def run_decode_worker(cfg: ServerConfig,
                      make_runner: Callable[[EngineConfig], ModelRunner] = tp_runner.make_runner) -> None:
    """The decode worker process; `make_runner` builds the model runner (a TPRunner driving ranks
    1..N-1 under --tp N; tests pass a wrapper)."""
    setup_process(cfg)
    runner = make_runner(decode_engine_config(cfg.engine))
    mgr = make_transfer_manager(cfg, runner, "decode")
    kv = KVManager.for_runner(runner, cfg.engine.prefix_cache, spec_for_server(cfg))
    role = DecodeRole(cfg.engine, runner, kv, mgr, local_threshold=cfg.pd.local_prefill_threshold,
                      local_budget=cfg.pd.local_prefill_budget, local_max_queued=cfg.pd.local_prefill_max_queued,
                      local_max_running=cfg.pd.local_prefill_max_running, max_queued=cfg.pd.max_queued_requests,
                      queue_timeout=cfg.pd.queue_timeout_s)
    info = {"role": "decode", **runner.server_info(), "advertise_host": cfg.pd.advertise_host or "127.0.0.1"}
    run_loop(cfg, role, info)
