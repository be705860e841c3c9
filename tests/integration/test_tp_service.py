"""`pdserve colocated --tp 2` (issue 35) as real processes: the frontend, the worker (rank 0) and rank 1
(gloo on the CPU, 1 thread each), over HTTP, on a tiny random-weight GQA model with the embedded
model's tokenizer.

- It answers exactly as the TP 1 service does (greedy, /generate and /v1/completions, batched).
- SIGKILL of rank 1 in the middle of a streamed request: the stream ends with an error, the frontend
  stops the worker and exits 1 (so `pdserve up` or Kubernetes starts it again), no process is left.
- Under `pdserve up --decode-tp 2` the supervisor does start it again: served, pools back to 0.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from pd_harness import COMMON, call
from router_harness import Proc, free_port, wait_for

from common.procs import stop_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[(5 * i + k) % 250 + 1 for i in range(n)] for k, n in enumerate((7, 30, 61))]


def _start(model: Path, *extra: str) -> Proc:
    port = free_port()
    args = [sys.executable, "-m", "pdserve", "colocated", "--port", str(port), "--model", str(model), *COMMON,
            "--max-total-tokens", "1024", "--page-size", "8", *extra]
    return Proc(f"colocated-{port}", args, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory):
    """(TP 1 service, TP 2 service), started at once."""
    model = make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("tp_svc") / "gqa"))
    procs = [_start(model), _start(model, "--tp", "2")]
    try:
        for p in procs:
            p.wait_healthy(180)
        yield procs
    finally:
        stop_all(procs, 20)  # both at once: each stops its ranks in parallel
        for p in procs:
            p.stop()  # gone already: removes its log


def _children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _gen(ids: list[int], new: int = 12, **kw: object) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            **kw}


def test_tp2_service_answers_like_tp1(services) -> None:  # noqa: ANN001
    one, two = services
    info = httpx.get(two.url + "/server_info", timeout=10).json()["internal_states"][0]
    assert info["tp"] == 2
    outs = []
    for svc in services:
        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:  # one batch
            res = list(ex.map(lambda ids, u=svc.url: call(u, "/generate", _gen(ids)), PROMPTS))
        assert all(status == 200 for status, _ in res), res
        text = call(svc.url, "/v1/completions", {"model": "m", "prompt": PROMPTS[1], "max_tokens": 10,
                                                 "temperature": 0, "stream": True})
        assert text[0] == 200, text
        outs.append(([body["output_ids"] for _, body in res], [e["choices"][0]["text"] for e in text[1]]))
    assert outs[0] == outs[1]
    assert all(len(ids) == 12 for ids in outs[1][0])


def test_rank_killed_mid_request_fails_it_and_stops_the_service(services) -> None:  # noqa: ANN001
    _, two = services
    worker = httpx.get(two.url + "/server_info", timeout=10).json()["worker_pid"]
    ranks = [p for p in _children(two.pid) if p != worker and "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(ranks) == 1, ranks
    events: list[dict] = []
    body = _gen(PROMPTS[0], 480, stream=True)
    with httpx.Client(timeout=60) as c, c.stream("POST", two.url + "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:
                os.kill(ranks[0], signal.SIGKILL)  # rank 1 dies while the request runs
    assert "error" in events[-1], events[-1]
    assert len(events[-2]["output_ids"]) < 480, "the request finished before the kill"
    assert two.popen.wait(60) == 1  # the frontend stops the group and exits 1
    wait_for(lambda: not _alive(worker) and not _alive(ranks[0]), 30, "every rank process to exit")


def test_up_restarts_a_tp_decode_that_lost_a_rank_and_its_pools_return_to_zero(tmp_path: Path) -> None:
    """`pdserve up --decode-tp 2`: SIGKILL of the decode's rank 1 mid-stream ends that stream (an error or
    a migrated, complete answer: never a hang), the supervisor starts the decode group afresh, the next
    request is served, and every worker's pools are back to 0."""
    model = make_tiny_model(make_tokenizer_dir(tmp_path / "gqa"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "UCX_TLS": "tcp",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--model", str(model), "--decode-tp", "2",
         "--threads", "1", "--log-dir", str(tmp_path / "logs"), "--grace", "5",
         "--worker-args", "--max-total-tokens 1024 --page-size 8"],
        cwd=Path(__file__).resolve().parents[2], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    def seen(pattern: str, timeout: float = 180.0) -> re.Match:
        return wait_for(lambda: re.search(pattern, "".join(lines)), timeout, pattern)

    try:
        seen("Ctrl-C stops everything")
        m = seen(r"started decode-0 pid (\d+): (http://\S+)")
        decode, decode_url = int(m.group(1)), m.group(2)
        prefill_url = seen(r"started prefill-0 pid \d+: (http://\S+)").group(1)
        log = tmp_path / "logs" / "decode-0.log"
        ranks = [int(wait_for(lambda: re.search(r"tensor-parallel pdserve-tp-rank-1 started: pid (\d+)",
                                                log.read_text()), 30, "rank 1's pid").group(1))]
        assert ranks[0] in _children(decode), ranks
        events: list[dict] = []
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/generate",
                                                     json=_gen(PROMPTS[0], 480, stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        os.kill(ranks[0], signal.SIGKILL)  # the decode's rank 1 dies while the stream runs
        last = events[-1]
        assert "error" in last or len(last["output_ids"]) == 480, last  # ended, one way or the other
        seen(r"restarted decode-0 \(restart 1\): pid (\d+)", 120)

        def served() -> bool:
            r = httpx.post(url + "/generate", json=_gen(PROMPTS[1]), timeout=60)
            return r.status_code == 200 and len(r.json()["output_ids"]) == 12

        wait_for(served, 120, "a request served after the restart", interval=0.25)
        token = {"x-pdserve-token": (tmp_path / "logs" / "internal-token").read_text().strip()}
        for u in (decode_url, prefill_url):
            def idle(u: str = u) -> bool:
                s = httpx.get(u + "/server_info", headers=token, timeout=10).json()["internal_states"][0]
                return s["kv_used_tokens"] == 0 and s.get("host_kv_used_pages", 0) == 0 and \
                    s.get("active_rooms", 0) == 0
            wait_for(idle, 60, f"{u} to hold no KV", interval=0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        pids = [int(p) for p in re.findall(r"pid (\d+)", "".join(lines))]
        wait_for(lambda: not any(_alive(p) for p in pids + ranks), 30, "every process gone")
    finally:
        if proc.poll() is None:  # a failed test: up stops its children (each in its own session)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in (int(p) for p in re.findall(r"pid (\d+)", "".join(lines))):
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)  # each child leads its own session
