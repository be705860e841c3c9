"""Tensor-parallel ranks: one process per rank, one scheduler, rank 0 drives (docs/architecture.md,
"Tensor parallelism").

Rank 0 is the service's worker process (frontend channels, scheduler, sampling, transfer control);
its runner is a TPRunner (engine/distributed/tp_runner.py) over its own ModelRunner shard. Ranks
1..N-1 run only a plain ModelRunner shard in `rank_loop`: receive an op, run it. Rank 0 broadcasts
every op that touches model or KV data before running it itself:

    rank 0 (TPRunner)                                rank r > 0
    runner.forward(batch)                            rank_loop(runner)
      send(run_segments, batch.segments) -------->     recv -> run_segments(runner, segments)
      ModelRunner.forward(batch): model <--------->    forward(build_batch(segments)): model
        (all-reduces) -> logits (rank 0 only)            (all-reduces) -> nothing (no LM head here)
    KVManager.fork -> pool.copy_pages(src, dst) ---->  copy_pages(src, dst)
    retraction: host.offload(pages) (rank 0 picks     offload/reload the same page lists, each
      the host pages) / host.reload(host, pages) --->   rank its own KV heads

The segments of every forward travel with the op (each rank builds the same ForwardBatch from them),
so a token sampled on rank 0 reaches every rank without another collective; only rank 0 gets logits
(sampling, grammars, penalties, logprobs and seeds are unchanged). Page ids are rank 0's: its
allocators are the only ones (a host free is bookkeeping there and moves nothing).
`runner.collective(op, **kwargs)` runs op(runner, **kwargs), any module-level function, on every rank
and returns rank 0's result (engine/distributed/tp_kv.py runs the KV gather/scatter of the transfer
this way, engine/extras/lora/runner.py adapter loads); an op travels as its module and name, and a
rank imports the op's module on first use. `@rank_op(name)` names the ops of this package.

Groups: control messages go over a gloo group of their own (CPU, also under NCCL) whose timeout is
IDLE_TIMEOUT, since ranks 1..N-1 wait in it while the service is idle; the model's all-reduce over
gloo on CPU, NCCL on CUDA (rank r on cuda:r, or the devices listed), timeout COLLECTIVE_TIMEOUT.

Faults: a rank that dies closes its sockets; rank 0's next collective raises (gloo: "connection
closed by peer"; NCCL: its timeout) and the worker exits non-zero, and ranks whose rank 0 dies fail
their receive and exit 1 (they also exit when their parent process goes). Nothing waits forever.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.cpus import threads_per_worker
from engine.distributed.tp import SINGLE, TPGroup
from engine.forward.forward_batch import Segment, build_batch
from engine.forward.model_runner import ModelRunner, Shard
from engine.kvcache.hicache.host import HostTier
from engine.kvcache.memory import HostKVPool, KVPool, _runs
from engine.models.embedded import resolve_model_path
from engine.recurrent.state_pool import StatePool

log = logging.getLogger("pdserve.tp")

RENDEZVOUS_TIMEOUT = timedelta(minutes=10)  # every rank must join within this (model loads run after)
IDLE_TIMEOUT = timedelta(days=3650)  # ranks > 0 wait for rank 0's next op this long (an idle service)
COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # one all-reduce (NCCL: a hung peer fails after this)


RankOp = Callable[..., Any]  # op(runner, **kwargs), a module-level function
OPS: dict[str, RankOp] = {}


def rank_op(name: str) -> Callable[[RankOp], RankOp]:
    """Name fn(runner, **kwargs) rank op `name` (returns fn): `runner.collective(fn, **kwargs)` runs it on
    every rank of the group (rank 0 sends it, then runs it too) and returns rank 0's result."""
    def register(fn: RankOp) -> RankOp:
        if OPS.get(name, fn) is not fn:
            raise ValueError(f"rank op {name!r} is registered twice")
        OPS[name] = fn
        return fn
    return register


class RankLost(RuntimeError):
    """A rank of the TP group is gone (its process died or its connection closed)."""


# ---- placement -----------------------------------------------------------------------------------
def local_ranks(cfg: EngineConfig) -> range:
    """Global ranks of the processes on this node (node_rank's even share of tp)."""
    per = cfg.tp // cfg.nnodes
    return range(cfg.node_rank * per, (cfg.node_rank + 1) * per)


