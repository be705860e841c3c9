"""Frozen configuration objects, built once in `main` from CLI flags and passed explicitly.

ModelConfig   what the weights are (read from an HF config.json)
EngineConfig  how one engine runs them (device, dtype, KV pool, batching limits)

The service layer (service/config.py) wraps EngineConfig in a ServerConfig and owns the CLI flags.

Validation raises ValueError with a message naming the flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.checks import need
from engine.extras.speculative.config import SpecConfig

EMBEDDED_MODEL = "embedded:smollm2-135m"


CPU_DEFAULT_TOKENS = 16384  # fp32 KV on the CPU: 16k tokens of the embedded model are ~750 MB


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from a config.json: transformers<5 keys, or >=5's `rope_parameters`. Scaling this
    engine cannot compute exactly raises ValueError naming the field (engine/models/rope.py). As
    transformers does, YaRN's original_max_position_embeddings comes from the top level when there,
    else defaults to max_position_embeddings."""
    from engine.models.rope import check_rope, rope_type

    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"config.json field 'rope_scaling' must be an object or null, got {scaling!r}")
    if rope_type(scaling) == "yarn":
        old = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling = scaling | {"original_max_position_embeddings": old or cfg.get("max_position_embeddings")}
    check_rope(scaling)
    return float(theta), scaling


_ATTENTION_KINDS = ("full_attention", "sliding_attention")


