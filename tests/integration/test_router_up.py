"""`pdserve up` with stub workers (--worker-cmd): it waits until healthy, prints the URL and a curl
example, serves through the router (an image request through its encoder with --encoder), and stops every
child on SIGINT with exit 0; a worker that dies at start (an encoder on a text-only model) makes it print
the log tail and exit non-zero."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from router_harness import ROOT, STUB, free_port, wait_for

pytestmark = pytest.mark.slow


def _up(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = free_port()
    proc = _up(
        [
            "--prefill",
            "2",
            "--decode",
            "1",
            "--encoder",
            "1",
            "--port",
            str(port),
            "--log-dir",
            str(tmp_path),
            "--worker-cmd",
            f"{sys.executable} {STUB}",
            "--grace",
            "5",
        ]
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while not any("Ctrl-C stops everything" in ln for ln in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "\n".join(lines)
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        assert len(pids) == 5 and f"http://127.0.0.1:{port}/v1/chat/completions" in text and "curl" in text
        assert '"model": "stub-model"' in text
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"].split()) == 3
        # the encoder is registered with its bootstrap port; an image request goes encoder -> prefill -> decode
        enc = re.search(r"started encoder-0 pid \d+: (\S+)", text).group(1)
        (worker,) = [w for w in httpx.get(f"http://127.0.0.1:{port}/admin/workers").json()["workers"]
                     if w["role"] == "encoder"]
        assert worker["url"] == enc and worker["bootstrap_port"] not in (None, int(enc.rsplit(":", 1)[1]))
        image = {"text": "describe", "image_data": ["data:image/png;base64,iVBORw0KGgo="],
                 "sampling_params": {"max_new_tokens": 3}}
        assert httpx.post(f"http://127.0.0.1:{port}/generate", json=image).status_code == 200
        # workers demand the generated internal token: a direct call without it is refused
        worker_url = re.search(r"started prefill-0 pid \d+: (\S+)", text).group(1)
        assert httpx.post(worker_url + "/generate", json={"text": "x"}).status_code == 401
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        wait_for(lambda: not any(_alive(p) for p in pids), 10, "children gone")
        assert "stopped; logs in" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_reports_a_worker_that_dies_at_start(tmp_path):
    # the encoder dies as `pdserve encoder` does on a text-only model; the prefill and decode are stubs
    crash = tmp_path / "crash.py"
    crash.write_text(
        "import os, sys\n"
        "if sys.argv[1] != 'encoder':\n"
        f"    os.execv(sys.executable, [sys.executable, {str(STUB)!r}, *sys.argv[1:]])\n"
        "print(\"ValueError: `pdserve encoder` runs a vision-language model's tower; llama has none\")\n"
        "sys.exit(3)\n")
    proc = _up(["--encoder", "1", "--port", str(free_port()), "--log-dir", str(tmp_path),
                "--worker-cmd", f"{sys.executable} {crash}"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "encoder-0 exited with 3" in out and "vision-language model's tower; llama has none" in out


class _Lines:
    """stdout of `pdserve up`, read by a thread, so a test polls it with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    def wait(self, pattern: str, timeout: float = 60.0) -> re.Match:
        return wait_for(lambda: re.search(pattern, "".join(self.lines)), timeout, pattern)


def test_up_restarts_a_killed_worker_and_keeps_serving(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _up(["--prefill", "1", "--decode", "2", "--port", str(port), "--log-dir", str(tmp_path),
                "--worker-cmd", f"{sys.executable} {STUB}", "--grace", "5"])
    out = _Lines(proc)
    try:
        out.wait("Ctrl-C stops everything", 90)
        old = int(out.wait(r"started decode-0 pid (\d+)").group(1))
        os.kill(old, signal.SIGKILL)
        out.wait(r"decode-0 \(pid \d+\) exited with -9; restarting in 1s")
        # the other decode serves while decode-0 is down (the router retries away from it)
        body = {"prompt": "hi", "max_tokens": 3}
        assert all(httpx.post(url + "/v1/completions", json=body).status_code == 200 for _ in range(4))
        new = int(out.wait(r"restarted decode-0 \(restart 1\): pid (\d+)").group(1))
        assert new != old and _alive(new)

        def readmitted() -> bool:
            workers = httpx.get(url + "/admin/workers").json()["workers"]
            return len(workers) == 3 and all(w["healthy"] and w["eligible"] for w in workers)

        wait_for(readmitted, 30, "decode-0 healthy in the router again")
        assert all(httpx.post(url + "/v1/completions", json=body).status_code == 200 for _ in range(6))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        pids = [int(p) for p in re.findall(r"pid (\d+)", "".join(out.lines))]
        wait_for(lambda: not any(_alive(p) for p in pids), 10, "children gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
