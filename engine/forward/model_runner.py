"""ModelRunner: owns the model, the device KV pool, the host pool and the attention backend, and
runs one forward over a list of segments (each a request's new tokens).

The caller allocates pages first: a segment's request must own pages covering
`start + len(tokens)` tokens.

Tensor parallelism (`cfg.tp` > 1, engine/distributed/tp_ranks.py): every rank builds a ModelRunner holding its
shard and its KV heads. Rank 0's (the driver's) `forward`, its pool's page copies and its host pool's
offload/reload are broadcast to the other ranks before they run here; only rank 0 gets logits.
`collective(name, **kwargs)` runs any registered rank op on every rank. With tp 1 nothing is sent.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention.base import build_metadata, create_backend
from engine.config import EngineConfig, ModelConfig
from engine.cpus import cpu_budget
from engine.distributed import tp_ranks
from engine.extras import features
from engine.extras.lora import runner as lora_runner
from engine.kvcache.memory import HostKVPool, KVPool
from engine.models.embedded import resolve_model_path
from engine.models.llama import ForwardContext
from engine.models.loader import DTYPES, load_model

log = logging.getLogger(__name__)

LOGITS_NONE, LOGITS_LAST, LOGITS_ALL = 0, 1, 2


@dataclass
class Segment:
    pages: list[int]  # the request's pages (covering start + len(tokens))
    start: int  # cache position of the first new token
    tokens: list[int]  # new tokens
    logits: int = LOGITS_LAST
    skip: int = 0  # LOGITS_ALL: the first `skip` rows get no logits
    lora: str = ""  # LoRA adapter the segment runs under ("" = the base model; engine/extras/lora)
    embeds: Any = None  # float32 [n, H]: input embeddings instead of the tokens' (engine.extras.features)
    hidden: bool = False  # keep this segment's final hidden states in `hidden_out` (fp32 [n, H], CPU)
    hidden_out: Any = None


class ModelRunner:
    """One rank's model, KV pools and attention backend (the whole engine's with tp 1)."""

    def __init__(self, cfg: EngineConfig, rank: int = 0) -> None:
        self.cfg = cfg
        if cfg.tp > 1 and cfg.device == "cpu":
            torch.set_num_threads(tp_ranks.rank_threads(cfg))
        elif cfg.device == "cpu" or cfg.threads > 0:
            torch.set_num_threads(cfg.threads or cpu_budget())
        self.model_path: Path = resolve_model_path(cfg.model)
        self.model_cfg = ModelConfig.from_dir(self.model_path)
        mc = self.model_cfg
        if cfg.tp > 1:
            tp_ranks.check_model(mc, cfg.tp)
        self.context_length = cfg.context_length or mc.max_position
        if self.context_length > mc.max_position and not mc.rope_scaling and rank == 0:
            log.warning("context length %d exceeds the model's %d", self.context_length, mc.max_position)
        self.tp, self.ctrl = tp_ranks.join(cfg, rank)
        # rank 0 of a group sends every op to the others first; None: nothing to send
        self.driver = tp_ranks.Driver(self.ctrl) if self.ctrl is not None and self.tp.driver else None
        if self.driver is not None:
            atexit.register(self.close)
        self.device = torch.device(tp_ranks.rank_device(cfg, rank))
        self.dtype = DTYPES[cfg.dtype]
        self.model = load_model(self.model_path, mc, cfg.dtype, str(self.device), max(self.context_length, 1) + 1,
                                cfg.cpu_gemm, tp=self.tp)
        self.backend = create_backend(cfg.resolved_attention_backend)
        self.pool, self.host_pool = self._pools(getattr(self.model, "local_kv_heads", mc.num_kv_heads))
        self.scale = mc.head_dim ** -0.5
        self.lora = lora_runner.registry_for(self)  # LoRARegistry, or None when LoRA is off

    def _pools(self, kv_heads: int) -> tuple[KVPool, HostKVPool]:
        """The device pool [P, L, 2, ps, kv_heads, D] (MLA: the latent pool [P, L, ps, kv_lora_rank +
        rope_dim], the same on every rank) and the host pool of this rank (rank 0's of a group send their
        page moves to the other ranks)."""
        mc, cfg = self.model_cfg, self.cfg
        shape = (cfg.num_pages, mc.num_layers, cfg.page_size, kv_heads, mc.head_dim, self.dtype, self.device)
        latent = {"latent_dim": mc.mla.latent_dim} if mc.mla is not None else {}
        pin = self.device.type == "cuda"
        if self.driver is None:
            pool = KVPool(*shape, **latent)
            return pool, HostKVPool(cfg.num_host_pages, tuple(pool.buffer.shape[1:]), self.dtype, pin=pin)
        pool = tp_ranks.DrivenKVPool(self.driver, *shape, **latent)
        return pool, tp_ranks.DrivenHostKVPool(self.driver, cfg.num_host_pages, tuple(pool.buffer.shape[1:]),
                                               self.dtype, pin=pin)

    def collective(self, name: str, **kwargs: Any) -> Any:
        """Run rank op `name` (engine.distributed.tp_ranks.rank_op) on every rank of the group (rank 0 sends it,
        then runs it too); returns rank 0's result. Without TP it only runs here. tp_ranks.RankLost if
        a rank is gone."""
        if self.driver is not None:
            self.driver.send(name, kwargs)
        return tp_ranks.OPS[name](self, **kwargs)

    def close(self) -> None:
        """Rank 0 of a group: stop the other ranks' loops and leave the group (idempotent; a no-op
        without TP). Called at exit too."""
        if self.driver is not None:
            self.driver.close()
            tp_ranks.leave()

    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    def forward(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """Run the segments as one batch (on every rank of a TP group). Returns per segment: fp32
        logits [V] (LOGITS_LAST), [n - skip, V] (LOGITS_ALL: rows of tokens skip..n-1) or None."""
        if self.driver is not None:
            return self.collective("forward", segments=segments)
        return self.run_forward(segments)

    def run_forward(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """`forward` on this rank alone (the rank op); ranks other than 0 return no logits."""
        lora = None
        if self.lora is not None and any(s.lora for s in segments):
            split = lora_runner.forward_split(self, segments)  # more adapters than --max-loras-per-batch
            if split is not None:
                return split
            lora = self.lora.batch([s.lora for s in segments], [len(s.tokens) for s in segments])
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        out_page: list[int] = []
        out_off: list[int] = []
        for s in segments:
            n = len(s.tokens)
            ids.extend(s.tokens)
            rng = range(s.start, s.start + n)
            pos.extend(rng)
            out_page.extend(s.pages[p // ps] for p in rng)
            out_off.extend(p % ps for p in rng)
        dev = self.device
        meta = build_metadata(
            [s.pages for s in segments], [s.start + len(s.tokens) for s in segments],
            [len(s.tokens) for s in segments], ps, self.scale, dev,
        )
        ctx = ForwardContext(
            pool=self.pool, backend=self.backend, meta=meta,
            out_page=torch.tensor(out_page, dtype=torch.long, device=dev),
            out_offset=torch.tensor(out_off, dtype=torch.long, device=dev),
            native=getattr(self.backend, "native", None),  # the cpu backend's kernels
            lora=lora,
        )
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        x = features.batch_embeds(segments, self.model.embed_tokens, ids_t, self.dtype)
        extra = {} if x is None else {"input_embeds": x}  # only then: families without it run as before
        hidden = self.model(ids_t, torch.tensor(pos, dtype=torch.long, device=dev), ctx, **extra)
        features.capture_hidden(segments, hidden)
        # gather the rows that need logits, one lm_head call for all of them
        rows: list[int] = []
        spans: list[tuple[int, int] | None] = []
        off = 0
        for s in segments:
            n = len(s.tokens)
            if s.logits == LOGITS_LAST:
                spans.append((len(rows), 1))
                rows.append(off + n - 1)
            elif s.logits == LOGITS_ALL:
                spans.append((len(rows), n - s.skip))
                rows.extend(range(off + s.skip, off + n))
            else:
                spans.append(None)
            off += n
        if not rows or not self.tp.driver:
            return [None] * len(segments)
        logits = self.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])
        out: list[torch.Tensor | None] = []
        for s, span in zip(segments, spans):
            if span is None:
                out.append(None)
            elif s.logits == LOGITS_LAST:
                out.append(logits[span[0]])
            else:
                out.append(logits[span[0] : span[0] + span[1]])
        return out

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
            "device": self.cfg.device,
            "tp": self.tp.size,
            "attention_backend": self.backend.name,
            "kv_bytes_per_token": self.pool.page_bytes // self.page_size,
            **lora_runner.info(self),
        }
