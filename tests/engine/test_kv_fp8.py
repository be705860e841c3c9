"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`, issue 49 part 4; format in engine/kv_fp8.py).

- the row codec (codes + a float32 scale per row) and the pool: bytes per token, writes that quantize;
- the torch backend reading FP8 pages equals it reading the same values dequantized (decode and extend);
- the engine: the embedded model's teacher-forced log-probability within FP8_NATS of fp32 KV; the tiny
  model's greedy tokens FP8 = auto on a short run;
- PD in process with FP8 KV equals colocated with FP8 KV (the wire page is D + 4 bytes a row, half of
  bf16's for the same tokens); a decode whose KV dtype differs from its prefill's is refused with 412
  naming kv_cache_dtype;
- MLA (tiny DeepSeek-V3): the latent pool in FP8, greedy equal to auto, absorbed decode = expanded;
- the host tier and retraction: FP8 pages leave and come back byte for byte (scales included);
- flags: --attention-backend cpu refused with FP8, auto picks torch, /server_info names the KV dtype,
  the default --max-total-tokens grows with the smaller rows, every role and `pdserve up` take the flag.
The Triton kernels' FP8 reads: tests/unit/triton/test_triton_kv_fp8.py.
"""

from __future__ import annotations

import pytest
import torch

from engine import kv_fp8
from engine.attention.base import build_metadata
from engine.attention.torch_ref import TorchAttention
from engine.config import EngineConfig
from engine.engine import LLM
from engine.forward.model_runner import ModelRunner
from engine.kvcache.memory import HostKVPool, KVPool
from engine.sampling.params import SamplingParams
from tests.pd_harness import PDPair, colocated_tokens, pd_equals_colocated

# measured on the embedded model and test_quantize_at_load's 76-token text (fp32 KV: -3.632 nats/token):
# FP8 KV with per token-head scales moved it by ~0.003 nats/token (docs/architecture.md, "KV cache layout");
# the bound keeps a margin for thread-count noise
FP8_NATS = 0.02
TINY_NATS, TINY_PROB = 0.05, 0.15  # the tiny random-weight model (test_tiny_model_teacher_forced_...)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _prompt(seed: int, n: int, vocab: int = 250) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


# ---- the row codec and the pool ---------------------------------------------------------------------
def test_codec_round_trip_and_edge_rows() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 16, generator=g) * torch.logspace(-4, 3, 64)[:, None, None]  # 1e-4 .. 1e3 magnitudes
    x[0, 0] = 0.0  # an all-zero row
    rows = kv_fp8.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 3, 16 + kv_fp8.SCALE_BYTES)
    back = kv_fp8.dequantize(rows, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(16))
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits, relative step 1/16 of the value; values below amax/2^15 fall to subnormals
    err = (back - x).abs()
    assert torch.all(err <= x.abs() / 15 + amax * 2.0**-15), (err / amax).max()
    assert torch.isfinite(back).all() and (back.abs().amax(-1, keepdim=True) - amax).abs().max() <= 1e-3 * amax.max()
    codes, scale = kv_fp8.split(rows)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64, 3)
    torch.testing.assert_close(scale[..., None], amax / kv_fp8.FP8_MAX)


def test_pool_rows_bytes_and_writes() -> None:
    kw = dict(num_pages=5, num_layers=2, page_size=4, num_kv_heads=2, head_dim=16, device="cpu")
    plain = KVPool(dtype=torch.float32, **kw)
    half = KVPool(dtype=torch.bfloat16, **kw)
    fp8 = KVPool(dtype=torch.float32, kv_cache_dtype="fp8_e4m3", **kw)
    assert fp8.buffer.dtype == torch.uint8 and fp8.buffer.shape == (5, 2, 2, 4, 2, 20)
    assert fp8.page_bytes * 16 == plain.page_bytes * 5  # (16 + 4) / (16 * 4)
    assert fp8.page_bytes < 0.63 * half.page_bytes  # D=16: the scale is a quarter of the codes; D=64: 0.53x
    assert (fp8.kv_cache_dtype, plain.kv_cache_dtype, half.kv_cache_dtype) == ("fp8_e4m3", "float32", "bfloat16")
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    page, off = torch.tensor([1, 1, 3]), torch.tensor([0, 3, 2])
    fp8.write(1, page, off, k, v)
    kp, vp = fp8.layer(1)
    torch.testing.assert_close(kv_fp8.dequantize(kp[page, off], torch.float32), k, atol=0.07, rtol=0.07)
    torch.testing.assert_close(kv_fp8.dequantize(vp[page, off], torch.float32), v, atol=0.07, rtol=0.07)
    lat = KVPool(num_pages=3, num_layers=2, page_size=4, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                 device="cpu", latent_dim=24, kv_cache_dtype="fp8_e4m3")
    assert lat.buffer.shape == (3, 2, 4, 28)
    x = torch.randn(2, 24)
    lat.write_latent(0, torch.tensor([1, 2]), torch.tensor([1, 0]), x)
    torch.testing.assert_close(kv_fp8.dequantize(lat.latent(0)[[1, 2], [1, 0]], torch.float32), x, atol=0.1, rtol=0.07)
    with pytest.raises(ValueError, match="divisible by 4"):
        KVPool(num_pages=3, num_layers=1, page_size=4, num_kv_heads=1, head_dim=6, dtype=torch.float32, device="cpu",
               kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVPool(dtype=torch.float32, kv_cache_dtype="fp8_e5m2", **kw)


@pytest.mark.parametrize("q_lens,window", [((1, 1, 1), 0), ((5, 1, 9), 0), ((1, 1), 6), ((7, 3), 5)])
def test_torch_backend_reads_fp8_pages_as_their_values(q_lens: tuple, window: int) -> None:
    """Attention over FP8 pages = attention over a float pool holding the dequantized values, exactly."""
    ps, hkv, hq, d = 4, 2, 4, 16
    seq = [n + 6 * i + 3 for i, n in enumerate(q_lens)]
    pages = [list(range(1 + 8 * i, 1 + 8 * i + -(-s // ps))) for i, s in enumerate(seq)]
    fp8 = KVPool(num_pages=32, num_layers=1, page_size=ps, num_kv_heads=hkv, head_dim=d, dtype=torch.float32,
                 device="cpu", kv_cache_dtype="fp8_e4m3")
    ref = KVPool(num_pages=32, num_layers=1, page_size=ps, num_kv_heads=hkv, head_dim=d, dtype=torch.float32,
                 device="cpu")
    g = torch.Generator().manual_seed(1)
    for s, pl in zip(seq, pages):
        page = torch.tensor([pl[t // ps] for t in range(s)])
        off = torch.tensor([t % ps for t in range(s)])
        fp8.write(0, page, off, torch.randn(s, hkv, d, generator=g), torch.randn(s, hkv, d, generator=g))
    ref.buffer[:, 0] = kv_fp8.dequantize(fp8.buffer[:, 0], torch.float32)
    meta = build_metadata(pages, seq, list(q_lens), ps, d**-0.5, "cpu")
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    got = TorchAttention().forward(q, *fp8.layer(0), meta, window)
    want = TorchAttention().forward(q, *ref.layer(0), meta, window)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# ---- the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_fp8kv")))


def _cfg(model: str, kv: str = "fp8_e4m3", **kw: object) -> EngineConfig:
    base = dict(model=model, max_total_tokens=256, page_size=4, chunked_prefill_size=16, max_prefill_tokens=64,
                threads=1, kv_cache_dtype=kv)
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_flags_backend_and_server_info(tiny_dir: str) -> None:
    assert _cfg(tiny_dir).resolved_attention_backend == "torch"
    assert _cfg(tiny_dir, "auto").resolved_attention_backend == "cpu"
    assert _cfg(tiny_dir, device="cuda").resolved_attention_backend == "triton"
    with pytest.raises(ValueError, match="--attention-backend cpu .*--kv-cache-dtype fp8_e4m3"):
        _cfg(tiny_dir, attention_backend="cpu")
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        _cfg(tiny_dir, "int8")
    info = ModelRunner(_cfg(tiny_dir)).server_info()
    assert info["kv_cache_dtype"] == "fp8_e4m3" and info["attention_backend"] == "torch"
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)  # layers x K,V x heads x (D + scale)
    plain = ModelRunner(_cfg(tiny_dir, "auto")).server_info()
    assert plain["kv_cache_dtype"] == "float32" and plain["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_service_flags_every_role_and_default_pool() -> None:
    from service.config import build_parser, server_config_from_args

    for role in ("colocated", "prefill", "decode"):
        ns = build_parser(role).parse_args(["--kv-cache-dtype", "fp8_e4m3", "--device", "cpu"])
        cfg = server_config_from_args(ns, role)
        assert cfg.engine.kv_cache_dtype == "fp8_e4m3"
        assert cfg.engine.max_total_tokens == 4 * server_config_from_args(
            build_parser(role).parse_args(["--device", "cpu"]), role).engine.max_total_tokens
        assert "fp8_e4m3" in build_parser(role).format_help()
    ns = build_parser("decode").parse_args(["--kv-cache-dtype", "fp8_e4m3", "--device", "cpu", "--max-total-tokens",
                                            "1000"])
    assert server_config_from_args(ns, "decode").engine.max_total_tokens == 1000  # given: as given
    with pytest.raises(SystemExit):
        build_parser("colocated").parse_args(["--kv-cache-dtype", "fp8"])


def test_pdserve_up_passes_the_flag() -> None:
    from pdserve import up

    a = up.config_from_args(up.build_parser().parse_args(["--kv-cache-dtype", "fp8_e4m3"]))
    for role in ("prefill", "decode"):
        argv = up.role_flags(a, role)
        assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3", argv
    assert "--kv-cache-dtype" not in up.role_flags(up.config_from_args(up.build_parser().parse_args([])), "decode")


def _logprobs(cfg: EngineConfig, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-softmax [n, V] (LLM.prompt_logits over a bare runner: the tiny model has no tokenizer)."""
    from types import SimpleNamespace

    return torch.log_softmax(LLM.prompt_logits(SimpleNamespace(cfg=cfg, runner=ModelRunner(cfg)), ids).float(), -1)


def test_tiny_model_teacher_forced_fp8_close_to_fp32_kv(tiny_dir: str) -> None:
    """Random weights put near-ties everywhere, so greedy runs part ways after a few tokens; teacher-forced over
    60 tokens (measured: mean log-prob of the text moved 0.016 nats/token, the largest probability change at
    any position 0.063, argmax kept at 87% of positions; the same random model in bf16 weights moves more)."""
    ids = _prompt(5, 60)
    ref = _logprobs(_cfg(tiny_dir, "auto", attention_backend="torch"), ids)
    got = _logprobs(_cfg(tiny_dir), ids)
    nxt = torch.tensor(ids[1:])[:, None]
    moved = (got[:-1].gather(1, nxt).mean() - ref[:-1].gather(1, nxt).mean()).abs().item()
    assert moved < TINY_NATS, moved
    assert (got.exp() - ref.exp()).abs().max().item() < TINY_PROB
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    prompts = [_prompt(i, n) for i, n in enumerate((5, 17, 40))]
    out = colocated_tokens(_cfg(tiny_dir), prompts, GREEDY)  # serves, and frees every page after
    assert [len(out[f"r{i}"]) for i in range(3)] == [GREEDY.max_new_tokens] * 3


@pytest.mark.slow
def test_embedded_model_teacher_forced_logprob_close_to_fp32_kv(tokenizer) -> None:
    from tests.engine.test_quantize_at_load import TEXT, mean_logprob

    ids = tokenizer.encode(TEXT)
    kw = dict(max_total_tokens=2048, page_size=16, chunked_prefill_size=32, threads=2, attention_backend="torch")
    ref = mean_logprob(LLM(EngineConfig(**kw)), ids)  # type: ignore[arg-type]
    llm = LLM(EngineConfig(kv_cache_dtype="fp8_e4m3", **kw))  # type: ignore[arg-type]
    got = mean_logprob(llm, ids)
    assert abs(got - ref) < FP8_NATS, f"FP8 KV moved the mean log-prob {abs(got - ref):.4f} nats/token ({ref:.4f})"
    assert llm.runner.server_info()["kv_bytes_per_token"] * 4 < 1.1 * LLM(EngineConfig(**kw)).runner.server_info()[
        "kv_bytes_per_token"]  # type: ignore[arg-type]


# ---- PD ----------------------------------------------------------------------------------------------
def test_pd_fp8_equals_colocated_fp8(tiny_dir: str) -> None:
    prompts = [_prompt(10 + i, n) for i, n in enumerate((6, 23, 41))]
    cfg = _cfg(tiny_dir)
    pair = PDPair(cfg)
    try:
        assert pair.p_mgr.wire_page_bytes == pair.p_kv.pool.page_bytes == 4 * 2 * 2 * 2 * 20
    finally:
        pair.close()
    pd_equals_colocated(cfg, prompts, GREEDY)


def test_pd_mismatched_kv_dtype_is_refused_with_412_naming_the_field(tiny_dir: str) -> None:
    pair = PDPair(_cfg(tiny_dir, "auto", attention_backend="torch"), decode_cfg=_cfg(tiny_dir))
    try:
        _, done, _ = pair.run([_prompt(3, 9)], GREEDY, timeout_s=30)
        o = done["r0"]
        assert o.error_code == 412 and "kv_cache_dtype" in (o.error or ""), (o.error_code, o.error)
        assert "fp8_e4m3" in o.error and "float32" in o.error
        assert pair.d_kv.all_free()
    finally:
        pair.close()


# ---- the host tier and retraction --------------------------------------------------------------------
def test_host_pool_and_host_tier_move_fp8_pages_byte_for_byte(tiny_dir: str) -> None:
    from tests.engine.test_hicache import _conversations, _ecfg

    pool = KVPool(num_pages=6, num_layers=2, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                  device="cpu", kv_cache_dtype="fp8_e4m3")
    pool.buffer.copy_(torch.randint(0, 255, pool.buffer.shape, dtype=torch.uint8))
    host = HostKVPool(4, tuple(pool.buffer.shape[1:]), pool.buffer.dtype, pin=False)
    saved = pool.buffer[[2, 3, 5]].clone()
    h = host.offload(pool, [2, 3, 5])
    pool.buffer[1:].zero_()
    host.reload(pool, h, [1, 2, 4])
    assert torch.equal(pool.buffer[[1, 2, 4]], saved) and host.all_free()

    off_out, _, _ = _conversations(_ecfg(tiny_dir, 0, kv_cache_dtype="fp8_e4m3"))
    on_out, _, sched = _conversations(_ecfg(tiny_dir, 1024, kv_cache_dtype="fp8_e4m3"))
    assert sched.kv.pool.fp8 and sched.kv.cache.host.buffer.dtype == torch.uint8
    assert sched.kv.cache_stats().tiers["hit_tokens"]["host"] > 0
    assert on_out == off_out  # pages back from the host decode exactly as those that never left


# ---- MLA (tiny DeepSeek-V3) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.engine.test_deepseek import save_deepseek

    d = tmp_path_factory.mktemp("ds_fp8kv")
    save_deepseek("deepseek_v3", d)
    return str(d)


@pytest.mark.slow
def test_mla_latent_pool_in_fp8(deepseek_dir: str) -> None:
    from engine.models.deepseek_mla import MLAAttention

    prompts = [_prompt(20 + i, n) for i, n in enumerate((7, 33))]
    kw = dict(max_total_tokens=512, page_size=16, chunked_prefill_size=64, threads=1)
    # the reference: the plain pool storing each latent as FP8 would give it back (quantized and dequantized
    # with the same per-row scale), so the FP8 pool's reads, dequantization and attention are checked
    # exactly; FP8's own error on this random model is large (one scale over c_kv and k_pe: teacher-forced
    # log-prob ~0.24 from fp32) and is not what this test bounds
    want = LLM(EngineConfig(model=deepseek_dir, **kw))  # type: ignore[arg-type]
    plain_write = want.runner.pool.write_latent
    want.runner.pool.write_latent = lambda layer, page, off, lat: plain_write(  # type: ignore[method-assign]
        layer, page, off, kv_fp8.dequantize(kv_fp8.quantize(lat), lat.dtype))
    llm = LLM(EngineConfig(model=deepseek_dir, kv_cache_dtype="fp8_e4m3", **kw))  # type: ignore[arg-type]
    pool = llm.runner.pool
    assert pool.fp8 and pool.buffer.shape[-1] == 32 + 16 + 4
    assert llm.runner.server_info()["kv_bytes_per_token"] == 3 * (32 + 16 + 4)
    ref_lp = torch.log_softmax(want.prompt_logits(prompts[1]).float(), -1)
    got_lp = torch.log_softmax(llm.prompt_logits(prompts[1]).float(), -1)
    assert (got_lp - ref_lp).abs().max() < 1e-3  # teacher-forced over 33 tokens
    got = [o.output_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.output_ids for o in want.generate(prompts, GREEDY)]
    assert all(len(o) == GREEDY.max_new_tokens for o in got)
    # absorbed decode = expanded decode over the same FP8 latents
    absorbed = got
    for m in llm.runner.model.modules():
        if isinstance(m, MLAAttention):
            m.absorb = False
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == absorbed
    assert llm.scheduler.kv.all_free()
    pd_equals_colocated(EngineConfig(model=deepseek_dir, kv_cache_dtype="fp8_e4m3", **kw), prompts,  # type: ignore[arg-type]
                        GREEDY)


@pytest.mark.slow
def test_tp2_fp8_equals_tp1_fp8(tiny_dir: str) -> None:
    """Rank 1 holds its KV heads' FP8 rows with their scales: TP 2 gives TP 1's logits (within 1e-3)."""
    from engine.forward.forward_batch import LOGITS_ALL, Segment, forward_segments
    from engine.forward.model_runner import ModelRunner
    from engine.kvcache.memory import pages_for
    from tests.tp_spawn import tp_runner

    cfg = _cfg(tiny_dir)
    ids = _prompt(5, 21)
    one = ModelRunner(cfg)
    with tp_runner(cfg, 2) as two:
        outs = []
        for r in (one, two):
            pages = r.pool.allocator.allocate(pages_for(len(ids), cfg.page_size))
            outs.append(forward_segments(r, [Segment(pages, 0, ids, LOGITS_ALL)]).logits[0])
        assert two.pool.buffer.dtype == torch.uint8
        assert (outs[0] - outs[1]).abs().max().item() < 1e-3
