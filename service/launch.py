"""Process plumbing of one service: worker process, zmq bridge, uvicorn, graceful drain.

    serve(config, worker_entry)
      1. resolve the model directory (converting the embedded model once), make the ipc dir (it goes
         into the config: both processes derive the channel addresses from `config.endpoints`)
      2. spawn the worker: worker_entry(config) in a `spawn` child process
      3. load the tokenizer while the worker loads the model
      4. bind the frontend's zmq PULL, run uvicorn; /health is 503 until the worker's ready
         StatsOut(token=-1) arrives, 503 again if the worker dies (pending requests get 503)
      5. SIGTERM/SIGINT: drain (health 503, new requests 503, in-flight ones finish within the
         grace period), stop uvicorn, stop the worker, exit 0

Tensor parallelism (--tp N, engine/distributed/): the worker is rank 0 (its runner a TPRunner,
`tp_runner.make_runner`); this process also starts this node's ranks 1..N-1 (their own `spawn`
processes running `tp_ranks.run_rank`, rendezvous at --dist-init-addr, default a free loopback
port). A rank process that exits takes the service down: pending requests get 503, the others are
stopped and the service exits 1, so its supervisor (`pdserve up`, Kubernetes) starts the group afresh.
With --node-rank > 0 no frontend runs: `serve_ranks` runs this node's ranks until one exits.

zmq layout: service.channels (the worker binds `to_worker`, the frontend binds `to_frontend`, each
connects a PUSH to the other's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import multiprocessing as mp
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import uvicorn

from common import tracing
from common.logs import setup_logging
from engine.config import ModelConfig
from engine.distributed.tp_ranks import check_model, host_rendezvous, run_rank, spawn_ranks
from engine.models.embedded import resolve_model_path
from service.bridge import WorkerBridge
from service.config import ServerConfig, build_parser, server_config_from_args
from service.frontend import FrontendState, create_app
from service.messages import AbortReq
from service.tokenizer import load_tokenizer

log = logging.getLogger("pdserve.launch")

WorkerEntry = Callable[[ServerConfig], None]
DEFAULT_DRAIN_GRACE_S = ServerConfig.drain_grace_s  # --drain-grace


@contextlib.contextmanager
def _ipc_dir(config: ServerConfig) -> Iterator[str]:
    if config.ipc_dir:
        yield config.ipc_dir
        return
    path = tempfile.mkdtemp(prefix="pdserve-ipc-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _stop_worker(proc: mp.process.BaseProcess, timeout: float = 10.0) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        log.warning("worker pid %s ignored SIGTERM for %.0fs; killing it", proc.pid, timeout)
        proc.kill()
        proc.join(5)


def _stop_all(procs: list[mp.process.BaseProcess]) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL after 10 s)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        _stop_worker(p)


def _tp_ready(config: ServerConfig, model_dir: Path) -> tuple[ServerConfig, Any]:
    """(the config with a rendezvous address when --tp > 1 needs one, the rendezvous store this process
    holds for it or None); ValueError naming the config.json field the group cannot shard (before any
    process starts)."""
    if config.engine.tp == 1:
        return config, None
    check_model(ModelConfig.from_dir(model_dir), config.engine.tp)
    eng, store = host_rendezvous(config.engine)
    return dataclasses.replace(config, engine=eng), store


def _run_rank(config: ServerConfig, rank: int) -> None:
    """Entry of a rank > 0 process of a service: its logging, then engine.distributed.tp_ranks.run_rank."""
    setup_logging(config.log_level, config.log_format, f"{config.role}-rank{rank}")
    run_rank(config.engine, rank)


def _spawn_ranks(config: ServerConfig) -> list[mp.process.BaseProcess]:
    procs = spawn_ranks(config.engine, _run_rank, (config,))
    for p in procs:
        log.info("%s tensor-parallel %s started: pid %s", config.role, p.name, p.pid)
    return procs


def serve_ranks(config: ServerConfig) -> int:
    """--node-rank > 0: run this node's ranks (no frontend) until one exits; stop the rest; exit 1
    (0 when every rank was stopped by rank 0)."""
    procs = _spawn_ranks(config)
    try:
        wait([p.sentinel for p in procs])
    finally:
        _stop_all(procs)
    codes = [p.exitcode for p in procs]
    log.info("%s node %d: ranks exited with %s", config.role, config.engine.node_rank, codes)
    return 0 if all(c == 0 for c in codes) else 1


def serve(config: ServerConfig, worker_entry: WorkerEntry,
          drain_grace_s: float = DEFAULT_DRAIN_GRACE_S) -> int:
    """Run a service (frontend in this process, worker in a child) until SIGTERM; returns the exit code."""
    setup_logging(config.log_level, config.log_format, config.role)
    tracing.setup(f"pdserve-{config.role}", config.otlp_endpoint)
    try:
        model_dir = resolve_model_path(config.engine.model)
        config, _store = _tp_ready(config, model_dir)  # held until serve returns
    except (ValueError, FileNotFoundError) as e:
        log.error("%s", e)
        return 2
    if config.engine.node_rank > 0:
        return serve_ranks(config)
    with _ipc_dir(config) as ipc_dir:
        config = dataclasses.replace(config, ipc_dir=ipc_dir)
        proc = mp.get_context("spawn").Process(target=worker_entry, args=(config,),
                                               name=f"pdserve-{config.role}-worker")
        proc.start()
        log.info("%s worker started: pid %s, ipc %s", config.role, proc.pid, ipc_dir)
        procs = [proc]
        try:
            procs += _spawn_ranks(config)
            tokenizer = load_tokenizer(model_dir)
            return asyncio.run(_serve_async(config, procs, tokenizer, str(model_dir), drain_grace_s))
        finally:
            _stop_all(procs)
            tracing.shutdown()
            log.info("%s service stopped", config.role)


async def _watch_worker(procs: list[mp.process.BaseProcess], bridge: WorkerBridge,
                        on_dead: Callable[[], None]) -> None:
    """Wait until the worker (procs[0]) or a tensor-parallel rank exits; fail pending requests."""
    while all(p.is_alive() for p in procs):
        await asyncio.sleep(0.2)
    gone = next(p for p in procs if not p.is_alive())
    what = "worker process" if gone is procs[0] else f"tensor-parallel rank process {gone.name}"
    reason = f"{what} exited (code {gone.exitcode})"
    log.error("%s; failing pending requests with 503", reason)
    bridge.fail_all(reason)
    on_dead()


async def _serve_async(config: ServerConfig, procs: list[mp.process.BaseProcess], tokenizer: Any,
                       model_dir: str, drain_grace_s: float) -> int:
    bridge = WorkerBridge(config.endpoints)
    state = FrontendState(config=config, bridge=bridge, tokenizer=tokenizer, model_dir=model_dir,
                          worker_pid=procs[0].pid or 0)
    vocab = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    if isinstance(vocab, int):
        state.warm_grammars(vocab)
    app = create_app(state)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                    access_log=False, lifespan="off", timeout_graceful_shutdown=5))
    exit_code = 0

    def worker_dead() -> None:
        nonlocal exit_code
        if not bridge.ready.is_set() and not state.draining:
            log.error("the worker died before it was ready; exiting")
            exit_code = 1
            server.should_exit = True
        elif config.engine.tp > 1 and not state.draining:  # a TP group that lost a rank cannot serve again
            log.error("the tensor-parallel group lost a process; stopping the others and exiting")
            for p in procs:
                if p.is_alive():
                    p.terminate()
            exit_code = 1
            server.should_exit = True

    drain_task: list[asyncio.Task[None]] = []

    def on_signal(sig: signal.Signals) -> None:
        if drain_task:
            log.warning("second %s: stopping now", sig.name)
            server.should_exit = True
            return
        log.info("%s: draining (grace %.0fs)", sig.name, drain_grace_s)
        drain_task.append(asyncio.get_running_loop().create_task(_drain(state, server, drain_grace_s)))

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    tasks = [loop.create_task(bridge.run()), loop.create_task(_watch_worker(procs, bridge, worker_dead))]
    try:
        await server.serve()
        if not server.started:
            log.error("HTTP server failed to start on %s:%s", config.host, config.port)
            exit_code = exit_code or 1
    finally:
        for t in tasks + drain_task:
            t.cancel()
        bridge.shutdown()
    return exit_code


async def _drain(state: Any, server: Any, grace_s: float) -> None:
    state.draining = True
    deadline = asyncio.get_running_loop().time() + grace_s
    while state.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        log.warning("grace period over with %d requests in flight; aborting them", state.in_flight)
        await state.bridge.send(AbortReq(abort_all=True, reason="server shutting down"))
        await asyncio.sleep(0.2)
    server.should_exit = True


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM starts our drain instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _import_entry(spec: str) -> WorkerEntry:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def run_main(role: str, worker_entry: str, argv: list[str] | None, description: str | None) -> int:
    """The `main` of `pdserve colocated|prefill|decode`: flags -> ServerConfig -> serve().

    `worker_entry` is "module:function", imported only after the flags parsed.
    """
    p = build_parser(role, description)
    ns = p.parse_args(argv)
    try:
        config = server_config_from_args(ns, role)
    except (ValueError, OSError) as e:
        p.error(str(e))
    return serve(config, _import_entry(worker_entry), drain_grace_s=config.drain_grace_s)
