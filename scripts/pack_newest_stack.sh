#!/usr/bin/env bash
# Pack the newest kernel stack for the H200 (Python 3.12, x86-64, CUDA 13) in two layers that
# fit two device calls' carry, the way a server that installs today's releases gets them:
#   OUT_DIR/kernels  FlashInfer, fla-core and what they import (apache-tvm-ffi,
#                    torch-c-dlpack-ext, cuda-bindings): one part, complete in the first call,
#                    so FlashInfer's JIT builds and the fla-backed stages start there;
#   OUT_DIR/cutlass  nvidia-cutlass-dsl and its three library wheels, flash-attn-4 and
#                    quack-kernels: part_aa beside the kernels layer in the first call, the
#                    rest in the next.
# FlashInfer 0.7 wants nvidia-cutlass-dsl>=4.8 where the DSL is installed (0.7.4 imports and
# ran the kit without it); flash-attn-4 betas after 4.0.0b14 need >=4.6.2. From 4.8 the DSL's
# Python sources (cutlass.cute) ship in nvidia-cutlass-dsl-libs-core and the compiled
# libraries in -libs-cu12 / -libs-cu13 (64 MB xz-compressed on their own: more than one call
# carries beside the working tree), so all four cutlass wheels go in the second layer.
# Usage (development machine, checkout root): bash scripts/pack_newest_stack.sh [OUT_DIR]
# Device: call 1 carries OUT_DIR/kernels, OUT_DIR/cutlass/MANIFEST and OUT_DIR/cutlass/part_aa;
#   call 2, on the same warm machine, OUT_DIR/cutlass/MANIFEST and the other cutlass parts.
#   Each starts with STACK="OUT_DIR/kernels OUT_DIR/cutlass" bash scripts/gpu_run.sh
#   stack_install ... (scripts/stack_unpack.sh puts each layer in the site folder once all of
#   its parts are there).
# OUT_DIR (default .whl-new) must be git-ignored. Takes about 7 minutes on 2 cores.
set -euo pipefail
out=${1:-.whl-new}
# a call carries 64 MiB with the working tree (~5 MiB): the first call's kernels layer and
# cutlass part_aa together stay under CALL_MIB - TREE_MIB, later cutlass parts under PART_MIB
CALL_MIB=${CALL_MIB:-64}
TREE_MIB=${TREE_MIB:-6}
PART_MIB=${PART_MIB:-56}
FLASHINFER=${FLASHINFER:-0.7.4}
CUTLASS_DSL=${CUTLASS_DSL:-4.8.1}
FLASH_ATTN_4=${FLASH_ATTN_4:-4.0.0b40}
QUACK=${QUACK:-0.6.5}
FLA_CORE=${FLA_CORE:-0.6.0}
TVM_FFI=${TVM_FFI:-0.1.15.post2}
DLPACK_EXT=${DLPACK_EXT:-0.1.5}
# the H200's driver is CUDA 13.0 (580.x): cuda-bindings of the same minor
CUDA_BINDINGS=${CUDA_BINDINGS:-13.0.3}
kernels_wheels=(
  "flashinfer-python==$FLASHINFER"
  "fla-core==$FLA_CORE"
  "apache-tvm-ffi==$TVM_FFI"
  "torch-c-dlpack-ext==$DLPACK_EXT"
  "cuda-bindings==$CUDA_BINDINGS"
  "cuda-pathfinder"
)
cutlass_wheels=(
  "nvidia-cutlass-dsl==$CUTLASS_DSL"
  "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL"
  "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL"
  "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_DSL"
  "flash-attn-4==$FLASH_ATTN_4"
  "quack-kernels==$QUACK"
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pack_layer() {  # pack_layer NAME FIRST_PART_BYTES WHEEL...: OUT_DIR/NAME/{MANIFEST,part_*}
  local name=$1 first=$2 w p; shift 2
  local dir="$out/$name" tmp="$work/$name"
  mkdir -p "$tmp/wheels" "$tmp/tree" "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --dest "$tmp/wheels" "$@"
  for w in "$tmp"/wheels/*.whl; do
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
      "$w" "$tmp/tree"
  done
  # one archive over the layer's tree: xz finds what the wheels' per-file deflate cannot
  (cd "$tmp/tree" && tar -cf - . | xz -9e -T0) >"$tmp/stack.tar.xz"
  # part_aa of FIRST_PART_BYTES, then part_ab, part_ac, ... of PART_MIB each
  local size off=$first letters=bcdefghijklmnopqrstuvwxyz i=0
  size=$(stat -c %s "$tmp/stack.tar.xz")
  head -c "$first" "$tmp/stack.tar.xz" >"$dir/part_aa"
  while [ "$off" -lt "$size" ]; do
    tail -c +"$((off + 1))" "$tmp/stack.tar.xz" | head -c "$((PART_MIB * mib))" \
      >"$dir/part_a${letters:i:1}"
    off=$((off + PART_MIB * mib)) i=$((i + 1))
  done
  {
    for p in "$dir"/part_*; do echo "part ${p##*/}"; done  # in order: the archive is their cat
    echo "sha256 $(sha256sum "$tmp/stack.tar.xz" | cut -d' ' -f1)"
    for w in "$tmp"/wheels/*.whl; do echo "wheel ${w##*/}"; done
  } >"$dir/MANIFEST"
}
rm -rf "$out"
mkdir -p "$out"
mib=$((1024 * 1024))
pack_layer kernels $((PART_MIB * mib)) "${kernels_wheels[@]}"
kernels_bytes=$(cat "$out"/kernels/part_* | wc -c)
if [ "$(ls "$out"/kernels/part_* | wc -l)" -ne 1 ]; then
  echo "the kernels layer needs more than one part ($kernels_bytes bytes): it must be whole in" \
    "the first call" >&2
  exit 1
fi
first=$(((CALL_MIB - TREE_MIB) * mib - kernels_bytes))
if [ "$first" -lt $((4 * mib)) ]; then
  echo "the kernels layer ($kernels_bytes bytes) leaves no room for cutlass part_aa" >&2
  exit 1
fi
pack_layer cutlass "$first" "${cutlass_wheels[@]}"
ls -l "$out"/*
cat "$out"/*/MANIFEST
