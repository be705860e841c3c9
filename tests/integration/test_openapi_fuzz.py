"""A schema-driven fuzzer (schemathesis) on the router's own OpenAPI document, with the router in front
of a real prefill and decode service frontend (tests/stub_worker.py: the real HTTP service and request
parser, a stub engine), and on a colocated service's own document (`pdserve colocated`'s frontend over
the stub engine): every request the document allows must be answered 2xx, every status and content
type an answer has must be documented, a 405 names the allowed methods, and so on (schemathesis'
checks, all of them).

The CI test runs a bounded, derandomized number of examples (`FUZZ_EXAMPLES`, a fixed seed). Run it by
hand for a longer session and a report of every finding:

    python tests/integration/test_openapi_fuzz.py --examples 200 [--root DIR] [--out findings.txt]
    python tests/integration/test_openapi_fuzz.py --service colocated --examples 25   # a service alone

(`--root` serves another checkout of the code, e.g. the tree before a change, for a before/after.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from common.procs import Child, free_port, wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
FUZZ_EXAMPLES = 25
SEED = 34


def _child(root: Path, logs: Path, name: str, args: list[str]) -> Child:
    """`python -m args...` run from `root` (its code, not this checkout's), on a free port."""
    port = free_port()
    return Child(name, [sys.executable, "-m", *args, "--port", str(port)], logs / f"{name}.log",
                 url=f"http://127.0.0.1:{port}", cwd=root,
                 env={"PYTHONPATH": str(root), "PDSERVE_STUB_DELAY_S": "0.001"})


def _service(root: Path, logs: Path, role: str, model_dir: Path) -> Child:
    pd = ["--transfer-backend", "fake"] if role != "colocated" else []
    return _child(root, logs, role, ["tests.stub_worker", "--role", role, "--model", str(model_dir), "--device",
                                     "cpu", "--dtype", "float32", "--context-length", "4096", "--log-level",
                                     "warning", *pd])


@contextmanager
def service_stack(root: Path = ROOT, role: str = "colocated") -> Iterator[str]:
    """One service of `role` (code from `root`; the real frontend over the stub engine); yields its URL."""
    from tests.stub_worker import make_tokenizer_dir

    with tempfile.TemporaryDirectory() as tmp:
        service = _service(root, Path(tmp), role, make_tokenizer_dir(Path(tmp) / "model"))
        try:
            wait_until(service.healthy, 180, f"{role} healthy")
            yield service.url
        finally:
            service.stop()


@contextmanager
def router_stack(root: Path = ROOT) -> Iterator[str]:
    """A router (code from `root`) in front of one prefill and one decode service; yields its URL."""
    from tests.stub_worker import make_tokenizer_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tokenizer_dir(Path(tmp) / "model")
        logs = Path(tmp)
        procs = [_service(root, logs, "prefill", model_dir), _service(root, logs, "decode", model_dir)]
        procs.append(_child(root, logs, "router", ["router.main", "--health-interval", "0.3", "--log-level",
                                                   "warning", "--prefill", procs[0].url, "--decode", procs[1].url]))
        try:
            for p in procs:
                wait_until(p.healthy, 180, f"{p.name} healthy")
            yield procs[2].url
        finally:
            for p in reversed(procs):
                p.stop()


# Schema-valid requests the services still refuse (400) for what no static document can say: token ids
# outside this model's vocabulary, prompts over its context length, grammars that do not compile, a
# named tool_choice missing from tools, tool-call arguments that are not JSON, a logprob_start_len past
# the prompt, input_embeds rows of another width than the model's hidden size. (Whole numbers sent as
# floats, 2.0, are integers: taken everywhere, common/api_requests.validate.) The hand run reports
# these; the CI run leaves that one check out.
SEMANTIC = ("positive_data_acceptance",)
CI_PHASES = ("--phases", "fuzzing")  # the coverage phase's boundary cases take minutes; the hand run has them


def fuzz(url: str, examples: int, seed: int = SEED, out: Path | None = None, exclude: tuple[str, ...] = (),
         extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run schemathesis' CLI (every check but `exclude`) on `url`/openapi.json; its report is the result."""
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "run", f"{url}/openapi.json", "--checks", "all", "--max-examples", str(examples), "--seed",
           str(seed), "--generation-deterministic", "--workers", "1", "--continue-on-failure",
           "--request-timeout", "30", "--no-color"]
    if exclude:
        cmd += ["--exclude-checks", ",".join(exclude)]
    cmd += extra
    with tempfile.TemporaryDirectory() as cwd:  # schemathesis keeps its state in ./.schemathesis
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=cwd)
    if out is not None:
        out.write_text(r.stdout + r.stderr)
    return r


def _embeddings_answer(url: str) -> None:
    """POST /v1/embeddings through the router reaches the prefill stub (tests/stub_worker.py answers
    with fake vectors) and the services' own document shows the router's request model."""
    import httpx

    r = httpx.post(f"{url}/v1/embeddings", json={"input": ["a b", [5, 6]], "dimensions": 8}, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and all(len(d["embedding"]) == 8 for d in data)
    assert data[0]["embedding"] != data[1]["embedding"] and r.json()["usage"]["prompt_tokens"] >= 3
    bad = httpx.post(f"{url}/v1/embeddings", json={"input": "a", "dimensions": 10**6}, timeout=30)
    assert bad.status_code == 400 and "'dimensions'" in bad.json()["error"]["message"]
    prefill = next(w["url"] for w in httpx.get(f"{url}/admin/workers").json()["workers"] if w["role"] == "prefill")
    op = httpx.get(f"{prefill}/openapi.json").json()["paths"]["/v1/embeddings"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/EmbeddingRequest")


def test_router_document_survives_the_fuzzer() -> None:
    pytest.importorskip("schemathesis")
    with router_stack() as url:
        _embeddings_answer(url)
        r = fuzz(url, FUZZ_EXAMPLES, exclude=SEMANTIC, extra=CI_PHASES)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_colocated_document_survives_the_fuzzer() -> None:
    """The same checks on a service's own document (its sessions, abort, flush, LoRA and embeddings
    routes too): 405s carry Allow, whole numbers sent as floats (2.0) are integers, every body a
    handler needs is documented as required."""
    pytest.importorskip("schemathesis")
    with service_stack() as url:
        r = fuzz(url, FUZZ_EXAMPLES, exclude=SEMANTIC, extra=CI_PHASES)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def _stack(root: Path, service: str):  # noqa: ANN202
    return router_stack(root) if service == "router" else service_stack(root, service)


def _ci_run(root: Path, service: str = "router") -> None:
    """The CI configuration by hand, on any checkout (the tree before the fixes fails it)."""
    with _stack(root, service) as url:
        r = fuzz(url, FUZZ_EXAMPLES, exclude=SEMANTIC, extra=CI_PHASES)
    print(r.stdout[-3000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--root", type=Path, default=ROOT)
    p.add_argument("--out", type=Path)
    p.add_argument("--service", default="router", choices=("router", "colocated", "prefill", "decode"),
                   help="whose document: the router's (in front of a prefill and a decode), or one service's")
    p.add_argument("--ci", action="store_true", help="only the CI configuration (on --root)")
    a = p.parse_args()
    if a.ci:
        return _ci_run(a.root.resolve(), a.service)
    with _stack(a.root.resolve(), a.service) as url:
        r = fuzz(url, a.examples, a.seed, a.out)
    print(r.stdout[-20000:], r.stderr[-4000:])
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
