#!/usr/bin/env bash
# Pack the newest kernel stack for the H200 (Python 3.12, x86-64, CUDA 13) into parts that fit
# two device calls' carry: FlashInfer, FlashAttention-4 and nvidia-cutlass-dsl as one
# environment, the way a server that installs today's releases gets them. FlashInfer 0.7 needs
# nvidia-cutlass-dsl>=4.8 and flash-attn-4 betas after 4.0.0b14 need >=4.6.2; from 4.8 the DSL's
# Python sources (cutlass.cute) ship in nvidia-cutlass-dsl-libs-core and the compiled libraries
# in -libs-cu12 / -libs-cu13, so all four cutlass wheels go in.
# Usage (development machine, checkout root): bash scripts/pack_newest_stack.sh [OUT_DIR]
# Device: carry OUT_DIR/part_aa in one call and the other parts in the next, while the machine
#   is warm; each call starts with STACK=OUT_DIR bash scripts/gpu_run.sh stack_install ...
#   (scripts/stack_unpack.sh puts the stack in the site folder once every part is there).
# OUT_DIR (default .whl-new) must be git-ignored. Takes about 6 minutes on 2 cores.
set -euo pipefail
out=${1:-.whl-new}
part_size=${PART_SIZE:-48M}  # two parts of at most 48 MiB beside the working tree's ~4 MiB
FLASHINFER=${FLASHINFER:-0.7.4}
CUTLASS_DSL=${CUTLASS_DSL:-4.8.1}
FLASH_ATTN_4=${FLASH_ATTN_4:-4.0.0b40}
QUACK=${QUACK:-0.6.5}
FLA_CORE=${FLA_CORE:-0.6.0}
TVM_FFI=${TVM_FFI:-0.1.15.post2}
DLPACK_EXT=${DLPACK_EXT:-0.1.5}
# the H200's driver is CUDA 13.0 (580.x): cuda-bindings of the same minor
CUDA_BINDINGS=${CUDA_BINDINGS:-13.0.3}
wheels=(
  "flashinfer-python==$FLASHINFER"
  "nvidia-cutlass-dsl==$CUTLASS_DSL"
  "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL"
  "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL"
  "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_DSL"
  "flash-attn-4==$FLASH_ATTN_4"
  "quack-kernels==$QUACK"
  "fla-core==$FLA_CORE"
  "apache-tvm-ffi==$TVM_FFI"
  "torch-c-dlpack-ext==$DLPACK_EXT"
  "cuda-bindings==$CUDA_BINDINGS"
  "cuda-pathfinder"
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --dest "$work/wheels" "${wheels[@]}"
mkdir "$work/tree"
for w in "$work"/wheels/*.whl; do
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    "$w" "$work/tree"
done
rm -rf "$out"
mkdir -p "$out"
# one archive over the whole tree: xz finds what the wheels' per-file deflate cannot
(cd "$work/tree" && tar -cf - . | xz -9e -T0) >"$work/stack.tar.xz"
(cd "$out" && split -b "$part_size" "$work/stack.tar.xz" part_)
{
  for p in "$out"/part_*; do echo "part ${p##*/}"; done  # in order: the archive is their cat
  echo "sha256 $(sha256sum "$work/stack.tar.xz" | cut -d' ' -f1)"
  for w in "$work"/wheels/*.whl; do echo "wheel ${w##*/}"; done
} >"$out/MANIFEST"
ls -l "$out"
cat "$out/MANIFEST"