def rank_device(cfg: EngineConfig, rank: int) -> str:
    """The device of global rank `rank`: cpu; the --tp-devices entry of its local index; or on CUDA
    cuda:<N + local index> (N from --device cuda:N, else 0)."""
    if cfg.tp == 1 or cfg.device == "cpu":
        return cfg.device
    local = rank % (cfg.tp // cfg.nnodes)
    listed = [d for d in cfg.tp_devices.split(",") if d]
    if listed:
        return listed[local]
    base = int(cfg.device.partition(":")[2] or 0)
    return f"cuda:{base + local}"


def rank_threads(cfg: EngineConfig) -> int:
    """Torch threads of one rank: --threads, else this node's CPU budget split across its ranks."""
    return cfg.threads or threads_per_worker(cfg.tp // cfg.nnodes)


def check_model(mc: ModelConfig, tp: int) -> None:
    """ValueError naming the config.json field a TP group of `tp` ranks cannot shard (before any spawn)."""
    g = TPGroup(rank=0, size=tp)
    g.split(mc.num_heads, "num_attention_heads")
    g.kv_heads(mc.num_kv_heads)
    g.split(mc.moe.intermediate_size if mc.moe else mc.intermediate_size,
            "moe_intermediate_size" if mc.moe else "intermediate_size")


def rank_shard(cfg: EngineConfig, rank: int, tp: TPGroup, driver: Driver | None = None) -> Shard:
    """Rank `rank`'s placement: its group, device and threads; rank 0's pools send their page moves."""
    threads = rank_threads(cfg) if cfg.device == "cpu" else 0
    if driver is None:
        return Shard(tp, rank_device(cfg, rank), threads)
    return Shard(tp, rank_device(cfg, rank), threads, lambda *a, **k: DrivenKVPool(driver, *a, **k),
                 lambda *a, **k: DrivenHostKVPool(driver, *a, **k), lambda *a, **k: DrivenStatePool(driver, *a, **k))


def rank_runner(cfg: EngineConfig, rank: int) -> tuple[ModelRunner, Any]:
    """A rank > 0: join the group, load this rank's shard. (its ModelRunner, the control group)."""
    check_model(ModelConfig.from_dir(resolve_model_path(cfg.model)), cfg.tp)
    tp, ctrl = join(cfg, rank)
    return ModelRunner(cfg, rank_shard(cfg, rank, tp)), ctrl


# ---- process groups ------------------------------------------------------------------------------
def join(cfg: EngineConfig, rank: int) -> tuple[TPGroup, Any]:
    """Join the TP group as `rank`: (the model's TPGroup, the control group). (SINGLE, None) for tp 1."""
    if cfg.tp == 1:
        return SINGLE, None
    if not cfg.dist_init_addr:
        raise ValueError("--tp > 1 needs --dist-init-addr (the launcher picks one on a single node)")
    device = rank_device(cfg, rank)
    if cfg.dist_store_hosted:
        host, _, port = cfg.dist_init_addr.rpartition(":")
        store = dist.TCPStore(host, int(port), cfg.tp, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.tp, timeout=RENDEZVOUS_TIMEOUT)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{cfg.dist_init_addr}", rank=rank, world_size=cfg.tp,
                                timeout=RENDEZVOUS_TIMEOUT)
    ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        model_group = dist.new_group(backend="nccl", timeout=COLLECTIVE_TIMEOUT)
    else:
        model_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    log.info("tensor-parallel rank %d/%d joined at %s on %s", rank, cfg.tp, cfg.dist_init_addr, device)
    return TPGroup(rank=rank, size=cfg.tp, group=model_group), ctrl


def host_rendezvous(cfg: EngineConfig) -> tuple[EngineConfig, Any]:
    """(cfg, the store) for a single-node group without --dist-init-addr: this process holds the
    rendezvous store on a loopback port the OS picked and every rank, rank 0 too, joins it as a client.
    (A port picked free and bound later by rank 0 could be taken in between: EADDRINUSE.) Keep the store
    alive while the group runs. (cfg, None) when a group needs no store here (tp 1, or an address given)."""
    if cfg.tp == 1 or cfg.dist_init_addr:
        return cfg, None
    store = dist.TCPStore("127.0.0.1", 0, cfg.tp, is_master=True, wait_for_workers=False,
                          timeout=RENDEZVOUS_TIMEOUT)
    return dataclasses.replace(cfg, dist_init_addr=f"127.0.0.1:{store.port}", dist_store_hosted=True), store


def leave() -> None:
    """Destroy this process's groups (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class Driver:
    """Rank 0's end of the control group: `send` broadcasts one op to ranks 1..N-1."""

    def __init__(self, ctrl: Any) -> None:
        self.ctrl = ctrl
        self.closed = False

    def send(self, op: RankOp, kwargs: dict[str, Any]) -> None:
        """Broadcast op (a module-level function) with its arguments; RankLost if a rank is gone."""
        if self.closed:
            raise RankLost("the tensor-parallel group is closed")
        name = op.__qualname__
        if not name.isidentifier():
            raise ValueError(f"a rank op is a module-level function, not {op.__module__}.{name}")
        try:
            dist.broadcast_object_list([(op.__module__, name, kwargs)], src=0, group=self.ctrl)
        except RuntimeError as e:
            self.closed = True
            raise RankLost(f"tensor-parallel rank lost while sending {name!r}: {e}") from e

    def close(self) -> None:
        """Tell the ranks to leave their loop (best effort: a rank may be gone already)."""
        if self.closed:
            return
        try:
            self.send(_stop, {})
        except RankLost:
            pass
        self.closed = True


def rank_loop(runner: ModelRunner, ctrl: Any) -> None:
    """Ranks 1..N-1: run rank 0's ops in order until it sends "stop". RuntimeError when rank 0 is gone."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        module, name, kwargs = box[0]
        op = getattr(importlib.import_module(module), name)  # imported on first use
        if op is _stop:
            return
        op(runner, **kwargs)


def watch_parent() -> None:
    """Exit this process (1) as soon as its parent process is gone: a rank never outlives its service."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        log.error("parent process %s is gone; tensor-parallel rank exits", parent.pid)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def run_rank(cfg: EngineConfig, rank: int) -> None:
    """A rank > 0 process: join, load the shard, run ops until rank 0 stops (exit 0) or is lost (exit 1).
    Leaves with os._exit: a gloo group torn down by interpreter exit after a lost peer aborts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service's frontend owns Ctrl-C and stops us
    watch_parent()
    code = 0
    try:
        runner, ctrl = rank_runner(cfg, rank)
        rank_loop(runner, ctrl)
        log.info("tensor-parallel rank %d stopped by rank 0", rank)
    except Exception as e:  # noqa: BLE001 - a rank reports why it ends, then exits non-zero
        log.error("tensor-parallel rank %d exits: %s", rank, e)
        code = 1
    logging.shutdown()
    os._exit(code)


def spawn_ranks(cfg: EngineConfig, target: Callable[..., None] = run_rank,
                args: tuple[Any, ...] = ()) -> list[Any]:
    """Start this node's ranks other than global rank 0 as `spawn` processes running
    target(*args, rank) (default: run_rank(cfg, rank)); returns them, started."""
    ctx = mp.get_context("spawn")
    procs = []
    for r in local_ranks(cfg):
        if r == 0:
            continue
        p = ctx.Process(target=target, args=(*(args or (cfg,)), r), name=f"pdserve-tp-rank-{r}")
        p.start()
        procs.append(p)
    return procs


# ---- the pools rank 0 drives ---------------------------------------------------------------------
class DrivenKVPool(KVPool):
    """Rank 0's device pool: a page copy (a fork's partial page) runs on every rank."""

    def __init__(self, driver: Driver, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.driver = driver

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.driver.send(_copy_pages, {"src": src, "dst": dst})
        super().copy_pages(src, dst)


class DrivenHostKVPool(HostKVPool):
    """Rank 0's host pool: it chooses the host pages; every rank copies its own heads of the same lists."""

    def __init__(self, driver: Driver, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.driver = driver

    def offload(self, device: KVPool, pages: list[int]) -> list[int]:
        host = super().offload(device, pages)
        self.driver.send(_host_offload, {"pages": pages, "host": host})
        return host

    def reload(self, device: KVPool, host: list[int], pages: list[int]) -> None:
        self.driver.send(_host_reload, {"host": host, "pages": pages})
        super().reload(device, host, pages)


class DrivenHostTier(HostTier):
    """Rank 0's host tier of the prefix cache (--hicache-host-tokens under TP): it chooses the host pages; each
    store and load runs on every rank over its own heads of the same page lists (each rank has a tier of the
    same size over its own pool). The disk tier under it is refused under TP (engine/config.py)."""

    def __init__(self, driver: Driver, pool: KVPool, tokens: int) -> None:
        super().__init__(pool, tokens)
        self.driver = driver
        self.tokens = tokens

    def store(self, dev_pages: list[int], host_pages: list[int]) -> None:
        self.driver.send(_tier_store, {"dev": dev_pages, "host": host_pages, "tokens": self.tokens})
        super().store(dev_pages, host_pages)

    def load(self, host_pages: list[int], dev_pages: list[int]) -> None:
        self.driver.send(_tier_load, {"host": host_pages, "dev": dev_pages, "tokens": self.tokens})
        super().load(host_pages, dev_pages)


class DrivenStatePool(StatePool):
    """Rank 0's recurrent-state pool (hybrid models): it hands out the slots; a fork's copy and a
    retraction's save / load / discard run on every rank, each over its own heads' state. A saved state is
    (key, rank 0's row); the other ranks keep theirs under the same key until it is loaded or discarded."""

    def __init__(self, driver: Driver, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.driver = driver
        self._keys = itertools.count(1)

    def copy(self, src: int, dst: int) -> None:
        self.driver.send(_state_copy, {"src": src, "dst": dst})
        super().copy(src, dst)

    def save(self, slot: int) -> tuple[int, torch.Tensor]:
        key = next(self._keys)
        self.driver.send(_state_save, {"slot": slot, "key": key})
        return key, super().save(slot)

    def load(self, slot: int, saved: Any) -> None:
        key, row = saved
        self.driver.send(_state_load, {"slot": slot, "key": key})
        super().load(slot, row)

    def discard(self, saved: Any) -> None:
        self.driver.send(_state_discard, {"key": saved[0]})


_SAVED_STATES: dict[int, torch.Tensor] = {}  # ranks > 0: retracted requests' state rows, by rank 0's key


@rank_op("state_copy")
def _state_copy(runner: ModelRunner, src: int, dst: int) -> None:
    runner.states.copy(src, dst)  # type: ignore[union-attr]


@rank_op("state_save")
def _state_save(runner: ModelRunner, slot: int, key: int) -> None:
    _SAVED_STATES[key] = runner.states.save(slot)  # type: ignore[union-attr]


@rank_op("state_load")
def _state_load(runner: ModelRunner, slot: int, key: int) -> None:
    runner.states.load(slot, _SAVED_STATES.pop(key))  # type: ignore[union-attr]


@rank_op("state_discard")
def _state_discard(runner: ModelRunner, key: int) -> None:
    _SAVED_STATES.pop(key, None)


@rank_op("stop")
def _stop(runner: ModelRunner) -> None:
    """Sent by Driver.close; rank_loop returns before running it."""


@rank_op("forward")
def run_segments(runner: ModelRunner, segments: list[Segment]) -> None:
    """Ranks > 0: the batch rank 0 built from the same segments (no logits here)."""
    runner.forward(build_batch(segments, runner.page_size))


@rank_op("copy_pages")
def _copy_pages(runner: ModelRunner, src: list[int], dst: list[int]) -> None:
    runner.pool.copy_pages(src, dst)


@rank_op("host_offload")
def _host_offload(runner: ModelRunner, pages: list[int], host: list[int]) -> None:
    """Device pages -> the host pages rank 0 chose ([L, 2, ps, h_r, D] each, this rank's heads)."""
    dev, hbuf = runner.pool.buffer, runner.host_pool.buffer
    for d, h, n in _runs(pages, host):
        hbuf[h : h + n].copy_(dev[d : d + n], non_blocking=True)


# ranks > 0: the prefix cache's host tier of each runner (a process may serve one group after another: tests)
_TIERS: weakref.WeakKeyDictionary[ModelRunner, HostTier] = weakref.WeakKeyDictionary()


def _rank_tier(runner: ModelRunner, tokens: int) -> HostTier:
    """This rank's host tier (made at its first use: rank 0's first store), over its own pool."""
    if runner not in _TIERS:
        _TIERS[runner] = HostTier(runner.pool, tokens)
    return _TIERS[runner]


@rank_op("tier_store")
def _tier_store(runner: ModelRunner, dev: list[int], host: list[int], tokens: int) -> None:
    _rank_tier(runner, tokens).store(dev, host)


@rank_op("tier_load")
def _tier_load(runner: ModelRunner, host: list[int], dev: list[int], tokens: int) -> None:
    _rank_tier(runner, tokens).load(host, dev)


@rank_op("host_reload")
def _host_reload(runner: ModelRunner, host: list[int], pages: list[int]) -> None:
    dev, hbuf = runner.pool.buffer, runner.host_pool.buffer
    for h, d, n in _runs(host, pages):
        dev[d : d + n].copy_(hbuf[h : h + n], non_blocking=True)
