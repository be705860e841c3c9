"""`POST /v1/embeddings` (OpenAI's shape) as pydantic models: `EmbeddingRequest` is the one model the
services parse the body with (service/embeddings.py: `validate(EmbeddingRequest, body)` first, then
what no schema can say: the vocabulary, the context length, `dimensions` up to the model's hidden
size) and the one the OpenAPI documents of the router and of every service show (`route_docs`).

Contract (as common/api_requests.py): a body the model accepts passes every type and shape check the
services make; one it refuses raises `RequestInvalid` with the services' message naming the field
(`'input[1]' is empty`). Pure pydantic: the router imports it without torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from common import api_schema
from common.api_requests import NonEmpty, TokenId, _Open, whole
from common.checks import is_int

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request

Ids = Annotated[list[TokenId], Field(min_length=1)]
Inputs = Annotated[list[NonEmpty | Ids], Field(min_length=1, max_length=MAX_INPUTS)]


def check_input(raw: Any) -> None:
    """The shape of `input` (ValueError with the services' message naming the field): a non-empty
    string, a non-empty list of token ids >= 0, or a list of 1..MAX_INPUTS of these."""
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(is_int(t) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw or len(raw) > MAX_INPUTS:
        raise ValueError(f"'input' must be a string, a list of token ids, or a list of 1..{MAX_INPUTS} of these")
    for i, item in enumerate(raw):
        if not (isinstance(item, str) or (isinstance(item, list) and all(is_int(t) for t in item))):
            raise ValueError(f"'input[{i}]' must be a string or a list of integer token ids")
        if not item:
            raise ValueError(f"'input[{i}]' is empty")
        if isinstance(item, list) and min(item) < 0:
            raise ValueError(f"'input[{i}]' holds token id {min(item)} outside the vocabulary (ids are >= 0)")


class EmbeddingRequest(_Open):
    """The body of `POST /v1/embeddings`; other fields OpenAI clients send (`user`) are ignored."""

    input: NonEmpty | Ids | Inputs = Field(description="a string, a list of token ids, or a list of 1..2048 of "
                                                       "these (one vector each); strings are tokenized without "
                                                       "special tokens; each fits the context length")
    model: str | None = None
    dimensions: int | None = Field(None, ge=1, description="the first `dimensions` values of each vector (at most "
                                                           "the model's hidden size), then normalised")
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="float (default) or base64: little-endian float32 bytes")

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        try:
            check_input(v)
        except ValueError:  # token ids sent as whole-number floats (2.0) are ids, as for every integer field
            v = _whole_ids(v)
            check_input(v)
        return v


def _whole_ids(raw: Any) -> Any:
    """`raw` with its whole-number floats (in lists, one level of lists deep) as ints."""
    if not isinstance(raw, list):
        return raw
    return [_whole_ids(t) if isinstance(t, list) else whole(t) for t in raw]


# ---- the answer -------------------------------------------------------------------------------------
class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="the vector, or with encoding_format base64 its bytes")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[Embedding] = Field(description="one vector per input, in order")
    usage: EmbeddingUsage


def route_docs(*codes: int) -> dict[str, Any]:
    """FastAPI keyword arguments of a `POST /v1/embeddings` route whose handler reads the body itself:
    the request model by reference (nothing validated by FastAPI), the answer, the error `codes`."""
    return {"summary": "OpenAI embeddings: pooled, normalised final hidden states of each input",
            "response_model": EmbeddingResponse, "responses": api_schema.errors(*codes),
            "openapi_extra": api_schema.body_docs(EmbeddingRequest)}
