"""Frozen configuration objects, built once in `main` from CLI flags and passed explicitly.

ModelConfig   what the weights are (read from an HF config.json)
EngineConfig  how one engine runs them (device, dtype, KV pool, batching limits)

The service layer (service/config.py) wraps EngineConfig in a ServerConfig and owns the CLI flags.

Validation raises ValueError with a message naming the flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.checks import need

EMBEDDED_MODEL = "embedded:smollm2-135m"


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
    attention_backend: str = "auto"  # auto | cpu | torch | triton
    cpu_gemm: str = "onednn"  # onednn (fp32 CPU linears packed once, engine/models/cpu_gemm.py) | torch
    new_token_ratio: float = 0.4  # share of max_new_tokens reserved when admitting a request
    seed: int = 0
    threads: int = 0  # torch intra-op threads on CPU; 0 = engine.cpus.cpu_budget()
    schedule_policy: str = "fcfs"  # order of waiting prompts: fcfs | sjf | lpm (engine.scheduler.order_waiting)
    schedule_aging_s: float = 5.0  # sjf/lpm: a prompt waiting this long goes ahead of the policy's order
    # reuse cached prompt prefixes (engine.radix_cache). Off for the engine library (offline LLM,
    # tests: pools drain to 0 after each request); the colocated and prefill services turn it on
    # unless --disable-prefix-cache.
    prefix_cache: bool = False

    def __post_init__(self) -> None:
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
        need(self.attention_backend in ("auto", "cpu", "torch", "triton"),
             f"--attention-backend must be auto, cpu, torch or triton, got {self.attention_backend!r}")
        need(self.attention_backend != "cpu" or (self.device == "cpu" and self.dtype == "float32"),
             "--attention-backend cpu runs float32 on the CPU only (use torch for other dtypes)")
        need(self.cpu_gemm in ("onednn", "torch"), f"--cpu-gemm must be onednn or torch, got {self.cpu_gemm!r}")
        need(0.0 <= self.new_token_ratio <= 1.0, "--new-token-ratio must be in [0, 1]")
        need(self.schedule_policy in ("fcfs", "sjf", "lpm"),
             f"--schedule-policy must be fcfs, sjf or lpm, got {self.schedule_policy!r}")
        need(self.schedule_aging_s > 0, "--schedule-aging must be > 0 seconds")

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
        if self.device.startswith("cuda"):
            return "triton"
        return "cpu" if self.device == "cpu" and self.dtype == "float32" else "torch"
