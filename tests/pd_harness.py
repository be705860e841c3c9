"""A prefill role and a decode role stepped in one process: real runners, real zmq control plane,
and the fake data backend (bytes handed over in-process) or UCX. Used by the in-process PD tests and
benchmarks/swa_pd.py."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from colocated_service.worker import ColocatedRole
from common.procs import stop_all
from decode_service.worker import DecodeRole, decode_engine_config
from engine.config import EngineConfig
from engine.forward.model_runner import ModelRunner
from engine.kvcache.hicache import HiCacheSpec
from engine.kvcache.kv_manager import KVManager
from engine.request_groups import Bootstrap, Extras, LogprobParams, ReqOptions
from engine.sampling.params import SamplingParams
from prefill_service.worker import PrefillRole
from service import messages as m
from service.config import PDConfig, ServerConfig
from service.pd import make_transfer_manager


def integration_helpers() -> None:
    """Make tests/integration's harness modules (its pd_harness: real service processes; router_harness)
    importable from a test elsewhere that starts a real stack."""
    path = str(Path(__file__).resolve().parent / "integration")
    if path not in sys.path:
        sys.path.insert(0, path)


@contextlib.contextmanager
def router_stack(model: Path, prefill_args: tuple[str, ...] = (), decodes: int = 1,
                 decode_args: tuple[str, ...] = ()) -> Iterator[dict]:
    """Real processes on `model`: a colocated service ("colo"), a prefill ("pre", with `prefill_args`), a
    decode ("dec", with `decode_args`; `decodes` 2: a second one, "dec2") and the router over them
    ("router"), all healthy; stopped on exit."""
    integration_helpers()
    from pd_harness import start_service  # tests/integration's: real service processes
    from router_harness import start_router

    common = ["--model", str(model), "--page-size", "8", "--heartbeat-interval", "30"]
    procs: dict = {}
    try:
        procs["colo"], _ = start_service("colocated", "--model", str(model), "--page-size", "8")
        procs["pre"], _ = start_service("prefill", *common, *prefill_args, "--bootstrap-timeout", "300")
        names = ["dec", "dec2"][:decodes]
        for name in names:
            procs[name], _ = start_service("decode", *common, *decode_args, "--waiting-timeout", "300")
        for p in procs.values():
            p.wait_healthy(300)
        procs["router"] = start_router(["--prefill", procs["pre"].url,
                                        *[a for name in names for a in ("--decode", procs[name].url)]])
        procs["router"].wait_healthy(60)
        yield procs
    finally:
        stop_all(list(procs.values()), 20)  # all at once: each drains and stops its worker in parallel
        for p in procs.values():
            p.stop()  # gone already: removes its log


def pd_equals_colocated(cfg: EngineConfig, prompts: list[list[int]], sampling: SamplingParams, **pair: object) -> None:
    """The in-process PD pair (`pair`: PDPair's options) serves `prompts` with no error, the colocated
    role's tokens, and frees every page (and state slot) on both sides."""
    want = colocated_tokens(cfg, prompts, sampling)
    pd = PDPair(cfg, **pair)  # type: ignore[arg-type]
    try:
        got, d_done, p_done = pd.run(prompts, sampling)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert got == want
        assert pd.p_kv.all_free() and pd.d_kv.all_free()
    finally:
        pd.close()


def router_equals_colocated(procs: dict, prompts: list[list[int]], tokens: int = 10) -> None:
    """Each greedy /generate through `router_stack`'s router returns the colocated service's tokens."""
    from pd_harness import call  # tests/integration's (router_stack made it importable)

    for ids in prompts:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
        status, want = call(procs["colo"].url, "/generate", body)
        assert status == 200, want
        status, got = call(procs["router"].url, "/generate", body)
        assert status == 200, got
        assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) == tokens


def kv_manager(runner: ModelRunner, prefix_cache: bool = False) -> KVManager:
    """The role's KV manager, with the host/disk tiers of runner.cfg's --hicache-* fields when cached."""
    spec = HiCacheSpec.from_config(runner.cfg, f"w{id(runner)}") if prefix_cache else None
    return KVManager.for_runner(runner, prefix_cache, spec)


_GROUPED = {  # the request's SGLang-style field names -> (GenerateReq group, the group's field)
    "return_logprob": ("logprobs", "on"), "top_logprobs_num": ("logprobs", "top_k"),
    "logprob_start_len": ("logprobs", "start_len"),
    "bootstrap_host": ("pd", "host"), "bootstrap_port": ("pd", "port"), "bootstrap_room": ("pd", "room"),
    "prefill_here": ("pd", "prefill_here"),
    "priority": ("options", "priority"), "extra_key": ("options", "extra_key"),
    "session_id": ("options", "session_id"), "lora": ("options", "lora"),
    "return_hidden_states": ("extras", "hidden_states"), "input_embeds": ("extras", "input_embeds"),
    "token_ids_logprob": ("extras", "token_ids_logprob"),
}
_GROUP_TYPES = {"logprobs": LogprobParams, "pd": Bootstrap, "options": ReqOptions, "extras": Extras}


def generate_req(rid: str, input_ids: list[int], sampling: SamplingParams, **fields) -> m.GenerateReq:  # noqa: ANN003
    """A GenerateReq from the request's field names (return_logprob=True, bootstrap_room=7, extra_key=...,
    as the tests spell them), each put in its group; n, stream, traceparent, resumed_tokens as they are."""
    groups: dict[str, dict] = {}
    for name in [f for f in fields if f in _GROUPED]:
        group, key = _GROUPED[name]
        groups.setdefault(group, {})[key] = fields.pop(name)
    return m.GenerateReq(rid=rid, input_ids=input_ids, sampling=sampling, **fields,
                         **{g: _GROUP_TYPES[g](**kw) for g, kw in groups.items()})


