"""Native float32 CPU kernels (kernels.c), compiled once per machine at first use (build.py) and
called through ctypes on the tensors' memory: a fused rotary + KV-pool store, and decode attention
over the paged pool in place. `NativeKernels.get()` returns None, with one log line, where no C
compiler is present or the build fails; the engine then runs its torch path.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from engine.native.build import BuildError, load

log = logging.getLogger(__name__)

_i32, _i64, _f32, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class NativeKernels:
    _lock = threading.Lock()
    _loaded: NativeKernels | None = None
    _failed: str | None = None

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rope_store = lib.rope_store
        self._rope_store.restype = _i32
        self._rope_store.argtypes = [_ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                                     _i64, _i64, _i32, _ptr, _ptr, _i32]
        self._decode = lib.decode_attention
        self._decode.restype = _i32
        self._decode.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i32, _i32, _i32,
                                 _i32, _i32, _i32, _f32, _i32]

    @classmethod
    def get(cls) -> NativeKernels | None:
        """The process's kernels, built and loaded on the first call; None if that failed."""
        with cls._lock:
            if cls._loaded is None and cls._failed is None:
                try:
                    cls._loaded = cls(load())
                except BuildError as e:
                    cls._failed = str(e)
                    log.warning("native CPU kernels unavailable, attention runs in torch: %s", e)
            return cls._loaded

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pages: torch.Tensor,
                   v_pages: torch.Tensor, page_idx: torch.Tensor, offset: torch.Tensor, hq: int, hkv: int,
                   d: int) -> torch.Tensor:
        """qkv [T, (hq + 2 hkv) d] -> rotated q [T, hq, d]; rotated k and v stored at (page_idx[t],
        offset[t]) of the layer's pool views k_pages, v_pages [P, ps, hkv, d]. cos, sin [T, d/2]."""
        t = qkv.shape[0]
        check(qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous(), "rope_store: layout")
        check_pages(k_pages, v_pages)
        check(page_idx.dtype == torch.int64 and offset.dtype == torch.int64, "rope_store: int64 indices")
        q = torch.empty((t, hq, d), dtype=torch.float32)
        rc = self._rope_store(qkv.data_ptr(), qkv.stride(0), t, hq, hkv, d, cos.data_ptr(), sin.data_ptr(),
                              q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), k_pages.stride(0),
                              k_pages.stride(1), k_pages.shape[0], k_pages.shape[1], page_idx.data_ptr(),
                              offset.data_ptr(), torch.get_num_threads())
        check(rc == 0, "rope_store: a slot outside the pool")
        return q

    def decode_attention(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, window: int,
                         scale: float) -> torch.Tensor:
        """q [B, Hq, D] (one query per request, at position seq_lens[b] - 1) -> [B, Hq, D]."""
        b, hq, d = q.shape
        q = q.contiguous()
        check_pages(k_pages, v_pages)
        check(page_table.dtype == torch.int32 and page_table.is_contiguous() and seq_lens.dtype == torch.int32
              and seq_lens.is_contiguous(), "decode_attention: int32 page table and lengths")
        out = torch.empty_like(q)
        rc = self._decode(q.data_ptr(), out.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), k_pages.stride(0),
                          k_pages.stride(1), k_pages.shape[0], page_table.data_ptr(), page_table.shape[1],
                          seq_lens.data_ptr(), b, hq, k_pages.shape[2], d, k_pages.shape[1], window, scale,
                          torch.get_num_threads())
        check(rc != -1, f"decode_attention: unsupported heads ({hq} query, {k_pages.shape[2]} KV, dim {d})")
        check(rc == 0, "decode_attention: a length or page outside the page table or the pool")
        return out


def check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def check_pages(k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    """K/V views [P, ps, Hkv, D] of one float32 CPU pool layer: heads and dims dense, same strides."""
    hkv, d = k_pages.shape[2], k_pages.shape[3]
    check(k_pages.dtype == torch.float32 and k_pages.device.type == "cpu", "native kernels: float32 CPU pool")
    check(k_pages.stride()[2:] == (d, 1) and k_pages.stride(1) == hkv * d and k_pages.stride() == v_pages.stride()
          and k_pages.shape == v_pages.shape, "native kernels: pool layout")
