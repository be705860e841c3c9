"""The split-node acceptance checks on hand-made worker states (no processes)."""

from __future__ import annotations

from loadtest import promtext
from loadtest.splitnode import REUSED_BYTES_METRIC, TRANSFER_BYTES_METRIC, SplitNodeConfig, check, info_value

BPT = 46080


def state(sent: int, used: int, reused: int | None = None) -> dict:
    text = f'{TRANSFER_BYTES_METRIC}{{peer="x"}} {sent}\npdserve_worker_kv_used_tokens {used}\n'
    if reused is not None:
        text += f"{REUSED_BYTES_METRIC} {reused}\n"
    info = {"ready": True, "internal_states": [{"kv_used_tokens": used, "kv_total_tokens": 4096,
                                                "page_size": 16, "kv_bytes_per_token": BPT}]}
    return {"metrics": promtext.parse(text), "info": info}


def bench(prompts: list[int], failed: int = 0) -> dict:
    reqs = [{"error": None, "prompt_len": n, "server_prompt_tokens": n} for n in prompts]
    reqs += [{"error": "HTTP 500", "prompt_len": 5, "server_prompt_tokens": None}] * failed
    return {"requests": reqs, "summary": {"failed": failed, "completed": len(prompts),
                                          "num_requests": len(reqs), "errors": ["HTTP 500"] * bool(failed)}}


def test_info_value_reads_internal_states():
    info = {"a": 1, "internal_states": [{"kv_used_tokens": 3}, {"kv_used_tokens": 4, "dtype": "f"}]}
    assert info_value(info, "a") == 1
    assert info_value(info, "kv_used_tokens") == 7
    assert info_value(info, "dtype") == "f"
    assert info_value(info, "nope") is None


def test_check_passes_when_bytes_match_and_pools_free():
    cfg = SplitNodeConfig(out_dir="x")
    expected = (32 + 16 + 16) * BPT  # prompts of 17, 16 and 1 tokens -> 2 + 1 + 1 pages
    before = {"pre": state(1000, 0), "dec": state(1000, 0)}
    after = {"pre": state(1000 + expected, 0), "dec": state(1000 + expected, 0)}
    rep = check(cfg, bench([17, 16, 1]), before, after, bytes_per_token=1)
    assert rep["problems"] == []
    assert rep["expected_kv_bytes"] == expected and rep["kv_bytes_per_token"] == BPT


def test_check_counts_pages_the_decode_held_already():
    """Decode-side prefix reuse: prefill and decode move fewer bytes; moved + reused == the prompts'."""
    cfg = SplitNodeConfig(out_dir="x")
    before = {"pre": state(0, 0), "dec": state(0, 0, reused=5)}
    after = {"pre": state(32 * BPT, 0), "dec": state(32 * BPT, 0, reused=5 + 16 * BPT)}
    rep = check(cfg, bench([17, 16]), before, after, BPT)
    assert rep["problems"] == [] and rep["expected_kv_bytes"] == (32 + 16) * BPT
    after["dec"] = state(32 * BPT, 0, reused=5)  # nothing reused: the pre/dec bytes fall short
    assert len(check(cfg, bench([17, 16]), before, after, BPT)["problems"]) == 2


def test_check_reports_each_failure():
    cfg = SplitNodeConfig(out_dir="x")
    before = {"pre": state(0, 0), "dec": state(0, 0)}
    after = {"pre": state(16 * BPT, 16), "dec": state(0, 0)}
    rep = check(cfg, bench([16], failed=1), before, after, bytes_per_token=BPT)
    text = " | ".join(rep["problems"])
    assert "1 failed" in text
    assert "pre pool not free" in text
    assert "dec: " in text and "prompts imply 737280" in text
    assert len(rep["problems"]) == 3
    missing = {"metrics": {}, "info": {"kv_used_tokens": 0}}
    rep = check(cfg, bench([16]), {"pre": missing, "dec": missing}, {"pre": missing, "dec": missing}, BPT)
    assert any("nan" in p for p in rep["problems"])  # a renamed counter cannot pass silently
