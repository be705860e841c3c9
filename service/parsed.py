"""What a parsed request is, shared by the parser (service/protocol.py) and the modules it calls for
one concern each (service/request_options.py, service/req_features.py, service/sessions.py): the
400 they raise (`RequestError`), the limits they check against (`Limits`), the result they fill
(`ParsedRequest`) and the one JSON body check (`parse_json_body`). It imports none of them, so they
import it without a circle."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from service.messages import GenerateReq
from service.tools import ToolPlan


class RequestError(Exception):
    """A request the service refuses: `status` is the HTTP status, `message` says why."""

    def __init__(self, message: str, status: int = 400, err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


@dataclass(frozen=True)
class Limits:
    """What the parser checks requests against (from the worker's ready info)."""

    role: str
    context_length: int
    vocab_size: int
    model_name: str
    grammars: Any = None  # engine.sampling.grammar.Grammars: a structured-output grammar must compile here
    hidden_size: int = 0  # the model's (input_embeds rows, hidden-state sizes)
    loras: Any = None  # service.lora.AdapterTable: the adapters a request may name (None: LoRA unknown)
    sessions: Any = None  # service.sessions.SessionStore (colocated): /generate's session_params
    image_tokens: tuple[int, int, int] | None = None  # vision-language models: (vision start, image, vision end) ids


@dataclass
class ParsedRequest:
    kind: str  # generate | completion | chat
    req: GenerateReq
    model: str
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token in the answer
    echo: str | None = None  # completions with echo: the prompt text, put in front of the answer
    role: str = "colocated"  # the answering service's role (a prefill leaves output logprobs to its decode)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    token_ids: bool = False  # stream events carry their token ids (TOKEN_IDS_KEY), for the router
    resumed: list[int] = dataclasses.field(default_factory=list)  # output ids another decode streamed
    response_id: str = ""  # the id of the stream this request continues ("" = from the rid)
    tools: ToolPlan | None = None  # chat: the tools the reply may call (service.tools)
    echo_only: bool = False  # completions with echo and max_tokens 0: the prompt (and its logprobs) only
    reasoning: str = ""  # chat: the --reasoning-parser style that splits the reply (service.reasoning)
    session: Any = None  # /generate's session_params (common.api_requests.SessionParams), or None
    # vision-language models: the request's image URLs in prompt order, and the index in req.input_ids of each
    # one's single image token (service/image_prompt.py expands it to the image's tokens once it is processed)
    image_urls: list[str] = dataclasses.field(default_factory=list)
    image_at: list[int] = dataclasses.field(default_factory=list)

    @property
    def choices(self) -> int:
        """Choices this service answers with: n, but one on a prefill (it reports choice 0 only:
        the router needs its status and prompt logprobs, the decode streams every choice)."""
        return 1 if self.role in ("prefill", "encoder") else self.req.n


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise RequestError("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON body: {e}") from e
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    return body
