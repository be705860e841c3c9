"""Prefill worker: compute each prompt's KV chunk by chunk and stream it to the room's decode.

Queues of one request (a room):
  bootstrap  sender created; waiting for the decode's TransferInfo (bootstrap timeout applies).
             A decode that holds the prompt's first pages itself (decode-side prefix reuse) names
             them by count and hash; if they hash as this prompt's, those pages are never sent
             (Room.first_page), else the TransferInfo is refused and the decode asks again, whole
  waiting    the decode is ready; prompt chunks run in extend batches under the token budget, in
             the --schedule-policy order (sjf: shortest prompt first, aging bound), each new prompt
             taking its longest cached prefix's pages (locked until the room ends), and after each
             chunk the pages it completed are sent (they move on the transfer progress thread while
             the next chunk computes); the last chunk sends the remaining pages plus metadata
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
reports the transfer error's code and message.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

from engine.batch import ExtendItem
from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.model_runner import ModelRunner
from engine.request import FinishReason, Req
from engine.scheduler import ExtendPlanner, make_executor, order_waiting
from service import messages as m
from service.channels import WorkerChannels
from service.config import ServerConfig
from service.pd import TransferStats, make_transfer_manager, pd_request, transfer_error
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


class PrefillRole:
    """The prefill queues over an injected runner, KV manager and transfer manager."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, kv: KVManager, mgr: TransferManager,
                 slow_first_forward_s: float = 0.0) -> None:
        self.runner, self.kv, self.mgr, self.cfg = runner, kv, mgr, cfg
        self.slow_first_forward_s = slow_first_forward_s  # test hook: the first forward takes this long
        self.exec = make_executor(runner, cfg, stop_strings=False)  # a stop string needs the decode's text
        self.planner = ExtendPlanner(kv, cfg, reserve=False)
        self.page_bytes = runner.pool.page_bytes
        self.bootstrap: list[Room] = []
        self.waiting: deque[Room] = deque()
        self.inflight: list[Room] = []
        self.outbox: list[m.TokenOut] = []
        self.tstats = TransferStats()
        self.blocked = False  # the head of `waiting` needs pages that only a finished room frees
        self.declined = 0  # rooms the decode prefilled itself

    # ---- intake -------------------------------------------------------------------------------
    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]:
        req, bad = pd_request(msg, self.kv, "prefill", self.cfg.chunked_prefill_size)
        if req is None:
            return [bad]  # type: ignore[list-item]
        try:
            sender = self.mgr.create_sender(req.bootstrap_room, req.input_ids)
        except TransferError as e:
            return [error_out(msg.rid, e.message, int(e.code))]
        start = self.kv.window_start(len(req.input_ids))  # the decode reads nothing before it
        self.bootstrap.append(Room(req, sender, start, start))
        if req.trace is not None:
            req.trace.begin("bootstrap_queue", room=req.bootstrap_room, prompt_tokens=len(req.input_ids))
        log.info("rid=%s room=%d: %d prompt tokens, waiting for the decode", req.rid, req.bootstrap_room,
                 len(req.input_ids))
        return []

    def abort(self, msg: m.AbortReq) -> None:
        for room in [*self.bootstrap, *self.waiting, *self.inflight]:
            if room.req.matches(msg.rid, msg.room, msg.abort_all):
                room.sender.abort(msg.reason or "aborted")
                self._end(room, FinishReason.ABORT, msg.reason or "aborted", 499)

    # ---- one iteration ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.outbox) or (bool(self.waiting) and not self.blocked)

    def wait(self, io: WorkerChannels) -> None:
        self.mgr.idle_wait(1.0, extra=(io.inbox.socket,))

    def step(self) -> list[m.TokenOut]:
        self.mgr.progress()
        self._poll_rooms()
        order = order_waiting([room.req for room in self.waiting], self.cfg.schedule_policy,
                              self.cfg.schedule_aging_s, time.monotonic(), self.kv.prefix_len)
        items = self.planner.plan(order)
        self.blocked = bool(self.waiting) and not items
        if items:
            t0 = time.time_ns()
            with self.mgr.background():  # transfers, acks and heartbeats move during the forward
                self.exec.run(items, [])
                if self.slow_first_forward_s:
                    time.sleep(self.slow_first_forward_s)
                    self.slow_first_forward_s = 0.0
            _trace_chunks(items, t0, time.time_ns())
            rooms = {id(room.req): room for room in self.waiting}
            for it in items:
                self._after_chunk(rooms[id(it.req)], it)
            self.mgr.progress()
        self._poll_inflight()
        out, self.outbox = self.outbox, []
        return out

    def _poll_rooms(self) -> None:
        for room in list(self.bootstrap):
            st = room.sender.poll()
            if st == KVPoll.FAILED:
                self._fail(room)
            elif room.sender.declined:  # the decode prefilled it itself (conditional disaggregation)
                self.declined += 1
                log.info("rid=%s room=%d: prefilled on the decode", room.req.rid, room.req.bootstrap_room)
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

    def _after_chunk(self, room: Room, it: ExtendItem) -> None:
        r = room.req
        if r.trace is not None:
            r.trace.ensure("kv_transfer", room=r.bootstrap_room, page_bytes=self.page_bytes)
        try:
            if it.completes_prompt:
                meta = {"room": r.bootstrap_room, "first_token": r.output_ids[0], "cached_tokens": r.cached_tokens,
                        "prompt_tokens": len(r.input_ids)}
                if r.output_logprobs:
                    meta["first_logprob"] = r.output_logprobs[0]
                if r.output_top_logprobs:  # [ids, logprobs] of the first token's alternatives
                    meta["first_top_logprobs"] = list(r.output_top_logprobs[0])
                if r.forks:  # n > 1: every other choice's first token, sampled from the same row
                    meta.update(fork_meta(r))
                room.sender.send(r.pages[room.sent_pages :], True, meta)
                room.sent_pages = len(r.pages)
                room.t_last_sent = time.monotonic()
                self.waiting.remove(room)
                self.inflight.append(room)
            else:
                full = r.kv_len // self.kv.page_size
                if full > room.sent_pages:
                    room.sender.send(r.pages[room.sent_pages : full], False)
                    room.sent_pages = full
            self.kv.trim(r)  # sliding window: only pages before room.first_page go, never a sent one
        except (ValueError, TransferError) as e:  # the room failed between poll and send
            if room.sender.poll() == KVPoll.FAILED:
                self._fail(room)
            else:
                room.sender.abort(str(e))
                self._end(room, FinishReason.ERROR, f"KV send failed: {e}", 500)

    def _poll_inflight(self) -> None:
        for room in list(self.inflight):
            st = room.sender.poll()
            if st == KVPoll.SUCCESS:
                r = room.req
                now = time.monotonic()
                pages = len(r.pages) - room.first_page
                self.tstats.success(pages * self.page_bytes, now - room.t_ready, now - room.t_last_sent)
                if r.trace is not None:
                    r.trace.end("kv_transfer", pages=pages, bytes=pages * self.page_bytes)
                if r.finish_reason is None:  # prefill's part ends with the first token
                    r.finish(FinishReason.LENGTH)
                self._end(room, r.finish_reason, None, 0)
            elif st == KVPoll.FAILED:
                self._fail(room)

    def _fail(self, room: Room) -> None:
        self.tstats.failed += 1
        message, code, fault = transfer_error(room.sender.error, "prefill")
        log.warning("rid=%s room=%d: %s", room.req.rid, room.req.bootstrap_room, message)
        self._end(room, FinishReason.ERROR, message, code, fault)

    def _end(self, room: Room, reason: FinishReason, error: str | None, code: int, fault: str = "") -> None:
        for q in (self.bootstrap, self.waiting, self.inflight):
            if room in q:
                q.remove(room)
        r = room.req
        if reason in (FinishReason.ERROR, FinishReason.ABORT):  # overrides a stop the first token hit
            r.finish_reason, r.matched_stop = None, None
        r.finish(reason, error, code, fault)
        self.kv.release(r)
        room.sender.release()
        self.blocked = False
        self.outbox.append(token_out(r))

    # ---- reporting ----------------------------------------------------------------------------
    def busy(self) -> int:
        return len(self.bootstrap) + len(self.waiting) + len(self.inflight)

    def stats(self) -> dict:
        return {
            "queues": {"bootstrap": len(self.bootstrap), "waiting": len(self.waiting), "inflight": len(self.inflight)},
            # the prefill pool's autoscaling signal (pdserve_worker_queued_prompt_tokens)
            "queued_prompt_tokens": sum(len(room.req.input_ids) - room.req.kv_len
                                        for room in (*self.bootstrap, *self.waiting)),
            "kv_used_tokens": self.kv.used_tokens,
            "kv_total_tokens": self.kv.pool.total_tokens,
            "active_rooms": self.mgr.active_rooms(),
            "counters": {"forward_tokens": self.exec.forward_tokens, "rooms_prefilled_on_decode": self.declined},
            "transfer": self.mgr.stats(),
            **self.tstats.info(),
            **self.kv.cache_stats(),
        }

    def close(self) -> None:
        for room in [*self.bootstrap, *self.waiting, *self.inflight]:
            room.sender.abort("prefill worker shutting down")
        self.mgr.close()


