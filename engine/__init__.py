"""The model core (docs/architecture.md).

Importing it before torch turns on torch's huge-page advice for large CPU allocations (weights,
oneDNN's packed copies): engine/hugepages.py says why; an explicit THP_MEM_ALLOC_ENABLE wins, and
PDSERVE_HUGEPAGES=0 turns every huge-page advice of the engine off (start-up time on a box whose memory
is fragmented: engine/hugepages.py).

It also bounds torch's and oneDNN's per-shape caches on the CPU (LRU_CACHE_CAPACITY: torch's cache of
mkldnn computations; ONEDNN_PRIMITIVE_CACHE_CAPACITY: oneDNN's primitives; both 1024 by default). Each
entry belongs to one GEMM shape, i.e. one token count of a forward, and holds megabytes: a prefill that
sees prompts of many lengths kept growing by ~3 MB per new length (measured: 300 lengths, +980 MB of
anonymous memory on the embedded model, flat when bounded), which an hour's soak showed as a worker's
RSS creeping up (issue 53). Bounded (torch's at LRU_CAPACITY, oneDNN's at
PRIMITIVE_CAPACITY entries), a new shape costs its primitive's creation again instead; an explicit setting
in the environment wins. oneDNN's needs room for one forward's working set: engine/models/cpu_gemm.py runs
packed GEMMs at bucketed row counts, and an MoE layer calls its experts at several of them (16 thrashed:
decode batch 16 of an MoE model 2x slower); torch's cache does not affect speed here (measured).
"""

import os

LRU_CAPACITY = "16"
PRIMITIVE_CAPACITY = "64"

if os.environ.get("PDSERVE_HUGEPAGES", "1") != "0":
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
os.environ.setdefault("LRU_CACHE_CAPACITY", LRU_CAPACITY)
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", PRIMITIVE_CAPACITY)
