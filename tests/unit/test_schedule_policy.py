"""Prefill scheduling policy (issue 15, part 2): shortest uncomputed prompt first, with an aging
bound, and prompts already started kept going."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.request import Req
from engine.sampling.params import SamplingParams
from engine.scheduling.policy import order_by_policy

SP = SamplingParams(max_new_tokens=4)


def _req(rid: str, n: int, created: float, kv_len: int = 0) -> Req:
    r = Req(rid=rid, token_ids=list(range(1, n + 1)), sampling=SP, created=created)
    r.kv.kv_len = kv_len
    return r


def test_fcfs_keeps_arrival_order() -> None:
    reqs = [_req("long", 1000, 0.0), _req("short", 10, 1.0)]
    assert [r.rid for r in order_by_policy(reqs, "fcfs", 5.0, now=2.0)] == ["long", "short"]


def test_sjf_puts_short_prompts_first_ties_by_arrival() -> None:
    reqs = [_req("long", 1000, 0.0), _req("mid", 100, 0.5), _req("short_b", 10, 1.5), _req("short_a", 10, 1.0)]
    assert [r.rid for r in order_by_policy(reqs, "sjf", 5.0, now=2.0)] == ["short_a", "short_b", "mid", "long"]


def test_sjf_aging_bound_and_started_prompts_go_first() -> None:
    reqs = [_req("short", 10, 9.0), _req("old_long", 1000, 0.0), _req("started", 2000, 8.0, kv_len=512),
            _req("older_mid", 100, -1.0)]
    # at t=6 old_long (6 s) and older_mid (7 s) passed the 5 s bound: oldest first, after the started one
    order = [r.rid for r in order_by_policy(reqs, "sjf", 5.0, now=6.0)]
    assert order == ["started", "older_mid", "old_long", "short"]
    # at t=3 nothing aged yet: shortest remaining first
    assert [r.rid for r in order_by_policy(reqs, "sjf", 5.0, now=3.0)] == ["started", "short", "older_mid", "old_long"]


def test_bad_policy_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--schedule-policy"):
        EngineConfig(schedule_policy="lifo")
    with pytest.raises(ValueError, match="--schedule-aging"):
        EngineConfig(schedule_aging_s=0)
