#!/usr/bin/env bash
# GPU check for a lent CUDA machine (one GPU or more): install what is missing, run the GPU's code paths,
# print figures and ONE summary table. Every step ends PASS, FAIL, SKIP (with its reason) or MISSING and the
# script goes on to the next; the whole run stays under GPU_CHECK_BUDGET_S (default 450 s, hard cap 470 s:
# under 8 minutes) including installs, and exits 1 if a step did not pass or skip. Logs and the summary go to
# $OUT (set by the device runner) or bench_out/gpu_check.
#
#   bash benchmarks/gpu_check.sh            run every step (a CUDA machine)
#   bash benchmarks/gpu_check.sh --list     the steps, and a check that every file and test they name exists
#                                           (no python, no GPU: tests/unit/test_gpu_check.py runs it)
#   bash benchmarks/gpu_check.sh --dry-run  --list, then pytest collects every named test and every benchmark
#                                           answers --help (no GPU)
#
# The steps (STEPS below is the one list; --list prints it):
#   env, install; kernels (every Triton kernel compiled: attention, MLA decode, LoRA SGMV, fused MoE, the
#   recurrent decode steps, each against its torch form); families (every family kind, whole models on the
#   Triton backend on CUDA against the torch reference on the CPU); engine_oracle (paged KV + Triton vs HF
#   transformers, fp32 and bf16); pd_gpu (prefill and decode as two processes on one GPU through the router);
#   host_tier (the host tier's copy streams); tp_nccl (TP 2 over NCCL; SKIP on one GPU); figures:
#   mla_decode, attention_kernels, engine_throughput.
set -euo pipefail

MODE=run
case "${1:-}" in
  "") ;;
  --list) MODE=list ;;
  --dry-run) MODE=dry ;;
  -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--list | --dry-run]" >&2; exit 2 ;;
esac

if [[ "$MODE" == run && -z "${GPU_CHECK_INNER:-}" ]]; then
  # hard cap a little above the step budget so the summary is still printed in the normal case
  exec timeout -k 5 "$(( ${GPU_CHECK_BUDGET_S:-450} + 20 ))" env GPU_CHECK_INNER=1 bash "$0" "$@"
fi

cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python}
PYTEST="$PY -m pytest -q -p no:cacheprovider"
TRITON_TESTS="tests/engine/test_recurrent_kernels.py::test_triton_conv1d_step \
tests/engine/test_recurrent_kernels.py::test_triton_gdn_step tests/engine/test_recurrent_kernels.py::test_triton_ssd_step \
tests/engine/test_moe.py::test_triton_fused_moe_matches_cpu_path"

# name | limit s | what it covers | command (from the repo root; tests by file or node id, benchmarks by path)
STEPS=(
  "env|20|the GPU, torch, triton, ucxx|env_info"
  "install|120|pip install -e .[test,gpu] unless every import is there|install"
  # the sm_90 ahead-of-time compile tests (*for_h100*) stand in for a GPU on CPU-only boxes: here the kernels
  # are compiled and run for real, so skip their ~20 s of extra compiles
  "kernels|120|every Triton kernel compiled on CUDA vs its torch form|$PYTEST -k 'not for_h100' tests/unit/triton $TRITON_TESTS"
  "families|120|each family kind, whole model, triton on CUDA vs torch on CPU|$PYTEST tests/engine/test_triton_models.py"
  "engine_oracle|120|paged KV + Triton attention vs HF transformers, fp32 and bf16|$PY benchmarks/gpu_oracle.py --device cuda"
  "pd_gpu|120|prefill + decode processes on one GPU vs colocated|$PYTEST tests/integration/test_pd_gpu.py"
  "host_tier|60|host tier copy streams; greedy equal tier on/off|$PYTEST tests/engine/test_gpu_paths.py::test_host_tier_copy_streams_roundtrip tests/engine/test_gpu_paths.py::test_host_tier_on_cuda_keeps_greedy_outputs"
  "tp_nccl|90|TP 2 over NCCL vs TP 1 (needs 2 GPUs)|needs_gpus 2 $PYTEST tests/engine/test_gpu_paths.py::test_tp2_over_nccl_matches_tp1"
  "mla_decode|45|MLA decode kernel timings, DeepSeek-V3 widths|$PY benchmarks/mla_decode.py --dtype bfloat16 --out \$LOGDIR/mla_decode.json"
  "attention_kernels|60|extend/decode kernel timings vs SDPA|$PY benchmarks/attention_kernels.py --dtype bfloat16 --out \$LOGDIR/attention_kernels.json"
  "engine_throughput|60|prefill tok/s, decode tok/s by batch|$PY benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --batches 1,64 --out \$LOGDIR/engine_throughput.json"
)

