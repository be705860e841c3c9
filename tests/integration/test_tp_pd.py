"""PD between any prefill TP and any decode TP (issue 35): real services, one process per rank (gloo on
the CPU, 1 thread each), real UCX between prefill and decode, a tiny random-weight GQA model (4 query
heads, 2 KV heads) with the embedded model's tokenizer.

The wire page holds all KV heads (transfer/config.py: CompatInfo): a TP 2 prefill gathers its ranks'
heads into full pages before sending, a TP > 1 decode receives into staging and scatters each rank its
heads (engine/distributed/tp_kv.py); a TP 4 decode replicates each of the 2 KV heads on 2 ranks. Also: decode-side
reuse, retraction on a TP 2 decode, a sliding-window pair (only the window moves), an abort while
the KV is awaited, and a pair of different models refused with 412. Every answer must
equal the colocated TP 1 engine's, greedy (the offline LLM in this process, one thread as the services:
what a colocated service runs, without two more service starts); the test plays the router (the body
plus bootstrap fields to the chosen prefill and decode), and one pair goes through the real router.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pd_harness import Pair, call, info, pd_call, start_service, wait_idle
from router_harness import start_router, wait_for

from common.procs import stop_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

NEW = 12  # tokens generated per request
PAGE = ["--page-size", "8"]  # prompts of a few pages each, so chunks and reuse cut real page runs
SMALL_D2 = ["--max-total-tokens", "192", "--new-token-ratio", "0"]  # a burst on D2 must retract
PATIENT = ["--heartbeat-interval", "30", "--waiting-timeout", "300", "--bootstrap-timeout", "300"]


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 250) for _ in range(n)]


def _body(ids: list[int], new: int = NEW) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}


def _ids(status_body: tuple[int, object]) -> list[int]:
    status, body = status_body
    assert status == 200, body
    return body["output_ids"]  # type: ignore[index]


@contextmanager
def _one_thread():
    """torch's thread count is the process's: one thread (the services' --threads 1), then back."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class Colocated:
    """The colocated TP 1 reference: the offline engine (engine.engine.LLM) on `model`, as `pdserve
    colocated --model MODEL --page-size 8 --threads 1` runs it, one request at a time."""

    def __init__(self, model: Path) -> None:
        from engine.config import EngineConfig
        from engine.engine import LLM
        from engine.sampling.params import SamplingParams

        self._params = SamplingParams
        with _one_thread():
            self.llm = LLM(EngineConfig(model=str(model), device="cpu", page_size=8, threads=1,
                                        max_total_tokens=16384, host_kv_tokens=16384))

    def __call__(self, ids: list[int], new: int = NEW) -> list[int]:
        with _one_thread():
            out = self.llm.generate([ids], self._params(temperature=0.0, max_new_tokens=new, ignore_eos=True))[0]
        assert out.error is None and len(out.output_ids) == new, out
        assert self.llm.scheduler.kv.all_free()
        return out.output_ids


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory):
    """prefills TP1, TP2; decodes TP1, TP2 (small pool), TP4; a decode of another model (4 KV heads:
    unservable); a sliding-window TP2 prefill and TP4 decode; all started at once (their model loads
    overlap); the colocated TP 1 references in this process (Colocated)."""
    root = tmp_path_factory.mktemp("tp_pd")
    model = make_tiny_model(make_tokenizer_dir(root / "gqa"))
    other = make_tiny_model(make_tokenizer_dir(root / "mha"), num_key_value_heads=4)
    procs: dict = {}
    boots: dict = {}
    try:
        common = ["--model", str(model), *PAGE, *PATIENT]
        procs["p1"], boots["p1"] = start_service("prefill", *common)
        # chunks of 16 tokens: a room's pages are gathered and sent chunk by chunk
        procs["p2"], boots["p2"] = start_service("prefill", *common, "--tp", "2", "--chunked-prefill-size", "16")
        procs["d1"], _ = start_service("decode", *common)
        procs["d2"], _ = start_service("decode", *common, "--tp", "2", *SMALL_D2)
        procs["d4"], _ = start_service("decode", *common, "--tp", "4")
        procs["bad"], _ = start_service("decode", "--model", str(other), *PAGE, *PATIENT)
        # a sliding-window Mistral (same weights, window 16): only the window's pages move
        swa = make_tiny_model(make_tokenizer_dir(root / "swa"), model_type="mistral", sliding_window=16)
        procs["p2_swa"], boots["p2_swa"] = start_service("prefill", "--model", str(swa), *PAGE, *PATIENT, "--tp", "2")
        procs["d4_swa"], _ = start_service("decode", "--model", str(swa), *PAGE, *PATIENT, "--tp", "4")
        refs = {"colo": Colocated(model), "colo_swa": Colocated(swa)}  # while the services start
        for p in procs.values():
            p.wait_healthy(300)
        procs["router"] = start_router(["--prefill", procs["p2"].url, "--decode", procs["d4"].url])
        procs["router"].wait_healthy(60)
        yield {"procs": procs, "pair": lambda p, d: Pair(procs[p], procs[d], boots[p]), **refs}
    finally:
        stop_all(list(procs.values()), 20)  # all at once: each drains and stops its ranks in parallel
        for p in procs.values():
            p.stop()  # gone already: removes its log


