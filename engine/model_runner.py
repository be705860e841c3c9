"""ModelRunner: owns the model, the device KV pool, the host pool and the attention backend, and
runs one forward over a list of segments (each a request's new tokens).

The caller allocates pages first: a segment's request must own pages covering
`start + len(tokens)` tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import build_metadata, create_backend
from engine.config import EngineConfig, ModelConfig
from engine.cpus import cpu_budget
from engine.memory import HostKVPool, KVPool
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


class ModelRunner:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.device == "cpu" or cfg.threads > 0:
            torch.set_num_threads(cfg.threads or cpu_budget())
        self.model_path: Path = resolve_model_path(cfg.model)
        self.model_cfg = ModelConfig.from_dir(self.model_path)
        mc = self.model_cfg
        self.context_length = cfg.context_length or mc.max_position
        if self.context_length > mc.max_position and not mc.rope_scaling:
            log.warning("context length %d exceeds the model's %d", self.context_length, mc.max_position)
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.model = load_model(self.model_path, mc, cfg.dtype, cfg.device, max(self.context_length, 1) + 1,
                                cfg.cpu_gemm)
        self.backend = create_backend(cfg.resolved_attention_backend)
        self.pool = KVPool(cfg.num_pages, mc.num_layers, cfg.page_size, mc.num_kv_heads, mc.head_dim,
                           self.dtype, self.device)
        self.host_pool = HostKVPool(cfg.num_host_pages, tuple(self.pool.buffer.shape[1:]), self.dtype,
                                    pin=self.device.type == "cuda")
        self.scale = mc.head_dim ** -0.5

    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    def forward(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """Run the segments as one batch. Returns per segment: fp32 logits [V] (LOGITS_LAST),
        [n - skip, V] (LOGITS_ALL: rows of tokens skip..n-1) or None."""
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
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(pos, dtype=torch.long, device=dev), ctx)
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
        if not rows:
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
            "context_length": self.context_length,
            "page_size": self.page_size,
            "max_total_tokens": self.pool.total_tokens,
            "host_kv_tokens": self.cfg.num_host_pages * self.page_size,
            "dtype": self.cfg.dtype,
            "device": self.cfg.device,
            "attention_backend": self.backend.name,
            "kv_bytes_per_token": self.pool.page_bytes // self.page_size,
        }
