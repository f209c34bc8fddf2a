#!/usr/bin/env bash
# One device call: install, the GPU tests of the new linear variants, per-phase dispatch, the
# launch and FlashInfer self-checks, the kit of the new variants, and their bench rows.
export XDIST=8 DEADLINE=$(( $(date +%s) + ${1:-420} ))
P="python3 -m pytest -q -p no:cacheprovider --tb=short -rfE -n 8"
bash scripts/gpu_run.sh install \
  "t_new=$P attn_plugins/triton_ssm/tests -k 'mamba1 or lightning or short_conv or compat' tests/runtime/test_phase_dispatch.py tests/test_fast_launch.py attn_plugins/flashinfer/tests/test_gpu.py::test_tensor_core_decode_fast_replan_equals_public_plan attn_plugins/flashinfer/tests/test_gpu.py::test_the_fast_path_self_check_passes_on_this_flashinfer" \
  "kit_new=$P --attn-backend=triton_ssm:triton_ssm -k 'lightning or short_conv' && $P --attn-backend=triton_ssm:triton_ssm_mamba1" \
  "b_new=python3 attn_plugins/triton_ssm/bench/bench_ssm.py --prefill --quick --only mamba1_decode,lightning_decode,short_conv_decode,mamba1_prefill,lightning_prefill --budget-s 110 --out $OUT/bench_new.json"
