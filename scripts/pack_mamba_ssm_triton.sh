#!/usr/bin/env bash
# Copy mamba_ssm's Triton SSD forward (mamba_chunk_scan_combined: mamba_ssm/ops/triton/ssd_*.py
# and the modules they import at module level; Apache-2.0, Tri Dao / Albert Gu) and its LICENSE
# into the git-ignored .ext/mamba_ssm_triton/, so that attn_plugins/triton_ssm/bench/bench_ssm.py
# (--only mamba2_vs_mamba_ssm, attn_plugins/triton_ssm/bench/mamba_ssm_ssd.py loads it) can time
# our Mamba2 SSD prefill against it on the H200, which cannot pip-install mamba_ssm. Pure Python
# and Triton: nothing to build. Third-party code: it is carried to the device, never committed.
# The sibling of scripts/pack_mamba_ssm_src.sh (Mamba1's CUDA selective scan).
#
# Usage (development machine, checkout root):
#   bash scripts/pack_mamba_ssm_triton.sh SRC [REV] [OUT_DIR]
# SRC: a work tree of github.com/state-spaces/mamba (mamba_ssm/ops/triton/ in it), or a git
# directory of it (bare or not: HEAD and objects/ in it, e.g. a mirror), read at REV (default
# HEAD). OUT_DIR defaults to .ext/mamba_ssm_triton; put OUT_DIR on sys.path and
# `import mamba_ssm.ops.triton.ssd_combined` works. The commit goes to OUT_DIR/SOURCE.
# Every package's __init__.py is written empty: upstream's mamba_ssm/__init__.py imports the
# CUDA selective scan (selective_scan_cuda), which the device does not have.
# Imports at module level only: the function-level `from mamba_ssm.ops.selective_scan_interface
# import ...` of ssd_combined.mamba_split_conv1d_scan_ref (a reference, not the forward) is left
# out. Third-party imports the files need: torch, triton, einops, packaging.
set -euo pipefail
src=${1:?usage: pack_mamba_ssm_triton.sh SRC [REV] [OUT_DIR]}
rev=${2:-HEAD}
out=${3:-.ext/mamba_ssm_triton}
# mamba_chunk_scan_combined's closure under module-level `from mamba_ssm.X import` (checked
# below against the copied files)
files=(
  mamba_ssm/ops/triton/ssd_combined.py
  mamba_ssm/ops/triton/ssd_bmm.py
  mamba_ssm/ops/triton/ssd_chunk_state.py
  mamba_ssm/ops/triton/ssd_state_passing.py
  mamba_ssm/ops/triton/ssd_chunk_scan.py
  mamba_ssm/ops/triton/layernorm_gated.py
  mamba_ssm/ops/triton/k_activations.py
  mamba_ssm/ops/triton/softplus.py
  mamba_ssm/utils/torch.py
  mamba_ssm/utils/determinism.py
)

. "$(dirname "$0")/upstream_source.sh"
open_upstream pack_mamba_ssm_triton.sh "$src" "$rev" mamba_ssm/ops/triton "${files[@]}" LICENSE

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for f in "${files[@]}"; do
  mkdir -p "$tmp/$(dirname "$f")"
  show "$f" >"$tmp/$f" 2>/dev/null || { echo "missing $f in $src" >&2; exit 1; }
done
show LICENSE >"$tmp/LICENSE" 2>/dev/null || { echo "missing LICENSE in $src" >&2; exit 1; }
# upstream's version, for SOURCE (its __init__.py itself is not copied)
version=$(show mamba_ssm/__init__.py 2>/dev/null | sed -n 's/^__version__ = "\(.*\)"/\1/p' | head -1)
# every module-level mamba_ssm import of the copied files must be one of them (a new module
# upstream would otherwise fail only on the device)
for mod in $(sed -nE 's/^(from|import) (mamba_ssm(\.[A-Za-z0-9_]+)+).*/\2/p' "${files[@]/#/$tmp/}" | sort -u); do
  [ -f "$tmp/${mod//.//}.py" ] || { echo "the SSD forward imports $mod, which this script does not copy" >&2; exit 1; }
done
# empty packages: importing mamba_ssm.ops.triton.ssd_combined runs no upstream __init__
inits=()
for f in "${files[@]}"; do
  d=$(dirname "$f")
  while [ "$d" != . ]; do
    [ -f "$tmp/$d/__init__.py" ] || { : >"$tmp/$d/__init__.py"; inits+=("$d/__init__.py"); }
    d=$(dirname "$d")
  done
done
{
  echo "repository: https://github.com/state-spaces/mamba"
  echo "commit: $commit"
  echo "version: ${version:-unknown}"
  echo "read from: $src ($mode)"
  echo "packed: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "files:"
  (cd "$tmp" && sha256sum "${files[@]}" LICENSE | sed 's/^/  /')
  echo "written empty: ${inits[*]}"
} >"$tmp/SOURCE"

install_pack "$tmp" "$out" "${#files[@]}"
