"""Colocated scheduler: mixed chunked prefill and continuous decode in one engine.

Request lifecycle (colocated):
1. `add`: validated, appended to `waiting`.
2. Each `step`: retracted requests at the head of `waiting` are reloaded from host memory when
   they fit; running requests get a page for their next token, retracting the newest ones to the
   host pool when pages run out; waiting requests are admitted into an extend batch under the token
   budget by the ExtendPlanner (one chunk of at most `chunked_prefill_size` each; a partial chunk
   ends the batch), keeping a reservation for the running requests' future tokens.
3. One forward runs the extend chunks and all running decodes together (BatchExecutor); with
   --speculative a decode may verify its proposed tokens in the same forward (engine/extras/speculative).
4. Requests whose prompt completed join `running`; finished requests release every page
   (engine.scheduling.lifecycle.finish_request) and everything to report goes to the `Outbox`, which the
   role drains (`drain`).

With --enable-priority-scheduling, `waiting` is kept in the waiting order (engine.scheduling.policy)
and, before planning, less urgent running requests may be retracted for the first new one
(`preempt_for`, engine.scheduling.priority.preempt, with `admits_first_chunk` as the admission rule).

Roles never touch the queues: they ask `load`, `counts`, `retracted`, `full`,
`queued_prefill_tokens` and `reserved_pages`, act through `add`, `join_running`, `make_room`,
`preempt_for`, `abort` and `step`, and report what `drain` returns.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from engine.config import EngineConfig
from engine.extras.speculative.stats import SpecStats
from engine.forward.batch import BatchExecutor, StepResult
from engine.forward.draft import make_speculator
from engine.forward.model_runner import ModelRunner
from engine.kvcache.hicache import HiCacheSpec
from engine.kvcache.kv_manager import KVManager, reservation
from engine.request import FinishReason, Req
from engine.sampling.grammar import Grammars
from engine.sampling.sampler import Sampler
from engine.sampling.stops import StopChecker, TailDecoder
from engine.scheduling import priority
from engine.scheduling.lifecycle import Outbox, finish_request
from engine.scheduling.planner import ExtendPlanner
from engine.scheduling.policy import first_new, waiting_order
from engine.stats import SchedulerStats

log = logging.getLogger("pdserve.scheduler")


def make_executor(runner: ModelRunner, cfg: EngineConfig, stop_strings: bool = True) -> BatchExecutor:
    """The batch executor of a role; stop strings are checked with the model's tokenizer (TailDecoder)."""
    tail = TailDecoder(runner.model_path) if stop_strings else None
    stops = StopChecker(runner.model_cfg.eos_token_ids, runner.context_length, tail)
    eos = runner.model_cfg.eos_token_ids
    grammars = Grammars(runner.model_path, runner.model_cfg.vocab_size, eos)
    grammars.warm()  # ready for a grammar request by the time one comes
    return BatchExecutor(runner, Sampler(cfg.seed, eos, grammars), stops)


def validate_prompt(req: Req, context_length: int, kv: KVManager, chunk: int = 0) -> str | None:
    """The engine's own guard (the offline LLM has no frontend): empty, too long, or never fits the
    pool when computed in chunks of `chunk` tokens (0: at once)."""
    n = req.num_prompt_tokens
    if n == 0:
        return "the prompt is empty"
    if n >= context_length:
        return f"the prompt has {n} tokens; the context length is {context_length}"
    return kv.capacity_error(n, chunk, len(req.choice.forks))


Event = Callable[[str, Req], None]


class Counts(NamedTuple):
    """The scheduler's queues: `waiting` (retracted ones included) and `running`."""

    waiting: int
    running: int
    retracted: int  # waiting requests whose KV is in the host pool


