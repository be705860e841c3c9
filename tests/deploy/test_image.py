"""The container image (deploy/docker), built and smoke-run (issue 42).

1. deploy/docker/build_local.sh builds the CPU variant with buildah from a debootstrapped Debian base
   (cached under ~/.cache/pdserve/images; a cold build makes it first), tags it and prints its size.
2. A working container of the image; inside its root filesystem (`buildah run`, chroot isolation,
   host network) `pdserve up` starts the router, a prefill and a decode service on the embedded model.
3. A chat request through the router answers 200 with text (the KV crossed from prefill to decode over
   UCX inside the image), /metrics is served, the services run as user 10001, `pdserve --help` works, and the
   CPU attention kernels were compiled by the image's own cc. A SIGTERM to pdserve up (what tini
   forwards in a pod) ends every process in the container, exit status 0.
4. Teardown, even on failure: SIGTERM to pdserve up, then SIGTERM and SIGKILL to every process whose
   root is the container's filesystem, then `buildah rm` (unmounts it). The image stays, so the
   next build reuses its layers.

The fast test checks that the manifests reference the tags the build script prints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from common.procs import Child, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "docker" / "build_local.sh"
K8S = ROOT / "deploy" / "k8s"
LOGS = "/home/pdserve/logs"  # inside the container: `pdserve up --log-dir`
BUILD_TIMEOUT = 480  # s; a cold build (debootstrap, apt, pip) takes about 3-5 min on 2 busy cores


def _print_tag(variant: str) -> str:
    out = subprocess.run(["bash", str(SCRIPT), "--print-tag", variant], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _image_ref(kustomization: Path) -> tuple[str | None, str] | None:
    """(newName or None, newTag) of the `pdserve` image entry of a kustomization; None without one."""
    images = yaml.safe_load(kustomization.read_text()).get("images") or []
    entry = next((i for i in images if i["name"] == "pdserve"), None)
    return None if entry is None else (entry.get("newName"), entry["newTag"])


def _images(node: object) -> set[str]:
    """Every container image named anywhere in rendered manifests."""
    if isinstance(node, dict):
        found = {node["image"]} if isinstance(node.get("image"), str) else set()
        return found.union(*(_images(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_images(v) for v in node))
    return set()


def test_manifests_use_the_tags_the_build_prints(rendered_all: dict) -> None:
    cpu, cuda = _print_tag("cpu"), _print_tag("cuda")
    assert re.fullmatch(r"pdserve:[\w.]+-cpu", cpu) and cuda == cpu.removesuffix("-cpu"), (cpu, cuda)
    assert _image_ref(K8S / "base" / "kustomization.yaml") == (None, cuda.split(":")[1])
    for kustomization in sorted((K8S / "overlays").glob("*/kustomization.yaml")):
        if (ref := _image_ref(kustomization)) is None:
            continue  # the base's tag
        name, tag = ref
        want = cpu if kustomization.parent.name == "cpu-demo" else cuda
        assert f"pdserve:{tag}" == want and (name is None or name.endswith("/pdserve")), kustomization
    assert _images(list(rendered_all["cpu-demo"].docs)) == {cpu}
    assert {i.rsplit("/", 1)[-1] for i in _images(list(rendered_all["gpu"].docs))} == {cuda}
    bad = subprocess.run(["bash", str(SCRIPT), "rocm"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr


# ---- the real build and smoke run (slow) ----

def _buildah(*args: str, timeout: float = 120) -> str:
    out = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"buildah {' '.join(args)}: {out.stderr[-2000:]}"
    return out.stdout.strip()


@pytest.fixture(scope="module")
def image() -> str:
    """Build the CPU image (the script's own caching applies); its tag."""
    if os.geteuid() != 0 or not (shutil.which("buildah") and shutil.which("debootstrap")):
        pytest.skip("needs root, buildah and debootstrap (.ci/run installs them)")
    t0 = time.monotonic()
    build = subprocess.Popen(["bash", str(SCRIPT), "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        stdout, stderr = build.communicate(timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        _stop_group(build)
        pytest.fail(f"build_local.sh took over {BUILD_TIMEOUT} s")
    assert build.returncode == 0, f"build_local.sh failed:\n{stderr[-4000:]}"
    fields = dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)
    assert fields["tag"] == _print_tag("cpu") and re.fullmatch(r"[\d.]+ [MG]B", fields["size"]), stdout
    print(f"image {fields['tag']}, {fields['size']}, built in {time.monotonic() - t0:.0f} s")
    return fields["tag"]


def _stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the process group of `proc` (build_local.sh then removes the working containers its
    buildah made), SIGKILL after `grace` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.communicate(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _processes_under(root: str) -> list[int]:
    """Pids of the processes whose root directory is `root` (those running inside the container).
    `buildah run` chroots into a private bind mount of it, so the test is the same (device, inode)."""
    want = (os.stat(root).st_dev, os.stat(root).st_ino)
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                st = os.stat(entry / "root")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == want:
                pids.append(int(entry.name))
    return pids


def _stop_processes_under(root: str, grace: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after `grace` s, every process inside the container; raises if any survive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _processes_under(root):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            wait_until(lambda: not _processes_under(root), grace, f"the processes in {root} to exit", 0.2)
            return
        except TimeoutError:
            continue
    raise RuntimeError(f"processes left in {root}: {_processes_under(root)}")


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[tuple[str, str]]:
    """A working container of the image: (name, mount point of its root filesystem)."""
    name = f"pdserve-image-test-{os.getpid()}"
    _buildah("from", "--pull-never", "--name", name, image)
    try:
        yield name, _buildah("mount", name)
    finally:
        root = subprocess.run(["buildah", "mount", name], capture_output=True, text=True).stdout.strip()
        try:
            if root:
                _stop_processes_under(root)
        finally:
            _buildah("rm", name)
    assert name not in _buildah("containers", "--format", "{{.ContainerName}}")


def _run_in(name: str, *argv: str) -> list[str]:
    return ["buildah", "run", "--isolation", "chroot", "--network", "host", name, "--", *argv]


@pytest.fixture(scope="module")
def served(container: tuple[str, str]) -> Iterator[Child]:
    """`pdserve up` (router + 1 prefill + 1 decode, embedded model) inside the container; its `buildah
    run` process, whose url is the router's."""
    name, root = container
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="pdserve-image-up-", suffix=".log", delete=False)
    log.close()
    argv = _run_in(name, "pdserve", "up", "--prefill", "1", "--decode", "1", "--threads", "1", "--port", str(port),
                   "--model", "embedded:smollm2-135m", "--device", "cpu", "--restart", "never",
                   "--startup-timeout", "240", "--log-dir", LOGS)
    up = Child("image-up", argv, log.name, url=f"http://127.0.0.1:{port}")
    try:
        wait_until(lambda: up.healthy(), 270, "pdserve up in the image to answer /health", 0.5)
        yield up
    finally:
        _sigterm_up(root, up)
        _stop_processes_under(root)  # whatever is left, then `buildah run` itself
        up.stop(grace=10)
        print(up.tail(8))
        os.unlink(log.name)


def _is_chroot_helper(pid: int) -> bool:
    """buildah's helper that chroots and then waits on the command (it runs as root)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"buildah-chroot-exec")


def _sigterm_up(root: str, up: Child, timeout: float = 60.0) -> int | None:
    """SIGTERM `pdserve up` inside the container (it stops the router, then the workers, as under tini
    in a pod); the exit status `buildah run` passes on, None if still running. pdserve up is the oldest
    process there after buildah's own chroot helper, which would not forward the signal."""
    def started(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])

    try:
        ours = [p for p in _processes_under(root) if not _is_chroot_helper(p)]
        os.kill(min(ours, key=started), signal.SIGTERM)
        return up.popen.wait(timeout)
    except (ValueError, OSError, subprocess.TimeoutExpired):  # none left, or gone meanwhile, or stuck
        return up.popen.poll()


@pytest.mark.slow
def test_chat_through_the_router_in_the_image(served: Child, container: tuple[str, str]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip(), r.text
    # structured output (xgrammar) in the CPU image, which ships no triton
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    r = httpx.post(served.url + "/v1/chat/completions", json={**body, "max_tokens": 16, "response_format": fmt},
                   timeout=120)
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"])["ok"] in (True, False)
    metrics = httpx.get(served.url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "pdserve_" in metrics.text
    services = [p for p in _processes_under(container[1]) if not _is_chroot_helper(p)]
    assert len(services) >= 4, "the teardown sweep cannot see the services"
    assert {os.stat(f"/proc/{p}").st_uid for p in services} == {10001}, "the services must not run as root"
    logs = Path(container[1] + LOGS)
    workers = "".join(p.read_text(errors="replace") for p in logs.glob("*-0.log"))
    assert workers and "native CPU kernels unavailable" not in workers, workers[-2000:]
    print("in the image:", *re.findall(r"built native CPU kernels in [\d.]+ s", workers))
    assert list(Path(container[1], "var/cache/pdserve/kernels").glob("kernels-*.so")), "kernels not built"


@pytest.mark.slow
def test_sigterm_stops_everything_in_the_image(served: Child, container: tuple[str, str]) -> None:
    """Last of the module's tests on `served`: a SIGTERM to pdserve up ends every process it started."""
    assert _sigterm_up(container[1], served) == 0, served.tail(20)
    assert not _processes_under(container[1])


@pytest.mark.slow
def test_image_help_and_user(container: tuple[str, str]) -> None:
    name, _ = container
    out = subprocess.run(_run_in(name, "pdserve", "--help"), capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert all(cmd in out.stdout for cmd in ("router", "prefill", "decode", "colocated", "up")), out.stdout
    assert _buildah("inspect", "--format", "{{.OCIv1.Config.User}}", name) == "10001:10001"
