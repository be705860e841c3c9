"""pdserve.supervise: restart policy and backoff, stepped with a fake clock over real processes."""

from __future__ import annotations

import sys

import pytest

from common.procs import Child
from pdserve.supervise import Supervisor


def _child(tmp_path, code: int) -> Child:  # noqa: ANN001
    return Child("w", [sys.executable, "-c", f"raise SystemExit({code})"], tmp_path / "w.log")


def test_on_failure_restarts_with_doubling_backoff(tmp_path):
    log: list[str] = []
    children = [_child(tmp_path, 3)]
    sup = Supervisor("on-failure", children, log.append)
    children[0].popen.wait(10)
    assert sup.poll(0.0) is None and "exited with 3; restarting in 1s" in log[-1]
    first = children[0]
    sup.poll(0.5)
    assert children[0] is first  # backoff not over
    sup.poll(1.0)
    assert children[0] is not first and sup.restarts("w") == 1 and "restarted w (restart 1)" in log[-1]
    children[0].popen.wait(10)
    sup.poll(1.0)
    assert "restarting in 2s" in log[-1]


def test_clean_exit_stays_down_and_never_is_final(tmp_path):
    log: list[str] = []
    children = [_child(tmp_path, 0)]
    sup = Supervisor("on-failure", children, log.append)
    children[0].popen.wait(10)
    first = children[0]
    for t in (0.0, 5.0, 50.0):
        assert sup.poll(t) is None
    assert children[0] is first and sup.restarts("w") == 0
    assert len(log) == 1 and "exited with 0; not restarted" in log[0]
    dead = [_child(tmp_path, 1)]
    dead[0].popen.wait(10)
    assert Supervisor("never", dead, print).poll(0.0) is dead[0]
    with pytest.raises(ValueError, match="restart policy"):
        Supervisor("always", dead, print)
