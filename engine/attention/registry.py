"""Attention backends by name: "cpu" (native decode kernel), "torch" (reference) or "triton" (GPU).

The contract every backend keeps is in engine/attention/base.py; this module only picks one, so the
contract never imports its implementations. Triton is the optional `gpu` extra: its backend is
imported when asked for, so the package imports on a CPU without it.
"""

from __future__ import annotations

from engine.attention.base import AttentionBackend
from engine.attention.cpu_native import CpuAttention
from engine.attention.torch_ref import TorchAttention
from engine.native import NativeKernels


def create_backend(name: str) -> AttentionBackend:
    """The backend called `name`. "cpu" falls back to "torch" (with a log line from engine/native)
    where the native kernels cannot be built."""
    if name == "cpu":
        native = NativeKernels.get()
        if native is not None:
            return CpuAttention(native)
        name = "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttention  # triton: the optional gpu extra

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (cpu, torch or triton)")
