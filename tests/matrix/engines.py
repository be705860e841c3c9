"""The engines the combination matrix steps in one process: a colocated role, or an in-process PD pair
(prefill + decode roles, real zmq control plane, the fake data backend), each at TP 1 or TP 2. TP 2's rank 1
is ONE spawned process for the whole matrix (`RankServer`): it takes each TP engine's config in turn, joins
that engine's gloo group, runs rank 0's ops until stopped, leaves and waits for the next, so a TP cell costs
a rendezvous and a model load, not a process start."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field, replace
from typing import Any

from colocated_service.worker import ColocatedRole
from decode_service.worker import DecodeRole, decode_engine_config
from engine.config import EngineConfig, ModelConfig
from engine.distributed import tp_ranks
from engine.distributed.tp_runner import make_runner
from prefill_service.worker import PrefillRole
from service import messages as m
from service.config import PDConfig, ServerConfig
from service.pd import make_transfer_manager
from tests.pd_harness import collect, generate_req, kv_manager


def _rank_server(conn: Any, rank: int) -> None:
    """Rank `rank` of every TP engine of the matrix, one after the other: receive a config (None: exit),
    join its group, run rank 0's ops until it stops or is gone, leave; report None or the error."""
    import torch

    torch.set_num_threads(1)
    while True:
        cfg = conn.recv()
        if cfg is None:
            return
        try:
            runner, ctrl = tp_ranks.rank_runner(cfg, rank)
            tp_ranks.rank_loop(runner, ctrl)
            conn.send(None)
        except Exception as e:  # noqa: BLE001 - reported to rank 0's side, which records the cell
            conn.send(f"{type(e).__name__}: {e}")
        finally:
            tp_ranks.leave()


class RankServer:
    """Rank 1 of the matrix's TP engines: one spawned process, reused."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_server, args=(child, 1), name="matrix-tp-rank-1", daemon=True)
        self.proc.start()
        self.busy = False

    def join(self, cfg: EngineConfig) -> None:
        """Rank 1 joins `cfg`'s group (rank 0 joins it next, in this process)."""
        self.conn.send(cfg)
        self.busy = True

    def finish(self, timeout_s: float = 60.0) -> str | None:
        """Wait for rank 1 to leave the group: None, or its error."""
        if not self.busy:
            return None
        self.busy = False
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"TP rank 1 did not leave its group within {timeout_s} s")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


_STORES: list = []  # the TP engines' rendezvous stores, held by this process for the matrix's run


def tp_config(cfg: EngineConfig) -> EngineConfig:
    """`cfg` with a fresh rendezvous (TP 2 engines only): a store this process holds, rank 0 and the rank
    server join it as clients (tp_ranks.host_rendezvous)."""
    if cfg.tp == 1:
        return cfg
    cfg, store = tp_ranks.host_rendezvous(replace(cfg, dist_init_addr="", dist_store_hosted=False))
    _STORES.append(store)
    return cfg


def open_runner(cfg: EngineConfig, ranks: RankServer | None) -> Any:
    """Rank 0's runner for `cfg` (TP 2: rank 1 joins from the rank server). A refusal raises ValueError
    and leaves no group behind."""
    if cfg.tp == 1:
        return make_runner(cfg)
    assert ranks is not None, "a TP engine needs the rank server"
    tp_ranks.check_model(ModelConfig.from_dir(cfg.model), cfg.tp)  # refused before any rank joins
    ranks.join(cfg)
    try:
        return make_runner(cfg)
    except BaseException:
        tp_ranks.leave()  # rank 1 sees the group close and reports
        ranks.finish()
        raise


def close_runner(runner: Any, ranks: RankServer | None) -> str | None:
    """Close the runner (TP: stop rank 1's loop): rank 1's error, if it had one."""
    close = getattr(runner, "close", None)
    if close is not None:
        close()
    return ranks.finish() if ranks is not None and getattr(runner, "driver", None) is not None else None


