"""Acceptance 3 of deploy/: the rendered manifests agree with each other and with the code.

Selectors match pod labels; probes, Services and annotations name ports the processes really listen
on; the router's discovery flags match the worker pods; every flag in a container's args is one
this checkout's `pdserve <command> --help` offers, and the values parse with the real parsers.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_render import (
    ALL_WORKERS,
    DEPLOY,
    ENCODER,
    VAR_RE,
    WORKER_ROLES,
    Rendered,
    container_flags,
    env_values,
    expand,
    help_flags,
    help_text,
    main_container,
    pod_labels,
    pod_spec,
    selector_matches,
)

COMPONENTS = ("router", *ALL_WORKERS)
POOL_LABEL = "pdserve.io/pool"


def _ports(deploy: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in main_container(deploy)["ports"]}


def _flags(r: Rendered, component: str) -> dict[str, str]:
    c = main_container(r.deployment(component))
    env = env_values(c, r)
    return {k: expand(v, env) for k, v in container_flags(c).items()}


def test_workload_selectors_match_their_pods_only(rendered: Rendered) -> None:
    pods = {c: pod_labels(rendered.deployment(c)) for c in COMPONENTS}
    for comp, labels in pods.items():
        deploy = rendered.deployment(comp)
        assert selector_matches(deploy["spec"]["selector"], labels)
        assert labels["app.kubernetes.io/name"] == "pdserve"
        assert [c for c, lab in pods.items() if selector_matches(deploy["spec"]["selector"], lab)] == [comp]
    for kind in ("Service", "PodDisruptionBudget"):
        for obj in rendered.of_kind(kind):
            sel = obj["spec"]["selector"]
            sel = {"matchLabels": sel} if kind == "Service" else sel
            hit = [c for c, lab in pods.items() if selector_matches(sel, lab)]
            assert len(hit) == 1, f"{kind}/{obj['metadata']['name']} selects {hit}"
            assert hit[0] == obj["metadata"]["labels"]["app.kubernetes.io/component"]
    for pol in rendered.of_kind("NetworkPolicy"):
        hit = [c for c, lab in pods.items() if selector_matches(pol["spec"]["podSelector"], lab)]
        assert hit == [pol["metadata"]["labels"]["app.kubernetes.io/component"]]
    hpa = rendered.get("HorizontalPodAutoscaler", "pdserve-router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == rendered.deployment("router")["metadata"]["name"]
    assert "replicas" not in rendered.deployment("router")["spec"]  # owned by the HPA


def test_service_and_probe_ports_are_ports_the_process_listens_on(rendered: Rendered) -> None:
    for comp in COMPONENTS:
        deploy = rendered.deployment(comp)
        ports, flags, c = _ports(deploy), _flags(rendered, comp), main_container(deploy)
        assert ports["http"] == int(flags["--port"]), f"{comp}: http containerPort != --port"
        assert flags["--host"] == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = c[probe].get("httpGet") or c[probe]["tcpSocket"]
            assert action["port"] == "http", f"{comp} {probe}"
        ann = deploy["spec"]["template"]["metadata"]["annotations"]
        assert int(ann["prometheus.io/port"]) == ports["http"]
        for svc in rendered.of_kind("Service"):
            if selector_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(deploy)):
                for sp in svc["spec"]["ports"]:
                    assert sp["targetPort"] in ports, f"Service {svc['metadata']['name']}: {sp['targetPort']}"
                    assert sp["port"] == ports[sp["targetPort"]]
    for role in ("prefill", ENCODER):  # the roles with a bootstrap server
        deploy = rendered.deployment(role)
        ann = deploy["spec"]["template"]["metadata"]["annotations"]
        boot = int(_flags(rendered, role)["--bootstrap-port"])
        assert _ports(deploy)["bootstrap"] == boot == int(ann["pdserve.io/bootstrap-port"]), role


def test_router_discovery_matches_the_worker_pods(rendered: Rendered) -> None:
    flags = _flags(rendered, "router")
    selector, role_label = flags["--k8s-selector"], flags["--k8s-role-label"]
    annotation = flags["--k8s-bootstrap-port-annotation"]
    assert not selector_matches(selector, pod_labels(rendered.deployment("router")))
    for role in ALL_WORKERS:
        deploy = rendered.deployment(role)
        labels = pod_labels(deploy)
        assert selector_matches(selector, labels), f"--k8s-selector misses {role} pods"
        assert labels[role_label] == role == main_container(deploy)["args"][0]
        assert int(flags["--k8s-port"]) == _ports(deploy)["http"]
    for role in ("prefill", ENCODER):
        assert annotation in rendered.deployment(role)["spec"]["template"]["metadata"]["annotations"], role
    ns = rendered.deployment("router")["metadata"]["namespace"]
    router = main_container(rendered.deployment("router"))
    assert router["args"].count("--k8s-namespace=$(POD_NAMESPACE)") == 1
    env = {e["name"]: e for e in router["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # RBAC: the router's service account may list and watch pods in its namespace.
    sa = pod_spec(rendered.deployment("router"))["serviceAccountName"]
    binding = next(b for b in rendered.of_kind("RoleBinding")
                   if any(s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == ns
                          for s in b["subjects"]))
    role = rendered.get("Role", binding["roleRef"]["name"])
    verbs = {v for rule in role["rules"] if "pods" in rule["resources"] and "" in rule["apiGroups"]
             for v in rule["verbs"]}
    assert {"list", "watch"} <= verbs
    assert sa in rendered.names("ServiceAccount")


@pytest.mark.parametrize("component", COMPONENTS)
def test_container_flags_are_accepted_by_pdserve_help(rendered_all: dict[str, Rendered],
                                                      component: str) -> None:
    for r in rendered_all.values():
        c = main_container(r.deployment(component))
        assert "command" not in c, "the image ENTRYPOINT (tini -- pdserve) must stay in effect"
        assert c["args"][0] == component
        known = help_flags(help_text(component))
        unknown = sorted(set(container_flags(c)) - known)
        assert not unknown, f"{r.overlay} {component}: flags not in `pdserve {component} --help`: {unknown}"


def test_worker_flag_values_parse_and_validate(rendered: Rendered) -> None:
    from common.configs import build
    from engine.config import EngineConfig
    from service.config import PDConfig, add_server_args

    for role in WORKER_ROLES:
        parser = argparse.ArgumentParser(prog=f"pdserve {role}", exit_on_error=False)
        add_server_args(parser, role)
        argv = [f"{k}={v}" for k, v in _flags(rendered, role).items() if k != "--drain-grace"]
        ns = parser.parse_args(argv)
        EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype, page_size=ns.page_size,
                     max_total_tokens=ns.max_total_tokens, host_kv_tokens=ns.host_kv_tokens,
                     chunked_prefill_size=ns.chunked_prefill_size, max_prefill_tokens=ns.max_prefill_tokens,
                     max_running_requests=ns.max_running_requests, threads=ns.threads)
        build(PDConfig, ns)  # every transfer flag, by name (as server_config_from_args builds it)
        assert ns.advertise_host == "10.0.0.7", "--advertise-host must be the pod IP"
    # Prefill and decode must agree on what the transfer handshake compares.
    same = ("--model", "--dtype", "--page-size", "--device")
    prefill, decode = _flags(rendered, "prefill"), _flags(rendered, "decode")
    assert {k: prefill[k] for k in same} == {k: decode[k] for k in same}
    # The encoder: its own (few) flags parse and validate; it serves the prefills' model and dtype.
    from service.config import ImageConfig

    parser = argparse.ArgumentParser(prog="pdserve encoder", exit_on_error=False)
    add_server_args(parser, ENCODER)
    enc = _flags(rendered, ENCODER)
    ns = parser.parse_args([f"{k}={v}" for k, v in enc.items() if k != "--drain-grace"])
    EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype, threads=ns.threads, image_cache_mb=ns.image_cache_mb,
                 image_transfer_tokens=ns.image_transfer_tokens)
    build(PDConfig, ns)
    build(ImageConfig, ns)
    assert ns.advertise_host == "10.0.0.7", "--advertise-host must be the pod IP"
    assert {k: enc[k] for k in ("--model", "--dtype", "--device")} == {k: prefill[k] for k in ("--model", "--dtype",
                                                                                              "--device")}


def test_router_config_file_loads(rendered: Rendered, tmp_path: Path) -> None:
    from router.config import RouterConfig, load_yaml

    router = rendered.deployment("router")
    path = _flags(rendered, "router")["--config"]
    mount = next(m for m in main_container(router)["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    vol = next(v for v in pod_spec(router)["volumes"] if v["name"] == mount["name"])
    data = rendered.get("ConfigMap", vol["configMap"]["name"])["data"]
    key = path[len(mount["mountPath"]) + 1:]
    f = tmp_path / "router.yaml"
    f.write_text(data[key])
    cfg = RouterConfig(**load_yaml(f))
    assert cfg.workers == ()  # workers come from discovery, not from the file


def test_env_references_resolve(rendered: Rendered) -> None:
    external = {"gpu": {"pdserve-tokens"}}.get(rendered.overlay, set())
    secrets = rendered.names("Secret") | external
    for comp in COMPONENTS:
        deploy = rendered.deployment(comp)
        c, spec = main_container(deploy), pod_spec(deploy)
        env = env_values(c, rendered)  # raises KeyError on a missing ConfigMap or key
        for arg in c["args"]:
            for var in VAR_RE.findall(arg):
                assert var in env, f"{comp}: $({var}) in {arg!r} is not defined"
        volumes = {v["name"]: v for v in spec["volumes"]}
        for m in c["volumeMounts"]:
            assert m["name"] in volumes, f"{comp}: mount {m['name']} has no volume"
        for v in volumes.values():
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets
                assert v["secret"]["defaultMode"] == 0o440
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in rendered.names("PersistentVolumeClaim")
        for flag, value in container_flags(c).items():
            if flag.endswith("-file"):
                mount = next(m for m in c["volumeMounts"] if value.startswith(m["mountPath"] + "/"))
                vol = volumes[mount["name"]]
                key = value[len(mount["mountPath"]) + 1:]
                src = vol.get("secret") or vol.get("configMap")
                if "items" in src:
                    assert key in {i["path"] for i in src["items"]}
                if vol.get("secret") and vol["secret"]["secretName"] in rendered.names("Secret"):
                    sec = rendered.get("Secret", vol["secret"]["secretName"])
                    assert key in (sec.get("stringData") or sec.get("data") or {}), f"{comp}: {flag}"


def _allowed(r: Rendered, src: dict[str, str], dst: str, port: int) -> bool:
    """NetworkPolicy ingress semantics (same namespace, TCP): may pods labelled `src` reach `port`
    on the `dst` component's pods?"""
    deploy = r.deployment(dst)
    labels, named = pod_labels(deploy), _ports(deploy)
    policies = [p for p in r.of_kind("NetworkPolicy") if selector_matches(p["spec"]["podSelector"], labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    for pol in policies:
        for rule in pol["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers and not any("podSelector" in p and "namespaceSelector" not in p
                                 and selector_matches(p["podSelector"], src) for p in peers):
                continue
            entries = rule.get("ports")
            if not entries or any(e.get("protocol", "TCP") == "TCP" and (
                    "port" not in e or e["port"] == port or named.get(e["port"]) == port) for e in entries):
                return True
    return False


def test_network_policy_admits_only_router_to_workers_and_decode_prefill(rendered: Rendered) -> None:
    lab = {c: pod_labels(rendered.deployment(c)) for c in COMPONENTS}
    http, boot, ucx = 30000, 8998, 41234  # 41234: one of UCX's ephemeral listener ports
    outsider = {"app": "something-else"}
    for worker in WORKER_ROLES:
        assert _allowed(rendered, lab["router"], worker, http)
        assert not _allowed(rendered, lab["router"], worker, ucx)
        assert not _allowed(rendered, outsider, worker, http)
        assert not _allowed(rendered, lab[worker], worker, ucx), f"{worker}->{worker} must be refused"
    assert not _allowed(rendered, lab["router"], "prefill", boot)
    assert _allowed(rendered, lab["decode"], "prefill", boot)
    assert _allowed(rendered, lab["decode"], "prefill", ucx)
    assert _allowed(rendered, lab["prefill"], "decode", ucx)
    # E/P/D: a prefill bootstraps at its encoder, the encoder sends the embeddings to the prefill's UCX ports
    assert _allowed(rendered, lab["prefill"], ENCODER, boot) and _allowed(rendered, lab["prefill"], ENCODER, ucx)
    assert _allowed(rendered, lab[ENCODER], "prefill", ucx)
    assert not _allowed(rendered, lab["router"], ENCODER, boot)
    assert not _allowed(rendered, lab["decode"], ENCODER, ucx) and not _allowed(rendered, lab[ENCODER], "decode", ucx)
    assert _allowed(rendered, outsider, "router", 8000)
    assert not _allowed(rendered, outsider, "router", 9000)


def test_graceful_termination_and_probes(rendered: Rendered) -> None:
    from service.frontend import OPEN_PATHS

    for comp in COMPONENTS:
        deploy = rendered.deployment(comp)
        c, spec = main_container(deploy), pod_spec(deploy)
        pre = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre[0] == "sleep" and int(pre[1]) >= 5
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        paths = {c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                 if "httpGet" in c[p]}
        if comp == "router":
            assert c["livenessProbe"]["httpGet"]["path"] == "/livez"  # /health is 503 without workers
            assert spec["terminationGracePeriodSeconds"] >= 300
            continue
        # Workers run with an internal token: kubelet probes cannot send it, so only open paths.
        assert paths <= set(OPEN_PATHS), f"{comp}: probe paths {paths - set(OPEN_PATHS)} need the token"
        # /health is 503 while draining: liveness must not use it or every drain gets killed.
        assert "/health" not in str(c["livenessProbe"])
        drain = float(container_flags(c)["--drain-grace"])
        assert spec["terminationGracePeriodSeconds"] >= int(pre[1]) + drain + 10
    prefill, decode = _flags(rendered, "prefill"), _flags(rendered, "decode")
    assert float(prefill["--drain-grace"]) > float(prefill["--bootstrap-timeout"]) + 30
    encoder = _flags(rendered, ENCODER)
    assert float(encoder["--drain-grace"]) > float(encoder["--bootstrap-timeout"]) + 30
    assert float(decode["--drain-grace"]) >= 300


def test_gpu_pools_and_cpu_demo(rendered_all: dict[str, Rendered]) -> None:
    gpu, cpu = rendered_all["gpu"], rendered_all["cpu-demo"]
    for role in ALL_WORKERS:
        spec = pod_spec(gpu.deployment(role))
        res = main_container(gpu.deployment(role))["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        exprs = [e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]
        assert {"key": POOL_LABEL, "operator": "In", "values": [role]} in exprs
        assert any(t["key"] == POOL_LABEL and t.get("value") == role for t in spec["tolerations"])
        flags = _flags(gpu, role)
        assert flags["--device"].startswith("cuda")
        assert any(flags["--model"].startswith(m["mountPath"] + "/")
                   for m in main_container(gpu.deployment(role))["volumeMounts"] if m["name"] == "models")
        cres = main_container(cpu.deployment(role))["resources"]
        assert "nvidia.com/gpu" not in str(cres) and "affinity" not in pod_spec(cpu.deployment(role))
        assert _flags(cpu, role)["--device"] == "cpu" and _flags(cpu, role)["--model"].startswith("embedded:")


def test_pods_run_as_the_image_user(rendered: Rendered) -> None:
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    uid = int(re.findall(r"^USER\s+(\d+)", dockerfile, re.M)[-1])
    for comp in COMPONENTS:
        spec = pod_spec(rendered.deployment(comp))
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == uid
        sc = main_container(rendered.deployment(comp))["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]


def test_flag_check_would_catch_an_unknown_flag() -> None:
    # Guard for the help check: the parser sees real flags and not made-up ones.
    flags = help_flags(help_text("prefill"))
    assert {"--advertise-host", "--bootstrap-port", "--cluster-token-file", "--drain-grace"} <= flags
    c = {"args": ["prefill", "--port=1", "--no-such-flag=2"]}
    assert set(container_flags(c)) - flags == {"--no-such-flag"}
    with pytest.raises(AssertionError):
        container_flags({"args": ["prefill", "--port", "1"]})  # split form would hide values


def test_ucx_env_values_are_accepted_by_ucx(rendered: Rendered) -> None:
    c = main_container(rendered.deployment("decode"))
    cms = [rendered.get("ConfigMap", src["configMapRef"]["name"]) for src in c["envFrom"]]
    ucx_env = {k: v for cm in cms for k, v in (cm.get("data") or {}).items() if k.startswith("UCX")}
    assert "UCX_TCP_TX_SEG_SIZE" in ucx_env
    code = "import ucxx._lib.libucxx as u; u.UCXWorker(u.UCXContext()); print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **ucx_env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_encoder_pool_is_off_for_the_text_models_shipped_here(rendered_all: dict[str, Rendered]) -> None:
    # Both overlays serve a text-only model (an encoder exits at start-up on one): the encoder Deployment
    # stays at 0 replicas until a vision-language model is configured and the pool scaled up.
    for r in rendered_all.values():
        assert r.deployment(ENCODER)["spec"]["replicas"] == 0, r.overlay
        assert "--tp" not in container_flags(main_container(r.deployment(ENCODER)))  # the tower runs on one GPU