class Scheduler:
    """`on_event(name, req)`, when given, hears "running" (prompt done or joined), "retract" (KV moved
    to the host pool) and "reload" (moved back) for each request: the services trace with it.
    `outbox`: where finished and sampled requests go (a role that ends requests of its own passes
    its outbox, so one drain reports both); the queues `waiting` and `running` are read-only outside."""

    def __init__(self, runner: ModelRunner, cfg: EngineConfig, kv: KVManager | None = None,
                 on_event: Event | None = None, outbox: Outbox | None = None) -> None:
        self.on_event = on_event
        self.cfg = cfg
        self.runner = runner
        self.kv = kv or KVManager.for_runner(runner, cfg.prefix_cache, HiCacheSpec.from_config(cfg))
        self.exec = make_executor(runner, cfg)
        self.spec = make_speculator(runner, cfg, self.kv, self.exec.sampler)  # None: --speculative off
        self.planner = ExtendPlanner(self.kv, cfg)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.outbox = outbox if outbox is not None else Outbox()
        self.pool_truncated = 0  # requests ended at the pool's end (`_end_at_pool_end`)

    # ---- intake -------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        """Queue a new request (reported with a 400 at the next drain when its prompt can never run)."""
        err = validate_prompt(req, self.runner.context_length, self.kv, self.cfg.chunked_prefill_size)
        if err:
            finish_request(req, self.kv, self.outbox, FinishReason.ERROR, err, 400)
            return
        self.waiting.append(req)

    def abort(self, rid: str = "", room: int | None = None, everything: bool = False,
              reason: str = "aborted") -> int:
        victims = [r for r in list(self.waiting) + self.running if r.matches(rid, room, everything)]
        for r in victims:
            self._finish(r, FinishReason.ABORT, reason, 499)
        return len(victims)

    def fail(self, r: Req, error: str, code: int = 503) -> None:
        """End a request of this scheduler's queues with an error (the watchdog's answer to a stuck one)."""
        self._finish(r, FinishReason.ERROR, error, code)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- queries ------------------------------------------------------------------------------
    def load(self) -> int:
        """Requests in this scheduler: running, waiting or retracted."""
        return len(self.waiting) + len(self.running)

    def counts(self) -> Counts:
        return Counts(len(self.waiting), len(self.running), sum(1 for r in self.waiting if r.is_retracted))

    def retracted(self) -> list[Req]:
        """The retracted requests waiting to be reloaded (a PD decode orders its prealloc queue with
        them: nothing new is admitted behind a more urgent one)."""
        return [r for r in self.waiting if r.is_retracted]

    def full(self, pending: int = 0) -> bool:
        """The running cap (max_running_requests) is reached, counting `pending` requests the caller
        holds for this scheduler (a PD decode's rooms still receiving KV)."""
        return self.load() + pending >= self.cfg.max_running_requests

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute by the prompts queued here (a queued prompt not yet matched
        against the prefix cache counts only what the cache lacks)."""
        return sum(r.num_prompt_tokens - max(r.kv.kv_len, self.kv.prefix_len(r))
                   for r in self.waiting if not r.is_retracted)

    def drain(self) -> list[Req]:
        """The requests with something to report since the last drain (engine.scheduling.lifecycle.Outbox)."""
        return self.outbox.drain()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> None:
        """Schedule (reload, grow running requests, plan prompt chunks), run one forward, and
        postprocess: prompts done join `running`, sampled and finished requests go to the outbox."""
        now, prio = time.monotonic(), self.cfg.enable_priority_scheduling
        if prio:
            self._prioritize(now)
        self._reload_retracted()
        if prio and self._preempt(now):
            self._prioritize(now)
        decode = self._prepare_decode()
        # with priority `waiting` is kept in the waiting order (reload and preemption read its head)
        order = self.waiting if prio else waiting_order(self.waiting, self.cfg, now, self.kv.prefix_len)
        extend = self.planner.plan(order, self.running)
        result = self.exec.run(extend, decode)
        self._postprocess(result)

    def _prioritize(self, now: float) -> None:
        """--enable-priority-scheduling: `waiting` in the waiting order (engine.scheduling.policy) and
        `running` most urgent first (engine.scheduling.priority.sort_running)."""
        ordered = waiting_order(self.waiting, self.cfg, now, self.kv.prefix_len)
        self.waiting.clear()
        self.waiting.extend(ordered)
        priority.sort_running(self.running, self.cfg)

    def _preempt(self, now: float) -> int:
        """Preemption for the first new request of the waiting order (none when a retracted one comes
        first): the admission rule for its first prompt chunk (`admits_first_chunk`)."""
        cand = first_new(self.waiting)
        if cand is None:
            return 0
        return self.preempt_for(cand, lambda: self.admits_first_chunk(cand), now)

    def preempt_for(self, cand: Req, admits: Callable[[], bool], now: float) -> int:
        """Retract running requests less urgent than `cand` until `admits()` (engine.scheduling.priority
        .preempt; a PD decode asks it for a prompt waiting for its KV pages); returns how many."""
        return priority.preempt(cand, self.running, admits, self._retract_for_priority, self.cfg, now)

    def admits_first_chunk(self, r: Req) -> bool:
        """Whether the planner would admit r's first prompt chunk now beside the running batch, each
        running request grown by one token (preemption asks before the decode grows them), r's
        cached prefix counted as held."""
        cfg, kv = self.cfg, self.kv
        if len(self.running) >= cfg.max_running_requests:
            return False
        prefix = kv.prefix_len(r)
        n = min(r.num_prompt_tokens - prefix, cfg.chunked_prefill_size, cfg.max_prefill_tokens)
        grow = sum(kv.extra_pages(x, 1) for x in self.running)
        return self.planner.admits(r, n, self.reserved_pages() + grow, bool(self.running), True, prefix)

    def _postprocess(self, result: StepResult) -> None:
        if self.spec is not None:
            self.spec.settle(result.decoded)  # speculative totals, switch-off, rejected KV rolled back
        for r in result.decoded + [it.req for it in result.extended]:
            self.kv.trim(r)  # sliding-window models: drop pages no later query reads
            self.kv.checkpoint(r)  # hybrid models with the prefix cache: a state snapshot at a snapshot point
        for it in result.extended:
            if it.completes_prompt:
                self.waiting.remove(it.req)
                self._run(it.req)
                self.fork(it.req)
        for r in result.sampled:
            self.outbox.add(r)
            if r.finished:
                self._finish(r)

    def join_running(self, r: Req) -> None:
        """Take a request whose prompt KV is already in its pages (kv_len set) and whose first token
        is in output_ids (PD decode): finish it if that token ends it, else add it to the batch. Its
        forks (n > 1), each with its own first token in output_ids, fork its KV first."""
        forks = list(r.choice.forks)
        for c in (r, *forks):
            self.exec.stops.check(c)
        self.fork(r)
        for f in forks:
            if f.finished:
                self._finish(f)
        if r.finished:
            self._finish(r)
        else:
            self._run(r)

    def fork(self, parent: Req) -> None:
        """n > 1: the parent's prompt is computed and every choice has its first token: each choice
        not already finished forks the parent's KV (KVManager.fork) and joins the batch."""
        forks, parent.choice.forks = parent.choice.forks, []
        for f in forks:
            if f.finished:
                continue  # its first token ended it: reported (and freed, holding nothing) by the caller
            self.kv.fork(parent, f)
            self._run(f)

    def _run(self, r: Req) -> None:
        """r joins the decode batch (reported: a joining request has its first token)."""
        self.running.append(r)
        self.outbox.add(r)
        if self.on_event is not None:
            self.on_event("running", r)

    def _finish(self, r: Req, reason: FinishReason | None = None, error: str | None = None, code: int = 0) -> None:
        """Take r out of the queues and end it (lifecycle.finish_request; None: it finished itself)."""
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        if self.spec is not None:
            self.spec.forget(r)
        finish_request(r, self.kv, self.outbox, reason, error, code)

    def _reload_retracted(self) -> None:
        while self.waiting and self.waiting[0].is_retracted:
            r = self.waiting[0]
            if len(self.running) >= self.cfg.max_running_requests or not self.kv.can_reload(r, 1):
                return
            self.kv.reload(r)
            self.waiting.popleft()
            self.running.append(r)
            if self.on_event is not None:
                self.on_event("reload", r)

    def _prepare_decode(self) -> list[Req]:
        """Give every running request room for one more token, retracting when pages run out. With
        --speculative, its draft's tokens too (engine/extras/speculative); drafts are dropped, all of them,
        before anyone is retracted for them."""
        if self.spec is not None:
            self.spec.propose(self.running)
            if sum(self.kv.extra_pages(r, 1 + len(r.spec.draft)) for r in self.running) > self.kv.free_pages:
                self.spec.drop(self.running)
        for r in [r for r in self.running if self.kv.outgrows_pool(r)]:
            self._end_at_pool_end(r)
        need = sum(self.kv.extra_pages(r, 1) for r in self.running)
        while need > self.kv.free_pages and self.running:
            victim = self.running[-1]
            need -= self.kv.extra_pages(victim, 1)
            self.retract(victim)
        for r in self.running:
            self.kv.grow(r, 1 + len(r.spec.draft))
        if self.spec is not None:
            self.spec.reserve(self.running)  # hybrid models: each draft's position-state slots
        return list(self.running)

    def _end_at_pool_end(self, r: Req) -> None:
        """r's next token would not fit even in the whole KV pool: end it now with what it generated,
        finish reason length (the pool is this server's context window, as the model's context length
        is), its message saying so, instead of retracting it and waiting forever for room that cannot come."""
        why = self.kv.pool_end_message(r)
        log.warning("rid=%s: %s; finished (length)", r.rid, why)
        self.pool_truncated += 1
        self._finish(r, FinishReason.LENGTH, why)

    def make_room(self, pages: int) -> bool:
        """Retract the newest running requests until `pages` pages are free (KVManager.free_pages);
        returns whether they are."""
        while pages > self.kv.free_pages and self.running:
            self.retract(self.running[-1])
        return pages <= self.kv.free_pages

    def retract(self, r: Req) -> None:
        """Move a running request's KV to the host pool and queue it first for reload (ended with a
        503 when the host pool is full too)."""
        self.running.remove(r)
        if self.kv.can_offload(r):
            self.kv.offload(r)
            self.waiting.appendleft(r)
            if self.on_event is not None:
                self.on_event("retract", r)
        else:
            self._finish(r, FinishReason.ERROR, "out of KV memory (device and host pools full)", 503)

    def _retract_for_priority(self, r: Req) -> bool:
        """Retract r for a preemption, only when the host pool can take its KV (never ended for it)."""
        if not self.kv.can_offload(r):
            return False
        self.retract(r)
        return True

    def reserved_pages(self) -> int:
        """Pages kept back for the running requests' future tokens (kv_manager.reservation)."""
        return reservation(self.running, self.cfg.new_token_ratio, self.kv.page_size)

    def stats(self) -> SchedulerStats:
        """Queue lengths, KV levels and totals since start (engine.stats; the service wraps them)."""
        waiting, running, retracted = self.counts()
        return SchedulerStats(
            waiting=waiting, running=running, retracted=retracted,
            kv_used_tokens=self.kv.used_tokens, kv_total_tokens=self.kv.pool.total_tokens,
            host_kv_used_pages=0 if self.kv.host.allocator is None else self.kv.host.allocator.num_used,
            state_slots_used=None if self.kv.states is None else self.kv.slots_used,
            retractions=self.kv.retractions, reloads=self.kv.reloads, forward_tokens=self.exec.forward_tokens,
            window_freed_pages=self.kv.trimmed_pages, pool_truncated=self.pool_truncated,
            images_encoded=None if self.exec.encoder is None else self.exec.encoder.images_encoded,
            image_cache_hits=None if self.exec.encoder is None else self.exec.encoder.cache_hits,
            prefix=self.kv.cache_stats(),
            spec=self.spec.stats() if self.spec is not None else SpecStats())
