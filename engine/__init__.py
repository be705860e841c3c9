"""The model core (docs/architecture.md).

Importing it before torch turns on torch's huge-page advice for large CPU allocations (weights,
oneDNN's packed copies): engine/hugepages.py says why; an explicit THP_MEM_ALLOC_ENABLE wins.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
