"""pdserve router: OpenAI-compatible HTTP endpoint that pairs a prefill and a decode worker per request
(plus a vision encoder in front for a request with images, when one is registered: E/P/D).

Modules: config (RouterConfig, flags/YAML), registry (workers, load, ejection), policies (round_robin,
least_load, cache_aware), health (probes), discovery_k8s (pod list/watch), client (pooled httpx to
workers), protocol (request checks, bootstrap fields, logprob merge), sse, proxy (pairing, rooms,
retries, relay), metrics (Prometheus text), app (FastAPI routes, auth, admin), main (CLI).
"""
