"""Frozen configuration of one service, built once in `main` from CLI flags and passed explicitly.

PDConfig      prefill/decode transfer settings (`transfer_config(role)`: the transfer layer's config)
ImageConfig   image inputs of vision-language models: where images may come from and how big they may be
              (service/images.py checks a request's images against it)
ServerConfig  one service process group: HTTP address, role, PD transfer settings, EngineConfig, ImageConfig,
              and the ipc endpoints of its frontend<->worker channels (`endpoints`)

Flags declared once: each field of these configs (and of the nested EngineConfig and SpecConfig) carries
its flag's help, type, default and choices (common.configs.option); `server_specs(role)` lists a role's
flags, `build_parser(role)` generates its parser from them and `pdserve up` its worker flags. The config
is built from the parsed flags by name (`server_config_from_args`: a flag's dest is its field's name).
Validation raises ValueError with a message naming the flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import torch

from common.configs import FIELD, Group, Spec, add_flags, build, nested, option, specs
from common.logs import add_observability_args
from common.secrets import read_secret
from common.tracing import traces_url
from engine.config import CPU_DEFAULT_TOKENS, MODEL, EngineConfig
from engine.extras.speculative.config import SpecConfig
from service.channels import Endpoints
from service.reasoning import STYLES as REASONING_STYLES
from transfer.config import TransferConfig

ROLES = ("colocated", "prefill", "decode", "encoder")
PD_ROLES = ("prefill", "decode")
TRANSFER_ROLES = ("prefill", "decode", "encoder")  # every role on the transfer plane (an encoder sends to prefills)
# the encoder role (`pdserve encoder`: a vision-language model's tower alone) takes only the flags declared for it
# (roles naming "encoder"), the image flags and these of the rest: which model, where, threads, the HTTP server's
ENCODER_FLAGS = frozenset({"model", "device", "dtype", "threads", "image_cache_mb", "served_model_name", "host",
                           "port", "internal_token_file", "log_level", "drain_grace_s", "watchdog_timeout_s"})
SERVER = Group("server")
KV_EVENTS = Group("kv cache events", "vLLM-format KV cache events for KV-aware routers (docs/kv_events.md)")
TRANSFER = Group("prefill/decode transfer")
IMAGES = Group("image inputs", "images in chat requests (content parts of type image_url) for vision-language models: "
               "where they may come from and how big they may be; a bad image is a 400 naming it")


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode transfer settings (unused in colocated mode); each field declares its flag."""

    bootstrap_port: int = option(8998, "port of this prefill's (or encoder's) bootstrap server (decodes, or the "
                                 "prefills an encoder sends image embeddings to, connect here)",
                                 group=TRANSFER, roles=("prefill", "encoder"))
    advertise_host: str = option("", "address peers use to reach this node (default: --host, or 127.0.0.1 for "
                                 "0.0.0.0)", group=TRANSFER, roles=TRANSFER_ROLES)  # "" in a config built without flags
    transfer_backend: str = option("ucx", "KV transfer backend (fake moves no bytes: tests only)", group=TRANSFER,
                                   roles=TRANSFER_ROLES, choices=("ucx", "fake"))
    bootstrap_timeout_s: float = option(
        60.0, "seconds a prefill waits for the decode's TransferInfo, counted again from each word of the decode "
        "that the request waits in its queue for KV memory; a decode says so at least 3 times per this many seconds "
        "(give both roles the same value)", group=TRANSFER, roles=TRANSFER_ROLES, name="--bootstrap-timeout")
    waiting_timeout_s: float = option(120.0, "seconds a decode waits for a room's KV to arrive", group=TRANSFER,
                                      roles=TRANSFER_ROLES, name="--waiting-timeout")
    heartbeat_interval_s: float = option(5.0, "seconds between transfer heartbeats; 3 missed fail the peer's rooms",
                                         group=TRANSFER, roles=TRANSFER_ROLES, name="--heartbeat-interval")
    progress_thread: bool = option(
        True, "move KV bytes, acks and heartbeats on a thread while a forward runs (default on; off: they move only "
        "between engine steps, so a long forward delays transfers and can miss heartbeats)", group=TRANSFER,
        roles=TRANSFER_ROLES, name="--transfer-progress-thread", action="optional")
    local_prefill_threshold: int = option(
        256, "conditional disaggregation: a prompt of which at most this many tokens are not in this decode's "
        "prefix cache is prefilled here instead of on its prefill (which is told to skip it) while its local "
        "prefill queue, this prompt included, stays within this many tokens; its PD round trip would cost more "
        "than the compute (default 256, with the budget and load term below: decode-stream TTFT and ITL in "
        "docs/benchmarks.md, 'First token at equal hardware'). 0: always disaggregate", group=TRANSFER,
        roles=("decode",))
    local_prefill_budget: int = option(
        32, "prompt tokens the local prefills may add to one decode step, so running streams' inter-token latency "
        "stays bounded (default 32: a 64-token prompt in two steps keeps decode ITL p99 at 0.16x colocated's on "
        "the PD-vs-colocated benchmark; 64 gives a faster first token and 0.23x)", group=TRANSFER,
        roles=("decode",))
    local_prefill_max_queued: int = option(
        2048, "a request the router marks as 'its prefill is busy' (router --local-prefill-queue-tokens) is "
        "prefilled here when its KV fits now and the prompt tokens already queued for local prefill plus its own "
        "stay within this many; otherwise it goes to its prefill as usual. 0: never on the router's word",
        group=TRANSFER, roles=("decode",))
    local_prefill_max_running: int = option(
        4, "decode load term of --local-prefill-threshold: a short prompt is prefilled here only while fewer than "
        "this many requests decode or wait for a local step here (those waiting for their KV do not count); at or "
        "above it the prompt goes to its prefill, so a busy decode spends its steps on its streams (default 4: "
        "goodput under an SLO in docs/benchmarks.md). 0: no bound", group=TRANSFER, roles=("decode",))
    max_queued_requests: int = option(
        1024, "requests that may wait in this decode's queue for KV memory (its prefill keeps each one waiting, "
        "computing nothing); a request arriving when it is full is refused at once with 503 and Retry-After, so "
        "the router can try another decode (default 1024)", group=TRANSFER, roles=("decode",))
    queue_timeout_s: float = option(
        300.0, "seconds one request may wait in this decode's queue for KV memory before it is refused with 503 and "
        "Retry-After (its prefill ends it too); keep it under the router's request timeout (600 s) so the router "
        "has time to try another decode (default 300)", group=TRANSFER, roles=("decode",), name="--queue-timeout")
    cluster_token: str | None = option(None, "file holding a shared token; control messages without it are "
                                       "refused", group=TRANSFER, roles=TRANSFER_ROLES, name="--cluster-token-file",
                                       dest="cluster_token_file")

    def __post_init__(self) -> None:
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError("--bootstrap-port must be in 0..65535 (0 = pick a free port)")
        if self.transfer_backend not in ("ucx", "fake"):
            raise ValueError("--transfer-backend must be ucx or fake")
        if self.bootstrap_timeout_s <= 0 or self.waiting_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.local_prefill_threshold < 0:
            raise ValueError("--local-prefill-threshold must be >= 0 (0: always disaggregate)")
        if self.local_prefill_budget < 1:
            raise ValueError("--local-prefill-budget must be >= 1")
        if self.local_prefill_max_queued < 0:
            raise ValueError("--local-prefill-max-queued must be >= 0")
        if self.local_prefill_max_running < 0:
            raise ValueError("--local-prefill-max-running must be >= 0 (0: no bound)")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        if self.queue_timeout_s <= 0:
            raise ValueError("--queue-timeout must be > 0")

    def transfer_config(self, role: str) -> TransferConfig:
        """The transfer layer's config of a `role` worker: the fields both configs name alike, by name; the
        backend from --transfer-backend; an empty advertise_host (a config built without flags) as 127.0.0.1."""
        return build(TransferConfig, self, role=role, backend=self.transfer_backend,
                     advertise_host=self.advertise_host or "127.0.0.1")


