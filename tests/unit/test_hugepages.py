"""engine/hugepages.py: the KV pool's memory is huge-page backed where the kernel's THP mode allows
it, and importing engine first turns on torch's own huge-page advice (an explicit setting wins)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import hugepages
from engine.kvcache.memory import KVPool

ROOT = Path(__file__).resolve().parents[2]


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


def anon_huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold t's memory (/proc/self/smaps; advising part of a mapping
    splits it, so t may span several)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.fixture
def enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The advice on, as in production (tests/conftest.py turns it off for the suite's start-up time)."""
    monkeypatch.setattr(hugepages, "ENABLED", True)


def test_kv_pool_gets_huge_pages(enabled: None) -> None:
    pool = KVPool(200, 30, 16, 3, 64, torch.float32, "cpu")  # 141 MiB
    assert torch.count_nonzero(pool.buffer) == 0  # still zeros, as torch.zeros gave
    if sys.platform.startswith("linux") and thp_mode() in ("always", "madvise"):
        assert anon_huge_kb(pool.buffer) >= 64 * 1024  # 32+ huge pages (fragmented memory may refuse some)
    else:  # the advice is refused or means nothing here; the pool still works
        assert pool.buffer.shape[0] == 200


def test_advise_needs_a_whole_huge_page() -> None:
    assert not hugepages.advise(torch.empty(1000))  # 4 KB: no aligned 2 MiB inside
    if hugepages._MADVISE is not None:
        assert hugepages.advise(torch.empty(2 * hugepages.HUGE_PAGE))


def _env_after_import(env: dict[str, str]) -> str:
    code = "import engine, os; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_importing_engine_enables_torch_huge_pages_unless_set() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "PDSERVE_HUGEPAGES")}
    assert _env_after_import(env) == "1"
    assert _env_after_import({**env, "THP_MEM_ALLOC_ENABLE": "0"}) == "0"
    assert _env_after_import({**env, "PDSERVE_HUGEPAGES": "0"}) == "None"  # torch's default: off


def test_pdserve_hugepages_0_gives_a_plain_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "ENABLED", False)
    called = []
    monkeypatch.setattr(hugepages, "advise", lambda t: called.append(t) or True)
    pool = KVPool(200, 30, 16, 3, 64, torch.float32, "cpu")
    assert torch.count_nonzero(pool.buffer) == 0 and not called


def test_importing_engine_bounds_the_per_shape_gemm_caches_unless_set() -> None:
    """torch's mkldnn cache and oneDNN's primitive cache keep megabytes per GEMM shape (one per token count of
    a forward): bounded on import, so a prefill that sees many prompt lengths stays flat (issue 53's soak)."""
    code = ("import engine, os; print(os.environ.get('LRU_CACHE_CAPACITY'), "
            "os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))")
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["16", "64"]
    mine = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "LRU_CACHE_CAPACITY": "512"},
                          capture_output=True, text=True, check=True)
    assert mine.stdout.split() == ["512", "64"]


def test_many_prompt_lengths_leave_the_anonymous_memory_flat() -> None:
    """A packed linear run at 150 distinct token counts (each a new GEMM shape): the process's anonymous memory
    grows by less than 60 MB with the bounded caches; with torch's defaults it grew 94 MB (0.6 MB a shape)."""
    code = """
import engine, torch
from engine.models import cpu_gemm
def anon():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon')) // 1024
w = torch.randn(2048, 2048)
packed = cpu_gemm.pack(w)
for m in range(1, 11):
    cpu_gemm.linear(torch.randn(m, 2048), w, packed)
start = anon()
for m in range(11, 161):
    cpu_gemm.linear(torch.randn(m, 2048), w, packed)
print(anon() - start)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert int(run.stdout.split()[-1]) < 60, run.stdout
