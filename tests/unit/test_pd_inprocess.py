"""The PD lifecycle stepped in one process: a PrefillRole and a DecodeRole (real runners on a tiny
random-weight model, real zmq control plane, the fake data backend handing bytes over in-process)
must produce the colocated role's greedy tokens, and free every page on both sides."""

from __future__ import annotations

import time

import pytest

from colocated_service.worker import ColocatedRole
from decode_service.worker import DecodeRole
from engine.config import EngineConfig
from engine.kv_manager import KVManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from prefill_service.worker import PrefillRole
from service import messages as m
from service.config import PDConfig, ServerConfig
from service.pd import make_transfer_manager
from tests.tiny_model import make_tiny_model

PROMPTS = [[5, 17, 42, 99, 3, 7, 11], list(range(1, 40)), [200, 201, 202]]  # 1, several and one page(s)
SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_cfg(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    return EngineConfig(model=str(model), max_total_tokens=1024, host_kv_tokens=256, page_size=4,
                        chunked_prefill_size=16, max_prefill_tokens=32)


def _parts(cfg: EngineConfig, role: str) -> tuple[ModelRunner, KVManager]:
    runner = ModelRunner(cfg)
    return runner, KVManager(runner.pool, runner.host_pool)


def _collect(outs: list[m.TokenOut], tokens: dict[str, list[int]], done: dict[str, m.TokenOut]) -> None:
    for o in outs:
        tokens.setdefault(o.rid, []).extend(o.new_token_ids)
        if o.finished:
            done[o.rid] = o


def colocated_tokens(cfg: EngineConfig) -> dict[str, list[int]]:
    runner, kv = _parts(cfg, "colocated")
    role = ColocatedRole(cfg, runner, kv)
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    for i, ids in enumerate(PROMPTS):
        _collect(role.add(m.GenerateReq(rid=f"r{i}", input_ids=ids, sampling=SAMPLING)), tokens, done)
    while len(done) < len(PROMPTS):
        _collect(role.step(), tokens, done)
    assert kv.all_free()
    return tokens


def test_pd_roles_in_process_match_colocated(engine_cfg: EngineConfig) -> None:
    want = colocated_tokens(engine_cfg)
    fake = PDConfig(bootstrap_port=0, transfer_backend="fake", heartbeat_interval_s=0.5)
    p_runner, p_kv = _parts(engine_cfg, "prefill")
    d_runner, d_kv = _parts(engine_cfg, "decode")
    p_mgr = make_transfer_manager(ServerConfig(role="prefill", engine=engine_cfg, pd=fake), p_runner, "prefill")
    d_mgr = make_transfer_manager(ServerConfig(role="decode", engine=engine_cfg, pd=fake), d_runner, "decode")
    prefill = PrefillRole(engine_cfg, p_runner, p_kv, p_mgr)
    decode = DecodeRole(engine_cfg, d_runner, d_kv, d_mgr)
    p_done: dict[str, m.TokenOut] = {}
    d_tokens: dict[str, list[int]] = {}
    d_done: dict[str, m.TokenOut] = {}
    try:
        for i, ids in enumerate(PROMPTS):
            boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p_mgr.bootstrap_port, "bootstrap_room": 100 + i}
            _collect(prefill.add(m.GenerateReq(rid=f"r{i}", input_ids=ids, sampling=SAMPLING, **boot)), {}, p_done)
            _collect(decode.add(m.GenerateReq(rid=f"r{i}", input_ids=ids, sampling=SAMPLING, **boot)), d_tokens, d_done)
        deadline = time.monotonic() + 30
        while len(d_done) < len(PROMPTS) or len(p_done) < len(PROMPTS):
            assert time.monotonic() < deadline, f"stuck: prefill {prefill.stats()['queues']}, decode {decode.stats()}"
            _collect(prefill.step(), {}, p_done)
            _collect(decode.step(), d_tokens, d_done)
            if not (prefill.has_work() or decode.has_work()):
                p_mgr.idle_wait(0.002)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert d_tokens == want
        assert p_kv.all_free() and d_kv.all_free()
        assert decode.stats()["transfer_rooms"] == {"succeeded": len(PROMPTS), "failed": 0}
    finally:
        prefill.close()
        decode.close()
