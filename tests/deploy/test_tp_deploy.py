"""Tensor parallelism in deploy/ (issue 35), rendered and validated offline like the rest:

- every worker pod of every overlay requests exactly as many GPUs as its `--tp` (1 in gpu, 4 in
  gpu-tp; none on the CPU demo, whose TP is 1); an encoder pod (no --tp) one GPU;
- overlays/gpu-tp's LeaderWorkerSet runs one decode TP group across nodes: the leader (node-rank 0)
  serves HTTP and is discovered by the router, the worker pods run node-rank LWS_WORKER_INDEX with the
  leader's rendezvous address, pods x GPUs = --tp, the flags parse with the real parsers, and the
  group's pods may reach each other; its pod templates pass `kubernetes-validate --strict` (wrapped
  as PodTemplates: the LeaderWorkerSet CRD itself has no schema there), with the rest of the overlay.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_render import (
    ENCODER,
    OVERLAYS,
    WORKER_ROLES,
    Rendered,
    container_flags,
    env_values,
    expand,
    help_flags,
    help_text,
    main_container,
    pod_labels,
    render,
    selector_matches,
)
from test_render_validate import K8S_VERSION, _tool

LWS = "pdserve-decode-tp"
LWS_ENV = {"LWS_LEADER_ADDRESS": "pdserve-decode-tp-0.pdserve-decode-tp", "LWS_WORKER_INDEX": "1"}


@pytest.fixture(scope="module")
def gpu_tp() -> Rendered:
    return render("gpu-tp")


def _lws(r: Rendered) -> dict:
    return r.get("LeaderWorkerSet", LWS)


def _templates(r: Rendered) -> dict[str, dict]:
    lwt = _lws(r)["spec"]["leaderWorkerTemplate"]
    return {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}


def _flags(container: dict, r: Rendered) -> dict[str, str]:
    env = {**env_values(container, r), **LWS_ENV}
    return {k: expand(v, env) for k, v in container_flags(container).items()}


def _gpus(container: dict) -> tuple[int, int]:
    res = container.get("resources") or {}
    return (int((res.get("requests") or {}).get("nvidia.com/gpu", 0)),
            int((res.get("limits") or {}).get("nvidia.com/gpu", 0)))


@pytest.mark.parametrize("overlay", [*OVERLAYS, "gpu-tp"])
def test_a_tp_n_worker_pod_requests_n_gpus(overlay: str, gpu_tp: Rendered) -> None:
    r = gpu_tp if overlay == "gpu-tp" else render(overlay)
    for role in WORKER_ROLES:
        c = main_container(r.deployment(role))
        flags = _flags(c, r)
        tp = int(flags["--tp"])
        if flags["--device"] == "cpu":
            assert tp == 1 and _gpus(c) == (0, 0), f"{overlay} {role}: a CPU pod runs TP 1 and no GPU"
        else:
            assert _gpus(c) == (tp, tp), f"{overlay} {role}: --tp={tp} but GPUs {_gpus(c)}"
    if overlay == "gpu-tp":
        assert {int(_flags(main_container(r.deployment(role)), r)["--tp"]) for role in WORKER_ROLES} == {4}
    enc = main_container(r.deployment(ENCODER))  # no --tp: the vision tower runs on one GPU (none on the CPU)
    assert "--tp" not in _flags(enc, r)
    assert _gpus(enc) == ((0, 0) if _flags(enc, r)["--device"] == "cpu" else (1, 1)), f"{overlay} encoder"


def test_lws_group_spans_nodes_with_one_gpu_per_rank(gpu_tp: Rendered) -> None:
    lws = _lws(gpu_tp)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost rank takes the whole group down
    size = lwt["size"]
    flags = {}
    for name, tmpl in _templates(gpu_tp).items():
        c = main_container({"spec": {"template": tmpl}})
        assert c["args"][0] == "decode" and "command" not in c
        f = flags[name] = _flags(c, gpu_tp)
        assert int(f["--nnodes"]) == size >= 2
        assert int(f["--tp"]) == size * _gpus(c)[0] and _gpus(c)[0] == _gpus(c)[1] > 0
        host, _, port = f["--dist-init-addr"].rpartition(":")
        assert host == LWS_ENV["LWS_LEADER_ADDRESS"], "ranks meet at the leader"
        assert container_flags(c)["--node-rank"] == ("0" if name == "leader" else "$(LWS_WORKER_INDEX)")
    leader_ports = {p["name"]: p["containerPort"] for p in main_container(
        {"spec": {"template": _templates(gpu_tp)["leader"]}})["ports"]}
    assert leader_ports["dist"] == int(port), "the leader exposes the rendezvous port"
    rest = ("--node-rank",)
    assert {k: v for k, v in flags["leader"].items() if k not in rest} == \
        {k: v for k, v in flags["worker"].items() if k not in rest}, "the ranks of a group run one config"
    # the group serves the same model as the prefill pool (the transfer handshake compares these)
    prefill = _flags(main_container(gpu_tp.deployment("prefill")), gpu_tp)
    for k in ("--model", "--dtype", "--page-size", "--device"):
        assert flags["leader"][k] == prefill[k], k


def test_lws_flags_parse_with_the_real_parsers(gpu_tp: Rendered) -> None:
    from common.configs import build
    from engine.config import EngineConfig
    from service.config import PDConfig, add_server_args

    known = help_flags(help_text("decode"))
    for name, tmpl in _templates(gpu_tp).items():
        c = main_container({"spec": {"template": tmpl}})
        unknown = sorted(set(container_flags(c)) - known)
        assert not unknown, f"{name}: flags not in `pdserve decode --help`: {unknown}"
        parser = argparse.ArgumentParser(prog="pdserve decode", exit_on_error=False)
        add_server_args(parser, "decode")
        ns = parser.parse_args([f"{k}={v}" for k, v in _flags(c, gpu_tp).items() if k != "--drain-grace"])
        eng = build(EngineConfig, ns)
        assert (eng.tp, eng.nnodes, eng.node_rank) == (8, 2, 0 if name == "leader" else 1)
        build(PDConfig, ns)


def test_router_discovers_the_leader_only_and_the_group_may_talk(gpu_tp: Rendered) -> None:
    router = main_container(gpu_tp.deployment("router"))
    flags = dict(container_flags(router))
    selector, role_label = flags["--k8s-selector"], flags["--k8s-role-label"]
    labels = {name: {**(t["metadata"].get("labels") or {}), "leaderworkerset.sigs.k8s.io/name": LWS}
              for name, t in _templates(gpu_tp).items()}  # LWS adds its name label to every pod
    assert selector_matches(selector, labels["leader"]) and labels["leader"][role_label] == "decode"
    assert not selector_matches(selector, labels["worker"]), "a node-rank > 0 pod serves no HTTP"
    group = gpu_tp.get("NetworkPolicy", "pdserve-decode-tp-group")
    assert all(selector_matches(group["spec"]["podSelector"], lab) for lab in labels.values())
    peers = [p["podSelector"] for rule in group["spec"]["ingress"] for p in rule["from"]]
    assert all(any(selector_matches(s, lab) for s in peers) for lab in labels.values())
    outsider = pod_labels(gpu_tp.deployment("prefill"))
    assert not any(selector_matches(s, outsider) for s in peers)


def test_gpu_tp_validates_strict(gpu_tp: Rendered, tmp_path: Path) -> None:
    docs = [d for d in gpu_tp.docs if d["kind"] != "LeaderWorkerSet"]
    for name, tmpl in _templates(gpu_tp).items():  # the CRD's pod templates, as core PodTemplates
        docs.append({"apiVersion": "v1", "kind": "PodTemplate",
                     "metadata": {"name": f"{LWS}-{name}", "namespace": "pdserve"}, "template": tmpl})
    f = tmp_path / "gpu-tp.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    proc = subprocess.run([*_tool("kubernetes-validate"), "-k", K8S_VERSION, "--strict", str(f)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Couldn't find schema" not in out and "ERROR" not in out and "WARN" not in out, out
    assert out.count("passed for resource") == len(docs), out