@dataclass(frozen=True)
class ImageConfig:
    """Where a request's images may come from and how big they may be (service/images.py); each field declares
    its flag. Every role takes them: a prefill computes the image's tokens, a decode may prefill locally."""

    image_url_fetch: bool = option(
        False, "let requests name images by http:// or https:// URL, fetched by this service (streamed, at most "
        "--max-image-bytes, within --image-fetch-timeout). Off by default: a client could make the service fetch "
        "any address it can reach, internal ones included; data: URLs are always taken", group=IMAGES)
    image_fetch_timeout_s: float = option(
        10.0, "seconds one image fetch may take in all (connect, headers and body) before the request is refused "
        "(default {default:g})", group=IMAGES, name="--image-fetch-timeout")
    max_image_bytes: int = option(
        20 * 1024 * 1024, "largest encoded image taken, in bytes, from a data: URL, a local file or a fetch "
        "(default {default}: 20 MiB)", group=IMAGES)
    image_dir: str = option(
        "", "local images: requests may name files under this directory, as file:// URLs or absolute paths "
        "(symlinks and .. resolved first; a path that leaves the directory is refused). \"\" (default): local "
        "files are refused", group=IMAGES)
    max_images_per_request: int = option(
        8, "most images one request may carry (default {default}; 0: refuse images)", group=IMAGES)
    max_image_pixels: int = option(
        40_000_000, "largest decoded image taken, width * height, checked from the image's header before its "
        "pixels are decoded (a decompression-bomb guard; default {default})", group=IMAGES)

    def __post_init__(self) -> None:
        if self.image_fetch_timeout_s <= 0:
            raise ValueError("--image-fetch-timeout must be > 0")
        if self.max_image_bytes < 1:
            raise ValueError("--max-image-bytes must be >= 1")
        if self.max_images_per_request < 0:
            raise ValueError("--max-images-per-request must be >= 0 (0: refuse images)")
        if self.max_image_pixels < 1:
            raise ValueError("--max-image-pixels must be >= 1")
        if self.image_dir and not os.path.isdir(self.image_dir):
            raise ValueError(f"--image-dir {self.image_dir!r} is not a directory")


