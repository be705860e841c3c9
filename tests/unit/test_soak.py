"""The pure parts of benchmarks/soak.py (the soak itself starts a whole stack: run it by hand): the RSS
reader over this test's own process tree, the classifier of answers, the growth and verdict arithmetic."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("soak", soak)  # its dataclasses look their module up by name
_spec.loader.exec_module(soak)

linux = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


@linux
def test_rss_reader_walks_and_names_this_process_tree():
    # a child (its own session, so its group can be stopped) that starts a grandchild `sleep`
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '30']); "
                              "time.sleep(30)"], start_new_session=True)
    try:
        me = os.getpid()
        deadline = time.monotonic() + 10
        while True:
            table = soak.proc_table()
            tree = soak.descendants(table, [me])
            if any(table[p][1][:1] == ["sleep"] for p in tree) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert tree[0] == me and child.pid in tree
        assert tree.index(child.pid) < max(i for i, p in enumerate(tree) if table[p][1][:1] == ["sleep"])
        rss = soak.read_rss([me], {me: "test", child.pid: "kid"})
        assert rss["test"]["pid"] == me and rss["test"]["rss_mb"] > 1
        assert rss["kid"]["pid"] == child.pid and rss["kid"]["rss_mb"] > 1
        assert "kid/sleep" in rss and rss["kid/sleep"]["rss_mb"] > 0
        assert soak.rss_mb(2**22 + 12345) is None  # no such pid
        assert soak.descendants(table, [2**22 + 12345]) == []
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_process_names_from_command_lines():
    table = {
        10: (1, ["python", "-m", "pdserve", "up", "--port", "8000"]),
        11: (10, ["python", "-m", "pdserve", "decode", "--port", "30002"]),
        12: (11, ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
                  "--multiprocessing-fork"]),
        13: (11, ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
                  "--multiprocessing-fork"]),
        14: (11, ["python", "-c", "from multiprocessing.resource_tracker import main;main(5)"]),
        15: (10, ["python", "-m", "pdserve", "router", "--port", "8000"]),
    }
    pids = soak.descendants(table, [10])
    assert pids == [10, 11, 15, 12, 13, 14]
    names = soak.name_processes(table, pids, {10: "up", 11: "decode-0"})
    assert names == {10: "up", 11: "decode-0", 15: "up/router:8000", 12: "decode-0/worker",
                     13: "decode-0/worker#2", 14: "decode-0/resource_tracker"}
    assert soak.short_name(["/usr/bin/sleep", "5"]) == "sleep"


def test_classify():
    c = soak.classify
    assert c(200, {}, {"choices": []}) == ("ok", "")
    assert c(200, {}, None, problem="no [DONE]") == ("other_error", "200: no [DONE]")
    # an error event in a 200 stream counts by its code
    assert c(200, {}, {"error": {"message": "busy", "code": 503, "retry_after": 2}})[0] == "overload_503"
    assert c(200, {}, {"error": {"message": "boom", "code": 500}}) == ("other_error", "500: boom")
    assert c(200, {}, {"error": {"message": "boom"}}) == ("other_error", "200: boom")
    # 503: overload only with Retry-After (header, any case, or the body's retry_after)
    assert c(503, {"Retry-After": "3"}, {"error": {"message": "queue full", "code": 503}}) == (
        "overload_503", "503 retry-after 3: queue full")
    assert c(503, {}, {"error": {"message": "x", "code": 503, "retry_after": 5}})[0] == "overload_503"
    assert c(503, {}, {"error": {"message": "worker dead", "code": 503}}) == ("other_error", "503: worker dead")
    # a 4xx is expected only where the kind expects one
    big = {"error": {"message": "the prompt needs 3000 tokens; the KV pool holds 2048", "code": 400}}
    assert c(400, {}, big, expect_4xx=True)[0] == "expected_4xx"
    assert c(400, {}, big)[0] == "other_error"
    assert c(500, {}, "Internal Server Error") == ("other_error", "500: Internal Server Error")
    assert c(422, {}, {"detail": "bad field"}, expect_4xx=True) == ("expected_4xx", "422: bad field")


def _series(values, t0=0, step=60, pid=1):
    return [{"t": t0 + i * step, "rss_mb": v, "pid": pid} for i, v in enumerate(values)]


def test_growth_calls():
    g = soak.growth(_series([100, 400, 500, 505, 510, 512]), warmup_s=120, run_end_t=300, flat_mb=20, flat_pct=5)
    assert g["call"] == "flat" and g["first_mb"] == 500 and g["last_mb"] == 512 and g["growth_mb"] == 12
    assert g["growth_pct"] == 2.4 and g["max_mb"] == 512 and g["limit_mb"] == 25  # 5% of 500 > 20 MB
    assert g["slope_mb_per_h"] > 0
    g = soak.growth(_series([100, 400, 500, 530, 560, 600]), 120, 300, 20, 5)
    assert g["call"] == "growing" and g["growth_mb"] == 100 and g["growth_pct"] == 20.0
    g = soak.growth(_series([80, 90, 100, 101]), 60, 180, 20, 5)  # small process: the MB floor applies
    assert g["call"] == "flat" and g["limit_mb"] == 20
    g = soak.growth(_series([100, 90, 80]), 60, 120, 20, 5)  # shrinking is flat
    assert g["call"] == "flat" and g["growth_mb"] == -10
    restarted = _series([500, 500, 500]) + [{"t": 180, "rss_mb": 300, "pid": 2}]
    assert soak.growth(restarted, 60, 180, 20, 5)["call"] == "restarted"
    assert soak.growth(_series([500, 500, 500]), 60, 300, 20, 5)["call"] == "gone"
    assert soak.growth(_series([500, 500, 500]), 150, 120, 20, 5)["call"] == "too_short"


def test_verdict():
    counts = {"ok": 90, "expected_4xx": 3, "overload_503": 4, "client_hangup": 3}
    flat = {"router": {"call": "flat"}, "decode-0/worker": {"call": "flat"}}
    v = soak.verdict(counts, 100, flat)
    assert v["pass"] and v["all_answered"] and v["hung"] == 0 and v["rss_flat"] is True and v["rss_not_flat"] == []
    v = soak.verdict({**counts, "hung": 1}, 101, flat)
    assert not v["pass"] and v["hung"] == 1 and not v["all_answered"]
    v = soak.verdict(counts, 101, flat)  # one sent, never classified
    assert not v["pass"] and not v["all_answered"]
    v = soak.verdict(counts, 100, {**flat, "decode-0": {"call": "growing"}})
    assert not v["pass"] and v["rss_flat"] is False and v["rss_not_flat"] == ["decode-0"]
    v = soak.verdict(counts, 100, {**flat, "up": {"call": "too_short"}})
    assert not v["pass"] and v["rss_flat"] is None
    assert soak.verdict(counts, 100, {})["rss_flat"] is None  # RSS not read


def test_router_and_worker_numbers():
    text = "\n".join([
        "# HELP pdserve_router_requests_total Requests finished",
        'pdserve_router_requests_total{endpoint="/v1/chat/completions",status="200"} 12.0',
        'pdserve_router_requests_total{endpoint="/generate",status="200"} 3.0',
        'pdserve_router_requests_total{endpoint="/generate",status="503"} 2.0',
        "pdserve_router_retries_total 1.0",
        'pdserve_router_ejections_total{role="decode",url="http://x"} 0.0',
    ])
    r = soak.router_numbers(text)
    assert r["requests_by_status"] == {"200": 15, "503": 2} and r["retries"] == 1 and r["migrations"] == 0
    info = {"in_flight": 2, "worker_pid": 7, "internal_states": [{
        "kv_used_tokens": 100, "kv_total_tokens": 2048, "queues": {"prealloc": 1}, "running_requests": 2,
        "active_rooms": 1, "counters": {"retractions": 3, "queue_rejected": 4, "forward_tokens": 9}}]}
    w = soak.worker_numbers(info)
    assert w["kv_used"] == 100 and w["kv_total"] == 2048 and w["running_requests"] == 2
    assert w["counters"] == {"retractions": 3, "queue_rejected": 4}
    assert soak.worker_numbers({"internal_states": []})["kv_used"] is None


def test_first_retraction_ends_warmup():
    samples = [{"t": 0, "server": {"router": {"counters": {"retractions": 5}},
                                   "decode-0": {"counters": {"retractions": 0}}}},
               {"t": 60, "server": {"decode-0": None}},
               {"t": 120, "server": {"prefill-0": {}, "decode-0": {"counters": {"retractions": 2}}}}]
    assert soak.first_counter_t(samples, "retractions") == 120  # the router's own counters do not count
    assert soak.first_counter_t(samples[:2], "retractions") is None