field() { local IFS='|'; read -r -a _f <<< "$1"; echo "${_f[$2]}"; }

# ---- --list / --dry-run: what each step names must exist ----------------------------------------------
check_refs() {  # check_refs CMD: every tests/... or benchmarks/... path exists; every ::test_name is defined
  local word path test bad=0
  for word in $1; do
    [[ "$word" == tests/* || "$word" == benchmarks/* ]] || continue
    path=${word%%::*}
    if [[ ! -e "$path" ]]; then
      echo "MISSING $path"; bad=1; continue
    fi
    if [[ "$word" == *::* ]]; then
      test=${word##*::}
      grep -qE "^(async )?def ${test}\(" "$path" || { echo "MISSING $word (no def ${test})"; bad=1; }
    fi
  done
  return $bad
}

list_steps() {
  local s name cmd status bad=0
  printf '%-18s %-6s %-7s %s\n' step limit refs covers
  for s in "${STEPS[@]}"; do
    name=$(field "$s" 0); cmd=$(field "$s" 3)
    if out=$(check_refs "$cmd"); then status=ok; else status=MISSING; bad=1; fi
    printf '%-18s %-6s %-7s %s\n' "$name" "$(field "$s" 1)s" "$status" "$(field "$s" 2)"
    printf '    $ %s\n' "$cmd"
    [[ -z "$out" ]] || sed 's/^/    /' <<< "$out"
  done
  return $bad
}

dry_run() {  # pytest collects every test the steps name; every benchmark answers --help
  local s cmd word targets=() scripts=() bad=0
  for s in "${STEPS[@]}"; do
    cmd=$(field "$s" 3)
    for word in $cmd; do
      [[ "$word" == tests/* ]] && targets+=("$word")
      [[ "$word" == benchmarks/*.py ]] && scripts+=("$word")
    done
  done
  echo "---- pytest --collect-only: ${#targets[@]} targets ----"
  local collected
  collected=$("$PY" -m pytest -q -p no:cacheprovider --collect-only "${targets[@]}" 2>&1) || {
    echo "$collected" | tail -n 20; return 1; }
  for word in "${targets[@]}"; do
    if ! grep -qF -- "$word" <<< "$collected"; then echo "NOT COLLECTED $word"; bad=1; fi
  done
  echo "$(grep -c '::' <<< "$collected") tests collected"
  for word in "${scripts[@]}"; do
    if "$PY" "$word" --help > /dev/null 2>&1; then echo "ok      $word --help"; else echo "FAILED  $word --help"; bad=1; fi
  done
  return $bad
}

if [[ "$MODE" != run ]]; then
  rc=0
  list_steps || rc=1
  if [[ "$MODE" == dry ]]; then dry_run || rc=1; fi
  exit $rc
fi

# ---- a real run ---------------------------------------------------------------------------------------
BUDGET=${GPU_CHECK_BUDGET_S:-450}
START=$(date +%s)
LOGDIR=${OUT:-$ROOT/bench_out/gpu_check}
mkdir -p "$LOGDIR"
export ROOT LOGDIR PY
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # works even when the install step cannot
export UCX_WARN_UNUSED_ENV_VARS=n
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels on the GPU, never the interpreter
SUMMARY=()
FAILED=0

remaining() { echo $(( BUDGET - ($(date +%s) - START) )); }

record() {  # record STATUS NAME SECONDS DETAIL
  SUMMARY+=("$(printf '%-18s %-8s %6s  %s' "$2" "$1" "$3" "$4")")
  echo "=== [$2] $1 $4"
  [[ "$1" == PASS || "$1" == SKIP ]] || FAILED=1
}

step() {  # step NAME MAX_SECONDS COVERS CMD: run with a time limit, log to $LOGDIR/NAME.log
  local name=$1 max=$2 covers=$3 cmd=$4 left lim t0 rc
  left=$(remaining)
  if (( left < 15 )); then
    record FAIL "$name" - "not run: time budget spent"
    return 0
  fi
  if ! out=$(check_refs "$cmd"); then
    record MISSING "$name" - "$(tr '\n' ';' <<< "$out")"
    return 0
  fi
  lim=$(( max < left ? max : left ))
  echo "=== [$name] limit ${lim}s: $cmd"
  t0=$(date +%s)
  set +e
  # bash -c so a step may be a shell function (exported below) as well as a command
  timeout -k 5 "$lim" bash -c "$cmd" 2>&1 | tee "$LOGDIR/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  local took=$(( $(date +%s) - t0 ))
  if (( rc == 0 )); then
    record PASS "$name" "$took" "$covers"
  elif (( rc == 75 )); then  # needs_gpus: not enough devices
    record SKIP "$name" "$took" "$(tail -n 1 "$LOGDIR/$name.log")"
  elif (( rc == 124 || rc == 137 )); then
    record FAIL "$name" "$took" "timed out (log: $LOGDIR/$name.log)"
  else
    record FAIL "$name" "$took" "rc=$rc (log: $LOGDIR/$name.log)"
  fi
}

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" - <<'EOF'
import importlib
import torch
print("python torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
for m in ("triton", "transformers", "ucxx", "pytest"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except ImportError as e:
        print(m, "MISSING:", e)
assert torch.cuda.is_available(), "CUDA is not available to torch"
EOF
}

needs_gpus() {  # needs_gpus N CMD...: run CMD when N CUDA devices exist, else exit 75 (the step is a SKIP)
  local want=$1 have
  shift
  have=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if (( have < want )); then
    echo "skipped: needs $want GPUs, this machine has $have"
    exit 75
  fi
  "$@"
}

need_imports() {  # exit 0 when everything the GPU subset imports is already there
  "$PY" -c "import torch, triton, pytest, pytest_asyncio, pytest_timeout, numpy, safetensors, \
tokenizers, transformers, gguf, zmq, msgpack, fastapi, uvicorn, httpx, yaml, ucxx" 2>/dev/null
}

install() {
  if need_imports; then
    echo "all imports present: skipping pip (no torch reinstall)"
  else
    # keep the preinstalled torch: pin it so pip never swaps it; fail fast when offline
    local tv
    tv=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
    local pin=()
    if [[ -n "$tv" ]]; then
      echo "torch==$tv" > "$LOGDIR/constraints.txt"
      pin=(-c "$LOGDIR/constraints.txt")
    fi
    "$PY" -m pip install --retries 1 --timeout 15 "${pin[@]}" -e ".[test,gpu]" \
      || echo "pip install with dependencies failed (offline?); trying the project alone"
  fi
  # console script `pdserve` for tests that launch services; no network needed
  if ! command -v pdserve >/dev/null; then
    "$PY" -m pip install --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
      || echo "editable install failed: using PYTHONPATH=$ROOT"
  fi
  need_imports || { "$PY" -c "import ucxx, transformers, triton" ; return 1; }
}

figures() {  # pull the headline numbers out of the logs
  echo "---- figures ----"
  grep -hE "max abs logit diff" "$LOGDIR/families.log" 2>/dev/null || true
  if [[ -f "$LOGDIR/attention_kernels.json" ]]; then
    "$PY" - "$LOGDIR/attention_kernels.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
if r.get("status") != "ok":
    print("attention kernels:", r)
for c in r.get("cases", []):
    sdpa = c.get("sdpa_ms") or c.get("sdpa_ms_no_prefix")
    ref = c.get("torch_ref_ms")
    print(f"attention {c['model']:8s} {c['kind']:6s} batch={c['batch']:3d} triton={c['triton_ms']:.3f} ms "
          f"sdpa={sdpa:.3f} ms (x{c['triton_ms'] / sdpa:.2f})"
          + (f" torch_ref={ref:.3f} ms" if ref else "")
          + (f" kv={c['triton_kv_gbps']:.0f} GB/s" if "triton_kv_gbps" in c else "")
          + f" err={c['max_abs_err_vs_ref']:.2e}")
EOF
  fi
  if [[ -f "$LOGDIR/mla_decode.json" ]]; then
    "$PY" - "$LOGDIR/mla_decode.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
if r.get("status") != "ok":
    print("mla decode:", {k: v for k, v in r.items() if k != "cases"})
for c in r.get("cases", []):
    print(f"mla_decode heads={c['heads']:3d} batch={c['batch']:3d} seq={c['seq_len']} "
          f"triton={c['triton_ms']:.3f} ms torch={c['torch_ms']:.3f} ms (x{c['torch_ms'] / c['triton_ms']:.1f}) "
          f"latent={c['latent_gbps']:.0f} GB/s err={c['max_abs_err_vs_ref']:.2e}")
EOF
  fi
  if [[ -f "$LOGDIR/engine_throughput.log" ]]; then
    grep -iE "tok/s|tok_s|tokens_per_s|throughput" "$LOGDIR/engine_throughput.log" | tail -n 20 || true
  fi
}

export -f env_info need_imports install needs_gpus
export PYTEST
for s in "${STEPS[@]}"; do
  step "$(field "$s" 0)" "$(field "$s" 1)" "$(field "$s" 2)" "$(field "$s" 3)"
done

figures 2>&1 | tee "$LOGDIR/figures.txt"
echo "---- summary ($(( $(date +%s) - START ))s of ${BUDGET}s) ----"
{
  printf '%-18s %-8s %6s  %s\n' step status seconds detail
  printf '%s\n' "${SUMMARY[@]}"
} | tee "$LOGDIR/summary.txt"
exit "$FAILED"
