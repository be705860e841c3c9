"""CPU attention backend (float32): decode through the native kernel (engine/native/kernels.c),
which reads each request's K/V pages where they lie in the pool, with no gather, no padded batch
and no mask; an extend (a prompt, a chunk) through the torch reference's blocked SDPA."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_ref import TorchAttention
from engine.native import NativeKernels


class CpuAttention:
    name = "cpu"

    def __init__(self, native: NativeKernels) -> None:
        self.native = native  # the model's rotary + KV store runs through it too (engine/models/llama.py)
        self._extend = TorchAttention()

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: AttentionMetadata,
        window: int = 0,
    ) -> torch.Tensor:
        if meta.max_q_len == 1:
            return self.native.decode_attention(q, k_pages, v_pages, meta.page_table, meta.seq_lens, window,
                                                meta.scale)
        return self._extend.forward(q, k_pages, v_pages, meta, window)
