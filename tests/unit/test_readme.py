"""README's first two commands stay true: one starts the system, one runs the tests, and CI runs
exactly that test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block and text.index(block.group(0)) < 200, "README must start with the set-up commands"
    return [ln.split("#")[0].strip() for ln in block.group(1).splitlines() if ln.strip()]


def test_readme_starts_with_up_and_test_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2
    assert cmds[0].startswith("bash scripts/dev.sh up") and cmds[1] == "bash scripts/dev.sh test"


def test_ci_runs_the_readme_test_command():
    lines = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    assert lines[-1] == _readme_commands()[1]


def test_dev_script_rejects_unknown_commands():
    proc = subprocess.run(["bash", str(ROOT / "scripts/dev.sh"), "bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_every_subcommand_has_help():
    for sub in ("up", "router", "prefill", "decode", "colocated", "bench", "model"):
        proc = subprocess.run([sys.executable, "-m", "pdserve", sub, "--help"], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
        assert proc.returncode == 0, (sub, proc.stderr[-2000:])
        assert "usage" in proc.stdout.lower() and len(proc.stdout) > 200, sub
