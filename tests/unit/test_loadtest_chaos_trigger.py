"""The chaos fault trigger (loadtest/chaos_trigger.py): it fires on the victim's own in-flight count, after
the token gate, and a wait that is not met ends with a message naming what it waited for."""

from __future__ import annotations

import threading

from loadtest.chaos_trigger import FaultTrigger, busiest

WHAT = "a prefill with requests in flight"


def test_fires_on_the_first_victim_with_requests_in_flight():
    counts = iter([("p1", 0), ("p2", 0), ("p2", 3)])
    injected: list[str] = []
    t = FaultTrigger(WHAT, lambda: next(counts), injected.append, timeout=30).start()
    assert t.wait(10)
    assert t.stop() == {"node": "p2", "in_flight": 3} and injected == ["p2"]


def test_token_gate_holds_the_fault_until_enough_tokens_streamed():
    picked = threading.Event()

    def pick() -> tuple[str, int]:
        picked.set()
        return "d1", 4

    t = FaultTrigger("a decode", pick, lambda _: None, timeout=30, at_tokens=32).start()
    t.on_progress(31)
    assert "error" in t.stop() and not picked.is_set()  # never asked the victim below the gate
    t = FaultTrigger("a decode", pick, lambda _: None, timeout=30, at_tokens=32).start()
    t.on_progress(32)
    assert t.wait(10) and t.stop() == {"node": "d1", "in_flight": 4} and picked.is_set()


def test_batch_over_first_names_what_was_awaited():
    t = FaultTrigger(WHAT, lambda: ("p1", 0), lambda _: None, timeout=30, at_tokens=8).start()
    t.on_progress(5)
    hit = t.stop()
    assert hit == {"error": f"the batch ended before 8 tokens streamed and {WHAT} (tokens streamed: 5)"}


def test_deadline_and_failures_become_errors():
    t = FaultTrigger(WHAT, lambda: ("p1", 0), lambda _: None, timeout=0.1).start()
    assert t.wait(10)
    assert t.stop() == {"error": f"timed out after 0.1 s waiting for {WHAT} (tokens streamed: 0)"}

    def boom(_: str) -> None:
        raise ProcessLookupError("no such process")

    t = FaultTrigger(WHAT, lambda: ("p1", 2), boom, timeout=30).start()
    assert t.wait(10)
    assert t.stop() == {"error": f"while waiting for {WHAT} (tokens streamed: 0): ProcessLookupError: no such process"}


def test_busiest_reads_each_workers_own_count_and_a_dead_one_as_zero(monkeypatch):
    import loadtest.chaos_trigger as ct

    monkeypatch.setattr(ct, "in_flight", lambda url, token="": {"http://a": 1, "http://b": 5}.get(url, 0))
    assert busiest({"p1": "http://a", "p2": "http://b", "p3": "http://dead"}) == ("p2", 5)
    assert busiest({"p3": "http://dead"}) == ("p3", 0)