@dataclass(frozen=True)
class ServerConfig:
    """One service process group; each field declares its flag (the engine's, PD's and images' nested in place)."""

    role: str = "colocated"
    engine: EngineConfig = nested(EngineConfig)
    served_model_name: str = option("", "model name reported by /v1/models (default: from --model)", group=MODEL)
    host: str = option("127.0.0.1", "HTTP bind address", group=SERVER)
    port: int = option(30000, "HTTP port", group=SERVER)
    internal_token: str | None = option(None, "file holding a token; when set, requests must carry it in header "
                                        "x-pdserve-token", group=SERVER, name="--internal-token-file",
                                        dest="internal_token_file")
    log_level: str = option("info", "debug, info, warning or error", group=SERVER)
    reasoning_parser: str = option(
        "", "chat replies: text inside <think>...</think> goes to message.reasoning_content (streamed as "
        "delta.reasoning_content), the rest to content. qwen3: reasoning only when the reply opens with <think>; "
        "deepseek-r1: the reply starts inside reasoning (the open tag optional)", group=SERVER,
        choices=("", *REASONING_STYLES))
    embedding_pooling: str = option("last", "POST /v1/embeddings: the last token's final hidden state or the mean "
                                    "over the input's tokens, L2-normalised", group=SERVER, choices=("last", "mean"))
    otlp_endpoint: str = ""  # OTLP/HTTP collector for traces; "" = OTEL_* variables or off (common.logs flag)
    log_format: str = "text"  # text | json (JSON lines with the trace id; common.logs flag)
    pd: PDConfig = nested(PDConfig)
    images: ImageConfig = nested(ImageConfig)
    drain_grace_s: float = option(30.0, "seconds in-flight requests may run after SIGTERM before they are aborted",
                                  name="--drain-grace")
    ipc_dir: str = ""  # where the zmq ipc sockets live; "" = a fresh temp dir (PDSERVE_IPC_DIR)
    watchdog_timeout_s: float = option(
        300.0, "a request that makes no progress for this many seconds while the worker runs is ended with a 503 "
        "naming the stage it was stuck in (queued, computing the prompt, waiting for KV, decoding, ...), counted "
        "in pdserve_worker_watchdog_ended_total and logged once. A queued request progresses while its worker "
        "computes or moves KV for anyone; waits with their own bound (--queue-timeout, --bootstrap-timeout, "
        "--waiting-timeout) end by it first when shorter. 0: off", name="--watchdog-timeout")

    kv_events_endpoint: str = option(
        "", "publish KV cache events (BlockStored / BlockRemoved / AllBlocksCleared, vLLM's wire format) on a zmq "
        "PUB socket here: binds when the address holds * (tcp://*:5557; tcp://127.0.0.1:* picks a free port), "
        "connects otherwise, as vLLM's --kv-events-config endpoint. Off by default", group=KV_EVENTS)
    kv_events_replay_endpoint: str = option(
        "", "zmq ROUTER address (bound) where a subscriber that missed batches asks for them again by sequence "
        "number (\"\": no replay)", group=KV_EVENTS)
    kv_events_topic: str = option("", "topic frame of every KV events message", group=KV_EVENTS)
    kv_events_encoding: str = option(
        "array", "each event as a positional array (vLLM's array_like structs, which every consumer decodes) or as a "
        "map with a 'type' key (vLLM since its PR #42892)", group=KV_EVENTS, choices=("array", "map"))
    kv_events_queue_size: int = option(
        100_000, "KV events the scheduler may queue ahead of the publisher thread; beyond it an event is dropped and "
        "counted in pdserve_worker_kv_events_dropped_total", group=KV_EVENTS)

    @property
    def endpoints(self) -> Endpoints:
        """The frontend<->worker channel addresses (ValueError until the launcher sets ipc_dir)."""
        return Endpoints.in_dir(self.ipc_dir)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in 0..65535")
        if self.otlp_endpoint:
            traces_url(self.otlp_endpoint)  # ValueError naming --otlp-endpoint
        if self.reasoning_parser not in ("", *REASONING_STYLES):
            raise ValueError(f"--reasoning-parser must be one of {REASONING_STYLES}, got {self.reasoning_parser!r}")
        if self.embedding_pooling not in ("last", "mean"):
            raise ValueError(f"--embedding-pooling must be last or mean, got {self.embedding_pooling!r}")
        if self.drain_grace_s < 0:
            raise ValueError("--drain-grace must be >= 0")
        if self.watchdog_timeout_s < 0:
            raise ValueError("--watchdog-timeout must be >= 0 (0: off)")
        if self.kv_events_encoding not in ("array", "map"):
            raise ValueError(f"--kv-events-encoding must be array or map, got {self.kv_events_encoding!r}")
        if self.kv_events_queue_size < 1:
            raise ValueError("--kv-events-queue-size must be >= 1")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")


