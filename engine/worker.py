"""The worker process side shared by every role: zmq endpoints, the step loop, token reports.

Loop: take messages -> schedule/run one step -> report tokens -> poll transfers (role hook).
A role plugs in through the `Role` protocol; `run_colocated_worker` is the colocated role.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Protocol

import zmq

from engine import messages as m
from engine.config import ServerConfig
from engine.request import FinishReason, Req
from engine.sampling_params import SamplingParams

log = logging.getLogger("pdserve.worker")


class WorkerIO:
    """Worker end of the frontend<->worker link: binds PULL worker.sock, PUSHes to frontend.sock."""

    def __init__(self, ipc_dir: str) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{ipc_dir}/worker.sock")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(f"ipc://{ipc_dir}/frontend.sock")
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)

    def wait(self, timeout_ms: int) -> None:
        """Block until a message arrives or timeout_ms passes."""
        self.poller.poll(timeout_ms)

    def recv_all(self, timeout_ms: int = 0) -> list:
        msgs = []
        if self.poller.poll(timeout_ms):
            while True:
                try:
                    data = self.pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msgs.append(m.decode(data))
                except ValueError as e:
                    log.error("dropping a malformed message: %s", e)
        return msgs

    def send(self, msg: object) -> None:
        self.push.send(m.encode(msg))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def req_from_msg(msg: m.GenerateReq) -> Req:
    """Raises ValueError on bad sampling parameters."""
    return Req(
        rid=msg.rid, input_ids=list(msg.input_ids), sampling=SamplingParams.from_dict(msg.sampling),
        stream=msg.stream, return_logprob=msg.return_logprob, bootstrap_host=msg.bootstrap_host,
        bootstrap_port=msg.bootstrap_port, bootstrap_room=msg.bootstrap_room,
    )


def token_out(r: Req) -> m.TokenOut:
    """What r produced since the last report; marks it reported."""
    new = r.output_ids[r.sent_tokens :]
    lps = r.output_logprobs[r.sent_tokens :] if r.return_logprob else []
    r.sent_tokens = len(r.output_ids)
    inp: list[float] = []
    if r.return_logprob and not r.input_logprobs_sent and r.input_logprobs:
        inp, r.input_logprobs_sent = list(r.input_logprobs), True
    return m.TokenOut(
        rid=r.rid, new_token_ids=list(new), new_logprobs=list(lps), input_logprobs=inp,
        finished=r.finished, finish_reason=r.finish_reason.value if r.finish_reason else None,
        matched_stop=r.matched_stop, error=r.error, error_code=r.error_code, fault=r.error_fault,
        prompt_tokens=len(r.input_ids), completion_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
    )


def error_out(rid: str, message: str, code: int) -> m.TokenOut:
    return m.TokenOut(rid=rid, new_token_ids=[], finished=True, finish_reason=FinishReason.ERROR.value,
                      error=message, error_code=code)


class Role(Protocol):
    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]: ...
    def abort(self, msg: m.AbortReq) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[m.TokenOut]: ...
    def stats(self) -> dict: ...
    def wait(self, io: WorkerIO) -> None: ...  # block until a message, a transfer event or a timer
    def close(self) -> None: ...


def setup_logging(cfg: ServerConfig) -> None:
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s {cfg.role}-worker %(levelname)s %(name)s: %(message)s")


def run_loop(cfg: ServerConfig, ipc_dir: str, role: Role, info: dict) -> None:
    io = WorkerIO(ipc_dir)
    stopping = False

    def on_term(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend owns Ctrl-C and stops us
    parent = os.getppid()
    io.send(m.StatsOut(token=-1, info={**info, "ready": True}))
    log.info("worker ready: %s", {k: info[k] for k in ("role", "model_path", "max_total_tokens") if k in info})
    try:
        while not stopping and os.getppid() == parent:
            if not role.has_work():
                role.wait(io)
            outs: list[m.TokenOut] = []
            for msg in io.recv_all(0):
                if isinstance(msg, m.GenerateReq):
                    outs.extend(role.add(msg))
                elif isinstance(msg, m.AbortReq):
                    role.abort(msg)
                elif isinstance(msg, m.StatsReq):
                    io.send(m.StatsOut(token=msg.token, info={**info, **role.stats(), "time": time.time()}))
            outs.extend(role.step())
            if outs:
                io.send(m.TokenBatch(outs=outs))
    finally:
        role.close()
        io.close()


class ColocatedRole:
    def __init__(self, cfg: ServerConfig) -> None:
        from transformers import AutoTokenizer

        from engine.model_runner import ModelRunner
        from engine.scheduler import Scheduler

        self.runner = ModelRunner(cfg.engine)
        tok = AutoTokenizer.from_pretrained(str(self.runner.model_path))
        self.sched = Scheduler(self.runner, cfg.engine,
                               decode_tail=lambda ids: tok.decode(ids, skip_special_tokens=False))

    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]:
        try:
            self.sched.add(req_from_msg(msg))
        except ValueError as e:
            return [error_out(msg.rid, str(e), 400)]
        return []

    def abort(self, msg: m.AbortReq) -> None:
        self.sched.abort(msg.rid, msg.room, msg.abort_all, msg.reason)

    def has_work(self) -> bool:
        return self.sched.has_work() or bool(self.sched.outbox)

    def step(self) -> list[m.TokenOut]:
        if not self.sched.has_work():
            out, self.sched.outbox = self.sched.outbox, []
            return [token_out(r) for r in out]
        return [token_out(r) for r in self.sched.step()]

    def stats(self) -> dict:
        return self.sched.stats()

    def wait(self, io: WorkerIO) -> None:
        io.wait(1000)

    def close(self) -> None:
        pass


def run_colocated_worker(cfg: ServerConfig, ipc_dir: str) -> None:
    setup_logging(cfg)
    role = ColocatedRole(cfg)
    info = {"role": "colocated", **role.runner.server_info()}
    run_loop(cfg, ipc_dir, role, info)
