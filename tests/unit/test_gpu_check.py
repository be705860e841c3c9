"""benchmarks/gpu_check.sh on a CPU box: every step it names exists (--list: files and test functions, no
python), a step naming a file or test that is gone is reported MISSING, and (--dry-run) pytest collects every
test the steps name and every benchmark they run answers --help. The GPU run itself needs a lent GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
# what the README's GPU paragraph says the check covers
STEPS = ("kernels", "families", "engine_oracle", "pd_gpu", "host_tier", "tp_nccl", "mla_decode", "attention_kernels",
         "engine_throughput")


def _run(script: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_list_names_only_what_exists() -> None:
    proc = _run(SCRIPT, "--list")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split()[2] for line in proc.stdout.splitlines() if line and not line[0].isspace()}
    for name in STEPS:
        assert rows.get(name) == "ok", (name, proc.stdout)
    assert "MISSING" not in proc.stdout
    for ref in ("tests/integration/test_pd_gpu.py", "tests/engine/test_triton_models.py",
                "tests/engine/test_gpu_paths.py::test_tp2_over_nccl_matches_tp1"):
        assert ref in proc.stdout


def test_a_missing_file_or_test_is_reported(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "gpu_check.sh")
    (tmp_path / "tests" / "engine").mkdir(parents=True)
    (tmp_path / "tests" / "engine" / "test_moe.py").write_text("def test_something_else():\n    pass\n")
    proc = _run(tmp_path / "benchmarks" / "gpu_check.sh", "--list")
    assert proc.returncode == 1
    assert "MISSING tests/integration/test_pd_gpu.py" in proc.stdout
    assert "MISSING tests/engine/test_moe.py::test_triton_fused_moe_matches_cpu_path (no def" in proc.stdout
    assert "MISSING benchmarks/gpu_oracle.py" in proc.stdout


def test_bad_flag_is_refused() -> None:
    proc = _run(SCRIPT, "--bogus")
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.slow
def test_dry_run_collects_every_named_test() -> None:
    proc = _run(SCRIPT, "--dry-run", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "NOT COLLECTED" not in proc.stdout and "FAILED" not in proc.stdout
    assert "ok      benchmarks/gpu_oracle.py --help" in proc.stdout
