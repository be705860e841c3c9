"""Prefill worker: compute each prompt's KV chunk by chunk and stream it to the room's decode.

Queues of one request (a room):
  bootstrap  sender created; waiting for the decode's TransferInfo (bootstrap timeout applies).
             A decode that holds the prompt's first pages itself (decode-side prefix reuse) names
             them by count and hash; if they hash as this prompt's, those pages are never sent
             (Room.first_page), else the TransferInfo is refused and the decode asks again, whole.
             A busy decode holds the request in its own queue until it has KV memory for it, and says
             so in its heartbeats: such a room (stats queue "queued_at_decode") is kept waiting, its
             bootstrap timeout counted from the decode's last word (counter rooms_kept_queued: rooms
             kept past it); nothing is computed or held for it here meanwhile. A decode that ends it
             there (its queue full or its queue deadline passed) has the room ended here too
  waiting    the decode is ready; prompt chunks run in extend batches under the token budget, in
             the waiting order (engine.scheduling.policy: --schedule-policy, sjf by default:
             shortest prompt first, aging bound; then priority when enabled), each new prompt
             taking its longest cached prefix's pages (locked until the room ends), and after each
             chunk the pages it completed are sent (they move on the transfer progress thread while
             the next chunk computes; with --tp > 1 they are first gathered from the ranks into
             full pages, all KV heads, on this thread: engine/distributed/tp_kv.py); the last chunk sends the
             remaining pages plus metadata
             (first token, its logprob and top alternatives, room; with n > 1 every choice's first
             token, sampled from the same last row: `fork_meta`). Sliding-window models send only
             the last window.
  inflight   everything queued for sending; waiting for the decode's SUCCESS ack
             (this side's cached prefix pages are sent like computed ones: the decode gets every
             prompt page it did not name as its own)
  done       the prompt's full pages go to the prefix cache, the rest freed; the request reported
             finished with its first token (and input logprobs)

A room the decode chose to prefill itself (conditional disaggregation: its TransferInfo says
local_prefill) ends in the bootstrap queue, finished with no tokens and no error, never computed.

A room that fails anywhere (timeout, abort, peer lost, incompatible KV) frees its pages at once and
reports the transfer error's code and message. Every room ends in `_end` (engine.scheduling.lifecycle's
finish_request into the role's Outbox). One step: poll rooms -> schedule (plan chunks) -> run (one
forward) -> postprocess (send each chunk's pages) -> poll inflight -> report (drain the outbox).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.distributed import tp_runner
from engine.distributed.tp_kv import gather
from engine.extras.features import to_meta
from engine.forward.batch import ExtendItem
from engine.forward.model_runner import ModelRunner
from engine.kvcache.hicache import spec_for_server
from engine.kvcache.kv_manager import KVManager
from engine.request import FinishReason, Req
from engine.scheduling.lifecycle import Outbox, finish_request
from engine.scheduling.planner import ExtendPlanner
from engine.scheduling.policy import waiting_order
from engine.scheduling.scheduler import make_executor
from service import messages as m
from service.channels import WorkerChannels
from service.config import ServerConfig
from service.epd import ImageRoom, ImageRooms
from service.pd import StateWire, TransferStats, gathers_kv, make_transfer_manager, pd_request, transfer_error
from service.stats import Counters, KVStats, WorkerStats
from service.watchdog import PREFILL, SENDING_KV, WAITING_DECODE, Progress
from service.worker import error_out, run_loop, setup_process, token_out
from transfer import KVPoll, KVSender, TransferError, TransferManager

log = logging.getLogger("pdserve.prefill")


@dataclass
class Room:
    req: Req
    sender: KVSender
    first_page: int = 0  # pages before it lie outside every window of the decode (sliding window)
    sent_pages: int = 0  # pages sent so far, counted from page 0 (the skipped ones count as sent)
    t_ready: float = field(default_factory=time.monotonic)
    t_last_sent: float = 0.0  # when the last chunk (with the metadata) was queued for sending
    images: ImageRoom | None = None  # E/P/D: the room bringing its images' rows from an encoder, until they landed


class PrefillRole:
    """The prefill queues over an injected runner, KV manager and transfer manager."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, kv: KVManager, mgr: TransferManager,
                 images: ImageRooms | None = None) -> None:
        self.runner, self.kv, self.mgr, self.cfg = runner, kv, mgr, cfg
        self.images = images  # E/P/D: image rows from encoders (service/epd.py); None: a text-only model
        self.exec = make_executor(runner, cfg, stop_strings=False)  # a stop string needs the decode's text
        self.planner = ExtendPlanner(kv, cfg, reserve=False)
        self.page_bytes = mgr.wire_page_bytes  # all KV heads (a TP > 1 rank 0 holds fewer)
        self.gather = gathers_kv(runner)  # TP > 1: chunks are gathered from the ranks into full pages
        self.wire = StateWire(runner)  # hybrid models: the prompt's final state follows its last page
        self.bootstrap: list[Room] = []
        self.waiting: deque[Room] = deque()
        self.inflight: list[Room] = []
        self.outbox = Outbox()
        self.tstats = TransferStats()
        self.blocked = False  # the head of `waiting` needs pages that only a finished room frees
        self.declined = 0  # rooms the decode prefilled itself

    # ---- intake -------------------------------------------------------------------------------
    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]:
        req = pd_request(msg, self.kv, "prefill", self.cfg.chunked_prefill_size)
        if isinstance(req, m.TokenOut):  # its prompt can never fit here: a 400
            return [req]
        try:
            sender = self.mgr.create_sender(req.pd.room, req.input_ids, req.cache_namespace)
        except TransferError as e:
            return [error_out(msg.rid, e.message, int(e.code))]
        start = self.kv.window_start(req.num_prompt_tokens)  # the decode reads nothing before it
        room = Room(req, sender, start, start)
        if msg.encoder.host is not None and req.mm is not None and self.images is not None:
            landing = self.images.expect(req, msg.encoder)
            if isinstance(landing, str):
                sender.abort(landing)
                sender.release()
                out = error_out(msg.rid, landing, 503)
                out.retry_after = 1
                return [out]
            room.images = landing
        self.bootstrap.append(room)
        if req.trace is not None:
            req.trace.begin("bootstrap_queue", room=req.pd.room, prompt_tokens=req.num_prompt_tokens)
        log.info("rid=%s room=%d: %d prompt tokens, waiting for the decode", req.rid, req.pd.room,
                 req.num_prompt_tokens)
        return []

    def abort(self, msg: m.AbortReq) -> None:
        for room in [*self.bootstrap, *self.waiting, *self.inflight]:
            if room.req.matches(msg.rid, msg.room, msg.abort_all):
                room.sender.abort(msg.reason or "aborted")
                self._end(room, FinishReason.ABORT, msg.reason or "aborted", 499)

    def close_session(self, session_id: str) -> None:
        """PD services refuse sessions (400): nothing is pinned here."""

    # ---- one iteration ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.outbox) or (bool(self.waiting) and not self.blocked)

    def wait(self, io: WorkerChannels) -> None:
        extra = () if self.images is None else self.images.mgr.wakeups()
        self.mgr.idle_wait(1.0, extra=(io.inbox.socket, *extra))

    def step(self) -> list[m.TokenOut]:
        self.mgr.progress()
        if self.images is not None:
            self.images.progress()
        self._poll_rooms()
        items = self._schedule()
        if items:
            t0 = time.time_ns()
            with contextlib.ExitStack() as bg:  # transfers, acks and heartbeats move during the forward
                bg.enter_context(self.mgr.background())
                if self.images is not None:
                    bg.enter_context(self.images.mgr.background())
                self.exec.run(items, [])
            _trace_chunks(items, t0, time.time_ns())
            self._postprocess(items)
        self._poll_inflight()
        return [token_out(r) for r in self.outbox.drain()]

    def _schedule(self) -> list[ExtendItem]:
        """This step's prompt chunks, in the waiting order (--schedule-policy, then priority:
        engine.scheduling.policy.waiting_order), their pages allocated."""
        order = waiting_order([room.req for room in self.waiting], self.cfg, time.monotonic(), self.kv.prefix_len)
        items = self.planner.plan(order)
        self.blocked = bool(self.waiting) and not items
        return items

    def _postprocess(self, items: list[ExtendItem]) -> None:
        """Send what each chunk completed (the whole rest plus metadata for a finished prompt)."""
        rooms = {id(room.req): room for room in self.waiting}
        for it in items:
            self._after_chunk(rooms[id(it.req)], it)
        self.mgr.progress()

    def _poll_rooms(self) -> None:
        for room in list(self.bootstrap):
            st = room.sender.poll()
            if st == KVPoll.FAILED:
                self._fail(room)
            elif room.images is not None and not self._images_landed(room):
                continue  # E/P/D: the prompt cannot compute before its images' rows are here
            elif room.sender.declined:  # the decode prefilled it itself (conditional disaggregation)
                self.declined += 1
                log.info("rid=%s room=%d: prefilled on the decode", room.req.rid, room.req.pd.room)
                self._end(room, FinishReason.LENGTH, None, 0)
            elif st >= KVPoll.WAITING_FOR_INPUT:
                self.bootstrap.remove(room)
                if room.sender.reused_pages:  # decode-side reuse: it holds these pages already
                    room.first_page = room.sent_pages = room.sender.reused_pages
                room.t_ready = time.monotonic()
                self.waiting.append(room)
                if room.req.trace is not None:
                    room.req.trace.end("bootstrap_queue")
                    room.req.trace.begin("waiting_queue")
        for room in list(self.waiting):
            if room.sender.poll() == KVPoll.FAILED:
                self._fail(room)

    def _images_landed(self, room: Room) -> bool:
        """Poll the room's encoder room: True once its rows are in the request's images; a failure ends it."""
        assert self.images is not None and room.images is not None
        st = self.images.poll(room.images)
        if st == KVPoll.FAILED:
            message, code, _ = transfer_error(room.images.receiver.error, "prefill")
            room.sender.abort(f"image rows from the encoder failed: {message}")  # the decode's room ends too
            # the encoder's room failed (it never came, timed out, or ended): a 5xx the router counts against the
            # encoder and retries (a timeout's 408 would read as the client's fault)
            self._end(room, FinishReason.ERROR, f"image rows from the encoder: {message}", max(code, 502), "encoder")
            return False
        if st != KVPoll.SUCCESS:
            return False
        images, room.images = room.images, None
        bad = self.images.land(room.req, images)
        if bad is not None:
            room.sender.abort(bad)
            self._end(room, FinishReason.ERROR, bad, 500, "encoder")
            return False
        return True

    def _after_chunk(self, room: Room, it: ExtendItem) -> None:
        r = room.req
        if r.trace is not None:
            r.trace.ensure("kv_transfer", room=r.pd.room, page_bytes=self.page_bytes)
        self.kv.checkpoint(r)  # hybrid models with the prefix cache: a state snapshot at a snapshot point
        try:
            if it.completes_prompt:
                meta = {"room": r.pd.room, "first_token": r.token_ids[r.num_prompt_tokens],
                        "cached_tokens": r.kv.cached_tokens, "prompt_tokens": r.num_prompt_tokens}
                if r.logprobs.output:
                    meta["first_logprob"] = r.logprobs.output[0]
                if r.logprobs.output_top:  # [ids, logprobs] of the first token's alternatives
                    meta["first_top_logprobs"] = list(r.logprobs.output_top[0])
                if r.choice.forks:  # n > 1: every other choice's first token, sampled from the same row
                    meta.update(fork_meta(r))
                meta.update(to_meta(r.features))  # hidden states, token_ids_logprob (engine.extras.features)
                self._send(room, r.kv.pages[room.sent_pages :], True, meta)
                room.sent_pages = len(r.kv.pages)
                room.t_last_sent = time.monotonic()
                self.waiting.remove(room)
                self.inflight.append(room)
            else:
                full = r.kv.kv_len // self.kv.page_size
                if full > room.sent_pages:
                    self._send(room, r.kv.pages[room.sent_pages : full], False)
                    room.sent_pages = full
            self.kv.trim(r)  # sliding window: only pages before room.first_page go, never a sent one
        except (ValueError, TransferError) as e:  # the room failed between poll and send
            if room.sender.poll() == KVPoll.FAILED:
                self._fail(room)
            else:
                room.sender.abort(str(e))
                self._end(room, FinishReason.ERROR, f"KV send failed: {e}", 500)

    def _send(self, room: Room, pages: list[int], is_last: bool, meta: dict | None = None) -> None:
        """Queue pages for the room's decode; TP > 1: gathered from every rank into full wire pages
        first (a collective, here on the worker thread, never on the transfer progress thread)."""
        data = gather(self.runner, pages) if self.gather and pages else None
        if is_last:
            pages, data = self.wire.with_state(room.req, pages, data)
        room.sender.send(pages, is_last, meta, data=data)

    def _poll_inflight(self) -> None:
        for room in list(self.inflight):
            st = room.sender.poll()
            if st == KVPoll.SUCCESS:
                r = room.req
                now = time.monotonic()
                pages = len(r.kv.pages) - room.first_page
                self.tstats.success(pages * self.page_bytes, now - room.t_ready, now - room.t_last_sent)
                if r.trace is not None:
                    r.trace.end("kv_transfer", pages=pages, bytes=pages * self.page_bytes)
                if r.finish_reason is None:  # prefill's part ends with the first token
                    r.finish(FinishReason.LENGTH)
                self._end(room)
            elif st == KVPoll.FAILED:
                self._fail(room)

    def _fail(self, room: Room) -> None:
        self.tstats.failed += 1
        message, code, fault = transfer_error(room.sender.error, "prefill")
        log.warning("rid=%s room=%d: %s", room.req.rid, room.req.pd.room, message)
        if room.sender.error is not None:  # the decode refused it as overloaded: the same Retry-After
            room.req.retry_after = room.sender.error.retry_after
        self._end(room, FinishReason.ERROR, message, code, fault)

    def _end(self, room: Room, reason: FinishReason | None = None, error: str | None = None, code: int = 0,
             fault: str = "") -> None:
        """Take the room out of its queue and end its request (reason None: it finished itself). An
        error or abort overrides a stop its first token hit; its choices (n > 1) are the decode's to
        report, so they are dropped with it."""
        for q in (self.bootstrap, self.waiting, self.inflight):
            if room in q:
                q.remove(room)
        finish_request(room.req, self.kv, self.outbox, reason, error, code, fault, forks=False)
        room.sender.release()
        if room.images is not None and self.images is not None:
            self.images.close(room.images)
            room.images = None
        self.blocked = False

    # ---- reporting ----------------------------------------------------------------------------
    def busy(self) -> int:
        return len(self.bootstrap) + len(self.waiting) + len(self.inflight)

    def stats(self) -> WorkerStats:
        link = self.mgr.stats()
        queued = [room for room in self.bootstrap if room.sender.queued_at]  # waiting in their decode's queue
        return WorkerStats(
            queues={"bootstrap": len(self.bootstrap) - len(queued), "queued_at_decode": len(queued),
                    "waiting": len(self.waiting), "inflight": len(self.inflight)},
            # the prefill pool's autoscaling signal (pdserve_worker_queued_prompt_tokens); rooms queued at
            # their decode wait for its memory, not for this pool's compute
            queued_prompt_tokens=sum(room.req.num_prompt_tokens - room.req.kv.kv_len
                                     for room in (*self.bootstrap, *self.waiting) if not room.sender.queued_at),
            kv=KVStats(used_tokens=self.kv.used_tokens, total_tokens=self.kv.pool.total_tokens,
                       state_slots_used=None if self.kv.states is None else self.kv.slots_used),
            active_rooms=self.mgr.active_rooms(),
            counters=Counters(forward_tokens=self.exec.forward_tokens, rooms_prefilled_on_decode=self.declined,
                              rooms_kept_queued=link.kept_queued,
                              images_encoded=None if self.exec.encoder is None else self.exec.encoder.images_encoded,
                              image_cache_hits=None if self.exec.encoder is None else self.exec.encoder.cache_hits),
            link=link, transfer=self.tstats.totals(), prefix=self.kv.cache_stats())

    def progress(self) -> Iterable[Progress]:
        """For the watchdog (service.watchdog): a room waiting for its decode or for its turn to compute
        moves with this worker (tokens computed, rooms ended) and with its sender's state; one computing,
        with its computed tokens; one sending, with its sender's."""
        worker = (self.exec.forward_tokens, self.tstats.succeeded, self.tstats.failed)
        for room in self.bootstrap:
            yield Progress(room.req, WAITING_DECODE, (worker, room.sender.moved))
        for room in self.waiting:
            yield Progress(room.req, PREFILL, (worker, room.req.kv.kv_len))
        for room in self.inflight:
            yield Progress(room.req, SENDING_KV, room.sender.moved)

    def fail(self, req: Req, why: str) -> None:
        """End a room the watchdog found stuck (its decode is told: the sender aborts)."""
        for room in [*self.bootstrap, *self.waiting, *self.inflight]:
            if room.req is req:
                room.sender.abort(why)
                self._end(room, FinishReason.ERROR, why, 503)
                return

    def close(self) -> None:
        for room in [*self.bootstrap, *self.waiting, *self.inflight]:
            room.sender.abort("prefill worker shutting down")
        self.mgr.close()
        if self.images is not None:
            self.images.close_all()


