"""Split-node load test (issue 7, acceptance 1): router, prefill and decode each in its own network
namespace, KV over UCX/TCP across veth links, ~60 s of load from the router's namespace.

Checks: zero failed requests, both KV pools fully free afterwards, and the transfer byte counters of
prefill and decode equal what the prompts imply (whole pages * kv_bytes_per_token).
Duration: PDSERVE_LOAD_DURATION seconds (default 60). Needs root for `ip netns` (CI runs as root).
"""

from __future__ import annotations

import os

import pytest

from loadtest.netns import list_netns
from loadtest.splitnode import SplitNodeConfig, run

DURATION = float(os.environ.get("PDSERVE_LOAD_DURATION", "60"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(int(DURATION) + 900)
def test_split_node_load(tmp_path):
    cfg = SplitNodeConfig(out_dir=str(tmp_path), duration_s=DURATION, prefix="pdl")
    report = run(cfg)
    s = report["summary"]
    assert report["problems"] == [], report
    assert s["failed"] == 0 and s["completed"] >= 5
    assert report["expected_kv_bytes"] > 0
    reused = report["reused_kv_bytes"]  # prompt pages the decode's prefix cache held already
    assert report["transfer_bytes"]["pre"] + reused == report["expected_kv_bytes"]
    assert report["transfer_bytes"]["dec"] + reused == report["expected_kv_bytes"]
    assert all(p["kv_used_tokens"] == 0 for p in report["pools"].values())
    for png in ("latency_cdf.png", "itl_over_time.png"):
        assert (tmp_path / "bench" / png).read_bytes()[:8] == PNG_MAGIC
    assert not [n for n in list_netns() if n.startswith("pdl-")]  # torn down
