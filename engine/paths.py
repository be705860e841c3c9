"""Where pdserve keeps files between runs: the converted embedded model (engine/models/embedded.py)
and the compiled native kernels (engine/native/build.py), under one cache root."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$PDSERVE_CACHE, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve."""
    base = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve"
    )
    return Path(base)