def fork_meta(r: Req) -> dict:
    """The first tokens (and logprobs) of choices 1..n-1, for the decode's forks (engine.scheduling.parallel)."""
    forks = r.choice.forks
    meta: dict = {"fork_tokens": [f.token_ids[f.num_prompt_tokens] for f in forks]}
    if r.logprobs.on:
        meta["fork_logprobs"] = [f.logprobs.output[0] for f in forks]
    if r.logprobs.top_k:
        meta["fork_top_logprobs"] = [list(f.logprobs.output_top[0]) for f in forks]
    return meta


def _trace_chunks(items: list[ExtendItem], t0: int, t1: int) -> None:
    """One `prefill.chunk` span per traced request of the extend batch that ran from t0 to t1 (ns)."""
    for it in items:
        t = it.req.trace
        if t is not None:
            t.end("waiting_queue", end_ns=t0)  # the wait ended when its first chunk's forward began
            t.span("chunk", t0, t1, tokens=it.num_tokens, start=it.req.kv.kv_len - it.num_tokens,
                   last=it.completes_prompt, batch_requests=len(items))


def run_prefill_worker(cfg: ServerConfig,
                       make_runner: Callable[[EngineConfig], ModelRunner] = tp_runner.make_runner) -> None:
    """The prefill worker process; `make_runner` builds the model runner (tests pass a wrapper)."""
    setup_process(cfg)
    runner = make_runner(dataclasses.replace(cfg.engine, decodes=False))  # no state slots for verifies
    mgr = make_transfer_manager(cfg, runner, "prefill")
    kv = KVManager.for_runner(runner, cfg.engine.prefix_cache, spec_for_server(cfg))
    images = ImageRooms.for_server(cfg, runner.model_cfg, runner.device, runner.dtype)  # E/P/D landing
    role = PrefillRole(cfg.engine, runner, kv, mgr, images)
    info = {"role": "prefill", **runner.server_info(), "bootstrap_port": mgr.bootstrap_port,
            "advertise_host": cfg.pd.advertise_host or "127.0.0.1"}
    run_loop(cfg, role, info)
