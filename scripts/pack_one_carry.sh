#!/usr/bin/env bash
# Pack the device wheels into one folder that fits a single device call's carry (64 MiB with the
# working tree): FlashInfer 0.6.7, fla-core and FlashAttention-4 with its cutlass libraries, so
# the fa3 plugin loads on a fresh machine in one call instead of two warm ones in a row.
# Usage (development machine, checkout root): bash scripts/pack_one_carry.sh [OUT_DIR]
# Device:  FI_WHEELS=.whl-one bash scripts/gpu_run.sh fi_install install STAGE ...
# The wheels are unzipped and re-packed with xz -9e (deflate leaves the 144 MB cutlass IR library
# at 57 MB, xz at 52); nvidia-cudnn-frontend is left out (FlashInfer imports it only if present).
# Takes about 4 minutes on 2 cores. OUT_DIR (default .whl-one) must be git-ignored.
set -euo pipefail
out=${1:-.whl-one}
mkdir -p "$out"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
unzip_to() { python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$@"; }
mkdir "$work/small" "$work/cutlass"
for w in .whl/*.whl; do
  case ${w##*/} in nvidia_cudnn_frontend-*) continue ;; esac
  unzip_to "$w" "$work/small"
done
cat .whl-big/part_aa .whl-big/part_ab .whl-big/part_ac >"$work/libs.whl"
unzip_to "$work/libs.whl" "$work/cutlass"
(cd "$work/small" && tar -cf - . | xz -9e -T0) >"$out/wheels.tar.xz"
(cd "$work/cutlass" && tar -cf - . | xz -9e -T0) >"$out/nvidia_cutlass_dsl_libs_base.tar.xz"
tracked=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
total=$(( $(du -cb "$out" | tail -n 1 | cut -f1) + tracked ))
echo "$out: $(du -sh "$out" | cut -f1); with the working tree $((total / 1048576)) MiB of 64"
[ "$total" -le $((64 * 1048576)) ] || { echo "too large for one carry" >&2; exit 1; }
