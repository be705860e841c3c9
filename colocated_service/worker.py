"""Colocated worker: one engine doing mixed chunked prefill and continuous decode.

Lifecycle of one request here (the whole path: docs/architecture.md):
  1. the frontend parsed and tokenized it once; `add` hands the Req to the Scheduler (`waiting`)
  2. each step: reload retracted requests, grow running ones by a page (retracting when pages run
     out), plan prompt chunks under the token budget and the admission rule, one forward for all
  3. every sampled token goes back to the frontend in a TokenBatch; finished requests free every page
The role's step is nano-vllm's: schedule -> run -> postprocess, all inside `Scheduler.step`, then
report what the scheduler's outbox holds (`Scheduler.drain`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.config import EngineConfig
from engine.distributed import tp_runner
from engine.forward.model_runner import ModelRunner
from engine.kvcache.hicache import spec_for_server
from engine.kvcache.kv_manager import KVManager
from engine.request import Req
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sessions import SessionPins
from service import messages as m
from service.channels import WorkerChannels
from service.config import ServerConfig
from service.stats import WorkerStats
from service.tracing import scheduler_hook
from service.watchdog import Progress, scheduler_progress
from service.worker import req_from_msg, run_loop, setup_process, token_out


class ColocatedRole:
    """The colocated scheduler over an injected runner and KV manager (no transfer manager)."""

    def __init__(self, cfg: EngineConfig, runner: ModelRunner, kv: KVManager) -> None:
        self.runner, self.kv = runner, kv
        self.sched = Scheduler(runner, cfg, kv, on_event=scheduler_hook())
        self.sessions = SessionPins(kv, cfg.session_timeout_s)  # pinned KV of sessions (engine.scheduling.sessions)

    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]:
        req = req_from_msg(msg, "colocated")
        if req.trace is not None:
            req.trace.begin("queue", prompt_tokens=req.num_prompt_tokens)
        self.sched.add(req)  # a prompt the KV pool can never hold is reported at the next step
        return []

    def abort(self, msg: m.AbortReq) -> None:
        self.sched.abort(msg.rid, msg.room, msg.abort_all, msg.reason)

    def has_work(self) -> bool:
        return self.sched.has_work() or bool(self.sched.outbox)

    def step(self) -> list[m.TokenOut]:
        if self.sched.has_work():
            computed = self.sched.exec.forward_tokens
            self.sched.step()
            if self.sched.waiting and self.sched.exec.forward_tokens == computed:
                self.sessions.relieve()  # nothing ran while requests wait: pinned pages never block them
        done = self.sched.drain()
        if self.sessions.pins or any(r.session_id for r in done):
            self.sessions.finished(done)
            self.sessions.expire()
        return [token_out(r) for r in done]

    def progress(self) -> Iterable[Progress]:
        """For the watchdog (service.watchdog): queued requests move with the tokens this worker computes."""
        return scheduler_progress(self.sched.waiting, self.sched.running, self.sched.exec.forward_tokens)

    def fail(self, req: Req, why: str) -> None:
        self.sched.fail(req, why)

    def close_session(self, session_id: str) -> None:
        """POST /close_session (or its expiry in the frontend): the session's KV is no longer pinned."""
        self.sessions.unpin(session_id)

    def stats(self) -> WorkerStats:
        return WorkerStats.from_scheduler(self.sched.stats())

    def busy(self) -> int:
        return self.sched.load()

    def wait(self, io: WorkerChannels) -> None:
        io.wait(1000)

    def close(self) -> None:
        pass


def run_colocated_worker(cfg: ServerConfig,
                         make_runner: Callable[[EngineConfig], ModelRunner] = tp_runner.make_runner) -> None:
    """The colocated worker process; `make_runner` builds the model runner (a TPRunner driving ranks 1..N-1
    under --tp N; tests pass a slowed one)."""
    setup_process(cfg)
    runner = make_runner(cfg.engine)
    role = ColocatedRole(cfg.engine, runner, KVManager.for_runner(runner, cfg.engine.prefix_cache,
                                                                     spec_for_server(cfg)))
    run_loop(cfg, role, {"role": "colocated", **runner.server_info()})
