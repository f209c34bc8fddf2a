#!/usr/bin/env bash
# One full GPU verification run on the lent H200: install, GPU tests, conformance kit, benchmarks.
# Usage (on the device, from the checkout root): bash scripts/gpu_run.sh [stage ...]
#   stages: info install tests kit bench e2e   (default: all of them)
# Logs and JSON results go to $OUT (or ./gpu-out when OUT is unset).
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
stages=${*:-info install tests kit bench e2e}
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export FLASHINFER_WORKSPACE_BASE=$PWD/.jit TRITON_CACHE_DIR=$PWD/.jit/triton
. ./scripts/device_setup.sh
log() { echo "=== $* ($(date +%T))" | tee -a "$OUT/summary.log"; }
run() {  # run NAME TIMEOUT CMD...: log to $OUT/NAME.log, tail the pass line into summary
  local name=$1 limit=$2; shift 2
  log "$name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  tail -n 3 "$OUT/$name.log" | sed "s/^/  [$name rc=$rc] /" | tee -a "$OUT/summary.log"
}
for stage in $stages; do case $stage in
info)
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv | tee -a "$OUT/summary.log"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.log" ;;
install)
  editables=(-e .)
  for p in attn_plugins/*/; do [ -f "$p/pyproject.toml" ] && editables+=(-e "$p"); done
  run install 300 python3 -m pip install -q --no-deps --no-build-isolation "${editables[@]}"
  run list 60 attn list ;;
tests)
  run gpu_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests attn_plugins ;;
kit)
  for b in flashinfer:flashinfer triton_ssm:triton_ssm fa3:fa3 varlen:varlen; do
    run "kit_${b%%:*}" 240 python3 -m pytest -q -p no:cacheprovider --attn-backend="$b"
  done ;;
bench)
  run bench_flashinfer 300 python3 attn_plugins/flashinfer/bench/bench_flashinfer.py --out "$OUT/bench_flashinfer.json"
  run bench_ssm 300 python3 attn_plugins/triton_ssm/bench/bench_ssm.py --out "$OUT/bench_ssm.json"
  run bench_runtime 120 python3 bench/bench_runtime.py --device cuda --out "$OUT/bench_runtime.json" ;;
e2e)
  run attn_run 300 attn run --model qwen3-next --device cuda --no-progress ;;
esac; done
log done
