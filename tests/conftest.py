"""Settings for the whole suite, made before anything imports torch."""

from __future__ import annotations

import os
import sys
import warnings

# GNU OpenMP (torch's CPU thread pool) spins 300000 rounds at every barrier before it sleeps. When the
# cores are busy with anything else (the services a test starts, another job on the box) a thread spins
# out its time slice waiting for a partner that is not running: a 2-thread forward of the embedded model
# took 5-15 times as long as with 1 thread on a loaded 2-core box. 10000 rounds cost nothing on an idle
# box (the partner arrives within microseconds) and bound the waste on a busy one. The environment wins;
# child processes (the services) inherit it.
if "torch" in sys.modules:  # too late: libgomp read its settings when torch loaded it
    warnings.warn("torch was imported before tests/conftest.py: GOMP_SPINCOUNT not applied", stacklevel=1)
else:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# No huge-page advice (engine/hugepages.py): with THP's default defrag mode every advised 2 MiB page is made by
# compacting memory when first touched, which on a box with fragmented memory cost building the embedded model's
# runner up to ~8 s of kernel time (the suite starts dozens of services). Huge pages are a speed hint, not a behaviour:
# tests/unit/test_hugepages.py turns them back on for its own checks. Child processes inherit it.
os.environ.setdefault("PDSERVE_HUGEPAGES", "0")