def server_specs(role: str, default: Any = FIELD) -> list[Spec]:  # noqa: ANN401
    """The flags of a `role` service, declared by the fields of ServerConfig (and its nested configs).
    `default`: as common.configs.specs (argparse.SUPPRESS for `pdserve up`'s forwarded flags)."""
    out = list(specs(ServerConfig, role, default=default))
    if role == "encoder":
        out = [s for s in out if "encoder" in s.flag.roles or s.dest in ENCODER_FLAGS or s.flag.group is IMAGES]
    return out


def add_server_args(p: argparse.ArgumentParser, role: str) -> None:
    """The flags of a `role` service, generated from its config's fields; --otlp-endpoint and --log-format
    (common.logs, shared with the router and `pdserve up`) join the server group."""
    groups = add_flags(p, server_specs(role))
    add_observability_args(groups[SERVER.title])


def build_parser(role: str, description: str | None = None) -> argparse.ArgumentParser:
    """`pdserve colocated|prefill|decode|encoder`'s parser."""
    p = argparse.ArgumentParser(prog=f"pdserve {role}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p, role)
    return p


def resolve_device(device: str) -> str:
    """`auto`: cuda when a GPU is visible, else cpu; any other value as given."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def server_config_from_args(ns: argparse.Namespace, role: str) -> ServerConfig:
    """The service's config from its parsed flags (build_parser): every field from the flag of its name
    (common.configs.build; the other role's flags are absent, so those fields keep their defaults), the
    nested ImageConfig's too. Derived: device and dtype `auto` resolved, the KV pool's default by device, the
    advertised host (--advertise-host, else --host, else 127.0.0.1 for a wildcard), the tokens read from their
    files, the ipc dir from PDSERVE_IPC_DIR. ValueError (naming the flag) from each config's validation."""
    device = resolve_device(ns.device)
    default_tokens = CPU_DEFAULT_TOKENS if device == "cpu" else EngineConfig.max_total_tokens
    dtype = ns.dtype if ns.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    if getattr(ns, "kv_cache_dtype", "auto") == "fp8_e4m3":  # the same memory holds 2x (bf16) / 4x (fp32) the tokens
        default_tokens *= 4 if dtype == "float32" else 2
    eng = build(EngineConfig, ns, device=device, dtype=dtype,
                max_total_tokens=getattr(ns, "max_total_tokens", None) or default_tokens,
                lora_paths=tuple(getattr(ns, "lora_paths", ())), spec=build(SpecConfig, ns))
    pd = PDConfig()
    if role in TRANSFER_ROLES:
        adv = ns.advertise_host or (ns.host if ns.host not in ("0.0.0.0", "::") else "127.0.0.1")
        pd = build(PDConfig, ns, advertise_host=adv, cluster_token=read_secret(ns.cluster_token_file))
    return build(ServerConfig, ns, role=role, engine=eng, pd=pd, images=build(ImageConfig, ns),
                 internal_token=read_secret(ns.internal_token_file),
                 ipc_dir=os.environ.get("PDSERVE_IPC_DIR", ""))
