"""The OpenAPI document (issue 16, part 7): the router's /openapi.json declares the request body, the
answer and the error responses of /v1/chat/completions, /v1/completions and /generate, while its hot
path stays plain ASGI (a bad body gets the 400 the services give, validated with their request models,
never FastAPI's 422).
The services' document is checked by tests/unit/test_frontend_service.py with `check_openapi`."""

from __future__ import annotations

from starlette.testclient import TestClient

from router.app import create_app
from router.config import RouterConfig
from service.config import ServerConfig
from service.frontend import FrontendState
from service.frontend import create_app as service_app

ENDPOINTS = {"/v1/chat/completions": "ChatCompletion", "/v1/completions": "Completion", "/generate": "Generate"}
REF = "#/components/schemas/"
ERRORS = {"400", "401", "404", "413", "429", "499", "500", "502", "503", "504"}


def check_openapi(doc: dict) -> None:
    schemas = doc["components"]["schemas"]
    for path, name in ENDPOINTS.items():
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}Request" and op["requestBody"]["required"]
        assert ERRORS <= set(op["responses"]), (path, sorted(op["responses"]))
        assert "422" not in op["responses"]  # FastAPI validates nothing on these routes
        ok = op["responses"]["200"]["content"]
        answer = ok["application/json"]["schema"]  # /generate with n > 1: a list of results
        refs = [answer.get("$ref")] + [a.get("$ref") or a.get("items", {}).get("$ref") for a in answer.get("anyOf", [])]
        assert f"#/components/schemas/{name}Response" in refs, answer
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
    # the hot path answers, not FastAPI: the request models' message for a bad body (common/api_requests.py)
    bad = client.post("/v1/chat/completions", json={"messages": "hi"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "'messages' must be a non-empty list"


def test_the_document_shows_what_the_parser_enforces() -> None:
    """The services parse with these models (service/protocol.py), so the limits they enforce are in the
    schema: non-empty prompts, the ranges, the roles; and the constants agree with the engine's."""
    from common import api_requests as ar
    from engine.sampling.params import MAX_GRAMMAR_CHARS, MAX_NEW_TOKENS_LIMIT
    from engine.scheduling.parallel import MAX_N

    assert (ar.MAX_N, ar.MAX_NEW_TOKENS, ar.MAX_GRAMMAR_CHARS) == (MAX_N, MAX_NEW_TOKENS_LIMIT, MAX_GRAMMAR_CHARS)
    doc = TestClient(create_app(RouterConfig())).get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert all(p.get("minLength", p.get("minItems")) == 1 for p in prompt)
    assert schemas["GenerateRequest"]["properties"]["text"]["anyOf"][0]["minLength"] == 1
    _prompt_alternatives_match_the_parser(schemas["GenerateRequest"]["oneOf"])
    assert schemas["GenerateSampling"]["additionalProperties"] is False  # unknown keys are refused
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == list(ar.ROLES)
    n = schemas["ChatCompletionRequest"]["properties"]["n"]["anyOf"][0]
    assert (n["minimum"], n["maximum"]) == (1, MAX_N)


def _prompt_alternatives_match_the_parser(one_of: list[dict]) -> None:
    """/generate's `oneOf` (exactly one of text, input_ids, input_embeds) says yes to a body exactly when
    the model the services parse with does, for every combination of the three (given or null)."""
    from itertools import product

    import jsonschema

    from common.api_requests import PROMPT_FIELDS, GenerateRequest, RequestInvalid, validate

    assert sorted(alt["required"][0] for alt in one_of) == sorted(PROMPT_FIELDS)
    values = {"text": "hi", "input_ids": [1, 2], "input_embeds": [[0.5, -1.0], [2, 0.25]]}
    checker = jsonschema.Draft202012Validator({"oneOf": one_of})
    for given in product(("absent", "null", "value"), repeat=len(PROMPT_FIELDS)):
        body = {f: None if g == "null" else values[f] for f, g in zip(PROMPT_FIELDS, given) if g != "absent"}
        try:
            accepted = bool(validate(GenerateRequest, body))
        except RequestInvalid:
            accepted = False
        assert checker.is_valid(body) == accepted == (given.count("value") == 1), body


def test_router_documents_embeddings_with_the_services_model() -> None:
    """POST /v1/embeddings (relayed to a worker, router/embeddings.py) shows the body the services
    validate (common/api_embeddings.EmbeddingRequest) and OpenAI's answer, and the document says yes
    to a body exactly when that model does (the services' document: tests/integration/test_openapi_fuzz.py)."""
    import jsonschema

    from common.api_embeddings import EmbeddingRequest
    from common.api_requests import RequestInvalid, validate

    doc = TestClient(create_app(RouterConfig())).get("/openapi.json").json()
    op = doc["paths"]["/v1/embeddings"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"] == REF + "EmbeddingRequest"
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"] == REF + "EmbeddingResponse"
    assert {"400", "401", "500", "503", "504"} <= set(op["responses"]) and "422" not in op["responses"]
    checker = jsonschema.Draft202012Validator(doc["components"]["schemas"]["EmbeddingRequest"])
    good = [{"input": "a"}, {"input": [1, 2]}, {"input": [[1], [2, 3]]}, {"input": ["a", [1]], "user": "u"},
            {"input": "a", "dimensions": 3, "encoding_format": "base64", "model": "m"}, {"input": ["a"] * 2048}]
    bad = [{}, {"input": ""}, {"input": []}, {"input": [-1]}, {"input": [[]]}, {"input": [True]}, {"input": [1.5]},
           {"input": ["a", ""]}, {"input": ["a"] * 2049}, {"input": "a", "dimensions": 0},
           {"input": "a", "encoding_format": "hex"}, {"input": "a", "dimensions": "3"}, {"input": 5}]
    for body in good + bad:
        try:
            accepted = isinstance(validate(EmbeddingRequest, body), EmbeddingRequest)
        except RequestInvalid:
            accepted = False
        assert checker.is_valid(body) == accepted == (body in good), body


def test_every_status_and_content_type_of_the_router_is_documented() -> None:
    client = TestClient(create_app(RouterConfig()))
    paths = client.get("/openapi.json").json()["paths"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")
    admin = paths["/admin/workers"]
    assert {"400", "401", "409"} <= set(admin["post"]["responses"]) and "requestBody" in admin["post"]
    assert {"401", "404", "409"} <= set(admin["delete"]["responses"])
    assert client.delete("/admin/workers", params={"url": "http://nope:1"}).status_code == 404
    assert "503" in paths["/health"]["get"]["responses"]
    # a method the path does not take: 405 in the error model, Allow naming every method it takes
    r = client.options("/admin/workers")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert set(r.headers["allow"].split(", ")) == {"GET", "POST", "DELETE"}
    assert client.get("/nope").json()["error"]["code"] == 404


def test_a_service_answers_405_with_allow_and_documents_the_bodies_it_needs() -> None:
    """What the schemathesis run on `pdserve colocated` found (tests/integration/test_openapi_fuzz.py, its
    coverage phase): a 405 without `Allow` (RFC 9110), and LoRA bodies the document left optional."""
    class Bridge:  # no worker: only FastAPI's own answers and the document are read
        info: dict = {}

    client = TestClient(service_app(FrontendState(config=ServerConfig(), bridge=Bridge(), tokenizer=None,
                                                  model_dir="")))
    for method, path, allow in (("TRACE", "/generate", "POST"), ("GET", "/v1/completions", "POST"),
                                ("OPTIONS", "/health", "GET"), ("TRACE", "/v1/embeddings", "POST")):
        r = client.request(method, path)
        assert r.status_code == 405 and r.json()["error"]["code"] == 405 and r.headers["allow"] == allow, path
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/load_lora_adapter", "/v1/load_lora_adapter", "/unload_lora_adapter", "/v1/unload_lora_adapter",
                 "/open_session", "/close_session", "/abort_request"):
        assert paths[path]["post"]["requestBody"]["required"] is True, path