def fork_meta(r: Req) -> dict:
    """The first tokens (and logprobs) of choices 1..n-1, for the decode's forks (engine.parallel)."""
    meta: dict = {"fork_tokens": [f.output_ids[0] for f in r.forks]}
    if r.return_logprob:
        meta["fork_logprobs"] = [f.output_logprobs[0] for f in r.forks]
    if r.top_logprobs_num:
        meta["fork_top_logprobs"] = [list(f.output_top_logprobs[0]) for f in r.forks]
    return meta


def _trace_chunks(items: list[ExtendItem], t0: int, t1: int) -> None:
    """One `prefill.chunk` span per traced request of the extend batch that ran from t0 to t1 (ns)."""
    for it in items:
        t = it.req.trace
        if t is not None:
            t.end("waiting_queue", end_ns=t0)  # the wait ended when its first chunk's forward began
            t.span("chunk", t0, t1, tokens=it.num_tokens, start=it.req.kv_len - it.num_tokens,
                   last=it.completes_prompt, batch_requests=len(items))


def run_prefill_worker(cfg: ServerConfig) -> None:
    setup_process(cfg)
    runner = ModelRunner(cfg.engine)
    mgr = make_transfer_manager(cfg, runner, "prefill")
    kv = KVManager(runner.pool, runner.host_pool, runner.model_cfg.max_window, cfg.engine.prefix_cache)
    slow = float(os.environ.get("PDSERVE_TEST_SLOW_FIRST_FORWARD_S", "0"))  # tests only
    role = PrefillRole(cfg.engine, runner, kv, mgr, slow_first_forward_s=slow)
    info = {"role": "prefill", **runner.server_info(), "bootstrap_port": mgr.bootstrap_port,
            "advertise_host": cfg.pd.advertise_host or "127.0.0.1"}
    run_loop(cfg, role, info)
