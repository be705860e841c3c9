"""Chaos suite on the split-node harness (issue 17, part 4): router, 2 prefills and 2 decodes in their
own network namespaces, one cluster for all six scenarios (loadtest/chaosnet.py), each under a batch
of concurrent greedy streams.

Per scenario: every request completed with the text of the unfailed reference batch (no token lost or
repeated across a migration), none hung, the fault hit requests in flight, every pool (kv_used_tokens,
active_rooms, host KV pages) back to 0, the next batch completed; the oversubscribed decode retracted
and reloaded. The whole suite must end within BUDGET_S (the aim: 6 minutes on CI's 2-core box).
Needs root for `ip netns` (CI runs as root).
"""

from __future__ import annotations

import os
import time

import pytest

from loadtest.chaosnet import KEYS, build_parser, run, table
from loadtest.netns import list_netns

# the aim is 6 min on CI's 2-core box; the bound leaves room for a busier box (here, shared: 6-6.5 min)
BUDGET_S = float(os.environ.get("PDSERVE_CHAOS_BUDGET_S", "540"))


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(int(BUDGET_S) + 300)
def test_chaos_suite_on_split_nodes(tmp_path):
    t0 = time.monotonic()
    report = run(build_parser().parse_args(["--out", str(tmp_path), "--prefix", "pdct"]))
    wall = time.monotonic() - t0
    print(table(report), f"\nwall {wall:.0f} s (start-up {report['startup_s']} s)")
    assert [r["scenario"] for r in report["rows"]] == list(KEYS)
    assert report["problems"] == [], report["problems"]
    for r in report["rows"]:
        assert r["completed"] == r["equal_to_unfailed"] == r["requests"] >= 8, r
        assert r["hangs"] == 0 and r["clean_errors"] == 0 and r["pools_after"] == "0", r
    rows = {r["scenario"]: r for r in report["rows"]}
    assert rows["kill-decode"]["migrated"] >= rows["kill-decode"]["hit"]["in_flight"] > 0
    assert rows["kill-decode"]["restarted"] and rows["kill-prefill"]["restarted"]
    assert rows["drain-decode"]["restarted"] and rows["drain-decode"]["migrated"] == 0  # drained, not cut
    over = rows["oversubscribed"]["hit"]
    assert over["need_pages"] >= 4 * over["pool_pages"] and over["retractions"] > 0 and over["reloads"] > 0
    assert not [n for n in list_netns() if n.startswith("pdct-")]  # torn down
    assert wall <= BUDGET_S, f"the chaos suite took {wall:.0f} s, over its {BUDGET_S:.0f} s budget"
