"""The OpenAPI document (issue 16, part 7): the router's /openapi.json declares the request body, the
answer and the error responses of /v1/chat/completions, /v1/completions and /generate, while its hot
path stays plain ASGI (a bad body still gets the router's own 400, nothing validated by pydantic).
The services' document is checked by tests/unit/test_frontend_service.py with `check_openapi`."""

from __future__ import annotations

from starlette.testclient import TestClient

from router.app import create_app
from router.config import RouterConfig

ENDPOINTS = {"/v1/chat/completions": "ChatCompletion", "/v1/completions": "Completion", "/generate": "Generate"}
ERRORS = {"400", "401", "404", "413", "429", "503"}


def check_openapi(doc: dict) -> None:
    schemas = doc["components"]["schemas"]
    for path, name in ENDPOINTS.items():
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}Request" and op["requestBody"]["required"]
        assert ERRORS <= set(op["responses"]), (path, sorted(op["responses"]))
        assert "422" not in op["responses"]  # FastAPI validates nothing on these routes
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"] == f"#/components/schemas/{name}Response"
        assert "text/event-stream" in ok
        for code in ERRORS:
            err = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert err == "#/components/schemas/ErrorResponse"
    for name in [f"{n}{kind}" for n in ENDPOINTS.values() for kind in ("Request", "Response")]:
        assert name in schemas, name
    assert {"logprobs", "top_logprobs", "messages"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"echo", "logprobs", "prompt"} <= set(schemas["CompletionRequest"]["properties"])
    assert {"return_logprob", "top_logprobs_num", "logprob_start_len"} <= set(schemas["GenerateRequest"]["properties"])
    assert "content" in schemas["ChatLogprobs"]["properties"]  # nested models are in the components too


def test_router_openapi_documents_the_proxied_endpoints() -> None:
    client = TestClient(create_app(RouterConfig()))  # no lifespan: no workers, no probes
    r = client.get("/openapi.json")
    assert r.status_code == 200
    check_openapi(r.json())
    assert client.get("/docs").status_code == 200
    # the hot path answers, not FastAPI: the router's own message for a bad body, not a pydantic one
    bad = client.post("/v1/chat/completions", json={"messages": "hi"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "'messages' must be a non-empty list"
