"""Transparent huge pages (2 MiB) for the engine's large CPU tensors.

Why: decode attention reads each request's K/V from pages spread over the whole pool, and the GEMMs
stream every weight once per step; with 4 KiB pages both miss the TLB on nearly every page they
touch. Where the kernel's THP mode is `madvise` (Debian's and most distributions' default), memory
gets huge pages only when asked. Two ways in: `zeros` allocates a tensor and advises its memory
before the first touch (the KV pool), and torch's own allocator advises every allocation of 2 MiB
or more when THP_MEM_ALLOC_ENABLE=1 is in the environment before torch is imported (weights,
oneDNN's packed copies, large activations): `engine/__init__.py` sets it when it can.
Measured: docs/benchmarks.md (engine speed).

The cost is at start-up: where THP's defrag mode is `madvise` (the default), every huge page faulted
in an advised region is made by compacting memory on the spot, and on a box whose memory is
fragmented that is slow. Measured on this 2-core box after a day of use: the embedded model's worker
took 11.8 s to build its runner (10.8 s of it kernel time) against 2.9 s without the advice. So
PDSERVE_HUGEPAGES=0 in the environment turns it off (the pool is then a plain torch.zeros, whose
pages are faulted in as requests first write them): for start-up-bound uses, like the test suite,
which starts dozens of services (tests/conftest.py sets it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise():  # noqa: ANN202
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()
ENABLED = os.environ.get("PDSERVE_HUGEPAGES", "1") != "0"  # PDSERVE_HUGEPAGES=0: no advice (module docstring)


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages over the 2 MiB-aligned part of t's memory (before it is touched, for the
    pages to be huge from the start). False where that is not possible; never raises."""
    if _MADVISE is None or t.device.type != "cpu":
        return False
    addr, size = t.data_ptr(), t.numel() * t.element_size()
    start = (addr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    length = (addr + size - start) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return False
    if _MADVISE(start, length, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU its memory is advised for huge pages before the zero fill touches it
    (unless PDSERVE_HUGEPAGES=0)."""
    if not ENABLED or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    advise(t)
    return t.zero_()