def _colocated(stacks: dict, ids: list[int], new: int = NEW) -> list[int]:
    return stacks["colo"](ids, new)


@pytest.mark.parametrize(("p", "d"), [("p1", "d1"), ("p1", "d2"), ("p2", "d1"), ("p2", "d2"), ("p1", "d4"),
                                      ("p2", "d4")])
def test_every_tp_pair_equals_colocated_tp1(stacks: dict, p: str, d: str) -> None:
    ids = _prompt(int(p[1]) * 10 + int(d[1]), 29)  # 4 pages of 8, the last partial
    want = _colocated(stacks, ids)
    pre, dec = pd_call(stacks["pair"](p, d), "/generate", _body(ids))
    assert pre[0] == 200, pre
    assert _ids(dec) == want, f"{p} -> {d}"


def test_through_the_router_tp2_prefill_to_tp4_decode(stacks: dict) -> None:
    ids = _prompt(7, 21)
    want = _colocated(stacks, ids)
    got = _ids(call(stacks["procs"]["router"].url, "/generate", _body(ids)))
    assert got == want


def test_decode_side_reuse_sends_only_the_new_pages(stacks: dict) -> None:
    first = _prompt(11, 24)  # 3 whole pages the decode caches
    nxt = first + _prompt(12, 13)
    for p in ("p1", "p2"):  # the second turn from the other prefill: the cached pages are D4's own
        pre, dec = pd_call(stacks["pair"](p, "d4"), "/generate", _body(first if p == "p1" else nxt))
        assert pre[0] == 200 and dec[0] == 200, (pre, dec)
    reused = info(stacks["procs"]["d4"])
    assert _ids(dec) == _colocated(stacks, nxt)
    assert reused["counters"]["kv_pages_reused_on_decode"] >= 3, reused


def test_retraction_on_a_tp2_decode_keeps_answers(stacks: dict) -> None:
    # 30 + 80 tokens each: any two of the five running together near their ends overfill D2's 192, so
    # the burst retracts however the five arrive (with 24 new tokens it took four at once: timing)
    prompts = [_prompt(100 + i, 30) for i in range(5)]
    want = [_colocated(stacks, ids, 80) for ids in prompts]
    pair = stacks["pair"]("p2", "d2")
    before = info(pair.decode)["counters"]["retractions"]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda ids: pd_call(pair, "/generate", _body(ids, 80)), prompts))
    assert [_ids(dec) for _, dec in outs] == want
    assert info(pair.decode)["counters"]["retractions"] > before, "the burst never retracted on D2"


def test_unservable_pair_is_refused_412_naming_the_field(stacks: dict) -> None:
    pre, dec = pd_call(stacks["pair"]("p2", "bad"), "/generate", _body(_prompt(5, 20)))
    assert dec[0] == 412 and pre[0] == 412, (pre, dec)
    assert "num_kv_heads" in str(dec[1]), dec
    for name in ("p2", "bad"):
        assert httpx.get(stacks["procs"][name].url + "/health", timeout=10).status_code == 200


def test_sliding_window_pair_sends_only_the_window(stacks: dict) -> None:
    ids = _prompt(21, 45)  # pages 0-2 lie before the last window of 16 tokens: never sent
    want = stacks["colo_swa"](ids)
    pair = stacks["pair"]("p2_swa", "d4_swa")
    pre, dec = pd_call(pair, "/generate", _body(ids))
    assert pre[0] == 200, pre
    assert _ids(dec) == want
    page_bytes = 2 * 2 * 8 * 2 * 16 * 4  # layers x (K, V) x page_size x all 2 KV heads x head_dim x fp32
    sent = info(pair.decode)["transfer_bytes_total"]
    assert sent % page_bytes == 0 and 0 < sent // page_bytes < 6, sent  # 6 pages hold the prompt


def test_abort_while_the_kv_is_awaited_frees_every_rank(stacks: dict) -> None:
    """D2 holds the room's pages (rank 0's allocator: every rank's) and its staging, P2 the room's
    TransferInfo; an abort on D2 ends both, and nothing is scattered."""
    pair = stacks["pair"]("p2", "d2")
    fields = pair.fields()
    with cf.ThreadPoolExecutor(1) as ex:
        fd = ex.submit(call, pair.decode.url, "/generate", {**_body(_prompt(9, 40)), **fields})
        wait_for(lambda: info(pair.decode)["queues"]["transfer"] == 1, 60, "D2 to reserve the room's pages")
        wait_for(lambda: info(pair.prefill)["transfer"]["early_infos"] == 1, 60, "P2 to hold the TransferInfo")
        r = httpx.post(pair.decode.url + "/abort_request", json={"bootstrap_room": fields["bootstrap_room"]},
                       timeout=10)
        assert r.status_code == 200, r.text
        status, resp = fd.result()
    assert status != 200 and "abort" in str(resp).lower(), (status, resp)
    wait_idle(pair.decode)
    wait_for(lambda: info(pair.prefill)["transfer"]["early_infos"] == 0, 30, "P2 to drop the aborted room")


def test_every_service_frees_its_kv(stacks: dict) -> None:
    for name in ("p1", "p2", "d1", "d2", "d4", "bad", "p2_swa", "d4_swa"):
        state = wait_idle(stacks["procs"][name])
        assert state.get("host_kv_used_pages", 0) == 0, (name, state)