@dataclass
class Served:
    """What a run produced, by key (rid, or rid#i for choice i > 0 of n)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    done: dict[str, m.TokenOut] = field(default_factory=dict)

    def take(self, outs: list[m.TokenOut]) -> None:
        seen: list[m.TokenOut] = []
        collect(outs, self.tokens, self.done, seen)
        for o in seen:
            self.logprobs.setdefault(f"{o.rid}#{o.index}" if o.index else o.rid, []).extend(o.new_logprobs)


@dataclass
class Request:
    rid: str
    ids: list[int]
    sampling: Any  # SamplingParams
    fields: dict = field(default_factory=dict)  # generate_req's field names (n, return_logprob, lora, ...)

    @property
    def choices(self) -> int:
        return int(self.fields.get("n", 1))


class Colocated:
    """A colocated role over one runner (TP 1 or 2)."""

    pd = False

    def __init__(self, cfg: EngineConfig, ranks: RankServer | None) -> None:
        self.ranks = ranks
        self.runner = open_runner(cfg, ranks)
        try:
            self.kv = kv_manager(self.runner, cfg.prefix_cache)
            self.role = ColocatedRole(cfg, self.runner, self.kv)
        except BaseException:
            close_runner(self.runner, ranks)
            raise

    def serve(self, reqs: list[Request], out: Served, timeout_s: float = 120.0) -> None:
        for r in reqs:
            out.take(self.role.add(generate_req(r.rid, r.ids, r.sampling, **r.fields)))
        want = {r.rid if i == 0 else f"{r.rid}#{i}" for r in reqs for i in range(r.choices)}
        deadline = time.monotonic() + timeout_s
        while not want <= out.done.keys():
            assert time.monotonic() < deadline, f"stuck: {self.role.sched.counts()}"
            out.take(self.role.step())

    def counters(self) -> dict[str, int]:
        return _counters(self.kv, self.kv, self.role.sched)

    def close(self) -> str | None:
        self.role.close()
        return close_runner(self.runner, self.ranks)


class PD:
    """A prefill role (TP 1) and a decode role (TP 1 or 2) in this process, the fake data backend between."""

    pd = True

    def __init__(self, cfg: EngineConfig, ranks: RankServer | None, prefill_tokens: int = 0) -> None:
        """`prefill_tokens`: the prefill's pool, when not the decode's (`cfg`'s)."""
        pcfg = cfg if cfg.tp == 1 else _tp1(cfg)
        if prefill_tokens:
            pcfg = replace(pcfg, max_total_tokens=prefill_tokens)
        pd = PDConfig(bootstrap_port=0, transfer_backend="fake", heartbeat_interval_s=5.0)
        self.ranks, self.rooms = ranks, 100
        self.p_runner = make_runner(pcfg)
        self.d_runner = open_runner(decode_engine_config(cfg), ranks)
        try:
            self.p_kv, self.d_kv = kv_manager(self.p_runner, pcfg.prefix_cache), kv_manager(self.d_runner, False)
            self.p_mgr = make_transfer_manager(ServerConfig(role="prefill", engine=pcfg, pd=pd), self.p_runner,
                                               "prefill")
            self.d_mgr = make_transfer_manager(ServerConfig(role="decode", engine=cfg, pd=pd), self.d_runner, "decode")
            self.prefill = PrefillRole(pcfg, self.p_runner, self.p_kv, self.p_mgr)
            self.decode = DecodeRole(cfg, self.d_runner, self.d_kv, self.d_mgr)
        except BaseException:
            close_runner(self.d_runner, ranks)
            raise

    def serve(self, reqs: list[Request], out: Served, timeout_s: float = 120.0) -> None:
        p_done: dict[str, m.TokenOut] = {}
        for r in reqs:
            self.rooms += 1
            boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.p_mgr.bootstrap_port,
                    "bootstrap_room": self.rooms, **r.fields}
            collect(self.prefill.add(generate_req(r.rid, r.ids, r.sampling, **boot)), {}, p_done)
            out.take(self.decode.add(generate_req(r.rid, r.ids, r.sampling, **boot)))
        want = {r.rid if i == 0 else f"{r.rid}#{i}" for r in reqs for i in range(r.choices)}
        deadline = time.monotonic() + timeout_s
        while not (want <= out.done.keys() and {r.rid for r in reqs} <= p_done.keys()):
            assert time.monotonic() < deadline, f"stuck: prefill {self.prefill.stats().queues}, " \
                                                f"decode {self.decode.stats()}"
            collect(self.prefill.step(), {}, p_done)
            out.take(self.decode.step())
            if not (self.prefill.has_work() or self.decode.has_work()):
                self.p_mgr.idle_wait(0.002)
        for r in reqs:  # a prefill-side failure is the request's error too
            if p_done[r.rid].error is not None and out.done[r.rid].error is None:
                out.done[r.rid] = p_done[r.rid]

    def counters(self) -> dict[str, int]:
        return _counters(self.p_kv, self.d_kv, self.decode.sched)

    def close(self) -> str | None:
        self.prefill.close()
        self.decode.close()
        return close_runner(self.d_runner, self.ranks)


def _tp1(cfg: EngineConfig) -> EngineConfig:
    return replace(cfg, tp=1, dist_init_addr="", dist_store_hosted=False)


def _counters(cache_kv: Any, decode_kv: Any, sched: Any) -> dict[str, int]:
    """The evidence a feature did something: host-tier loads (the prefix cache's side), retractions and
    reloads (the decoding side), speculative drafts proposed and accepted, both pools FP8."""
    cache = cache_kv.cache
    loaded = getattr(cache, "loaded_bytes", {}).get("host", 0) if cache is not None else 0
    spec = sched.spec.stats() if sched.spec is not None else None
    return {"host_loaded_bytes": loaded, "retractions": decode_kv.retractions, "reloads": decode_kv.reloads,
            "spec_proposed": spec.proposed_tokens if spec else 0, "spec_accepted": spec.accepted_tokens if spec else 0,
            "kv_fp8": int(cache_kv.pool.fp8 and decode_kv.pool.fp8)}
