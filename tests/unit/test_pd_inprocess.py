"""The PD lifecycle stepped in one process: a PrefillRole and a DecodeRole (real runners on a tiny
random-weight model, real zmq control plane, the fake data backend handing bytes over in-process)
must produce the colocated role's greedy tokens, and free every page on both sides."""

from __future__ import annotations

import time

import pytest

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.forward.model_runner import ModelRunner
from engine.sampling.params import SamplingParams
from service import messages as m
from tests.pd_harness import PDPair, collect, colocated_tokens, generate_req, kv_manager
from tests.tiny_model import make_tiny_model

PROMPTS = [[5, 17, 42, 99, 3, 7, 11], list(range(1, 40)), [200, 201, 202]]  # 1, several and one page(s)
SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_cfg(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    return EngineConfig(model=str(model), max_total_tokens=1024, host_kv_tokens=256, page_size=4,
                        chunked_prefill_size=16, max_prefill_tokens=32)


def test_pd_roles_in_process_match_colocated(engine_cfg: EngineConfig) -> None:
    want = colocated_tokens(engine_cfg, PROMPTS, SAMPLING)
    pair = PDPair(engine_cfg)
    try:
        d_tokens, d_done, p_done = pair.run(PROMPTS, SAMPLING)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert d_tokens == want
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
        t = pair.decode.stats().transfer
        assert t is not None and (t.rooms_succeeded, t.rooms_failed) == (len(PROMPTS), 0)
    finally:
        pair.close()


def test_short_prompts_are_prefilled_on_the_decode(engine_cfg: EngineConfig) -> None:
    """Conditional disaggregation: prompts of at most the threshold are computed on the decode (the
    prefill ends their rooms without a forward, cleanly), longer ones go through PD; the tokens equal
    the colocated role's either way."""
    want = colocated_tokens(engine_cfg, PROMPTS, SAMPLING)
    threshold = 10  # PROMPTS[0] (7 tokens) and PROMPTS[2] (3) stay local; PROMPTS[1] (39) goes PD
    pair = PDPair(engine_cfg, local_threshold=threshold)
    try:
        d_tokens, d_done, p_done = pair.run(PROMPTS, SAMPLING)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert d_tokens == want
        assert all(not p_done[f"r{i}"].new_token_ids for i in (0, 2))  # the prefill sampled nothing
        counters = pair.decode.stats().counters
        assert (counters.prefills_local, counters.prefills_remote) == (2, 1)
        assert pair.prefill.stats().counters.rooms_prefilled_on_decode == 2
        assert pair.prefill.stats().counters.forward_tokens == len(PROMPTS[1])
        t = pair.decode.stats().transfer
        assert t is not None and (t.rooms_succeeded, t.rooms_failed) == (1, 0)
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
        assert pair.p_mgr.active_rooms() == 0 and pair.d_mgr.active_rooms() == 0
    finally:
        pair.close()


def test_a_busy_decode_sends_short_prompts_to_their_prefill(engine_cfg: EngineConfig) -> None:
    """The decode-load term: with local_max_running 1, a short prompt goes local only while no request is
    in the decode's scheduler. All three arrive before any step: r0 (7 tokens, load 0) local, r1 (39) PD
    (over the threshold; waiting for KV, which does not count), r2 (3 tokens; r0 queued: load 1) to its
    prefill."""
    want = colocated_tokens(engine_cfg, PROMPTS, SAMPLING)
    pair = PDPair(engine_cfg, local_threshold=10, local_max_running=1)
    try:
        d_tokens, d_done, p_done = pair.run(PROMPTS, SAMPLING)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert d_tokens == want
        counters = pair.decode.stats().counters
        assert (counters.prefills_local, counters.prefills_remote, counters.prefills_remote_decode_busy) \
            == (1, 2, 1)
        assert pair.prefill.stats().counters.forward_tokens == len(PROMPTS[1]) + len(PROMPTS[2])
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
    finally:
        pair.close()


def test_a_burst_of_short_prompts_spills_over_to_the_prefill(engine_cfg: EngineConfig) -> None:
    """The local queue holds at most one threshold of prompt tokens: with threshold 10, r0 (7 tokens)
    is queued locally, r1 (39) is over the threshold, r2 (3: 7 + 3 = 10) still fits, and r3 (7 more:
    17 > 10) goes to its prefill although the decode is otherwise idle."""
    prompts = [*PROMPTS, [9, 8, 7, 6, 5, 4, 3]]
    want = colocated_tokens(engine_cfg, prompts, SAMPLING)
    pair = PDPair(engine_cfg, local_threshold=10)
    try:
        d_tokens, d_done, p_done = pair.run(prompts, SAMPLING)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert d_tokens == want
        counters = pair.decode.stats().counters
        assert (counters.prefills_local, counters.prefills_remote, counters.prefills_remote_decode_busy) \
            == (2, 2, 1)
        assert pair.prefill.stats().counters.forward_tokens == len(PROMPTS[1]) + len(prompts[3])
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
    finally:
        pair.close()


def test_busy_prefill_hint_prefills_on_the_decode_within_its_queue_bound(engine_cfg: EngineConfig) -> None:
    """The router's hint (its prefill is busy) moves a prompt of any length to the decode while the
    decode's local queue stays within local_max_queued tokens; beyond it the request goes PD."""
    want = colocated_tokens(engine_cfg, PROMPTS, SAMPLING)
    # all three arrive before any step: r0 (7) queues 7 tokens, r1 (39) would make 46 > 10: PD, r2 (3): 10
    pair = PDPair(engine_cfg, local_max_queued=10)
    try:
        d_tokens, d_done, p_done = pair.run(PROMPTS, SAMPLING, fields={"prefill_here": True})
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert d_tokens == want
        counters = pair.decode.stats().counters
        assert (counters.prefills_local, counters.prefills_local_busy_prefill, counters.prefills_remote) \
            == (2, 2, 1)
        assert pair.prefill.stats().counters.forward_tokens == len(PROMPTS[1])
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
    finally:
        pair.close()
    pair = PDPair(engine_cfg)  # local_max_queued 0: the hint is never taken
    try:
        d_tokens, _, _ = pair.run(PROMPTS, SAMPLING, fields={"prefill_here": True})
        assert d_tokens == want and pair.decode.stats().counters.prefills_remote == len(PROMPTS)
    finally:
        pair.close()


def _traced_provider():  # noqa: ANN202
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_pd_roles_trace_queues_chunks_transfer_and_retraction(engine_cfg: EngineConfig) -> None:
    """Traced requests get worker spans under the frontend's traceparent; the autoscaling signals
    (prefill queued prompt tokens, decode KV usage and running requests) follow the queues. The decode's
    pool is too small for every output (new_token_ratio 0), so running requests are retracted."""
    import dataclasses

    from common import tracing

    provider, exporter = _traced_provider()
    tracing.use_provider(provider)
    small = dataclasses.replace(engine_cfg, max_total_tokens=64, new_token_ratio=0.0)
    pair = PDPair(engine_cfg, decode_cfg=small)
    prefill, decode, p_mgr = pair.prefill, pair.decode, pair.p_mgr
    root = tracing.start("test.root")
    tp = tracing.traceparent(root)
    done: dict[str, m.TokenOut] = {}
    try:
        for i, ids in enumerate(PROMPTS):
            boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p_mgr.bootstrap_port, "bootstrap_room": 200 + i}
            prefill.add(generate_req(f"r{i}", ids, SAMPLING, traceparent=tp, **boot))
            decode.add(generate_req(f"r{i}", ids, SAMPLING, traceparent=tp, **boot))
        assert prefill.stats().queued_prompt_tokens == sum(map(len, PROMPTS))
        deadline = time.monotonic() + 30
        while len(done) < len(PROMPTS):
            assert time.monotonic() < deadline, f"stuck: decode {decode.stats()}"
            prefill.step()
            collect(decode.step(), {}, done)
            if not (prefill.has_work() or decode.has_work()):
                p_mgr.idle_wait(0.002)
        assert all(o.error is None for o in done.values())
        assert prefill.stats().queued_prompt_tokens == 0
        s = decode.stats()
        assert s.kv.usage == 0 and s.running_requests == 0 and s.counters.retractions > 0
    finally:
        prefill.close()
        decode.close()
        root.end()
        tracing.shutdown()
    spans = exporter.get_finished_spans()
    names = [sp.name for sp in spans]
    for name in ("prefill.bootstrap_queue", "prefill.waiting_queue", "prefill.chunk", "prefill.kv_transfer",
                 "decode.admission", "decode.kv_transfer", "decode.running", "decode.retracted"):
        assert name in names, f"no {name} span in {sorted(set(names))}"
    trace_id = root.get_span_context().trace_id
    assert {sp.context.trace_id for sp in spans} == {trace_id}
    assert all(sp.parent.span_id == root.get_span_context().span_id for sp in spans if sp.name != "test.root")
    chunks = [sp for sp in spans if sp.name == "prefill.chunk"]
    for w in (sp for sp in spans if sp.name == "prefill.waiting_queue"):  # a queue wait ends as a chunk starts
        assert any(c.start_time == w.end_time for c in chunks)
    assert sum(sp.attributes["tokens"] for sp in chunks) == sum(map(len, PROMPTS))
    xfer = [sp for sp in spans if sp.name == "prefill.kv_transfer"]
    assert sum(sp.attributes["pages"] for sp in xfer) == sum(-(-len(p) // 4) for p in PROMPTS)
    assert all(sp.attributes["bytes"] == sp.attributes["pages"] * sp.attributes["page_bytes"] for sp in xfer)


def test_colocated_role_traces_queue_running_and_retraction(engine_cfg: EngineConfig) -> None:
    import dataclasses

    from common import tracing

    provider, exporter = _traced_provider()
    tracing.use_provider(provider)
    small = dataclasses.replace(engine_cfg, max_total_tokens=64, new_token_ratio=0.0)
    runner = ModelRunner(small)
    kv = kv_manager(runner)
    role = ColocatedRole(small, runner, kv)
    root = tracing.start("test.root")
    done: dict[str, m.TokenOut] = {}
    try:
        for i, ids in enumerate(PROMPTS):
            role.add(m.GenerateReq(rid=f"r{i}", input_ids=ids, sampling=SAMPLING,
                                   traceparent=tracing.traceparent(root)))
        while len(done) < len(PROMPTS):
            collect(role.step(), {}, done)
    finally:
        root.end()
        tracing.shutdown()
    assert all(o.error is None for o in done.values())
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("colocated.queue") == names.count("colocated.running") == len(PROMPTS)
    assert "colocated.retracted" in names and kv.retractions > 0
