"""Triton kernel tests: on a machine without CUDA the kernels run under Triton's interpreter.

Triton picks interpreter or compiler when a `@triton.jit` function is decorated (and reads the
variable again while launching), so it is set while the kernel module is imported and, through an
autouse fixture, during each test of this folder only: other tests (and their subprocesses) never
see TRITON_INTERPRET. On CUDA the real compiled kernels are tested.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"

if not ON_CUDA:
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for _mod in ("engine.attention.triton_kernels", "engine.attention.mla_triton",
                     "engine.extras.lora.triton_sgmv"):
            importlib.import_module(_mod)
    finally:
        if _prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _prev


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_CUDA else "cpu")
