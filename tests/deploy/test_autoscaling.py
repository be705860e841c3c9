"""The gpu overlay's worker HPAs (issue 18): each pool scales on its own worker gauge as a Pods metric,
served by the Prometheus adapter rule documented in docs/operations.md; scale-down removes at most
one pod per drain period. The encoder pool (E/P/D) scales on its encode queue, pdserve_worker_queues{name="encode"};
its HPA is dormant while the Deployment sits at the base's 0 replicas (a text-only model).
(tests/integration/test_router_real_services.py checks that live workers export these gauges.)"""

from __future__ import annotations

import re

import yaml
from deploy_render import ALL_WORKERS, ENCODER, ROOT, WORKER_ROLES, Rendered, pod_spec

SIGNALS = {
    "prefill": {"pdserve_worker_queued_prompt_tokens"},
    "decode": {"pdserve_worker_kv_usage", "pdserve_worker_running_requests"},
    ENCODER: {"pdserve_worker_queues"},  # with the label selector name=encode
}


def _adapter_rule() -> dict:
    doc = (ROOT / "docs" / "operations.md").read_text()
    m = re.search(r"```yaml\n(# prometheus-adapter rule.*?)```", doc, re.S)
    assert m, "docs/operations.md lost its prometheus-adapter rule block"
    (rule,) = yaml.safe_load(m.group(1))
    return rule


def _hpa(r: Rendered, role: str) -> dict:
    found = [h for h in r.of_kind("HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] ==
             r.deployment(role)["metadata"]["name"]]
    assert len(found) == 1, f"{r.overlay}: expected one HPA for {role}, found {len(found)}"
    return found[0]


def test_worker_pools_scale_on_their_own_pods_metrics(rendered_all: dict[str, Rendered]) -> None:
    gpu = rendered_all["gpu"]
    for role in WORKER_ROLES:
        hpa = _hpa(gpu, role)
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        metrics = hpa["spec"]["metrics"]
        assert {m["type"] for m in metrics} == {"Pods"}
        assert {m["pods"]["metric"]["name"] for m in metrics} == SIGNALS[role]
        assert all(m["pods"]["target"]["type"] == "AverageValue" for m in metrics)
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert "replicas" not in gpu.deployment(role)["spec"], f"{role}: the HPA owns the replica count"


def test_encoder_pool_scales_on_its_encode_queue(rendered_all: dict[str, Rendered]) -> None:
    gpu = rendered_all["gpu"]
    hpa = _hpa(gpu, ENCODER)
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    encode = {"matchLabels": {"name": "encode"}}
    assert metric["pods"]["metric"] == {"name": "pdserve_worker_queues", "selector": encode}
    # the queue the encoder worker reports (service.metrics: WorkerStats.queues -> pdserve_worker_queues{name=...})
    assert 'queues={"encode":' in (ROOT / "encoder_service" / "worker.py").read_text()
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # a text-only model here: the Deployment stays at 0 replicas, where an HPA does not scale it
    assert gpu.deployment(ENCODER)["spec"]["replicas"] == 0


def test_scale_down_waits_for_each_drain(rendered_all: dict[str, Rendered]) -> None:
    gpu = rendered_all["gpu"]
    for role in ALL_WORKERS:
        down = _hpa(gpu, role)["spec"]["behavior"]["scaleDown"]
        grace = pod_spec(gpu.deployment(role))["terminationGracePeriodSeconds"]
        assert down["policies"], f"{role}: scale-down needs explicit policies"
        for pol in down["policies"]:
            assert pol["type"] == "Pods" and pol["value"] == 1, f"{role}: one pod at a time"
            assert pol["periodSeconds"] >= grace, f"{role}: a period shorter than the drain ({grace} s)"
        assert down.get("selectPolicy", "Max") in ("Min", "Max")  # all policies are one pod per drain
        assert down["stabilizationWindowSeconds"] >= 300


def test_adapter_rule_serves_every_hpa_metric(rendered_all: dict[str, Rendered]) -> None:
    rule = _adapter_rule()
    series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
    assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    used = {m["pods"]["metric"]["name"] for h in rendered_all["gpu"].of_kind("HorizontalPodAutoscaler")
            for m in h["spec"]["metrics"] if m["type"] == "Pods"}
    assert used == set().union(*SIGNALS.values())
    for name in used:
        assert re.fullmatch(series, name), f"the adapter's seriesQuery does not select {name}"
        served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), name)
        assert served == name, f"the adapter serves {name} as {served}"
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
