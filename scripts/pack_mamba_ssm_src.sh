#!/usr/bin/env bash
# Copy the sources of mamba_ssm's selective-scan FORWARD kernel (csrc/selective_scan/, Apache-2.0,
# Tri Dao / Albert Gu) and its LICENSE into the git-ignored .ext/mamba_ssm_src/, so that
# attn_plugins/triton_ssm/bench/mamba_ssm_scan.py can build the extension on the H200 (which
# cannot pip-install mamba_ssm) and bench_ssm.py can time our Mamba1 prefill against it.
# Third-party code: it is carried to the device, never committed.
#
# Usage (development machine, checkout root):
#   bash scripts/pack_mamba_ssm_src.sh SRC [REV] [OUT_DIR]
# SRC: a work tree of github.com/state-spaces/mamba (csrc/selective_scan/ in it), or a git
# directory of it (bare or not: HEAD and objects/ in it, e.g. a mirror), read at REV (default
# HEAD). OUT_DIR defaults to .ext/mamba_ssm_src. The commit goes to OUT_DIR/SOURCE.
# The backward kernels (selective_scan_bwd_*.cu, reverse_scan.cuh, uninitialized_copy.cuh) are
# left out: the forward does not include them, and mamba_ssm_scan.py stubs the backward.
set -euo pipefail
src=${1:?usage: pack_mamba_ssm_src.sh SRC [REV] [OUT_DIR]}
rev=${2:-HEAD}
out=${3:-.ext/mamba_ssm_src}
# The forward's closure under #include "..." (checked: selective_scan_fwd_kernel.cuh includes
# selective_scan.h, selective_scan_common.h, static_switch.h; selective_scan.cpp includes
# selective_scan.h; nothing of the forward includes reverse_scan.cuh).
files=(
  selective_scan.cpp
  selective_scan.h
  selective_scan_common.h
  selective_scan_fwd_kernel.cuh
  selective_scan_fwd_fp32.cu
  selective_scan_fwd_fp16.cu
  selective_scan_fwd_bf16.cu
  static_switch.h
)

. "$(dirname "$0")/upstream_source.sh"
open_upstream pack_mamba_ssm_src.sh "$src" "$rev" csrc/selective_scan csrc/selective_scan LICENSE

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for f in "${files[@]}"; do
  show "csrc/selective_scan/$f" >"$tmp/$f" || { echo "missing csrc/selective_scan/$f in $src" >&2; exit 1; }
done
show LICENSE >"$tmp/LICENSE" || { echo "missing LICENSE in $src" >&2; exit 1; }
# every quoted include of the copied files must be one of them (a new header upstream would
# otherwise fail only on the device, minutes into the build)
for inc in $(grep -ho '#include "[^"]*"' "$tmp"/* | sed 's/#include "\(.*\)"/\1/' | sort -u); do
  [ -f "$tmp/$inc" ] || { echo "the forward includes $inc, which this script does not copy" >&2; exit 1; }
done
{
  echo "repository: https://github.com/state-spaces/mamba"
  echo "commit: $commit"
  echo "read from: $src ($mode)"
  echo "packed: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "files:"
  (cd "$tmp" && sha256sum "${files[@]}" LICENSE | sed 's/^/  /')
} >"$tmp/SOURCE"

install_pack "$tmp" "$out" "${#files[@]}"