def _sliding_windows(cfg: dict, mtype: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's attention window in tokens (0: full causal attention), as transformers reads it:
    a query at position p sees keys p-W+1..p. Mistral: `sliding_window` on every layer; Qwen2, Qwen3
    (model_type qwen*): `use_sliding_window` from layer `max_window_layers` on; or an explicit
    `layer_types` (a family whose transformers model reads windows otherwise passes its own). A field
    this engine cannot run exactly raises ValueError naming it (never run approximately)."""
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
    elif mtype.startswith("qwen"):
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
class MoESpec:
    """A mixture-of-experts MLP's shape (engine/models/moe.py runs it)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert, gated by a sigmoid (0: none)
    sparse_layers: tuple[bool, ...] = ()  # per layer: True = MoE, False = the dense MLP
    # DeepSeek routing (engine/models/moe.py route_grouped): scores by softmax (V2) or sigmoid (V3, plus a
    # per-expert e_score_correction_bias for the choice only); the top-k is taken within the `topk_group`
    # best of `n_group` expert groups; the weights are scaled by routed_scaling_factor
    scoring: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_bias: bool = False  # V3's e_score_correction_bias
    shared_gate: bool = True  # the shared expert is scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention's shape (DeepSeek-V2/V3; engine/models/deepseek.py runs it). Each token
    of a layer caches one latent vector: kv_lora_rank (c_kv) + qk_rope_head_dim (the shared rope key)."""

    q_lora_rank: int  # 0: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # 1/sqrt(qk_nope + qk_rope), x YaRN mscale(factor, mscale_all_dim)^2
    rope_interleave: bool = True  # rope dims come in (x0, x1) pairs (V2 always; V3 `rope_interleave`)

    @property
    def latent_dim(self) -> int:
        """Elements one token of one layer caches: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before rope
    moe: MoESpec | None = None  # None: every layer's MLP is dense
    o_bias: bool = False  # o_proj has a bias (Llama/Qwen3 `attention_bias`; Qwen2 biases q/k/v only)
    mla: MLASpec | None = None  # DeepSeek's latent attention: the pool caches one latent per token and layer

    def window(self, layer: int) -> int:
        """Layer's attention window in tokens, 0 for full causal attention."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def max_window(self) -> int:
        """Tokens back a query can see in the widest layer: 0 when any layer attends to everything."""
        return 0 if not self.sliding_windows or 0 in self.sliding_windows else max(self.sliding_windows)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The config.json of an HF model directory, parsed by its family (engine/models/registry.py):
        an unknown model_type, or a field the family cannot honour exactly, is a ValueError naming it."""
        from engine.models.registry import family

        raw = json.loads((Path(path) / "config.json").read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{path}/config.json is not a JSON object")
        return family(raw.get("model_type", "llama")).config(raw)

    @classmethod
    def from_hf(cls, raw: dict, **fields: object) -> ModelConfig:
        """The fields every family shares, from config.json `raw` (sizes, norms, rope, windows, tokens);
        `fields` set the family's own (qkv_bias, o_bias, qk_norm, moe) or override a parsed one. A missing
        or malformed field is a ValueError naming it."""
        def num(key: str, default: object = None) -> int:
            v = raw.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"config.json field {key!r} must be a positive integer, got {v!r}")
            return v

        heads, layers, hidden = num("num_attention_heads"), num("num_hidden_layers"), num("hidden_size")
        kv_heads = num("num_key_value_heads") if raw.get("num_key_value_heads") is not None else heads
        if heads % kv_heads:
            raise ValueError(f"config.json field 'num_key_value_heads' ({kv_heads}) must divide "
                             f"num_attention_heads ({heads})")
        eos = raw.get("eos_token_id")
        mtype = raw.get("model_type", "llama")
        windows = _sliding_windows(raw, mtype, layers)
        theta, scaling = _rope(raw)
        parsed = dict(
            hidden_size=hidden, intermediate_size=num("intermediate_size"), num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads,
            head_dim=num("head_dim") if raw.get("head_dim") is not None else hidden // heads,
            vocab_size=num("vocab_size"), rms_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=scaling, max_position=raw.get("max_position_embeddings", 4096),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)), qkv_bias=False,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            model_type=mtype, sliding_windows=windows if any(windows) else ())
        return cls(**(parsed | fields))


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
    schedule_policy: str = "fcfs"  # order of waiting prompts: fcfs | sjf | lpm (scheduling.scheduler.order_waiting)
    schedule_aging_s: float = 5.0  # sjf/lpm: a prompt waiting this long goes ahead of the policy's order
    # request priority (engine.scheduling.priority): waiting order by priority first, preemption of lower ones
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False  # False: a higher `priority` value is more urgent
    priority_preemption_threshold: int = 1  # a running request is preempted only by one this much more urgent
    priority_max_preemptions: int = 2  # times one request may be preempted (low priority never starves)
    priority_aging_s: float = 30.0  # a request waiting this long ranks as the most urgent
    # sessions (engine.scheduling.sessions): a finished session request's KV stays pinned in the prefix cache
    session_timeout_s: float = 300.0  # a session idle this long loses its pin
    # reuse cached prompt prefixes (engine.kvcache.radix_cache). Off for the engine library (offline LLM,
    # tests: pools drain to 0 after each request); the colocated and prefill services turn it on
    # unless --disable-prefix-cache.
    prefix_cache: bool = False
    # host/disk tiers under the prefix cache (engine/kvcache/hicache): 0 host tokens = off
    hicache_host_tokens: int = 0
    hicache_write_policy: str = "write_back"  # write_back (copy at eviction) | write_through (at insert)
    hicache_dir: str = ""  # disk tier directory ("": none)
    hicache_disk_bytes: int = 1 << 30  # disk tier bound
    # tensor parallelism (engine/distributed/tp_ranks.py): one process per rank, rank 0 drives the others
    tp: int = 1  # ranks in the TP group
    tp_devices: str = ""  # comma list of this node's devices by local rank ("": cuda:<base + local rank>)
    dist_init_addr: str = ""  # HOST:PORT where rank 0 meets the others ("": a free loopback port, one node)
    nnodes: int = 1  # nodes the TP group spans (tp / nnodes ranks on each)
    node_rank: int = 0  # this node's index; node 0 runs rank 0 (frontend, scheduler)
    # LoRA (engine/extras/lora): adapters loaded at start-up ("NAME=PATH"), slots, rank cap, adapters per forward
    lora_paths: tuple[str, ...] = ()
    max_loaded_loras: int = 0  # adapter slots; 0 with no lora_paths: LoRA off (max(this, len(lora_paths)) slots)
    max_lora_rank: int = 64
    max_loras_per_batch: int = 8
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding (engine/extras/speculative)

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
        need(self.priority_preemption_threshold >= 1, "--priority-preemption-threshold must be >= 1")
        need(self.priority_max_preemptions >= 0, "--priority-max-preemptions must be >= 0")
        need(self.priority_aging_s > 0, "--priority-aging must be > 0 seconds")
        need(self.session_timeout_s > 0, "--session-timeout must be > 0 seconds")
        need(self.max_loaded_loras >= 0, "--max-loaded-loras must be >= 0")
        need(self.max_lora_rank >= 1, "--max-lora-rank must be >= 1")
        need(self.max_loras_per_batch >= 1, "--max-loras-per-batch must be >= 1")
        self._check_tp()
        self._check_hicache()

    def _check_hicache(self) -> None:
        need(self.hicache_host_tokens >= 0, "--hicache-host-tokens must be >= 0 (0: no host tier)")
        need(self.hicache_write_policy in ("write_back", "write_through"),
             f"--hicache-write-policy must be write_back or write_through, got {self.hicache_write_policy!r}")
        need(self.hicache_disk_bytes > 0, "--hicache-disk-bytes must be > 0")
        if not self.hicache_host_tokens:
            need(not self.hicache_dir, "--hicache-dir needs --hicache-host-tokens > 0 (the disk tier sits under it)")
            return
        need(self.hicache_host_tokens >= self.page_size, "--hicache-host-tokens must hold at least one page")
        need(self.prefix_cache, "--hicache-host-tokens needs the prefix cache (drop --disable-prefix-cache)")
        need(self.tp == 1, "--hicache-host-tokens is not supported with --tp > 1 (host tier copies are not "
                           "broadcast to the other ranks); use --tp 1 or --hicache-host-tokens 0")

    def _check_tp(self) -> None:
        need(self.tp >= 1, f"--tp must be >= 1, got {self.tp}")
        need(self.nnodes >= 1 and self.tp % self.nnodes == 0,
             f"--nnodes must be >= 1 and divide --tp ({self.tp}), got {self.nnodes}")
        need(0 <= self.node_rank < self.nnodes, f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        need(self.nnodes == 1 or bool(self.dist_init_addr),
             "--dist-init-addr HOST:PORT (rank 0's node) is needed when --nnodes > 1")
        if self.dist_init_addr:
            host, _, port = self.dist_init_addr.rpartition(":")
            need(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                 f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        devices = [d for d in self.tp_devices.split(",") if d]
        need(not devices or len(devices) == self.tp // self.nnodes,
             f"--tp-devices must list {self.tp // self.nnodes} devices (one per rank on this node), "
             f"got {self.tp_devices!r}")

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