def collect(outs: list[m.TokenOut], tokens: dict[str, list[int]], done: dict[str, m.TokenOut],
            seen: list[m.TokenOut] | None = None) -> None:
    """Tokens and last TokenOut by rid; choice i > 0 of an n > 1 request by f"{rid}#{i}"."""
    for o in outs:
        if seen is not None:
            seen.append(o)
        key = f"{o.rid}#{o.index}" if o.index else o.rid
        tokens.setdefault(key, []).extend(o.new_token_ids)
        if o.finished:
            done[key] = o


def colocated_tokens(cfg: EngineConfig, prompts: list[list[int]], sampling: SamplingParams,
                     n: int = 1) -> dict[str, list[int]]:
    """The colocated role's tokens for the same prompts (rids r0, r1, ...; choice i > 0 of n: r0#i);
    every page freed after."""
    runner = ModelRunner(cfg)
    kv = kv_manager(runner, cfg.prefix_cache)
    role = ColocatedRole(cfg, runner, kv)
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    for i, ids in enumerate(prompts):
        collect(role.add(m.GenerateReq(rid=f"r{i}", input_ids=ids, sampling=sampling, n=n)), tokens, done)
    while len(done) < len(prompts) * n:
        collect(role.step(), tokens, done)
    assert all(o.error is None for o in done.values()), [o.error for o in done.values()]
    kv.flush()  # the prefix cache (when on) keeps finished requests' pages until flushed
    assert kv.all_free()
    return tokens


class PDPair:
    """One prefill and one decode role with their own runners and KV managers."""

    def __init__(self, cfg: EngineConfig, backend: str = "fake", decode_cfg: EngineConfig | None = None,
                 local_threshold: int = 0, local_max_queued: int = 0, local_max_running: int = 0,
                 decode_cache: bool = False,
                 heartbeat_s: float = 0.5, runners: tuple | None = None) -> None:
        """`decode_cache`: the decode keeps its own prefix cache (decode-side reuse), as
        `pdserve decode` does unless --disable-prefix-cache. One thread steps both roles: a forward
        longer than 3 heartbeats (a real model) needs a larger `heartbeat_s`. `runners`: (prefill's,
        decode's) built by the caller (a TP group's rank 0: tests/tp_spawn.py), else ModelRunners."""
        pd = PDConfig(bootstrap_port=0, transfer_backend=backend, heartbeat_interval_s=heartbeat_s)
        dcfg = decode_cfg or cfg
        # the decode as run_decode_worker builds it
        p_runner, d_runner = runners or (ModelRunner(cfg), ModelRunner(decode_engine_config(dcfg)))
        self.p_kv, self.d_kv = kv_manager(p_runner, cfg.prefix_cache), kv_manager(d_runner, decode_cache)
        self.p_mgr = make_transfer_manager(ServerConfig(role="prefill", engine=cfg, pd=pd), p_runner, "prefill")
        self.d_mgr = make_transfer_manager(ServerConfig(role="decode", engine=dcfg, pd=pd), d_runner, "decode")
        self.prefill = PrefillRole(cfg, p_runner, self.p_kv, self.p_mgr)
        self.decode = DecodeRole(dcfg, d_runner, self.d_kv, self.d_mgr, local_threshold=local_threshold,
                                 local_max_queued=local_max_queued, local_max_running=local_max_running)

    def run(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams], timeout_s: float = 120.0,
            on_step: Callable[[PDPair], None] | None = None, fields: dict | None = None,
            seen: list[m.TokenOut] | None = None,
            room_base: int = 100) -> tuple[dict[str, list[int]], dict[str, m.TokenOut], dict[str, m.TokenOut]]:
        """Serve every prompt (rids r0, r1, ...): (decode tokens by rid, decode's last TokenOut by
        rid, prefill's last TokenOut by rid). `on_step` runs after each pair of steps; `fields` are
        extra GenerateReq fields (logprobs); every decode TokenOut is appended to `seen`. `sampling`
        may be a list: one per prompt."""
        extra = fields or {}
        seen = [] if seen is None else seen
        p_done: dict[str, m.TokenOut] = {}
        tokens: dict[str, list[int]] = {}
        d_done: dict[str, m.TokenOut] = {}
        for i, ids in enumerate(prompts):
            boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.p_mgr.bootstrap_port,
                    "bootstrap_room": room_base + i, **extra}
            sp = sampling[i] if isinstance(sampling, list) else sampling
            collect(self.prefill.add(generate_req(f"r{i}", ids, sp, **boot)), {}, p_done)
            collect(self.decode.add(generate_req(f"r{i}", ids, sp, **boot)),
                    tokens, d_done, seen)
        deadline = time.monotonic() + timeout_s
        choices = len(prompts) * extra.get("n", 1)  # the prefill reports choice 0 only
        while len(d_done) < choices or len(p_done) < len(prompts):
            assert time.monotonic() < deadline, f"stuck: prefill {self.prefill.stats().queues}, " \
                                                f"decode {self.decode.stats()}"
            collect(self.prefill.step(), {}, p_done)
            collect(self.decode.step(), tokens, d_done, seen)
            if on_step is not None:
                on_step(self)
            if not (self.prefill.has_work() or self.decode.has_work()):
                self.p_mgr.idle_wait(0.002)
        return tokens, d_done, p_done

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
