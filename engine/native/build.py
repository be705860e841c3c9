"""Build engine/native/kernels.c (or another C source: engine/models/quant_cpu.c) once per machine and
load it (ctypes).

The shared object is cached under `<cache root>/kernels/<key>.so`, the key a hash of the source, the
flags, the compiler's version and this CPU's flags (`-march=native` code is only reused on a CPU
that has the same instructions). A build writes a temporary file and renames it into place, so
services starting side by side never load a half-written file. Building takes about a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from engine.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")


class BuildError(RuntimeError):
    pass


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler (cc or gcc) on PATH")
    return cc


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def cache_key(cc: str, source: Path = SOURCE) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} --version failed: {e}") from e
    h = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()):
        h.update(part)
    return h.hexdigest()[:16]


def build(cache_dir: Path | None = None, source: Path = SOURCE) -> Path:
    """Path of `source` built as a shared object, compiling it first when the cache lacks it."""
    cc = compiler()
    out_dir = cache_dir or cache_root() / "kernels"
    target = out_dir / f"{source.stem}-{cache_key(cc, source)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([cc, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise BuildError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} could not run: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built native CPU kernels (%s) in %.1f s: %s", source.name, time.monotonic() - t0, target)
    return target


def load(cache_dir: Path | None = None, source: Path = SOURCE) -> ctypes.CDLL:
    """Build `source` (engine/native/kernels.c by default) if needed and load it; raises BuildError when
    either fails."""
    path = build(cache_dir, source)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"loading {path} failed: {e}") from e
