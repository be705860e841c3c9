"""What a request asks for beside its prompt and sampling, grouped as the HTTP request groups it
(common/api_requests.py -> service/protocol.py builds them once -> service/messages.GenerateReq
carries them over msgpack -> engine.request.Req takes them as they are):

  LogprobParams  return_logprob, top_logprobs_num, logprob_start_len
  ReqOptions     scheduling and cache options: priority, cache salt, session, LoRA adapter
  Bootstrap      PD: the prefill's bootstrap address and room; prefill_here (the router's hint)
  Extras         model extras (engine.extras.features): hidden states, input embeddings, ids' logprobs

Frozen values, valid when built (the frontend validated the body); pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LogprobParams:
    """What logprobs a request asked for."""

    on: bool = False  # return_logprob: a logprob per output token
    top_k: int = 0  # 0..20 alternatives per token (engine.sampling.logprobs.TopK), when on
    start_len: int = -1  # first prompt position whose logprob is reported; -1: none


@dataclass(frozen=True)
class ReqOptions:
    """Scheduling and cache options (issue 40; service/request_options.py reads them)."""

    priority: int = 0  # --enable-priority-scheduling: the waiting order and preemption (engine.scheduling.priority)
    extra_key: str = ""  # cache salt: prefixes are shared only between requests with the same one
    session_id: str = ""  # a session's request: its KV stays pinned once it ends (engine.scheduling.sessions)
    lora: str = ""  # LoRA adapter name ("" = the base model; the frontend checked it is loaded)


@dataclass(frozen=True)
class Bootstrap:
    """PD: the prefill's bootstrap address and the room both workers share (all None colocated);
    validated by the frontend on prefill/decode (host, port 1..65535, room 0..2^63-1)."""

    host: str | None = None
    port: int | None = None
    room: int | None = None
    prefill_here: bool = False  # decode: the router found this request's prefill busy; prefill it here if it fits

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Extras:
    """Model extras (engine.extras.features; service/req_features.py checks them)."""

    hidden_states: bool = False  # return_hidden_states: last-layer hidden states
    input_embeds: bytes = b""  # float32 [len(input_ids), H]: the prompt's embeddings (its ids then placeholders)
    token_ids_logprob: list[int] = field(default_factory=list)  # logprobs of these ids at every step

    @property
    def any(self) -> bool:
        return self.hidden_states or bool(self.input_embeds) or bool(self.token_ids_logprob)


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt (vision-language models; service/images.py prepares it, engine.extras.multimodal
    runs it): its content hash, where its image tokens sit in the prompt and the preprocessed pixels."""

    hash: bytes  # 16 bytes of the pixels and grid: equal images, equal hash
    offset: int  # prompt index of its first image token
    tokens: int  # image tokens it occupies: t * h * w / merge**2
    grid: list[int]  # [t, h, w] in patches
    pixels: bytes = b""  # float32 [P, dim], as the model's image processor emits them
    dim: int = 0


# nested in service.messages.GenerateReq on the wire
GROUPS = (LogprobParams, ReqOptions, Bootstrap, Extras, ImageInput)
# what most requests ask: shared (the groups are frozen), so a plain request builds none of them
NO_LOGPROBS, NO_OPTIONS, COLOCATED, NO_EXTRAS = LogprobParams(), ReqOptions(), Bootstrap(), Extras()
