"""ModelRunner: owns one rank's model, device KV pool, host pool, LoRA weights and attention backend,
and runs one forward over a ForwardBatch (engine/forward/forward_batch.py: the batch is built once,
before; the runner knows no feature and no tensor parallelism).

The caller allocates pages first: a segment's pages must cover `start + len(tokens)` tokens.

Tensor parallelism lives outside (engine/distributed/): each rank of a group builds a ModelRunner
over its `Shard` (its TPGroup, device, threads, and on rank 0 pools whose page moves every rank
repeats); rank 0 wraps its runner in a TPRunner that sends each op to the other ranks first, with the
same calls as here (`forward`, `collective`, `close`, the pools). Only rank 0 gets logits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.attention.base import build_metadata, triton_kernels
from engine.attention.registry import create_backend
from engine.config import EngineConfig, ModelConfig
from engine.cpus import cpu_budget
from engine.extras.lora import registry as lora_registry
from engine.forward.forward_batch import (
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    ForwardBatch,
    ForwardOutput,
    Segment,
)
from engine.kvcache.memory import HostKVPool, KVPool
from engine.models.embedded import resolve_model_path
from engine.models.llama import ForwardContext
from engine.models.loader import DTYPES, load_model
from engine.models.moe import use_triton
from engine.models.quant import quantized_modules
from engine.recurrent.batch import StateBatch
from engine.recurrent.state_pool import StatePool, StateSpec

__all__ = ["LOGITS_ALL", "LOGITS_LAST", "LOGITS_NONE", "ForwardBatch", "ForwardOutput", "ModelRunner", "Segment",
           "Shard"]

log = logging.getLogger(__name__)


class Shard(NamedTuple):
    """Where one rank's runner lives (engine/distributed builds it per rank; the default: the whole
    model in this process)."""

    tp: Any = None  # engine.distributed.tp.TPGroup of this rank; None: a group of one
    device: str = ""  # "" = cfg.device
    threads: int = 0  # torch threads on CPU; 0 = --threads, else the CPU budget
    kv_pool: Callable[..., KVPool] = KVPool  # rank 0 of a group: pools that send their page moves
    host_pool: Callable[..., HostKVPool] = HostKVPool
    state_pool: Callable[..., StatePool] = StatePool  # rank 0 of a group: a pool that sends its slot moves


class ModelRunner:
    """One rank's model, KV pools, LoRA weights and attention backend (the whole engine's with tp 1)."""

    def __init__(self, cfg: EngineConfig, shard: Shard = Shard()) -> None:
        self.cfg = cfg
        if cfg.device == "cpu" or cfg.threads > 0 or shard.threads:
            torch.set_num_threads(shard.threads or cfg.threads or cpu_budget())
        self.model_path: Path = resolve_model_path(cfg.model)
        self.model_cfg = ModelConfig.from_dir(self.model_path)
        mc = self.model_cfg
        if cfg.hicache_host_tokens and mc.max_window:  # never a flag that silently does nothing
            raise ValueError(f"{self.model_path}: --hicache-host-tokens keeps prefix-cache pages on the host, but "
                             f"this model attends through a sliding window ({mc.max_window} tokens) in every layer and "
                             "runs without a prefix cache (a page is freed once it leaves the window); drop "
                             "--hicache-host-tokens")
        if mc.vision is not None and cfg.spec.speculative:
            raise ValueError(f"{self.model_path} is a vision-language model; --speculative is not supported with "
                             "them yet (a draft's positions would need the request's M-RoPE offset)")
        self.context_length = cfg.context_length or mc.max_position
        self.device = torch.device(shard.device or cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        extra = {} if shard.tp is None else {"tp": shard.tp}
        # fused MoE, MLA decode, LoRA slot stacks, recurrent decode steps: Triton on CUDA or the triton backend
        # (there the weights stay plain tensors: no oneDNN packing, which the kernels cannot read)
        self.triton = triton_kernels(cfg.resolved_attention_backend, self.device)
        self.model = load_model(self.model_path, mc, cfg.dtype, str(self.device), max(self.context_length, 1) + 1,
                                "torch" if self.triton else cfg.cpu_gemm, quantization=cfg.quantization, **extra)
        self.tp = self.model.tp  # engine.distributed.tp.TPGroup: only its driver (rank 0) has an LM head
        if self.context_length > mc.max_position and not mc.rope_scaling and self.tp.driver:
            log.warning("context length %d exceeds the model's %d", self.context_length, mc.max_position)
        self.backend = create_backend(cfg.resolved_attention_backend)
        if self.triton:
            use_triton(self.model)
        self.pool, self.host_pool = self._pools(shard, getattr(self.model, "local_kv_heads", mc.num_kv_heads))
        self.states = self._state_pool(shard)  # hybrid models' recurrent-state slots; None for attention-only models
        self.scale = mc.head_dim ** -0.5
        self.lora = lora_registry.registry_for(cfg, mc, self.tp, self.dtype, self.device)  # None: LoRA off
        if self.lora is not None and quantized_modules(self.model):
            raise ValueError(f"{self.model_path}: LoRA adapters (--lora-paths, --max-loaded-loras) over a quantized "
                             "checkpoint (its quantization_config) are not supported yet")

    def _pools(self, shard: Shard, kv_heads: int) -> tuple[KVPool, HostKVPool]:
        """The device pool [P, L, 2, ps, kv_heads, D] (MLA: the latent pool [P, L, ps, kv_lora_rank +
        rope_dim], the same on every rank) and the host pool of this rank."""
        mc, cfg = self.model_cfg, self.cfg
        latent = {"latent_dim": mc.mla.latent_dim} if mc.mla is not None else {}
        pool = shard.kv_pool(cfg.num_pages, mc.num_kv_layers, cfg.page_size, kv_heads, mc.head_dim, self.dtype,
                             self.device, kv_cache_dtype=cfg.kv_cache_dtype, **latent)
        host = shard.host_pool(cfg.num_host_pages, tuple(pool.buffer.shape[1:]), pool.buffer.dtype,
                               pin=self.device.type == "cuda")  # FP8 KV: uint8 rows with their scales
        return pool, host

    def _state_pool(self, shard: Shard) -> StatePool | None:
        """One state slot per running request (--max-state-slots, default --max-running-requests), plus
        --state-cache-slots for the prefix cache's state snapshots when it is on, when the model has
        recurrent layers (its `state_spec()`: this rank's conv and recurrent states)."""
        spec_of = getattr(self.model, "state_spec", None)
        if spec_of is None:
            return None
        cfg, what = self.cfg, f"{self.model_path} ({self.model_cfg.model_type}) has recurrent layers"
        refused = [(bool(cfg.hicache_dir), "--hicache-dir (their prefix cache restarts from recurrent-state "
                    "snapshots, kept on the device with their tree nodes: a page found on disk has no node, so no "
                    "state at its end)")]
        for bad, flag in refused:
            if bad:
                raise ValueError(f"{what}; {flag} is not supported with them yet")
        spec: StateSpec = spec_of()
        slots = cfg.state_request_slots
        snaps = 0 if self.model_cfg.max_window else cfg.state_snapshot_slots  # windowed: no prefix cache
        if snaps and cfg.state_snapshot_interval % cfg.page_size:
            raise ValueError(f"{what}; their prefix cache snapshots the state at multiples of "
                             f"--state-snapshot-interval ({cfg.state_snapshot_interval}), which must be a multiple of "
                             f"--page-size ({cfg.page_size}) (or --state-cache-slots 0: no prefix cache for them)")
        verify = cfg.state_verify_slots  # --speculative: the state after each draft position
        if cfg.hicache_host_tokens and not snaps:  # e.g. a PD decode, which keeps no prefix cache for them
            log.warning("%s; --hicache-host-tokens is ignored: it tiers the prefix cache, which a hybrid model has "
                        "only with state snapshots (--state-cache-slots > 0, --prefix-cache, no sliding window)", what)
        pool = shard.state_pool(spec, slots + snaps + verify, self.device)
        log.info("recurrent state: %d slots for requests + %d for prefix-cache snapshots (every %d tokens) + %d for "
                 "speculative verifies, %.2f MB each (%d parts)", slots, snaps, cfg.state_snapshot_interval, verify,
                 pool.slot_bytes / 2**20, len(spec.parts))
        return pool

    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    def collective(self, op: Callable[..., Any], **kwargs: Any) -> Any:
        """Run rank op `op` (engine.distributed.tp_ranks.rank_op) on this runner; a TPRunner runs it on
        every rank of its group. Returns its result."""
        return op(self, **kwargs)

    def close(self) -> None:
        """Nothing to release (a TPRunner stops its ranks here)."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run the batch: logits of the rows it picks (rank 0 only; None elsewhere) and the hidden
        states it captures."""
        dev = self.device
        meta = build_metadata(batch.page_table, batch.seq_lens, batch.new_lens, self.page_size, self.scale, dev)
        ctx = ForwardContext(
            pool=self.pool, backend=self.backend, meta=meta,
            out_page=torch.tensor(batch.out_page, dtype=torch.long, device=dev),  # int64 [T]
            out_offset=torch.tensor(batch.out_offset, dtype=torch.long, device=dev),  # int64 [T]
            native=getattr(self.backend, "native", None),  # the cpu backend's kernels
            lora=None if batch.adapters is None or self.lora is None else self.lora.batch(batch.adapters,
                                                                                          batch.new_lens),
            state=self._state_batch(batch), triton=self.triton,
        )
        ids = torch.tensor(batch.ids, dtype=torch.long, device=dev)  # int64 [T]
        pos = torch.tensor(batch.positions, dtype=torch.long, device=dev)  # int64 [T]
        extra = {} if batch.embeds is None else {"input_embeds": self._input_embeds(ids, batch.embeds)}
        if self.model_cfg.mrope_section:  # M-RoPE: int64 [3, T] (engine.extras.multimodal)
            pos = self._rope3(pos, batch)
            if batch.deepstack is not None:
                extra["deepstack"] = self._deepstack(batch.deepstack)
        hidden = self.model(ids, pos, ctx, **extra)  # [T, H] model dtype, after the final norm
        captured = None if batch.capture is None else self._capture(hidden, batch)
        return ForwardOutput(self._logits(hidden, batch), captured)

    def _state_batch(self, batch: ForwardBatch) -> StateBatch | None:
        if self.states is None:
            return None
        if batch.state_slots is None or min(batch.state_slots) <= 0:
            raise ValueError(f"{self.model_cfg.model_type} has recurrent layers: every segment needs a state slot "
                             f"(Segment.slot), got {batch.state_slots}")
        starts = [s - n for s, n in zip(batch.seq_lens, batch.new_lens)]
        return StateBatch(self.states, torch.tensor(batch.state_slots, dtype=torch.long, device=self.device),
                          batch.new_lens, [s > 0 for s in starts], triton=self.triton,
                          checkpoints=batch.state_checkpoints)

    @torch.inference_mode()
    def _input_embeds(self, ids: torch.Tensor, embeds: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """The input rows [T, H] (model dtype): the ids' embeddings, with the given rows replaced."""
        x = self.model.embed_tokens(ids.clamp(max=self.model_cfg.vocab_size - 1))  # an image's rows hold its pad id
        for row, e in embeds:  # e: float32 [n, H]
            x[row : row + e.shape[0]] = e.to(device=x.device, dtype=self.dtype)
        return x

    def _rope3(self, pos: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """int64 [3, T]: each row's cache position on the three axes, but where a segment gave its own."""
        out = pos.unsqueeze(0).repeat(3, 1)
        for row, p in batch.rope3 or ():
            out[:, row : row + p.shape[1]] = p.to(out.device)
        return out

    def _deepstack(self, pieces: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows int64 [m], features [k, m, H]) of the image rows that get deepstack features."""
        rows = torch.cat([torch.arange(r, r + f.shape[1]) for r, f in pieces]).to(self.device)
        return rows, torch.cat([f for _, f in pieces], dim=1).to(device=self.device, dtype=self.dtype)

    @staticmethod
    def _capture(hidden: torch.Tensor, batch: ForwardBatch) -> list[torch.Tensor | None]:
        """The captured segments' rows of `hidden` [T, H], each fp32 [n, H] on the CPU; None for the others."""
        out: list[torch.Tensor | None] = [None] * len(batch.new_lens)
        for seg, row, n in batch.capture or ():
            out[seg] = hidden[row : row + n].float().cpu()
        return out

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> list[torch.Tensor | None]:
        """One LM head call over the picked rows of `hidden` [T, H] -> per segment fp32 [V], [n, V] or None."""
        if not batch.logit_rows or not self.tp.driver:
            return [None] * len(batch.picks)
        rows = torch.tensor(batch.logit_rows, dtype=torch.long, device=self.device)  # int64 [N]
        logits = self.model.logits(hidden[rows])  # fp32 [N, V]
        return [None if p is None else logits[p] for p in batch.picks]

    def server_info(self) -> dict:
        mc = self.model_cfg
        return {
            "model_path": str(self.model_path),
            "model_type": mc.model_type,
            "num_layers": mc.num_layers,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "vocab_size": mc.vocab_size,
            "hidden_size": mc.hidden_size,
            "context_length": self.context_length,
            "page_size": self.page_size,
            "max_total_tokens": self.pool.total_tokens,
            "host_kv_tokens": self.cfg.num_host_pages * self.page_size,
            "dtype": self.cfg.dtype,
            "quantization": self.cfg.quantization,  # --quantization (none: as the checkpoint ships)
            "device": self.cfg.device,
            "tp": self.tp.size,
            "attention_backend": self.backend.name,
            "kv_bytes_per_token": self.pool.page_bytes // self.page_size,
            "kv_cache_dtype": self.pool.kv_cache_dtype,  # fp8_e4m3, or the model dtype (--kv-cache-dtype auto)
            "state_slots": 0 if self.states is None else self.states.capacity,  # hybrid models' recurrent state
            "state_bytes_per_slot": 0 if self.states is None else self.states.slot_bytes,
            "state_snapshot_slots": 0 if self.states is None else
            self.states.capacity - self.cfg.state_request_slots - self.cfg.state_verify_slots,
            "state_verify_slots": 0 if self.states is None else self.cfg.state_verify_slots,
            **lora_registry.info(self.lora),
        }
