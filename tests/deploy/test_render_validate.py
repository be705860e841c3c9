"""Acceptance 1-2 of deploy/: every overlay renders with `kubectl kustomize`, passes
`kubernetes-validate --strict` for Kubernetes 1.30 with a schema for every object, and the YAML
sources are yamllint clean. Also a light lint of the Dockerfile and .dockerignore."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
import yaml
from deploy_render import DEPLOY, OVERLAYS, ROOT, Rendered

from service.metrics import WORKER_METRICS

K8S_VERSION = "1.30.0"
EXPECTED_KINDS = {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment",
                  "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"}


def _tool(name: str) -> list[str]:
    exe = Path(sys.executable).with_name(name)
    return [str(exe)] if exe.exists() else [shutil.which(name) or name]


def test_each_overlay_renders_the_expected_objects(rendered_all: dict[str, Rendered]) -> None:
    assert set(rendered_all) == set(OVERLAYS)
    for overlay, r in rendered_all.items():
        kinds = {d["kind"] for d in r.docs}
        assert EXPECTED_KINDS <= kinds, f"{overlay}: missing {EXPECTED_KINDS - kinds}"
        ns = {d["metadata"].get("namespace") for d in r.docs if d["kind"] != "Namespace"}
        assert ns == {r.get("Namespace", r.of_kind("Namespace")[0]["metadata"]["name"])["metadata"]["name"]}
    assert "Secret" in {d["kind"] for d in rendered_all["cpu-demo"].docs}
    assert "PersistentVolumeClaim" in {d["kind"] for d in rendered_all["gpu"].docs}


def test_kubernetes_validate_strict_1_30(rendered_all: dict[str, Rendered], tmp_path: Path) -> None:
    files = []
    for overlay, r in rendered_all.items():
        f = tmp_path / f"{overlay}.yaml"
        f.write_text(r.text)
        files.append(str(f))
    proc = subprocess.run([*_tool("kubernetes-validate"), "-k", K8S_VERSION, "--strict", *files],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Couldn't find schema" not in out, out  # that warning exits 0
    assert "ERROR" not in out and "WARN" not in out, out
    passed = len(re.findall(r"passed for resource", out))
    assert passed == sum(len(r.docs) for r in rendered_all.values()), out


def test_strict_validation_rejects_an_unknown_field(rendered_all: dict[str, Rendered],
                                                     tmp_path: Path) -> None:
    # Guard for the check above: a misspelt field in a rendered Deployment must fail it.
    docs = copy.deepcopy(list(rendered_all["gpu"].docs))
    next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containerz"] = []
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    proc = subprocess.run([*_tool("kubernetes-validate"), "-k", K8S_VERSION, "--strict", "--quiet", str(f)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "containerz" in proc.stdout + proc.stderr


def test_yamllint_clean() -> None:
    cmd = [*_tool("yamllint"), "-c", str(DEPLOY / "yamllint.yaml"), "--strict", "-f", "parsable", str(DEPLOY)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(DEPLOY.rglob("*.yaml")), "no YAML under deploy/"


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_shape() -> None:
    ins = _dockerfile_instructions()
    args = dict(a.partition("=")[::2] for w, a in ins if w == "ARG" and "=" in a)
    bases = [rest.split()[0] for w, rest in ins if w == "FROM"]
    bases = [args.get(b[2:-1], b) if b.startswith("${") else b for b in bases]
    cuda_runtime = re.compile(r"nvidia/cuda:12\.[\d.]+-runtime-ubuntu[\d.]+")
    assert bases and all(cuda_runtime.fullmatch(b) for b in bases), bases
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    users = [rest for w, rest in final if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    entry = [json.loads(rest) for w, rest in final if w == "ENTRYPOINT"]
    assert entry and entry[-1][-1] == "pdserve", entry
    runs = " ".join(rest for w, rest in final if w == "RUN")
    assert "[${PDSERVE_EXTRAS}]" in runs and args.get("PDSERVE_EXTRAS") == "gpu"
    # Every package setuptools ships is copied into the build stage (a new package is not forgotten).
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    copied = {src for w, rest in ins if w == "COPY" and "--from" not in rest for src in rest.split()[:-1]}
    for pattern in include["include"]:
        assert pattern.rstrip("*") in copied, f"Dockerfile does not COPY package {pattern}"
    for src in copied:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repository"


def test_dockerignore_keeps_sources_drops_junk() -> None:
    rules = [r.strip() for r in (ROOT / ".dockerignore").read_text().splitlines()
             if r.strip() and not r.startswith("#")]
    for junk in (".git", "tests", "**/__pycache__"):
        assert junk in rules
    for needed in ("pyproject.toml", "README.md", "engine", "router", "pdserve"):
        assert needed not in rules


def test_ci_tools_script_is_valid_bash() -> None:
    script = DEPLOY / "ci_tools.sh"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "kubectl kustomize" in script.read_text() or "Kustomize Version" in script.read_text()


def test_operations_doc_names_real_metrics_and_steps() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    for needed in ("kubectl -n pdserve create secret generic pdserve-tokens", "scale deploy/pdserve-prefill",
                   "scale deploy/pdserve-decode", "overlays/cpu-demo", "Troubleshooting a stuck transfer"):
        assert needed in doc, needed
    packages = ("router", "engine", "service", "common", "colocated_service", "prefill_service", "decode_service")
    source = "\n".join(p.read_text() for d in packages for p in (ROOT / d).rglob("*.py"))
    source += "\n".join(m.name for m in WORKER_METRICS)  # worker counters are declared from typed fields
    named = set(re.findall(r"\bpdserve_[a-z_]+[a-z]\b", doc))
    assert len(named) >= 10
    missing = sorted(m for m in named if m not in source)
    assert not missing, f"docs/operations.md names metrics the code does not export: {missing}"
