"""HiCache (issue 39): host and disk tiers under the radix prefix cache.

Mechanics over a bare KV pool (no model): evicted pages go to the host (write-back and
write-through), a match loads them back byte for byte, a prefix split across device and host, the
host tier's own LRU bound, the disk tier (a corrupt or missing block is a miss), flush. Then the
engine on the tiny random-weight model: greedy outputs identical with the tier on and off under
oversubscription, cached_tokens counting host hits, pools back to budget; and PD in process
(tests/pd_harness.py): the prefill's and the decode's caches reuse host pages.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.kvcache.hicache import HiCacheSpec, HiRadixCache
from engine.kvcache.kv_manager import KVManager
from engine.kvcache.memory import HostKVPool, KVPool
from engine.request import Req
from engine.sampling.params import SamplingParams

PS = 4


def _kv(pages: int = 9, host_tokens: int = 64, policy: str = "write_back", disk: str = "",
        disk_bytes: int = 1 << 20) -> KVManager:
    pool = KVPool(num_pages=pages, num_layers=2, page_size=PS, num_kv_heads=2, head_dim=4,
                  dtype=torch.float32, device="cpu")
    host = HostKVPool(0, tuple(pool.buffer.shape[1:]), torch.float32, pin=False)
    spec = HiCacheSpec(host_tokens=host_tokens, write_policy=policy, disk_dir=disk, disk_bytes=disk_bytes)
    return KVManager(pool, host, prefix_cache=True, hicache=spec)


def _compute(kv: KVManager, ids: list[int]) -> tuple[Req, int]:
    """Admit `ids` as a request (match, then grow), fill its own pages with a value per token
    position, release it into the cache. Returns (req, cached tokens at admission)."""
    r = Req(rid=str(ids[:3]), token_ids=list(ids), sampling=SamplingParams())
    hit = kv.match(r)
    kv.grow(r, len(ids) - r.kv.kv_len)
    for t in range(r.kv.kv_len, len(ids)):
        kv.pool.buffer[r.kv.pages[t // PS], :, :, t % PS] = float(ids[t])
    r.kv.kv_len = len(ids)
    return r, hit


def _check_bytes(kv: KVManager, r: Req) -> None:
    """Every full page of r holds its tokens' values (KV that came back from a tier is the KV stored)."""
    for t in range(r.kv.kv_len // PS * PS):
        got = kv.pool.buffer[r.kv.pages[t // PS], :, :, t % PS]
        assert torch.all(got == float(r.token_ids[t])), f"token {t} has wrong KV"


def _seq(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_evicted_prefix_comes_back_from_host(policy: str) -> None:
    kv = _kv(policy=policy)
    cache = kv.cache
    assert isinstance(cache, HiRadixCache)
    a = _seq(1, 17)  # 4 full pages + 1 token
    r, hit = _compute(kv, a)
    assert hit == 0
    kv.release(r)
    assert cache.cached_pages == 4
    if policy == "write_through":
        assert cache.host.used_pages == 4  # copied at insert
    # fill the device with another prompt: a's pages are evicted to the host
    r2, _ = _compute(kv, _seq(100, 30))
    assert cache.cached_pages < 4 and cache.host.used_pages >= 4 - cache.cached_pages
    kv.release(r2)
    r3, hit = _compute(kv, a + [7, 7, 7])  # a again: its 4 pages come back (device and/or host)
    assert hit == 16 and r3.kv.cached_tokens == 16
    _check_bytes(kv, r3)
    stats = kv.cache_stats().tiers
    assert stats["hit_tokens"]["host"] > 0 and stats["loaded_bytes"]["host"] > 0
    assert stats["evictions"]["device"] > 0
    kv.release(r3)
    assert kv.used_tokens == 0 and cache.evictable_pages == cache.cached_pages
    kv.flush()
    assert kv.pool.allocator.all_free() and cache.host.allocator.all_free()


def test_prefix_split_across_device_and_host() -> None:
    kv = _kv(pages=9)
    cache = kv.cache
    a = _seq(1, 24)  # 6 pages
    r, _ = _compute(kv, a)
    kv.release(r)
    cache.evict(3)  # the 3 deepest pages go to the host, the first 3 stay on the device
    assert cache.cached_pages == 3 and cache.host.used_pages == 3
    assert cache.match(a, 23).pages == cache.match(a[:12], 12).pages  # match stops at the device edge
    assert cache.match_len(a, 23) == 20  # a match would reuse 5 pages (the 6th holds the last token)
    r2, hit = _compute(kv, a + [9])
    assert hit == 24
    _check_bytes(kv, r2)
    assert cache.hits["host"] == 12
    kv.release(r2)


def test_full_host_tier_keeps_the_prefix_end_and_drops_the_rest() -> None:
    kv = _kv(pages=9, host_tokens=PS)  # one host page
    cache = kv.cache
    a = _seq(1, 17)
    r, _ = _compute(kv, a)
    kv.release(r)
    assert cache.evict(4) == 4  # 4 victims, 1 host page: the first page keeps it, its subtree goes
    assert cache.cached_pages == 0 and cache.host.used_pages == 1 and cache.match_len(a, 16) == PS
    r, hit = _compute(kv, a + [3])
    assert hit == PS
    _check_bytes(kv, r)
    kv.release(r)
    kv.flush()
    assert kv.pool.allocator.all_free() and cache.host.allocator.all_free()


def test_host_tier_bounded_and_lru() -> None:
    kv = _kv(pages=5, host_tokens=4 * PS)  # 4 device pages, 4 host pages
    cache = kv.cache
    for i in range(12):  # 12 prompts of 2 pages each: 6x the device, 3x the host
        r, _ = _compute(kv, _seq(1000 * (i + 1), 8))
        kv.release(r)
        assert cache.host.used_pages <= 4 and kv.pool.allocator.num_used <= 4
    assert cache.evictions["host"] > 0
    # the most recent prompts are still cached somewhere; the oldest is gone
    assert cache.match_len(_seq(12000, 8), 8) == 8
    assert cache.match_len(_seq(1000, 8), 8) == 0
    kv.flush()
    assert kv.pool.allocator.all_free() and cache.host.allocator.all_free() and cache.cached_pages == 0


def test_disk_tier_roundtrip_and_corrupt_block_is_a_miss(tmp_path) -> None:  # noqa: ANN001
    kv = _kv(pages=5, host_tokens=2 * PS, disk=str(tmp_path / "d"))
    cache = kv.cache
    a = _seq(1, 13)  # 3 pages
    r, _ = _compute(kv, a)
    kv.release(r)
    for i in range(4):  # push a's pages through the host tier onto the disk
        r, _ = _compute(kv, _seq(500 * (i + 1), 8))
        kv.release(r)
    assert cache.match_len(a, 12) == 0 and cache.disk.bytes_used > 0
    assert any(f.endswith(".kv") for f in os.listdir(tmp_path / "d"))
    r, hit = _compute(kv, a + [5])
    assert hit == 12 and cache.hits["disk"] == 12
    _check_bytes(kv, r)
    kv.release(r)
    # corrupt every block on disk (flip a byte of each payload), then push a out again... a is now on
    # the device: flush it from the device and host only, keeping the disk
    disk = cache.disk
    for i in range(4):
        r, _ = _compute(kv, _seq(700 * (i + 1), 8))
        kv.release(r)
    assert cache.match_len(a, 12) == 0
    for f in [f for f in os.listdir(disk.root) if f.endswith(".kv")]:
        p = disk.root + "/" + f
        data = bytearray(open(p, "rb").read())
        data[-1] ^= 0xFF
        open(p, "wb").write(bytes(data))
    before = disk.corrupt
    r, hit = _compute(kv, a + [5])
    assert hit == 0 and disk.corrupt > before  # a miss, computed again
    _check_bytes(kv, r)
    kv.release(r)
    kv.flush()
    assert os.listdir(disk.root) == [".lock"] and kv.pool.allocator.all_free() and cache.host.allocator.all_free()


def test_disk_dirs_of_dead_workers_are_swept(tmp_path) -> None:  # noqa: ANN001
    from engine.kvcache.hicache.disk import DiskTier

    live = DiskTier(str(tmp_path / "live"), 1 << 20, "x")
    live.put(b"k" * 16, b"payload")
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / ".lock").write_text("")
    (stale / "0000.kv").write_bytes(b"old")
    with pytest.raises(ValueError, match="--hicache-dir"):
        DiskTier(str(tmp_path / "live"), 1 << 20, "x")  # a live worker's directory is never shared
    mine = DiskTier(str(tmp_path / "new"), 1 << 20, "x")
    assert not stale.exists() and live.get(b"k" * 16, 7) == b"payload"
    assert mine.bytes_used == 0


def test_namespaces_never_share_across_tiers(tmp_path) -> None:  # noqa: ANN001
    kv = _kv(pages=5, host_tokens=2 * PS, disk=str(tmp_path / "d"))
    a = _seq(1, 9)
    r = Req(rid="x", token_ids=list(a), sampling=SamplingParams())
    r.extra_key = "tenant-a"
    assert r.cache_namespace
    kv.match(r)
    kv.grow(r, len(a))
    r.kv.kv_len = len(a)
    kv.release(r)
    for i in range(4):
        q, _ = _compute(kv, _seq(300 * (i + 1), 8))
        kv.release(q)
    other, hit = _compute(kv, a)  # same ids, namespace "": nothing from tenant-a's pages
    assert hit == 0
    kv.release(other)


def test_config_flags_checked() -> None:
    with pytest.raises(ValueError, match="--hicache-write-policy"):
        EngineConfig(prefix_cache=True, hicache_host_tokens=64, hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="--hicache-dir needs --hicache-host-tokens"):
        EngineConfig(hicache_dir="/tmp/x")
    with pytest.raises(ValueError, match="--hicache-dir is not supported with --tp > 1"):
        EngineConfig(prefix_cache=True, hicache_host_tokens=64, hicache_dir="/tmp/x", tp=2)
    assert EngineConfig(prefix_cache=True, hicache_host_tokens=64, tp=2).tp == 2  # the host tier runs on every rank
    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(hicache_host_tokens=64)
    assert HiCacheSpec.from_config(EngineConfig()) is None


# ---- the engine on the tiny model ------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def _ecfg(model: str, host_tokens: int, **kw: object) -> EngineConfig:
    base = dict(model=model, max_total_tokens=128, host_kv_tokens=256, page_size=PS, chunked_prefill_size=32,
                max_prefill_tokens=64, prefix_cache=True, hicache_host_tokens=host_tokens, threads=1)
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def _conversations(cfg: EngineConfig, n: int = 6, turns: int = 4, every_step=None,  # noqa: ANN001
                   runner=None) -> tuple[list, list, object]:  # noqa: ANN001
    """n multi-turn conversations, one turn of each at a time (round robin), so a conversation's
    history is evicted by the others before it comes back. Returns (outputs, cached tokens, sched).
    `runner`: the model runner (default: a ModelRunner of cfg)."""
    from engine.forward.model_runner import ModelRunner
    from engine.scheduling.scheduler import Scheduler

    sched = Scheduler(runner or ModelRunner(cfg), cfg)
    history = [[200 + c] + [(7 * c + i) % 190 + 1 for i in range(10)] for c in range(n)]
    outs, cached = [], []
    for t in range(turns):
        for c in range(n):
            prompt = history[c] + [(11 * c + 3 * t + i) % 190 + 1 for i in range(5)]
            r = Req(rid=f"c{c}t{t}", token_ids=list(prompt), sampling=GREEDY)
            sched.add(r)
            while not r.finished:
                sched.step()
                sched.drain()
                if every_step is not None:
                    every_step(sched)
            assert r.error is None, r.error
            outs.append(r.output_ids)
            cached.append(r.kv.cached_tokens)
            history[c] = prompt + r.output_ids
    return outs, cached, sched


def test_greedy_identical_tier_on_and_off_with_host_hits(tiny_dir: str) -> None:
    off_out, off_cached, _ = _conversations(_ecfg(tiny_dir, 0))
    on_out, on_cached, sched = _conversations(_ecfg(tiny_dir, 1024))
    assert on_out == off_out
    kv = sched.kv
    tiers = kv.cache_stats().tiers
    assert tiers["hit_tokens"]["host"] > 0, "the pool was meant to evict histories to the host"
    assert sum(on_cached) >= sum(off_cached) + tiers["hit_tokens"]["host"] // 2
    assert sum(on_cached) > 2 * sum(off_cached)
    assert kv.used_tokens == 0
    kv.flush()
    assert kv.pool.allocator.all_free() and kv.cache.host.allocator.all_free()


@pytest.mark.slow
def test_host_tier_under_tp2_equals_tp1(tiny_dir: str) -> None:
    """--hicache-host-tokens at --tp 2 (rank 1 a spawned process): every store and load runs on both ranks, so
    histories evicted to the host and loaded back give TP 1's tokens and its host hits."""
    from tests.tp_spawn import tp_runner

    want, want_cached, _ = _conversations(_ecfg(tiny_dir, 1024))
    with tp_runner(_ecfg(tiny_dir, 1024)) as runner:
        got, cached, sched = _conversations(runner.cfg, runner=runner)
        tiers = sched.kv.cache_stats().tiers  # type: ignore[attr-defined]
        assert got == want and cached == want_cached
        assert tiers["hit_tokens"]["host"] > 0
        sched.kv.flush()  # type: ignore[attr-defined]
        assert sched.kv.cache.host.allocator.all_free()  # type: ignore[attr-defined]


def test_memory_bounded_under_10x_oversubscription(tiny_dir: str) -> None:
    host_tokens = 256
    peak = {"dev": 0, "host": 0}

    def watch(sched) -> None:  # noqa: ANN001
        peak["dev"] = max(peak["dev"], sched.kv.pool.allocator.num_used)
        peak["host"] = max(peak["host"], sched.kv.cache.host.used_pages)

    outs, _, sched = _conversations(_ecfg(tiny_dir, host_tokens), n=24, turns=4, every_step=watch)
    kv = sched.kv
    distinct = sum(len(o) for o in outs) + 24 * (11 + 4 * 5)  # the conversations' final histories
    assert distinct >= 10 * kv.pool.total_tokens
    assert peak["dev"] <= kv.pool.allocator.capacity and peak["host"] <= host_tokens // PS
    assert kv.cache.evictions["host"] > 0
    kv.flush()
    assert kv.pool.allocator.all_free() and kv.cache.host.allocator.all_free()


# ---- PD in process (prefill and decode caches with host tiers) -----------------------------------
def _pd_chat(pair, n: int = 6, turns: int = 3) -> list[list[int]]:  # noqa: ANN001
    """n conversations, one at a time per turn over a PDPair; returns every turn's output tokens."""
    from tests.pd_harness import PDPair

    assert isinstance(pair, PDPair)
    history = [[210 + c] + [(5 * c + i) % 190 + 1 for i in range(12)] for c in range(n)]
    outs = []
    for t in range(turns):
        for c in range(n):
            prompt = history[c] + [(3 * c + 7 * t + i) % 190 + 1 for i in range(5)]
            tokens, d_done, p_done = pair.run([prompt], GREEDY, room_base=10_000 + 100 * t + c)
            assert all(o.error is None for o in [*d_done.values(), *p_done.values()])
            outs.append(tokens["r0"])
            history[c] = prompt + tokens["r0"]
    return outs


def test_pd_prefill_and_decode_reuse_host_tier(tiny_dir: str) -> None:
    from service.worker import flush_cache
    from tests.pd_harness import PDPair

    runs, stats = {}, {}
    for host in (0, 1024):
        pair = PDPair(_ecfg(tiny_dir, host), decode_cache=True)
        try:
            runs[host] = _pd_chat(pair)
            stats[host] = (pair.decode.stats(), pair.p_kv.cache_stats(), pair.d_kv.cache_stats())
            assert pair.d_kv.used_tokens == 0 and pair.p_kv.used_tokens == 0
            assert flush_cache(pair.decode, 1).ok and flush_cache(pair.prefill, 2).ok
            assert pair.p_kv.all_free() and pair.d_kv.all_free()
            if host:
                for kv in (pair.p_kv, pair.d_kv):
                    assert kv.cache.host.allocator.all_free() and kv.cache.cached_pages == 0
        finally:
            pair.close()
    assert runs[1024] == runs[0]
    d_on, p_on, dc_on = stats[1024]
    d_off = stats[0][0]
    assert p_on.tiers["hit_tokens"]["host"] > 0  # the prefill's cache loaded evicted histories
    assert dc_on.tiers["hit_tokens"]["host"] > 0  # so did the decode's: it named them to the prefill
    assert d_on.counters.kv_pages_reused_on_decode > d_off.counters.kv_pages_reused_on_decode
    assert d_on.transfer.bytes < d_off.transfer.bytes
