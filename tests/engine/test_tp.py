"""Tensor parallelism (issue 35): one process per rank, rank 0 drives (engine/distributed/tp_ranks.py).

TP=2 (rank 0 in this process, rank 1 a real `spawn` process over gloo, 1 thread each) against TP=1
on the same tiny random-weight models: a Llama, a Qwen2 with one KV head (fewer than ranks: the head
is replicated) and a sliding-window Mistral. Teacher-forced logits within 1e-4, and the colocated
role's tokens identical: greedy batches through a pool small enough to retract to host and reload,
n > 1 forks, prefix-cache hits, seeded sampling with penalties and logprobs. Flags and placement are
checked without processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig, ModelConfig
from engine.distributed import tp_ranks
from engine.kvcache.memory import pages_for
from engine.sampling.params import SamplingParams
from service import messages as m
from tests.pd_harness import collect, generate_req, kv_manager
from tests.tiny_model import make_tiny_model
from tests.tp_spawn import tp_runner

FAMILIES = {
    "llama": dict(),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=1),  # 1 KV head < 2 ranks: replicated
    "mistral": dict(model_type="mistral", sliding_window=28),
}
# 32 pages of 4 tokens: the greedy batch below (220 prompt tokens + 5 x 16) must retract
ENGINE = dict(max_total_tokens=128, host_kv_tokens=512, page_size=4, chunked_prefill_size=16,
              max_prefill_tokens=32, new_token_ratio=0.0, prefix_cache=True, threads=1)
PROMPTS = [[(7 * i + 3 + 11 * k) % 250 for i in range(n)] for k, n in enumerate((6, 37, 90))]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def _tiny(root: Path, family: str) -> Path:
    path = make_tiny_model(root / family, **FAMILIES[family])
    if family == "qwen2":  # Qwen2 has q/k/v biases
        weights = load_file(str(path / "model.safetensors"))
        g = torch.Generator().manual_seed(1)
        for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
            weights[name.replace("weight", "bias")] = torch.randn(weights[name].shape[0], generator=g) * 0.2
        save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """(TP=1 runner, TP=2 rank-0 runner) over the same model; rank 1 runs in its own process."""
    from engine.forward.model_runner import ModelRunner

    model = str(_tiny(tmp_path_factory.mktemp("tp"), request.param))
    one = ModelRunner(EngineConfig(model=model, **ENGINE))
    with tp_runner(EngineConfig(model=model, **ENGINE)) as two:
        yield one, two


def _serve(runner, prompts: list[list[int]], sampling: SamplingParams, n: int = 1,  # noqa: ANN001
           fields: dict | None = None, one_by_one: bool = False,
           ) -> tuple[dict[str, list[int]], dict[str, m.TokenOut], list[m.TokenOut]]:
    """The colocated role over `runner` (all prompts in one batch, or each after the previous finished):
    tokens and last TokenOut by rid (choice i: rid#i), every TokenOut; pools drained after."""
    cfg, kv = runner.cfg, kv_manager(runner, runner.cfg.prefix_cache)
    role = ColocatedRole(cfg, runner, kv)
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    seen: list[m.TokenOut] = []
    waves = [[i] for i in range(len(prompts))] if one_by_one else [list(range(len(prompts)))]
    for wave in waves:
        for i in wave:
            role.add(generate_req(f"r{i}", prompts[i], sampling, n=n, **(fields or {})))
        while len(done) < (wave[-1] + 1) * n:
            collect(role.step(), tokens, done, seen)
    assert all(o.error is None for o in done.values()), [o.error for o in done.values()]
    kv.flush()
    assert kv.all_free()
    return tokens, done, seen


@pytest.mark.slow
def test_each_rank_holds_its_kv_heads(pair) -> None:  # noqa: ANN001
    one, two = pair
    mc = one.model_cfg
    assert one.pool.buffer.shape[4] == mc.num_kv_heads
    assert two.pool.buffer.shape[4] == max(1, mc.num_kv_heads // 2)  # llama/mistral 2 -> 1, qwen2 1 -> 1
    assert two.pool.buffer.shape[0] == one.pool.buffer.shape[0] and two.server_info()["tp"] == 2


@pytest.mark.slow
def test_teacher_forced_logits_match_tp1(pair) -> None:  # noqa: ANN001
    from engine.forward.forward_batch import LOGITS_ALL, Segment, forward_segments

    worst = 0.0
    for ids in PROMPTS:
        out = []
        for runner in pair:
            alloc = runner.pool.allocator
            pages = alloc.allocate(pages_for(len(ids), runner.page_size))
            rows = [forward_segments(runner, [Segment(pages, s, ids[s : s + 16], LOGITS_ALL)]).logits[0]
                    for s in range(0, len(ids), 16)]
            alloc.free(pages)
            out.append(torch.cat(rows))
        assert out[0].shape == (len(ids), 256)
        worst = max(worst, (out[0] - out[1]).abs().max().item())
    assert worst < 1e-4, f"max abs logit diff TP=2 vs TP=1: {worst}"


@pytest.mark.slow
def test_greedy_batch_with_retraction_matches_tp1(pair) -> None:  # noqa: ANN001
    one, two = pair
    prompts = PROMPTS + [p[::-1][:50] for p in PROMPTS[1:]]  # a sliding window holds ~8 pages each
    ref, _, _ = _serve(one, prompts, GREEDY)
    got, _, _ = _serve(two, prompts, GREEDY)
    assert got == ref
    assert len(got) == 5 and all(len(t) == 16 for t in got.values())
    assert two.host_pool.allocator is not None and two.host_pool.allocator.high_water > 0, "meant to retract"


@pytest.mark.slow
def test_forks_prefix_hits_and_seeded_logprobs_match_tp1(pair) -> None:  # noqa: ANN001
    one, two = pair
    sp = SamplingParams(temperature=0.8, top_k=50, seed=11, max_new_tokens=8, ignore_eos=True,
                        frequency_penalty=0.5, repetition_penalty=1.2)
    fields = {"return_logprob": True, "top_logprobs_num": 3}
    # the same prompt twice: the second request's prefix comes from the cache (full-attention models)
    prompts = [PROMPTS[1], PROMPTS[1][:33] + [1, 2, 3]]
    results = [_serve(r, prompts, sp, n=3, fields=fields, one_by_one=True) for r in (one, two)]
    assert results[0][0] == results[1][0]
    assert len(results[1][0]) == 6 and len({tuple(t) for t in results[1][0].values()}) > 1  # seeded choices differ
    lp = [[x for o in res[2] for x in o.new_logprobs] for res in results]
    assert len(lp[1]) == 6 * 8 and max(abs(a - b) for a, b in zip(*lp)) < 1e-4
    if not one.model_cfg.max_window:
        assert results[1][1]["r1"].cached_tokens > 0, "the second prompt should hit the prefix cache"


def _driver_then_op(cfg: EngineConfig, ready, go) -> None:  # noqa: ANN001
    """Rank 0 in a child process: one forward, `ready`, wait for `go`, one more op. Exit 3 when that op
    raises RankLost, 4 when it does not."""
    from engine.distributed.tp_runner import make_runner
    from engine.forward.forward_batch import Segment, forward_segments

    runner = make_runner(cfg)
    pages = runner.pool.allocator.allocate(2)
    forward_segments(runner, [Segment(pages, 0, [1, 2, 3])])
    ready.set()
    go.wait(120)
    try:
        forward_segments(runner, [Segment(pages, 3, [4])])
    except tp_ranks.RankLost:
        os._exit(3)
    os._exit(4)


@pytest.mark.slow
def test_a_lost_rank_ends_the_others_promptly(tiny_llama: Path) -> None:
    """SIGKILL of rank 1: rank 0's next op raises RankLost. SIGKILL of rank 0: rank 1 exits 1."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    groups, stores = [], []
    for _ in range(2):  # both groups start at once
        cfg, store = tp_ranks.host_rendezvous(EngineConfig(model=str(tiny_llama), tp=2, **ENGINE))
        stores.append(store)
        ready, go = ctx.Event(), ctx.Event()
        driver = ctx.Process(target=_driver_then_op, args=(cfg, ready, go))
        driver.start()
        groups.append((driver, tp_ranks.spawn_ranks(cfg)[0], ready, go))
    try:
        for group in groups:
            assert group[2].wait(120), "rank 0 never ran its first forward"
        driver, rank1, _, go = groups[0]
        rank1.kill()
        rank1.join(30)
        go.set()
        driver.join(30)
        assert driver.exitcode == 3, f"rank 0 exited with {driver.exitcode}, not on RankLost"
        driver, rank1, _, _ = groups[1]
        driver.kill()
        rank1.join(30)
        assert rank1.exitcode == 1, f"rank 1 outlived its rank 0: exit code {rank1.exitcode}"
    finally:
        for procs in groups:
            for p in procs[:2]:
                p.kill()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("tp_fault"), "llama")


def test_tp_flags_are_validated() -> None:
    with pytest.raises(ValueError, match="--tp must be >= 1"):
        EngineConfig(tp=0)
    with pytest.raises(ValueError, match="--nnodes"):
        EngineConfig(tp=2, nnodes=3)
    with pytest.raises(ValueError, match="--dist-init-addr"):
        EngineConfig(tp=4, nnodes=2)
    with pytest.raises(ValueError, match="--dist-init-addr must be HOST:PORT"):
        EngineConfig(tp=2, dist_init_addr="nohost")
    with pytest.raises(ValueError, match="--node-rank"):
        EngineConfig(tp=4, nnodes=2, node_rank=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="--tp-devices must list 2"):
        EngineConfig(tp=2, device="cuda", tp_devices="cuda:0")


def test_rank_placement() -> None:
    cfg = EngineConfig(tp=4, nnodes=2, node_rank=1, dist_init_addr="leader:29500", device="cuda:2")
    assert list(tp_ranks.local_ranks(cfg)) == [2, 3]
    assert [tp_ranks.rank_device(cfg, r) for r in (2, 3)] == ["cuda:2", "cuda:3"]
    listed = EngineConfig(tp=2, device="cuda", tp_devices="cuda:5,cuda:7")
    assert [tp_ranks.rank_device(listed, r) for r in (0, 1)] == ["cuda:5", "cuda:7"]
    assert tp_ranks.rank_device(EngineConfig(tp=2), 1) == "cpu"
    assert tp_ranks.rank_threads(EngineConfig(tp=2, threads=3)) == 3


def test_unshardable_model_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    cfg = json.loads((path / "config.json").read_text())
    mc = ModelConfig.from_dir(path)
    tp_ranks.check_model(mc, 2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        tp_ranks.check_model(mc, 3)
    (path / "config.json").write_text(json.dumps(cfg | {"num_attention_heads": 8, "num_key_value_heads": 8,
                                                        "intermediate_size": 100}))
    with pytest.raises(ValueError, match="intermediate_size"):
        tp_ranks.check_model(ModelConfig.from_dir(path), 8)


def test_rank_ops_register_once() -> None:
    assert {"forward", "copy_pages", "host_offload", "host_reload", "stop"} <= set(tp_ranks.OPS)
    with pytest.raises(ValueError, match="registered twice"):
        tp_ranks.rank_op("forward")(lambda runner: None)


def test_up_gives_each_tp_worker_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve import up

    a = up.build(up.UpConfig, up.build_parser().parse_args(["--prefill-tp", "2", "--decode", "2", "--device", "cpu"]))
    assert up.worker_threads(a, []) == max(1, up.cpu_budget() // 4)  # 1 x 2 + 2 x 1 ranks share the CPUs
    assert up._tp_flags("cpu", [2, 1]) == [["--device", "cpu", "--tp", "2"], ["--device", "cpu"]]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert up._tp_flags("cuda", [2, 1, 1]) == [["--device", "cuda", "--tp", "2", "--tp-devices", "cuda:0,cuda:1"],
                                               ["--device", "cuda:2"], ["--device", "cuda:3"]]
    with pytest.raises(ValueError, match="--prefill-tp and --decode-tp"):
        up.UpConfig(decode_tp=0)
