#!/usr/bin/env bash
# One H200 call for one FlashInfer release: install it, then attn list, the FlashInfer plugin's
# tests, the conformance kit of both FlashInfer backends and the quick benchmark.
# Usage (on the device, from the checkout root): bash scripts/fi_version_run.sh DIR
#   DIR: a carried folder holding the release's wheel (or its files packed as a .tar.xz) and
#   apache-tvm-ffi's wheel; see scripts/gpu_run.sh (stage fi_install).
# Stages are cut at DEADLINE (default: 590 s from now, inside one call); FlashInfer's JIT cache
# (.jit/) stays on a warm machine, so a second call with the same DIR finishes what was cut.
set -u
dir=${1:?usage: bash scripts/fi_version_run.sh DIR}
export FI_WHEELS=$dir XDIST=${XDIST:-8} BENCH_FI_ARGS=${BENCH_FI_ARGS:---quick}
export DEADLINE=${DEADLINE:-$(($(date +%s) + 590))}
exec bash scripts/gpu_run.sh info fi_install install t_fi kit_fi b_fi
