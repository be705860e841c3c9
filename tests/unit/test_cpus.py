"""CPU budget for torch threads: affinity capped by the cgroup quota, split among local workers."""

from __future__ import annotations

import os

import pytest

from engine.cpus import cgroup_quota_cpus, cpu_budget, threads_per_worker
from pdserve.up import build_parser, worker_threads


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota_cpus(tmp_path) == 1.5
    assert cpu_budget(tmp_path) == 1  # 1.5 CPUs: one busy thread, not two fighting over 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota_cpus(tmp_path) is None
    assert cpu_budget(tmp_path) == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota_and_none(tmp_path):
    assert cgroup_quota_cpus(tmp_path) is None
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota_cpus(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert cgroup_quota_cpus(tmp_path) == 0.5
    assert cpu_budget(tmp_path) == 1  # never below one


def test_threads_per_worker_divides_and_never_goes_below_one():
    assert threads_per_worker(2, budget=2) == 1
    assert threads_per_worker(2, budget=16) == 8
    assert threads_per_worker(3, budget=16) == 5
    assert threads_per_worker(4, budget=2) == 1
    with pytest.raises(ValueError):
        threads_per_worker(0, budget=2)


def test_up_passes_threads_unless_the_user_or_a_gpu_decides():
    a = build_parser().parse_args(["--prefill", "1", "--decode", "1", "--device", "cpu"])
    assert worker_threads(a, []) == threads_per_worker(2)
    assert worker_threads(a, ["--threads", "3"]) is None  # --worker-args wins
    assert worker_threads(a, ["--threads=3"]) is None
    a = build_parser().parse_args(["--threads", "3", "--device", "cpu"])
    assert worker_threads(a, []) == 3
    a = build_parser().parse_args(["--device", "cuda:0"])
    assert worker_threads(a, []) is None  # GPU workers keep their defaults
