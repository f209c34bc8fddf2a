#!/usr/bin/env bash
# GPU verification on the lent H200s: install, GPU tests, conformance kit, benchmarks.
# Usage (on the device, from the checkout root): bash scripts/gpu_run.sh STAGE ...
#   stages: info install selfcheck                            (selfcheck: attn list --self-check)
#           fi_install                                      (FlashInfer from $FI_WHEELS, see below)
#           stack_install                                   (STACK="DIR ...": the newest kernel
#                                                            stack's layers in parts,
#                                                            scripts/pack_newest_stack.sh)
#           t_core t_e2e t_e2e_plugins t_e2e_gptoss t_tp t_fi t_ssm t_varlen t_fa3   (pytest; GPU tests of each area)
#           t_families                                      (issue 22's config families on the GPU plugins)
#           t_handoff                                       (prefill -> decode hand-off, 2 GPUs)
#           kit_fi kit_fa3 kit_ssm kit_varlen               (conformance kit per backend;
#                                                            kit_fi, kit_fa3, kit_ssm with KIT_SHARDS=N:
#                                                            N shard runs at once)
#                                                            (KIT_LIMIT=S: seconds per kit run)
#           kit_ssm_x2                                      (the triton_ssm kit over both GPUs)
#           t_ssd                                           (triton_ssm Mamba2 / SSD tests only)
#           t_mamba1                                        (Mamba1: triton_ssm and e2e tests)
#           t_generic                                       (generic adapter on the GPU plugins)
#           t_pick                                          (PICK="test ids ...": those tests only)
#           b_fi b_ssm b_varlen b_runtime b_e2e b_kvw b_tuned (benchmarks, JSON under $OUT)
#           b_samples                                       (attn bench --device cuda per BENCH_SAMPLES)
#           b_ssd b_gdn b_kda b_mamba1 b_ssd_ref            (triton_ssm prefill rows, one each;
#           b_issue23                                       (issue 23's table, one run)
#                                                            b_mamba1 carries .ext: mamba_ssm's scan;
#                                                            b_ssd_ref carries .ext: mamba_ssm's
#                                                            Triton SSD, our SSD timed against it)
#           b_sweep                                         (triton_ssm decode tilings vs copy)
#           run                                             (attn run --model all)
#           NAME=COMMAND                                    (any shell command, logged as NAME)
# Stages run in order; pick the GPU with CUDA_VISIBLE_DEVICES to run two lanes at once, and set
# DEADLINE=$(( $(date +%s) + N )) so that no stage outlives the device call.
# Logs go to $OUT/<stage>.log (or ./gpu-out), pass/fail lines to $OUT/summary.log.
# RESUME=1: pytest stages leave out what they passed in earlier calls on the same warm machine.
# fi_install: FI_WHEELS=DIR (a carried folder) puts DIR's wheels (*.whl: the FlashInfer release and
# what it imports beyond the H200's stack, apache-tvm-ffi) and packed wheels (*.tar.xz: a wheel's
# files as they are, xz-compressed to fit a call's carry) into the site folder device_setup.sh
# made, in place of the FlashInfer there; scripts/fi_version_run.sh DIR runs it with the
# FlashInfer stages in one call.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export FLASHINFER_WORKSPACE_BASE=$PWD/.jit TRITON_CACHE_DIR=$PWD/.jit/triton
# FlashInfer's JIT runs ninja at nproc + 2 jobs per process unless MAX_JOBS is set: 12 pytest
# processes compiling at once would start ~200 nvcc jobs on 16 cores (FlashInfer 0.7.4's kit
# did not finish in 2 x 420 s that way). A stage of several pytest processes (-n) shares the
# cores between them; a single-process stage (a benchmark) gets them all: with a pytest share
# of 4, b_tuned spent 250 s compiling one FlashInfer kernel module. MAX_JOBS set by the caller
# applies to every stage.
procs=${XDIST:-8}; jobs=$(( $(nproc) / procs )); [ "$jobs" -lt 2 ] && jobs=2
max_jobs_set=${MAX_JOBS:-}
# torch's CPU ops (transformers' float32 references, the gloo TP runs) start one thread per core
# in every process: 8 processes would run 128 threads on 16 cores. Share the cores the same way.
omp_set=${OMP_NUM_THREADS:-}
stage_env() {  # stage_env CMD...: MAX_JOBS and OMP_NUM_THREADS for the command, as above
  local share=$(nproc)
  case " $* " in *" -n "*) share=$jobs ;; esac
  # one of KIT_SHARDS kit runs at once (kit_shards): the cores split over the shards
  case " $* " in *" --attn-shard="*) share=$(( $(nproc) / ${KIT_SHARDS:-1} )); [ "$share" -lt 2 ] && share=2 ;; esac
  export MAX_JOBS=${max_jobs_set:-$share} OMP_NUM_THREADS=${omp_set:-$share}
}
. ./scripts/device_setup.sh
lane="gpu${CUDA_VISIBLE_DEVICES:-all}"
log() { echo "=== [$lane] $* ($(date +%T))" >>"$OUT/summary.log"; }
run() {  # run NAME TIMEOUT CMD...: log to $OUT/NAME.log, the last lines into the summary
  local name=$1 limit=$2; shift 2
  if [ -n "${DEADLINE:-}" ]; then  # DEADLINE (epoch seconds): never run past the call's limit
    local left=$((DEADLINE - $(date +%s) - 5))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then log "$name: skipped, no time left before DEADLINE"; return; fi
  fi
  # RESUME=1: a pytest stage leaves out the tests it passed in an earlier call on this machine
  # (listed in bench-out/passed_NAME.txt), so a stage cut at its limit goes on where it stopped
  local passed="bench-out/passed_$name.txt" skipped_passed=0
  local cmd="$*"
  if [ "${RESUME:-0}" = 1 ] && [ -s "$passed" ] && [ "${cmd#python3 -m pytest}" != "$cmd" ]; then
    local ids id; mapfile -t ids <"$passed"
    for id in "${ids[@]}"; do set -- "$@" --deselect "$id"; done
    skipped_passed=${#ids[@]}
  fi
  log "$name: ${*:1:40}$([ "$skipped_passed" -gt 0 ] && echo " (RESUME: $skipped_passed passed tests left out)")"
  local t0=$SECONDS timed_before
  timed_before=$(cat "$ATTN_TEST_TIMES" 2>/dev/null | wc -l)
  stage_env "$@"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  mkdir -p bench-out
  # -v lines: "[gw3] [ 40%] PASSED ID" under xdist, "ID PASSED   [ 40%]" without it
  sed -nE -e 's/^\[gw[0-9]+\] \[ *[0-9]+%\] PASSED (.*[^ ]) *$/\1/p' \
    -e 's/^(.*::.*[^ ]) PASSED +\[ *[0-9]+%\]$/\1/p' "$OUT/$name.log" >>"$passed"
  # skips too: a GPU module that skipped (say FlashAttention-4 not carried) must not read as a pass
  # (-v lines too: "[gw3] [ 40%] FAILED test", all a run cut at its limit leaves of its failures)
  { grep -E "^(FAILED|ERROR|SKIPPED) |^\[gw[0-9]+\] .*(FAILED|ERROR) " "$OUT/$name.log" | head -40
    tail -n 2 "$OUT/$name.log"
    # why each test failed (attn_core.testing.timing's last column): a run cut at its limit
    # never prints pytest's closing summary with the tracebacks
    tail -n +$((timed_before + 1)) "$ATTN_TEST_TIMES" 2>/dev/null | awk -F'\t' '$2 == "failed" {print "WHY " $3 ": " $4}'
  } | sed "s/^/  [$name rc=$rc $((SECONDS - t0))s] /" >>"$OUT/summary.log"
}
# XDIST=N spreads a stage's tests over N processes on the lane's GPU: FlashInfer and Triton
# JIT-compile each new kernel configuration on first use, and N processes compile N at once.
# -v: a line per finished test, so a stage cut at its limit still names what failed and what
# was left (-q prints names only in its closing summary)
# attn_core.testing.timing: each finished test's seconds into $OUT/test_times.tsv as it ends
# (where a stage's time went, also for one cut at its limit)
export ATTN_TEST_TIMES=${ATTN_TEST_TIMES:-$OUT/test_times.tsv}
PYTEST=(python3 -m pytest -v -p no:cacheprovider -p attn_core.testing.timing --tb=short -rfEs ${XDIST:+-n $XDIST})
# KIT_SHARDS=N: a kit stage runs as N kit processes at once on the lane's GPU, shard K of N
# each (--attn-shard: a layer spec's checks stay in one shard), the cores split over them, in
# place of one pytest-xdist run. FlashInfer builds each kernel module behind a file lock: xdist
# deals out neighbouring checks, which need the same modules, so its processes can wait on
# one build at a time (FlashInfer 0.7.4's cold kit: 16 processes finished 3 of 39 checks in 420 s).
kit_shards() {  # kit_shards NAME LIMIT BACKEND: logs NAME_0 .. NAME_{N-1}
  local name=$1 limit=$2 backend=$3 i
  for ((i = 0; i < KIT_SHARDS; i++)); do
    run "${name}_$i" "$limit" python3 -m pytest -v -p no:cacheprovider -p attn_core.testing.timing \
      --tb=short -rfEs --attn-backend="$backend" --attn-seed="${KIT_SEED:-7}" \
      --attn-shard="$i/$KIT_SHARDS" &
  done
  wait
}
kit_run() {  # kit_run NAME LIMIT BACKEND PROCS: the kit on PROCS xdist processes, or KIT_SHARDS shards
  if [ -n "${KIT_SHARDS:-}" ]; then kit_shards "$1" "$2" "$3"; return; fi
  run "$1" "$2" python3 -m pytest -v -p no:cacheprovider -p attn_core.testing.timing --tb=short \
    -rfEs -n "$4" --attn-backend="$3"
}
for stage in "$@"; do case $stage in
info)
  nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv >>"$OUT/summary.log"
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)" >>"$OUT/summary.log" 2>&1 ;;
fi_install)
  dir=${FI_WHEELS:?fi_install needs FI_WHEELS=DIR}
  rm -rf /tmp/site/flashinfer /tmp/site/flashinfer_python-*.dist-info  # the release carried before
  for w in "$dir"/*.whl; do
    [ -f "$w" ] && run "fi_install_${w##*/}" 120 python3 -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site "$w"
  done
  for t in "$dir"/*.tar.xz; do [ -f "$t" ] && run "fi_unpack_${t##*/}" 120 tar -xJf "$t" -C /tmp/site; done
  run fi_version 60 python3 -c "import flashinfer, importlib.metadata as m; print('flashinfer', \
m.version('flashinfer-python'), flashinfer.__file__); print(flashinfer.BatchDecodeWithPagedKVCacheWrapper)" ;;
stack_install)  # STACK="DIR ...": the newest stack's layers (scripts/pack_newest_stack.sh), parts over calls
  # STACK_SITE / STACK_STAGE: where they go (device_setup.sh's site folder) and where the parts
  # of earlier calls wait, a folder per layer
  site=${STACK_SITE:-/tmp/site} whole=0
  for dir in ${STACK:?stack_install needs STACK="DIR ..."}; do
    layer=${dir%/}; layer=${layer##*/}; stage=${STACK_STAGE:-/tmp/stack-stage}/$layer
    run "stack_install_$layer" 240 bash scripts/stack_unpack.sh "$dir" "$site" "$stage"
    sha=$(sed -n 's/^sha256 //p' "$stage/MANIFEST" 2>/dev/null)
    [ -n "$sha" ] && [ -f "$site/.stack-$sha" ] && whole=$((whole + 1))
  done
  # the versions once a layer is in (not while its parts are still to come): each library of
  # the stack, and an import of those present
  [ "$whole" -gt 0 ] && run stack_versions 120 python3 -c "import importlib, importlib.metadata as m
for d, mod in (('flashinfer-python', 'flashinfer'), ('fla-core', 'fla'), ('nvidia-cutlass-dsl', 'cutlass.cute'), ('flash-attn-4', 'flash_attn.cute.interface')):
    try:
        v = m.version(d)
    except m.PackageNotFoundError:
        print(d, 'absent'); continue
    try:
        importlib.import_module(mod); print(d, v, 'imports')
    except Exception as e:
        print(d, v, 'import failed:', type(e).__name__, e)" ;;
install)
  editables=(-e .)
  for p in attn_plugins/*/; do [ -f "$p/pyproject.toml" ] && editables+=(-e "$p"); done
  run install 300 python3 -m pip install -q --no-deps --no-build-isolation "${editables[@]}"
  run list 60 attn list ;;
selfcheck) run selfcheck 300 attn list --self-check ;;  # every fast path's self-check, at once
t_core) run t_core 500 "${PYTEST[@]}" -m gpu tests --ignore=tests/e2e ;;
t_e2e_gptoss) run t_e2e_gptoss 300 "${PYTEST[@]}" -m gpu tests/e2e -k gpt ;;
t_e2e) run t_e2e 500 "${PYTEST[@]}" -m gpu tests/e2e --deselect tests/e2e/test_tp.py \
--deselect tests/e2e/test_handoff.py ;;
t_e2e_plugins) run t_e2e_plugins 500 "${PYTEST[@]}" -m gpu tests/e2e --deselect tests/e2e/test_tp.py \
--deselect tests/e2e/test_handoff.py -k "gpu_plugins or triton_ssm_serves" ;;  # the plugin half of t_e2e
t_families) run t_families 400 "${PYTEST[@]}" -m gpu tests/e2e/test_run_families.py \
tests/e2e/test_run_dense.py -k issue_22_family ;;  # issue 22's families: t_e2e_plugins runs them too
t_pick) run t_pick 500 "${PYTEST[@]}" ${PICK:?t_pick needs PICK="test ids"} ;;  # words split on purpose
t_tp) run t_tp 600 "${PYTEST[@]}" tests/e2e/test_tp.py ;;
t_handoff) run t_handoff 600 "${PYTEST[@]}" -s tests/e2e/test_handoff.py ;;
t_fi) run t_fi 500 "${PYTEST[@]}" attn_plugins/flashinfer/tests ;;
t_ssm) run t_ssm 500 "${PYTEST[@]}" attn_plugins/triton_ssm/tests ;;
t_ssd) run t_ssd 300 "${PYTEST[@]}" attn_plugins/triton_ssm/tests -k "ssd or mamba2" ;;
t_mamba1) run t_mamba1 400 "${PYTEST[@]}" attn_plugins/triton_ssm/tests tests/e2e -k "mamba1 or jamba or falcon-mamba" ;;
t_varlen) run t_varlen 300 "${PYTEST[@]}" attn_plugins/varlen/tests ;;
t_fa3) run t_fa3 300 "${PYTEST[@]}" attn_plugins/fa3/tests ;;
kit_fi)  # 8 processes by default: on a cold JIT cache one process ran past 400 s, 8 took 321 s
  # The soft-cap checks first, alone, with every core on FlashInfer's build of its soft-cap
  # prefill module: in a shard, at 4 build jobs beside three other shards' builds, it had not
  # finished after 590 s over two calls (0.6.7 and 0.7.4 alike); at 8 jobs, two such builds
  # (both releases) at once on 16 cores, it took 180-186 s. A warm cache passes them at once.
  run kit_fi_softcap 400 python3 -m pytest -v -p no:cacheprovider -p attn_core.testing.timing \
    --tb=short -rfEs --attn-backend=flashinfer:flashinfer --attn-seed="${KIT_SEED:-7}" -k softcap
  kit_run kit_fi "${KIT_LIMIT:-420}" flashinfer:flashinfer "${XDIST:-8}"
  run kit_fi_mla 300 "${PYTEST[@]}" --attn-backend=flashinfer:flashinfer_mla ;;
kit_fa3) kit_run kit_fa3 "${KIT_LIMIT:-420}" fa3:fa3 "${XDIST:-8}" ;;  # FlashAttention-4 carried (.whl-one / .whl-new)
kit_ssm)  # KIT_SHARDS=N as for kit_fi: fla's and our Triton kernels compile per layer spec, and
  # xdist deals a spec's checks to every process at once (the first eight, one GDN spec, each
  # built the same kernels), where a shard keeps a spec's checks in one process
  kit_run kit_ssm "${KIT_LIMIT:-540}" triton_ssm:triton_ssm "${XDIST:-8}"
  run kit_ssm_mamba1 300 "${PYTEST[@]}" --attn-backend=triton_ssm:triton_ssm_mamba1 ;;
kit_ssm_x2)  # the whole triton_ssm battery in one pass: a shard per GPU, XDIST=8 each (~5 min)
  # -v: one line per finished test, so a run cut by its deadline shows which test was left;
  # --durations: where the time went.
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i run "kit_ssm_$i" 420 python3 -m pytest -v -p no:cacheprovider \
      --durations=10 --tb=short -rfEs -n "${XDIST:-8}" --attn-backend=triton_ssm:triton_ssm \
      --attn-seed="${KIT_SEED:-7}" --attn-shard="$i/2" &
  done
  wait ;;
kit_varlen) run kit_varlen 300 "${PYTEST[@]}" --attn-backend=varlen:varlen
  run kit_sdpa 300 "${PYTEST[@]}" --attn-backend=varlen:sdpa ;;
b_fi) run b_fi 400 python3 attn_plugins/flashinfer/bench/bench_flashinfer.py ${BENCH_FI_ARGS:-} --out "$OUT/bench_flashinfer.json" ;;
b_ssm) run b_ssm 450 python3 attn_plugins/triton_ssm/bench/bench_ssm.py --prefill --plugin --budget-s 400 --out "$OUT/bench_ssm.json" ;;
b_kvw) run b_kvw 120 python3 bench/bench_kv_write.py ;;
b_varlen) run b_varlen 200 python3 attn_plugins/varlen/bench/bench_varlen.py --out "$OUT/bench_varlen.json" ;;
t_generic) run t_generic 400 "${PYTEST[@]}" tests/e2e/test_run_dense.py -k on_gpu_plugins ;;
b_ssd) run b_ssd 300 python3 attn_plugins/triton_ssm/bench/bench_ssm.py --mamba2-sweep --only mamba2_sweep --no-fla --budget-s 280 --out "$OUT/bench_ssd.json" ;;
b_gdn) run b_gdn 300 python3 attn_plugins/triton_ssm/bench/bench_ssm.py --prefill --only gdn_solve,gdn_prefill --budget-s 280 --out "$OUT/bench_gdn.json" ;;
b_sweep) run b_sweep 400 python3 attn_plugins/triton_ssm/bench/bench_decode_sweep.py ${BENCH_SWEEP_ARGS:-} --budget-s 370 --out "$OUT/bench_decode_sweep.json" ;;
b_mamba1)  # Mamba1 prefill against mamba_ssm's CUDA scan, built here from the carried .ext/
  # (scripts/pack_mamba_ssm_src.sh; 1-2 minutes on the first call of a machine)
  run b_mamba1_build 400 python3 attn_plugins/triton_ssm/bench/mamba_ssm_scan.py
  # mamba1_lanes: both kernels against mamba_ssm in alternating rounds (about 20 s)
  run b_mamba1 300 python3 attn_plugins/triton_ssm/bench/bench_ssm.py --prefill \
    --only mamba1_prefill,mamba1_lanes --budget-s 280 --out "$OUT/bench_mamba1.json" ;;
b_issue23)  # issue 23's table in one process per group: GDN / Mamba2 decode against copy and
  # fla, GDN / KDA prefill against fla, the SSD against mamba_ssm's Triton SSD (carry .whl with
  # fla-core and .ext with mamba_ssm_triton); BENCH_ISSUE23_S: its budget (the whole table
  # needs about 460 s on a cold cache)
  run b_issue23 "$(( ${BENCH_ISSUE23_S:-520} + 20 ))" python3 attn_plugins/triton_ssm/bench/bench_ssm.py \
    --prefill --only gdn_decode,mamba2_decode,gdn_prefill,kda_prefill,mamba2_vs_mamba_ssm \
    --vs-mamba-ssm-tokens 32768 --gdn-variants "out given" --budget-s "${BENCH_ISSUE23_S:-520}" \
    --out "$OUT/bench_issue23.json" ;;
b_ssd_ref)  # Mamba2 SSD prefill against mamba_ssm's Triton mamba_chunk_scan_combined, imported
  # from the carried .ext/mamba_ssm_triton (scripts/pack_mamba_ssm_triton.sh; pure Triton, no
  # build; its kernels autotune on the first call, tens of seconds). BENCH_SSD_REF_ARGS: e.g.
  # "--mamba-ssm-chunk 128 --our-chunk 256"
  run b_ssd_ref 330 python3 attn_plugins/triton_ssm/bench/bench_ssm.py --only mamba2_vs_mamba_ssm \
    --no-fla ${BENCH_SSD_REF_ARGS:-} --budget-s 310 --out "$OUT/bench_ssd_ref.json" ;;
b_kda) run b_kda 360 python3 attn_plugins/triton_ssm/bench/bench_ssm.py --prefill --only kda_prefill --budget-s 340 --out "$OUT/bench_kda.json" ;;
b_tuned)  # the --out file stays on the machine (bench-out/): a call cut at its limit is resumed
  # by the next b_tuned on the same warm machine (same BENCH_TUNED_ARGS)
  mkdir -p bench-out; resume=(); [ -f bench-out/bench_tuned.json ] && resume=(--resume bench-out/bench_tuned.json)
  run b_tuned 500 python3 bench/bench_tuned_plans.py ${BENCH_TUNED_ARGS:-} "${resume[@]}" \
    --out bench-out/bench_tuned.json
  cp bench-out/bench_tuned.json "$OUT/" 2>/dev/null ;;
b_samples)  # attn bench on the GPU for the samples whose bench inputs need more than q/k/v
  for m in ${BENCH_SAMPLES:-minimax lfm2 gpt-oss}; do
    run "b_samples_$m" 300 attn bench --model "$m" --device cuda --batch 8 --context 1024 \
      --spec-tokens 2 --iters 5
  done ;;
b_runtime) run b_runtime 120 python3 bench/bench_runtime.py --device cuda --count-calls --out "$OUT/bench_runtime.json" ;;
b_e2e) run b_e2e 450 python3 bench/bench_e2e.py --device cuda --out "$OUT/bench_e2e.json" ;;
run) run attn_run 300 attn run --model all --device cuda --no-progress ;;
*=*) run "${stage%%=*}" 500 bash -c "${stage#*=}" ;;  # NAME=COMMAND: any command, logged alike
*) log "unknown stage $stage" ;;
esac; done
log done
