"""engine.scheduling.lifecycle: the one function that ends a request and the one outbox type (pure Python)."""

from __future__ import annotations

from engine.request import FinishReason, Req
from engine.sampling.params import SamplingParams
from engine.scheduling.lifecycle import Outbox, finish_request
from engine.scheduling.parallel import add_choices

SP = SamplingParams(max_new_tokens=4)


class _KV:
    """Records what finish_request releases (KVManager.release's contract: idempotent)."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, r: Req) -> None:
        self.released.append(r.rid)


def _req(rid: str = "a", n: int = 1) -> Req:
    r = Req(rid=rid, token_ids=[1, 2, 3], sampling=SP)
    add_choices(r, n)
    return r


def test_outbox_reports_each_request_once_in_first_order() -> None:
    box, a, b = Outbox(), _req("a"), _req("b")
    for r in (a, b, a):
        box.add(r)
    assert len(box) == 2 and box.drain() == [a, b]
    assert len(box) == 0 and box.drain() == []


def test_outbox_keeps_two_requests_sharing_a_rid() -> None:
    box, first, retry = Outbox(), _req("a"), _req("a")
    box.add(first)
    box.add(retry)
    assert box.drain() == [first, retry]


def test_a_request_that_finished_itself_keeps_its_stop() -> None:
    kv, box, r = _KV(), Outbox(), _req()
    r.append_token(9)
    r.matched_stop = 9
    r.finish(FinishReason.STOP)
    finish_request(r, kv, box)
    assert r.finish_reason == FinishReason.STOP and r.matched_stop == 9
    assert kv.released == ["a"] and box.drain() == [r]


def test_an_abort_or_error_overrides_a_stop_the_first_token_hit() -> None:
    for reason, code in ((FinishReason.ABORT, 499), (FinishReason.ERROR, 502)):
        kv, box, r = _KV(), Outbox(), _req()
        r.matched_stop = 7
        r.finish(FinishReason.STOP)
        finish_request(r, kv, box, reason, "gone", code, "decode")
        assert (r.finish_reason, r.matched_stop, r.error, r.error_code, r.error_fault) == \
            (reason, None, "gone", code, "decode")


def test_choices_waiting_on_the_parent_end_with_it() -> None:
    kv, box, r = _KV(), Outbox(), _req(n=3)
    forks = list(r.choice.forks)
    finish_request(r, kv, box, FinishReason.ABORT, "aborted", 499)
    assert r.choice.forks == [] and all(f.finish_reason == FinishReason.ABORT and f.error_code == 499
                                        for f in forks)
    # each choice is released too: on a hybrid model a waiting choice holds a recurrent-state slot
    assert [x.rid for x in box.drain()] == ["a#1", "a#2", "a"] and kv.released == ["a#1", "a#2", "a"]


def test_the_prefill_drops_choices_without_reporting_them() -> None:
    kv, box, r = _KV(), Outbox(), _req(n=2)
    finish_request(r, kv, box, FinishReason.ERROR, "transfer failed", 500, forks=False)
    assert [x.rid for x in box.drain()] == ["a"] and not r.choice.forks[0].finished


def test_one_token_list_with_prompt_and_output_views() -> None:
    r = Req(rid="a", token_ids=[5, 6], sampling=SP)
    r.append_token(7)
    assert (r.input_ids, r.output_ids, r.num_output_tokens) == ([5, 6], [7], 1)
    ids = [1, 2]
    a, b = Req("a", ids, SP), Req("b", ids, SP)
    a.append_token(3)
    assert b.token_ids == [1, 2] and ids == [1, 2]  # each request owns its list
