#!/usr/bin/env bash
# What the GPU machine runs (one call does everything, ~9 minutes on an H200): the CUDA backend's
# GPU tests (golden files + CPU-vs-GPU bit-exactness), the op-test suite over every backend
# (nibble_backend_ops_tests: each op on "cpu" and "cuda" against the CPU reference), the training
# step on CUDA against the CPU (nibble_train_tests, BackendStep.*: tiny dense + MoE, every recipe,
# one step, 50-step curves, determinism and resume), then `nibble bench train` for the OLMo-2 70M /
# 370M and Qwen3-MoE shapes at seq 4096 (bf16, nvfp4-nvidia, tetrajet-v2) and the TetraJet-v2
# linear, and bench/torch_train_baseline.py on the same shapes in the same call; logs go to $OUT
# (default ./gpu_out), a short table last.
# Build strategies, first that works: (1) NIBBLE_GPU_PREBUILT=<dir> (scripts/gpu_bundle.sh's .gpubin:
# binaries + lib/ with their shared libraries + testdata/, packed as bundle.tar.xz, unpacked here); (2) the project's CMake build
# (-DNIBBLE_CUDA=ON -DNIBBLE_CUDA_ARCH=90a -DNIBBLE_BENCH=OFF); (3) a direct nvcc/g++ build of the
# CUDA backend's tests only, from src/ with headers carried in .gpudeps/.
# Test data: $NIBBLE_TESTDATA_DIR, else ./.testdata, else the bundle's testdata/ (a copy of
# ../shared/testdata, which does not travel).
# Options (environment):
#   NIBBLE_GPU_PARTS   comma list of parts to run, default "tests,ops,train,bench,torch";
#                      also "bandwidth" (the format kernels' bandwidth vs device copy), "attn"
#                      (nibble bench attention + PyTorch SDPA), "dist" (NCCL one-rank tests and a
#                      one-rank pretrain against a plain one), "profile" (bench train --profile),
#                      "rollout" (the rollout engine on CUDA against the CPU), "decode" (nibble bench
#                      decode bf16 + w4a16 and bench/hf_generate_baseline.py: NIBBLE_DECODE_CONFIG,
#                      NIBBLE_DECODE_BATCHES (1,16,64,256), NIBBLE_DECODE_NEW (64), NIBBLE_DECODE_MODES),
#                      "rl" (nibble sft then nibble rl on CUDA, synchronous and with max_staleness 1),
#                      "distbench" (nibble bench collectives as a one-rank NCCL world and bench
#                      weight-sync for configs/qwen3moe-768.json: distbench_*.jsonl, ~1 min),
#                      "decodegraphs" (nibble bench decode with CUDA graphs on, then --no-cuda-graphs, in
#                      the same call: NIBBLE_DECODE_CONFIG, NIBBLE_DECODE_GRAPH_BATCHES (1,16,64),
#                      NIBBLE_DECODE_NEW (64), NIBBLE_DECODE_MODES; decode_graphs.jsonl and a table on/off),
#                      "decode30b" (nibble bench decode of the Qwen3-30B-A3B shape in w4a16, batches 1,16,
#                      prompt 512, new 32, --init uniform (the training init took > 5 min there): the
#                      inference-storage engine on one GPU; decode30b.jsonl),
#                      "moedecode" (the fused MoE decode against the per-expert walk, NIBBLE_FUSED_MOE_DECODE=off:
#                      nibble bench decode on NIBBLE_MOE_DECODE_CONFIG (configs/qwen3moe-768.json), bf16 and
#                      w4a16, NIBBLE_MOE_DECODE_BATCHES (1,16,64,256); moe_decode_{fused,walk}.jsonl + a table),
#                      "rlbench" (nibble bench rl on configs/qwen3moe-768.json: the RL step time split
#                      per arm, trace overhead, NVFP4/BF16 sync bytes; rlbench.jsonl + rlbench.log;
#                      NIBBLE_RLBENCH_ARGS replaces the default --steps/--prompts/--group/--max-new)
#   NIBBLE_GPU_BUDGET_S  seconds the whole script may take (default 540): each part's timeout is cut
#                      to what is left, so the call returns with its logs; the nibble benches keep
#                      NIBBLE_GPU_TORCH_RESERVE_S (200) for the PyTorch baseline that follows
#   NIBBLE_GPU_TRAIN_FILTER  gtest filter of the training-step cases (default BackendStep.*)
#   NIBBLE_BENCH_CONFIGS / NIBBLE_BENCH_BATCHES  space lists (default the three shapes, batches 16 8 8)
#   NIBBLE_BENCH_RECIPES (default "bf16 nvfp4-nvidia tetrajet-v2"), NIBBLE_BENCH_SEQ (4096),
#   NIBBLE_BENCH_WARMUP (2), NIBBLE_BENCH_STEPS (4), NIBBLE_BENCH_LINEAR (16384x4096x4096)
#   NIBBLE_GPU_SANITIZE=1 compute-sanitizer memcheck + racecheck of the backend tests and op suite
#                      (NIBBLE_GPU_SANITIZE_OPS: a gtest filter of op cases instead of every */cuda
#                      case, e.g. '*MultiRange*/cuda:*GroupedGemm*/cuda' for the newest kernels)
#   NIBBLE_GPU_NCU=1 (ncu counters of five format kernels), NIBBLE_GPU_SASS_KERNELS=<regex>
# Files under $OUT: steps.log, tests.log, ops_tests.log, train_tests.log, bench_train_*.log,
# torch_baseline.jsonl (+ .log), table.txt; with the options bench.log, sanitizer*.log, ncu.txt,
# sass_counts.txt, sass_kernels.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
PREBUILT=${NIBBLE_GPU_PREBUILT:-}
[ -n "$PREBUILT" ] && case $PREBUILT in /*) ;; *) PREBUILT=$ROOT/$PREBUILT;; esac
NIBBLE_TESTDATA_DIR_SET=${NIBBLE_TESTDATA_DIR:-}
if [ -z "${NIBBLE_TESTDATA_DIR:-}" ]; then
  NIBBLE_TESTDATA_DIR=$ROOT/.testdata
  [ ! -d "$NIBBLE_TESTDATA_DIR" ] && [ -n "$PREBUILT" ] && [ -d "$PREBUILT/testdata" ] && NIBBLE_TESTDATA_DIR=$PREBUILT/testdata
fi
export NIBBLE_TESTDATA_DIR
export NIBBLE_SOURCE_DIR=$ROOT  # configs/ for the training-step tests (built elsewhere)
PARTS=",${NIBBLE_GPU_PARTS:-tests,ops,train,bench,torch},"
want() { [[ $PARTS == *",$1,"* ]]; }
JOBS=$(nproc)
START=$(date +%s)
BUDGET=${NIBBLE_GPU_BUDGET_S:-540}
stamp() { echo "== [$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/steps.log"; }
# Seconds a part may run: its own limit ($1), cut to what is left of the budget after keeping
# $2 seconds (default 0) for parts still to come (at least 5).
limit() {
  local left=$(( BUDGET - ($(date +%s) - START) - ${2:-0} ))
  [ "$left" -lt "$1" ] && echo $(( left > 5 ? left : 5 )) || echo "$1"
}
TORCH_RESERVE=0; [[ $PARTS == *",torch,"* ]] && TORCH_RESERVE=${NIBBLE_GPU_TORCH_RESERVE_S:-200}
# rc 124 from timeout: say so in steps.log.
note_rc() { [ "$2" = 124 ] && stamp "$1 stopped by its time limit (NIBBLE_GPU_BUDGET_S=$BUDGET)"; return 0; }

stamp "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/steps.log"
# A prebuilt binary names its own commit (the copied tree's git metadata may be older).
COMMIT=""
[ -n "$PREBUILT" ] && COMMIT=$(cat "$PREBUILT/COMMIT" 2>/dev/null)
echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" | tee -a "$OUT/steps.log"
echo "parts ${PARTS//,/ } budget ${BUDGET}s testdata $NIBBLE_TESTDATA_DIR" | tee -a "$OUT/steps.log"

BIN=""       # the CUDA backend's tests
OPS_BIN=""   # the op-test suite, where the build strategy provides it
TRAIN_BIN="" # the train tests (BackendStep.*: CUDA against CPU)
NIBBLE=""    # the CLI (nibble bench train)
# NCCL is not carried (208 MB): the machine's /usr/local/cuda has it, or else PyTorch's wheel does.
nccl_fallback() {
  { ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2' || [ -e /usr/local/cuda/lib64/libnccl.so.2 ]; } && return 0
  local d
  d=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null) || return 0
  [ -e "$d/libnccl.so.2" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d" && echo "libnccl from $d" | tee -a "$OUT/steps.log"
  return 0
}
try_prebuilt() {
  local dir=$PREBUILT
  # gpu_bundle.sh packs the bundle (the unpacked one is over a device call's carry limit).
  if [ -n "$dir" ] && [ ! -x "$dir/nibble_backend_cuda_tests" ] && [ -f "$dir/bundle.tar.xz" ]; then
    tar -C "$dir" -xJf "$dir/bundle.tar.xz" || { stamp "could not unpack $dir/bundle.tar.xz"; return 1; }
    COMMIT=$(cat "$dir/COMMIT" 2>/dev/null)
    [ -z "${NIBBLE_TESTDATA_DIR_SET:-}" ] && [ ! -d "$ROOT/.testdata" ] && [ -d "$dir/testdata" ] && export NIBBLE_TESTDATA_DIR=$dir/testdata
  fi
  [ -n "$dir" ] && [ -x "$dir/nibble_backend_cuda_tests" ] || return 1
  export LD_LIBRARY_PATH="$dir/lib:${LD_LIBRARY_PATH:-}"
  nccl_fallback
  if "$dir/nibble_backend_cuda_tests" --gtest_list_tests >/dev/null 2>"$OUT/prebuilt_check.err"; then
    rm -f "$OUT/prebuilt_check.err"; BIN="$dir/nibble_backend_cuda_tests"
    [ -x "$dir/nibble_backend_ops_tests" ] && OPS_BIN="$dir/nibble_backend_ops_tests"
    [ -x "$dir/nibble_train_tests" ] && TRAIN_BIN="$dir/nibble_train_tests"
    [ -x "$dir/nibble" ] && NIBBLE="$dir/nibble"
    return 0
  fi
  head -5 "$OUT/prebuilt_check.err" | tee -a "$OUT/steps.log"; rm -f "$OUT/prebuilt_check.err"
  return 1
}
try_cmake() {
  command -v cmake >/dev/null || return 1
  cmake -S . -B build-gpu -G Ninja -DNIBBLE_CUDA=ON -DNIBBLE_CUDA_ARCH=90a -DNIBBLE_BENCH=OFF \
    -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake_configure.log" 2>&1 || { tail -3 "$OUT/cmake_configure.log"; return 1; }
  cmake --build build-gpu -j "$JOBS" --target nibble_backend_cuda_tests >"$OUT/cmake_build.log" 2>&1 \
    || { tail -20 "$OUT/cmake_build.log"; return 1; }
  BIN="$ROOT/build-gpu/tests/nibble_backend_cuda_tests"
  local t
  for t in nibble_backend_ops_tests nibble_train_tests nibble; do
    cmake --build build-gpu -j "$JOBS" --target $t >>"$OUT/cmake_build.log" 2>&1 || continue
    case $t in
      nibble_backend_ops_tests) OPS_BIN="$ROOT/build-gpu/tests/$t";;
      nibble_train_tests) TRAIN_BIN="$ROOT/build-gpu/tests/$t";;
      nibble) NIBBLE="$ROOT/build-gpu/bin/nibble";;
    esac
  done
}
try_direct() {
  local D=$ROOT/.gpudeps O=$ROOT/build-gpu-direct
  [ -d "$D/include" ] || return 1
  local NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  local CUDA_INC
  CUDA_INC=$(dirname "$NVCC")/../include
  mkdir -p "$O"
  local defs=(-DFMT_HEADER_ONLY -DNIBBLE_HAVE_CUDA=1 "-DNIBBLE_SOURCE_DIR=\"$ROOT\""
              "-DNIBBLE_TESTDATA_DIR=\"$ROOT/../shared/testdata\"")
  local inc=(-I"$ROOT/src" -I"$D/include" -I"$D/googletest/include" -I"$D/googletest" -I"$CUDA_INC")
  local nvf=(-std=c++20 -O3 --fmad=false --expt-relaxed-constexpr -Xcompiler=-ffp-contract=off,-fopenmp
             -DFMT_CONSTEVAL= -DFMT_USE_CONSTEXPR=1 -gencode=arch=compute_90a,code=sm_90a)
  local cxf=(-std=c++20 -O3 -ffp-contract=off -fopenmp)
  local pids=() f
  for f in src/backend/cuda/*.cu; do
    "$NVCC" "${nvf[@]}" "${defs[@]}" "${inc[@]}" -c "$f" -o "$O/$(basename "$f").o" >"$O/$(basename "$f").log" 2>&1 &
    pids+=($!)
  done
  for f in src/backend/cuda/*.cpp src/formats/*.cpp src/io/*.cpp src/core/tensor.cpp src/core/philox.cpp src/core/parallel.cpp \
           "$D/googletest/src/gtest-all.cc" "$D/googletest/src/gtest_main.cc"; do
    case $f in *_test.cpp) continue;; esac
    g++ "${cxf[@]}" "${defs[@]}" "${inc[@]}" -c "$f" -o "$O/$(basename "$f").o" >"$O/$(basename "$f").log" 2>&1 &
    pids+=($!)
  done
  local fail=0 p
  for p in "${pids[@]}"; do wait "$p" || fail=1; done
  if [ $fail = 1 ]; then grep -h -m 5 -i error "$O"/*.log; return 1; fi
  "$NVCC" -o "$O/nibble_backend_cuda_tests" "$O"/*.o -Xcompiler=-fopenmp -lcudart >"$O/link.log" 2>&1 \
    || { tail -20 "$O/link.log"; return 1; }
  BIN="$O/nibble_backend_cuda_tests"
}

stamp "build"
if try_prebuilt; then stamp "using prebuilt $BIN"
elif try_cmake; then stamp "built with CMake: $BIN"
elif try_direct; then stamp "built directly with nvcc: $BIN (no op suite, train tests or CLI: use the bundle)"
else stamp "no build strategy worked"; exit 1; fi

TEST_RC=skip OPS_RC=skip TRAIN_RC=skip BENCH_RC=skip BENCHT_RC=skip TORCH_RC=skip
if want tests; then
  stamp "CUDA backend tests"
  timeout "$(limit 180 "$TORCH_RESERVE")" "$BIN" --gtest_brief=0 >"$OUT/tests.log" 2>&1
  TEST_RC=$?; note_rc "CUDA backend tests" $TEST_RC
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|differ|cuda tests" "$OUT/tests.log" | head -60
  stamp "CUDA backend tests exit code $TEST_RC"
fi

if want ops; then
  if [ -n "$OPS_BIN" ]; then
    stamp "op-test suite (every op on cpu and cuda against the CPU reference)"
    timeout "$(limit 180 "$TORCH_RESERVE")" "$OPS_BIN" --gtest_brief=0 >"$OUT/ops_tests.log" 2>&1
    OPS_RC=$?; note_rc "op-test suite" $OPS_RC
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|unavailable" "$OUT/ops_tests.log" | head -60
    stamp "op-test suite exit code $OPS_RC"
    # the packed-weight cases once more with the GEMV for every M (the tensor-core GEMM takes M > 8)
    stamp "packed-weight GEMM cases with NIBBLE_NVFP4_WEIGHT_GEMM=gemv"
    NIBBLE_NVFP4_WEIGHT_GEMM=gemv timeout "$(limit 60 "$TORCH_RESERVE")" "$OPS_BIN" --gtest_filter='*PackedWeight*' \
      >"$OUT/ops_tests_gemv.log" 2>&1 || OPS_RC=$?
    grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/ops_tests_gemv.log" | head -20
  else
    OPS_RC=missing; stamp "op-test suite not built by this strategy (needs the bundle or the CMake build)"
  fi
fi

if want train; then
  if [ -n "$TRAIN_BIN" ]; then
    # CPU work of these cases runs on the host's cores (the CPU side of each comparison).
    stamp "training step on CUDA against the CPU (${NIBBLE_GPU_TRAIN_FILTER:-BackendStep.*})"
    timeout "$(limit 300 "$TORCH_RESERVE")" "$TRAIN_BIN" --gtest_brief=0 --gtest_filter="${NIBBLE_GPU_TRAIN_FILTER:-BackendStep.*}" \
      >"$OUT/train_tests.log" 2>&1
    TRAIN_RC=$?; note_rc "training-step tests" $TRAIN_RC
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|^  tiny-" "$OUT/train_tests.log" | head -80
    stamp "training-step tests exit code $TRAIN_RC"
  else
    TRAIN_RC=missing; stamp "train tests not built by this strategy (needs the bundle or the CMake build)"
  fi
fi

if want bandwidth; then
  stamp "bandwidth benchmark"
  BENCH_RC=0
  for run in $(seq "${NIBBLE_GPU_BENCH_RUNS:-1}"); do  # repeat to see the run-to-run spread
    timeout "$(limit 120)" "$BIN" --gtest_also_run_disabled_tests --gtest_filter='CudaBench.*' >>"$OUT/bench.log" 2>&1 || BENCH_RC=$?
  done
  stamp "bandwidth bench exit code $BENCH_RC"
fi

if [ "${NIBBLE_GPU_SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  # Out-of-bounds / misaligned accesses and races in the kernels, on the small test shapes
  # (the 2^32-input exhaustive check is left out: too slow under the sanitizer).
  stamp "compute-sanitizer memcheck + racecheck"
  timeout "$(limit 240)" compute-sanitizer --tool memcheck --leak-check no "$BIN" \
    --gtest_filter='CudaGolden.*:CudaVsCpu.*:ElementCodec.KernelsMatchCpu' >"$OUT/sanitizer.log" 2>&1
  echo "memcheck rc=$? $(grep 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)" | tee -a "$OUT/steps.log"
  timeout "$(limit 120)" compute-sanitizer --tool racecheck "$BIN" \
    --gtest_filter='CudaVsCpu.FusedBackwardOperand:CudaVsCpu.Absmax:CudaVsCpu.RhtAndTranspose' >>"$OUT/sanitizer.log" 2>&1
  echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)" | tee -a "$OUT/steps.log"
  if [ -n "$OPS_BIN" ]; then
    # The op suite's CUDA cases. The out-of-memory case is left out of memcheck: its deliberate
    # 1 PiB cudaMallocAsync failure is an API error memcheck counts.
    SAN_OPS=${NIBBLE_GPU_SANITIZE_OPS:-*/cuda}
    timeout "$(limit 300)" compute-sanitizer --tool memcheck --leak-check no "$OPS_BIN" \
      --gtest_filter="$SAN_OPS:-*OutOfMemory*" >"$OUT/sanitizer_ops.log" 2>&1
    echo "ops memcheck rc=$? $(grep 'ERROR SUMMARY' "$OUT/sanitizer_ops.log" | tail -1)" | tee -a "$OUT/steps.log"
    timeout "$(limit 300)" compute-sanitizer --tool racecheck "$OPS_BIN" --gtest_filter="$SAN_OPS" >>"$OUT/sanitizer_ops.log" 2>&1
    echo "ops racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/sanitizer_ops.log" | tail -1)" | tee -a "$OUT/steps.log"
  fi
fi

if want bench; then
  # `nibble bench train`, where this build's CLI has it: each shape and recipe in its own process
  # (a failure, e.g. out of memory, costs that row only). Options the CLI's help does not list are
  # left out (the command's defaults apply).
  if [ -n "$NIBBLE" ] && "$NIBBLE" bench train --help >"$OUT/bench_train_help.txt" 2>&1; then
    BENCHT_RC=0
    has() { grep -qE -- "(^|[ ,])$1([ ,=]|\$)" "$OUT/bench_train_help.txt"; }
    common=()
    has --device && common+=(--device cuda)
    has --seq && common+=(--seq "${NIBBLE_BENCH_SEQ:-4096}")
    has --warmup && common+=(--warmup "${NIBBLE_BENCH_WARMUP:-2}")
    has --steps && common+=(--steps "${NIBBLE_BENCH_STEPS:-4}")
    has --json && common+=(--json)  # one JSON object per row: scripts/gpu_table.py reads it
    read -r -a configs <<<"${NIBBLE_BENCH_CONFIGS:-configs/olmo2-70m.json configs/olmo2-370m.json configs/qwen3moe-768.json}"
    read -r -a batches <<<"${NIBBLE_BENCH_BATCHES:-16 8 8}"
    read -r -a recipes <<<"${NIBBLE_BENCH_RECIPES:-bf16 nvfp4-nvidia tetrajet-v2}"
    for i in "${!configs[@]}"; do
      cfg=${configs[$i]} b=${batches[$i]:-8}
      for r in "${recipes[@]}"; do
        log="$OUT/bench_train_$(basename "$cfg" .json)_$r.log"
        args=(bench train --config "$cfg" --recipe "$r" "${common[@]}")
        has --batch && args+=(--batch "$b")
        stamp "nibble ${args[*]}"
        echo "nibble ${args[*]}" >"$log"
        timeout "$(limit 90 "$TORCH_RESERVE")" "$NIBBLE" "${args[@]}" >>"$log" 2>&1
        rc=$?; note_rc "bench train $cfg $r" $rc; [ $rc = 0 ] || BENCHT_RC=$rc
        tail -3 "$log"
      done
    done
    log="$OUT/bench_train_linear.log"
    args=(bench train --linear "${NIBBLE_BENCH_LINEAR:-16384x4096x4096}")
    has --device && args+=(--device cuda)
    has --json && args+=(--json)
    stamp "nibble ${args[*]}"
    echo "nibble ${args[*]}" >"$log"
    timeout "$(limit 120 "$TORCH_RESERVE")" "$NIBBLE" "${args[@]}" >>"$log" 2>&1
    rc=$?; note_rc "bench train --linear" $rc; [ $rc = 0 ] || BENCHT_RC=$rc
    tail -8 "$log"
    stamp "nibble bench train exit code $BENCHT_RC"
  else
    BENCHT_RC=missing
    stamp "nibble bench train not in this build's CLI ($(head -2 "$OUT/bench_train_help.txt" 2>/dev/null | tr '\n' ' '))"
  fi
fi

ATTN_RC=skip DIST_RC=skip PROF_RC=skip ROLL_RC=skip DEC_RC=skip DG_RC=skip MD_RC=skip RL_RC=skip D30_RC=skip RLB_RC=skip
if want attn; then
  # Causal attention alone: nibble's FP32 and BF16 kernels, then PyTorch's SDPA (BF16) at the same
  # shapes in the same call (bench/torch_attention_baseline.py).
  shapes=(16x4096x8x8x64 8x4096x16x16x64 8x4096x12x4x64)
  ATTN_RC=0
  if [ -n "$NIBBLE" ] && "$NIBBLE" bench attention --help >/dev/null 2>&1; then
    sargs=(); for s in "${shapes[@]}"; do sargs+=(--shape "$s"); done
    stamp "nibble bench attention ${sargs[*]}"
    timeout "$(limit 120 "$TORCH_RESERVE")" "$NIBBLE" bench attention "${sargs[@]}" >"$OUT/bench_attention.log" 2>&1 || ATTN_RC=$?
    cat "$OUT/bench_attention.log"
  fi
  if python3 -c 'import torch' 2>/dev/null; then
    stamp "PyTorch SDPA: bench/torch_attention_baseline.py"
    timeout "$(limit 120)" python3 bench/torch_attention_baseline.py --shapes "$(IFS=,; echo "${shapes[*]}")" \
      >"$OUT/torch_attention.jsonl" 2>"$OUT/torch_attention.log" || ATTN_RC=$?
    cat "$OUT/torch_attention.jsonl"
  fi
  stamp "attention benches exit code $ATTN_RC"
fi

if want rollout; then
  # The rollout engine on CUDA against the CPU (issue #15): greedy BF16 tokens and w4a16 weight bits.
  ROLL_RC=0
  if [ -x "$PREBUILT/nibble_rollout_tests" ]; then
    stamp "rollout engine on CUDA against the CPU (RolloutEngineDevice.*), decode graphs against eager (DecodeGraphsDevice.*)"
    timeout "$(limit 180 "$TORCH_RESERVE")" "$PREBUILT/nibble_rollout_tests" \
      --gtest_filter='RolloutEngineDevice.*:DecodeGraphsDevice.*' \
      >"$OUT/rollout_tests.log" 2>&1 || ROLL_RC=$?
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure" "$OUT/rollout_tests.log" | head -20
  else
    ROLL_RC=missing
  fi
  stamp "rollout exit code $ROLL_RC"
fi

if want decode; then
  # The rollout engine's decode speed (issue #15 §4): `nibble bench decode` (random weights,
  # 512-token prompts) per mode, then Hugging Face `transformers` generate on the same config,
  # batches and token counts in the same call (bench/hf_generate_baseline.py): decode.jsonl,
  # hf_generate.jsonl. Each run's limit is cut to what is left of NIBBLE_GPU_BUDGET_S.
  DEC_RC=0
  DEC_CONFIG=${NIBBLE_DECODE_CONFIG:-configs/olmo2-1b.json}
  DEC_BATCHES=${NIBBLE_DECODE_BATCHES:-1,16,64,256}
  DEC_NEW=${NIBBLE_DECODE_NEW:-64}
  HF_RESERVE=0; python3 -c 'import torch, transformers' 2>/dev/null && HF_RESERVE=${NIBBLE_DECODE_HF_RESERVE_S:-150}
  if [ -n "$NIBBLE" ] && "$NIBBLE" bench decode --help >/dev/null 2>&1; then
    for mode in ${NIBBLE_DECODE_MODES:-bf16 w4a16}; do
      stamp "nibble bench decode --config $DEC_CONFIG --mode $mode --batch $DEC_BATCHES --new $DEC_NEW"
      timeout "$(limit 240 "$HF_RESERVE")" "$NIBBLE" bench decode --device cuda --config "$DEC_CONFIG" --mode "$mode" \
        --batch "$DEC_BATCHES" --prompt 512 --new "$DEC_NEW" >>"$OUT/decode.jsonl" 2>>"$OUT/decode.log" || DEC_RC=$?
      note_rc "bench decode $mode" "$DEC_RC"
    done
    cat "$OUT/decode.jsonl" "$OUT/decode.log" 2>/dev/null
  else
    DEC_RC=missing
  fi
  if [ "$HF_RESERVE" != 0 ]; then
    stamp "Hugging Face generate: bench/hf_generate_baseline.py"
    timeout "$(limit 240)" python3 bench/hf_generate_baseline.py --config "$DEC_CONFIG" --batch "$DEC_BATCHES" \
      --prompt 512 --new "$DEC_NEW" >"$OUT/hf_generate.jsonl" 2>"$OUT/hf_generate.log" || DEC_RC=$?
    cat "$OUT/hf_generate.jsonl"; tail -3 "$OUT/hf_generate.log"
  fi
  stamp "decode benches exit code $DEC_RC"
fi

if want decodegraphs; then
  # CUDA graphs for the decode step (rollout/decode_graph.h): the same bench with graphs on (the
  # default) and off, one after the other on one machine; the JSON's cuda_graphs says whether the
  # engine used them, graph_replays how many steps replayed one. decode_graphs.jsonl + a table.
  DG_RC=0
  DG_CONFIG=${NIBBLE_DECODE_CONFIG:-configs/olmo2-1b.json}
  DG_BATCHES=${NIBBLE_DECODE_GRAPH_BATCHES:-1,16,64}
  DG_NEW=${NIBBLE_DECODE_NEW:-64}
  if [ -n "$NIBBLE" ] && "$NIBBLE" bench decode --help 2>/dev/null | grep -q -- --no-cuda-graphs; then
    for mode in ${NIBBLE_DECODE_MODES:-bf16 w4a16}; do
      for graphs in on off; do
        flag=""; [ "$graphs" = off ] && flag="--no-cuda-graphs"
        stamp "nibble bench decode --config $DG_CONFIG --mode $mode --batch $DG_BATCHES --new $DG_NEW $flag"
        timeout "$(limit 200)" "$NIBBLE" bench decode --device cuda --config "$DG_CONFIG" --mode "$mode" \
          --batch "$DG_BATCHES" --prompt 512 --new "$DG_NEW" $flag >>"$OUT/decode_graphs.jsonl" \
          2>>"$OUT/decode_graphs.log" || DG_RC=$?
        note_rc "bench decode $mode graphs $graphs" "$DG_RC"
      done
    done
    python3 - "$OUT/decode_graphs.jsonl" <<'PY' || true
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
key = lambda r: (r["mode"], r["batch"])
on = {key(r): r for r in rows if not r["cuda_graphs"].startswith("off")}
off = {key(r): r for r in rows if r["cuda_graphs"].startswith("off")}
print(f"{'mode':6} {'batch':>5} {'graphs tok/s':>13} {'eager tok/s':>12} {'speedup':>8} {'replays':>8}  graphs")
for k in sorted(set(on) | set(off)):
    a, b = on.get(k), off.get(k)
    ta = a["decode_tokens_per_s"] if a else float("nan")
    tb = b["decode_tokens_per_s"] if b else float("nan")
    print(f"{k[0]:6} {k[1]:5d} {ta:13.1f} {tb:12.1f} {ta / tb:8.2f} {a['graph_replays'] if a else 0:8d}  "
          f"{(a or b)['cuda_graphs']}")
PY
  else
    DG_RC=missing
  fi
  stamp "decode graphs exit code $DG_RC"
fi

if want moedecode; then
  # The fused MoE decode (issue #15 item 4; rollout/precision.h QuantizedLinears::forward_experts)
  # against the per-expert walk (NIBBLE_FUSED_MOE_DECODE=off) on a Qwen3-MoE shape, bf16 and w4a16,
  # one after the other on one machine: moe_decode_fused.jsonl, moe_decode_walk.jsonl and a table.
  MD_RC=0
  MD_CONFIG=${NIBBLE_MOE_DECODE_CONFIG:-configs/qwen3moe-768.json}
  MD_BATCHES=${NIBBLE_MOE_DECODE_BATCHES:-1,16,64,256}
  if [ -n "$NIBBLE" ] && "$NIBBLE" bench decode --help >/dev/null 2>&1; then
    for mode in ${NIBBLE_DECODE_MODES:-bf16 w4a16}; do
      for form in fused walk; do
        fused=on; [ "$form" = walk ] && fused=off
        stamp "NIBBLE_FUSED_MOE_DECODE=$fused nibble bench decode --config $MD_CONFIG --mode $mode --batch $MD_BATCHES --prompt 512 --new 32"
        NIBBLE_FUSED_MOE_DECODE=$fused timeout "$(limit 150)" "$NIBBLE" bench decode --device cuda --config "$MD_CONFIG" \
          --mode "$mode" --batch "$MD_BATCHES" --prompt 512 --new 32 >>"$OUT/moe_decode_$form.jsonl" \
          2>>"$OUT/moe_decode.log" || MD_RC=$?
        note_rc "bench decode MoE $mode $form" "$MD_RC"
      done
    done
    python3 - "$OUT/moe_decode_fused.jsonl" "$OUT/moe_decode_walk.jsonl" <<'PY' || true
import json, sys
def load(p):
    try: return {(r["mode"], r["batch"]): r for r in (json.loads(l) for l in open(p) if l.startswith("{"))}
    except OSError: return {}
fu, wa = load(sys.argv[1]), load(sys.argv[2])
print(f"{'mode':6} {'batch':>5} {'fused tok/s':>12} {'walk tok/s':>11} {'speedup':>8}  graphs (fused)")
for k in sorted(set(fu) | set(wa)):
    a, b = fu.get(k), wa.get(k)
    ta = a["decode_tokens_per_s"] if a else float("nan")
    tb = b["decode_tokens_per_s"] if b else float("nan")
    print(f"{k[0]:6} {k[1]:5d} {ta:12.1f} {tb:11.1f} {ta / tb:8.2f}  {a['cuda_graphs'] if a else '-'}")
PY
  else
    MD_RC=missing
  fi
  stamp "moe decode exit code $MD_RC"
fi

if want decode30b; then
  # Qwen3-30B-A3B in w4a16 on one GPU (issue #15 item 4): the inference-storage engine, random
  # weights drawn on the host per tensor (init_s, a few minutes), memory_bytes and peak_bytes.
  D30_RC=0
  if [ -n "$NIBBLE" ] && "$NIBBLE" bench decode --help >/dev/null 2>&1; then
    stamp "nibble bench decode --config configs/qwen3-30b-a3b.json --mode w4a16 --init uniform --batch 1,16 --prompt 512 --new 32"
    timeout "$(limit 570)" "$NIBBLE" bench decode --device cuda --config configs/qwen3-30b-a3b.json --mode w4a16 \
      --init uniform --batch 1,16 --prompt 512 --new 32 >"$OUT/decode30b.jsonl" 2>"$OUT/decode30b.log" || D30_RC=$?
    note_rc "bench decode 30b" "$D30_RC"
    cat "$OUT/decode30b.jsonl"; tail -5 "$OUT/decode30b.log"
  else
    D30_RC=missing
  fi
  stamp "decode30b exit code $D30_RC"
fi

if want dist; then
  # The NCCL group as a one-rank world (issue #17): its tests, then a tiny pretrain under
  # WORLD_SIZE=1 against a plain run: metrics.jsonl losses and gradient norms must match exactly,
  # with ZeRO-1 on (the default), off, and on over buckets of 100003 elements (the bucketed
  # in-place reduce-scatter / all-gather on device buffers; one rank owns each parameter whole).
  DIST_RC=0
  if [ -x "$PREBUILT/nibble_dist_nccl_tests" ]; then
    stamp "NCCL one-rank tests"
    timeout "$(limit 120)" "$PREBUILT/nibble_dist_nccl_tests" >"$OUT/dist_tests.log" 2>&1 || DIST_RC=$?
    grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/dist_tests.log" | head -20
  fi
  if [ -n "$NIBBLE" ]; then
    d=$(mktemp -d)
    # The bare GPU image lacks the default corpus (a Debian package): train on this repository's docs.
    corpus=$(ls "$ROOT"/docs/*.md "$ROOT"/README.md | python3 -c 'import sys, json; print(json.dumps([l.strip() for l in sys.stdin]))')
    for w in plain nccl1 nccl1_nozero nccl1_buckets nccl1_nooverlap; do
      env_args=(); [ $w != plain ] && env_args=(WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29531)
      set_args=(); [ $w = nccl1_nozero ] && set_args=(--set dist.zero=0)
      [ $w = nccl1_buckets ] && set_args=(--set dist.bucket_elems=100003)
      [ $w = nccl1_nooverlap ] && set_args=(--set dist.overlap=0 --set dist.bucket_elems=100003)
      timeout "$(limit 120)" env "${env_args[@]}" "$NIBBLE" pretrain --config configs/pretrain-tiny.json --device cuda \
        --set steps=20 --set schedule.warmup_steps=5 --set "data.files=$corpus" "${set_args[@]}" --no-progress \
        --out "$d/$w" >"$OUT/dist_pretrain_$w.log" 2>&1 || DIST_RC=$?
    done
    if python3 - "$d/plain/metrics.jsonl" "$d/nccl1/metrics.jsonl" "$d/nccl1_nozero/metrics.jsonl" \
        "$d/nccl1_buckets/metrics.jsonl" "$d/nccl1_nooverlap/metrics.jsonl" >"$OUT/dist_compare.txt" 2>&1 <<'PY'
import json, sys
def rows(p):
    return [(r.get("step"), r.get("loss"), r.get("grad_norm")) for r in map(json.loads, open(p)) if "loss" in r]
a = rows(sys.argv[1])
ok = bool(a)
for name, p in zip(["one-rank NCCL ZeRO-1", "one-rank NCCL no ZeRO", "one-rank NCCL ZeRO-1 buckets",
                    "one-rank NCCL ZeRO-1 buckets, reduce after backward (dist.overlap=0)"], sys.argv[2:]):
    b = rows(p)
    print(f"{len(a)} rows plain, {len(b)} rows {name}, identical: {a == b}")
    ok = ok and a == b
sys.exit(0 if ok else 1)
PY
    then :; else DIST_RC=1; fi
    cat "$OUT/dist_compare.txt"; grep -h "world\|ZeRO-1" "$OUT"/dist_pretrain_*.log | head -6
    rm -rf "$d"
  fi
  stamp "dist exit code $DIST_RC"
fi

if want distbench; then
  # The multi-GPU benches (issue #17 item 4) as far as one GPU goes: `nibble bench collectives` as a
  # one-rank NCCL world (nibble's ProcessGroup calls against ncclAllReduce/... on the same device
  # buffers, 1 KiB..256 MiB; one rank moves nothing over a link: algbw only) and `nibble bench
  # weight-sync` for the RL shape configs/qwen3moe-768.json (host and device transports, bf16 and
  # w4a16; nobody receives in a world of one: the send path alone). JSON lines in
  # $OUT/distbench_collectives.jsonl and $OUT/distbench_weight_sync.jsonl. On 2..8 GPUs the same
  # commands under `mpirun -np N` give the bus bandwidth and the receivers' time
  # (docs/benchmarks.md, "Multi-GPU (issue #17)"), and scripts/dp_scaling.sh the DP efficiency.
  DB_RC=0
  if [ -n "$NIBBLE" ]; then
    env1=(WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533)
    stamp "nibble bench collectives (one-rank NCCL world)"
    timeout "$(limit 60)" env "${env1[@]}" "$NIBBLE" bench collectives --device cuda --min-bytes 1K --max-bytes 256M \
      --warmup 5 --iters 20 >"$OUT/distbench_collectives.jsonl" 2>"$OUT/distbench_collectives.log" || DB_RC=$?
    note_rc "bench collectives" "$DB_RC"
    tail -n 3 "$OUT/distbench_collectives.log"
    stamp "nibble bench weight-sync (configs/qwen3moe-768.json, one-rank NCCL world)"
    timeout "$(limit 90)" env "${env1[@]}" "$NIBBLE" bench weight-sync --device cuda --config configs/qwen3moe-768.json \
      --transport host,device --mode bf16,w4a16 --warmup 1 --iters 5 \
      >"$OUT/distbench_weight_sync.jsonl" 2>"$OUT/distbench_weight_sync.log" || DB_RC=$?
    note_rc "bench weight-sync" "$DB_RC"
    tail -n 3 "$OUT/distbench_weight_sync.log"
    # Several GPUs visible (a multi-GPU kind): the whole table in the same call. Each world of N
    # ranks is launched torchrun-style (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*: NCCL, no mpirun needed);
    # rank 0's JSON lines go to distbench_*_wN.jsonl, every rank's stderr to distbench_*_wN.log.
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    envworld() {  # envworld N OUTBASE nibble-args...: N ranks of an env world
      local n=$1 base=$2 r rc=0 pids=()
      shift 2
      for ((r = 0; r < n; r++)); do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29540 + n)) \
          "$NIBBLE" "$@" >"$base.rank$r.out" 2>>"$base.log" &
        pids+=($!)
      done
      for r in "${!pids[@]}"; do wait "${pids[$r]}" || rc=$?; done
      mv "$base.rank0.out" "$base.jsonl"; rm -f "$base".rank*.out
      return $rc
    }
    multi=()
    for n in 2 4 8; do [ "${NGPU:-0}" -ge "$n" ] && multi+=("$n"); done
    for n in "${multi[@]}"; do
      stamp "nibble bench collectives, $n GPUs"
      timeout "$(limit 120)" bash -c "$(declare -f envworld); NIBBLE='$NIBBLE' envworld $n '$OUT/distbench_collectives_w$n' \
        bench collectives --device cuda --min-bytes 1K --max-bytes 256M --warmup 5 --iters 20" || DB_RC=$?
    done
    if [ ${#multi[@]} -gt 0 ]; then
      n=${multi[-1]}
      stamp "nibble bench weight-sync, $n GPUs (rank 0 sends, $((n - 1)) receive)"
      timeout "$(limit 120)" bash -c "$(declare -f envworld); NIBBLE='$NIBBLE' envworld $n '$OUT/distbench_weight_sync_w$n' \
        bench weight-sync --device cuda --config configs/qwen3moe-768.json --transport host,device --mode bf16,w4a16" || DB_RC=$?
      stamp "scripts/dp_scaling.sh: OLMo-2 370M, 8 x 4096 tokens per GPU, worlds 1 ${multi[*]}"
      timeout "$(limit 400)" scripts/dp_scaling.sh --nibble "$NIBBLE" --device cuda --launcher env \
        --model configs/olmo2-370m.json --micro-batch 8 --seq 4096 --steps 12 --warmup 4 --worlds "1 ${multi[*]}" \
        --out "$OUT/dp_scaling_runs" >"$OUT/distbench_dp_scaling.jsonl" 2>"$OUT/distbench_dp_scaling.log" || DB_RC=$?
      cat "$OUT/distbench_dp_scaling.log"; rm -rf "$OUT/dp_scaling_runs/data"
    fi
    python3 - "$OUT/distbench_collectives.jsonl" "$OUT/distbench_weight_sync.jsonl" \
        $(ls "$OUT"/distbench_collectives_w*.jsonl "$OUT"/distbench_weight_sync_w*.jsonl 2>/dev/null) <<'PY' | tee "$OUT/distbench_table.txt"
import json, sys
for path in sys.argv[1:]:
    try:
        rows = [json.loads(l) for l in open(path) if l.strip()]
    except (OSError, ValueError) as e:
        print(f"{path}: {e}")
        continue
    for r in rows:
        if r["bench"] == "collectives":
            ratio, bus = r.get("ratio_to_library"), r.get("busbw_gbps")
            print(f"w{r['world']} {r['op']:<15} {r['path']:<7} {r['bytes']:>11} B {r['time_us']:>10.1f} us "
                  f"algbw {r['algbw_gbps']:8.2f} GB/s" + (f" busbw {bus:8.2f} GB/s" if bus is not None else "")
                  + (f"  nibble/nccl {ratio:.3f}" if ratio is not None else ""))
        else:
            print(f"w{r['world']} weight-sync {r['transport']:<6} {r['mode']:<6} {r['payload_bytes']:>11} B (x{r['ratio_to_bf16']:.3f} of bf16) "
                  f"prepare {r['prepare_ms']:.2f} ms sync {r['sync_ms']:.2f} ms {r['gb_per_s']:.2f} GB/s")
PY
  fi
  stamp "distbench exit code $DB_RC"
fi

if want rl; then
  # RL on CUDA (issue #16): the CPU quick start's SFT warm start, then 10 GRPO steps of the TRACE
  # arm with synchronous rollouts and with max_staleness 1 (the rollout worker is a second CUDA
  # backend on the same GPU). Logs and metrics.jsonl come back; every metric must be finite, and
  # no routed expert's row may lack its guidance record (R3 on: guided_expert_fallback 0).
  RL_RC=0
  if [ -n "$NIBBLE" ]; then
    d=$(mktemp -d)
    stamp "nibble sft + rl on CUDA"
    timeout "$(limit 150)" "$NIBBLE" sft --config configs/sft-tiny-moe.json --device cuda --no-progress \
      --out "$d/sft" >"$OUT/rl_sft.log" 2>&1 || RL_RC=$?
    tail -n 2 "$OUT/rl_sft.log"
    for s in 0 1; do
      python3 -c 'import json, sys; c = json.load(open("configs/rl-tiny-moe.json")); c.update(init=sys.argv[1], steps=10, max_staleness=int(sys.argv[2]), checkpoint_every=5); json.dump(c, open(sys.argv[3], "w"))' \
        "$d/sft" "$s" "$d/rl$s.json"
      timeout "$(limit 120)" "$NIBBLE" rl --config "$d/rl$s.json" --device cuda --out "$d/rl$s" >"$OUT/rl_staleness$s.log" 2>&1 || RL_RC=$?
      tail -n 1 "$OUT/rl_staleness$s.log"
      cp "$d/rl$s/metrics.jsonl" "$OUT/rl_staleness$s.metrics.jsonl" 2>/dev/null || RL_RC=missing
    done
    python3 - "$OUT"/rl_staleness*.metrics.jsonl <<'PY' || RL_RC=1
import json, math, sys
for p in sys.argv[1:]:
    rows = [r for r in map(json.loads, open(p)) if "reward_mean" in r]
    bad = [(r.get("step"), k) for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
    print(p.rsplit("/", 1)[-1], len(rows), "steps, reward", [round(r["reward_mean"], 3) for r in rows], "non-finite:", bad[:5])
    # guided sites include the routed experts' linears; with R3 every routed row has its record
    g = lambda k: [r.get(k) for r in rows]
    print("  guided_reproduced min", min(g("guided_reproduced")), " guided_mismatch max", max(g("guided_mismatch")),
          " guided_expert_fallback max", max(g("guided_expert_fallback")))
    if bad or len(rows) != 10 or max(g("guided_expert_fallback")) != 0: sys.exit(1)
PY
    rm -rf "$d"
  fi
  stamp "rl exit code $RL_RC"
fi

if want rlbench; then
  # RL step time on the ~0.5B MoE shape (issue #16 item 7): `nibble bench rl` runs 4 RL steps per
  # arm (fp4-naive, trace, bf16-rollout; the first step a warm-up) with random weights on the
  # arithmetic task, 8 prompts x 8 samples, at most 32 new tokens. Estimate on an H200: a step is
  # 64 sequences of ~45 tokens (~2.9k tokens); ~114M active parameters a token (12 layers x (1.6M
  # attention + 8 of 64 experts 4.7M) + the 38.6M lm_head) give ~3.3 TFLOP per step for three
  # trainer forwards and a forward + backward (2+2+6 FLOP per parameter and token): ~0.5 s at the
  # 4-10k tokens/s the MoE step reaches at this batch; 32 decode steps at ~30-50 ms (per-row
  # NVFP4 GEMVs, FP32 lm_head) ~1.5 s; the logits to the host and back (~0.6 GB a pass) and the
  # sync (~0.6 GB NVFP4 + FP32 rest) ~1 s: ~3-4 s a step, ~15 s an arm, plus ~10 s of set-up
  # (two 0.56B models drawn on the host, tokenizer, CUDA): ~75 s for the three arms (limit 300 s).
  RLB_RC=0
  if [ -n "$NIBBLE" ] && "$NIBBLE" bench rl --help >/dev/null 2>&1; then
    read -r -a rlb_args <<<"${NIBBLE_RLBENCH_ARGS:---steps 4 --prompts 8 --group 8 --max-new 32}"
    stamp "nibble bench rl --config configs/qwen3moe-768.json ${rlb_args[*]}"
    timeout "$(limit 300)" "$NIBBLE" bench rl --device cuda --config configs/qwen3moe-768.json "${rlb_args[@]}" \
      >"$OUT/rlbench.jsonl" 2>"$OUT/rlbench.log" || RLB_RC=$?
    note_rc "bench rl" "$RLB_RC"
    cat "$OUT/rlbench.jsonl"; tail -5 "$OUT/rlbench.log"
  else
    RLB_RC=missing
  fi
  stamp "rlbench exit code $RLB_RC"
fi

if want profile; then
  # One profiled step per shape (bf16 and tetrajet-v2): time per op and per category.
  PROF_RC=0
  if [ -n "$NIBBLE" ] && "$NIBBLE" bench train --help 2>&1 | grep -q -- --profile; then
    read -r -a configs <<<"${NIBBLE_PROFILE_CONFIGS:-configs/olmo2-70m.json}"
    read -r -a batches <<<"${NIBBLE_PROFILE_BATCHES:-16}"
    for i in "${!configs[@]}"; do
      for r in ${NIBBLE_PROFILE_RECIPES:-bf16 tetrajet-v2}; do
        log="$OUT/profile_$(basename "${configs[$i]}" .json)_$r.log"
        stamp "nibble bench train --profile --config ${configs[$i]} --recipe $r"
        timeout "$(limit 120 "$TORCH_RESERVE")" "$NIBBLE" bench train --config "${configs[$i]}" --recipe "$r" --device cuda \
          --seq "${NIBBLE_BENCH_SEQ:-4096}" --batch "${batches[$i]:-8}" --warmup 1 --steps 1 --profile >"$log" 2>&1 || PROF_RC=$?
        grep -iE "category|^ *(gemm|attention|norm|ce|quantize|optimizer|elementwise|moe|copies)" "$log" | head -14
      done
    done
  fi
  stamp "profile exit code $PROF_RC"
fi

if want torch; then
  # What a PyTorch user runs (transformers + torch.compile + SDPA + fused AdamW + BF16 autocast),
  # same shapes and batches, same GPU, same call. torch.compile takes most of this part's time.
  if python3 -c 'import torch, transformers' 2>/dev/null; then
    read -r -a configs <<<"${NIBBLE_BENCH_CONFIGS:-configs/olmo2-70m.json configs/olmo2-370m.json configs/qwen3moe-768.json}"
    read -r -a batches <<<"${NIBBLE_BENCH_BATCHES:-16 8 8}"
    targs=()
    for i in "${!configs[@]}"; do targs+=(--config "${configs[$i]}" --batch "${batches[$i]:-8}"); done
    stamp "PyTorch baseline: bench/torch_train_baseline.py ${targs[*]}"
    timeout "$(limit 300)" python3 bench/torch_train_baseline.py "${targs[@]}" --seq "${NIBBLE_BENCH_SEQ:-4096}" \
      --warmup "${NIBBLE_BENCH_WARMUP:-2}" --steps "${NIBBLE_BENCH_STEPS:-4}" \
      >"$OUT/torch_baseline.jsonl" 2>"$OUT/torch_baseline.log"
    TORCH_RC=$?; note_rc "PyTorch baseline" $TORCH_RC
    cat "$OUT/torch_baseline.jsonl"; [ $TORCH_RC = 0 ] || tail -5 "$OUT/torch_baseline.log"
    stamp "PyTorch baseline exit code $TORCH_RC"
  else
    TORCH_RC=missing; stamp "PyTorch baseline: python3 lacks torch or transformers"
  fi
fi

if command -v cuobjdump >/dev/null; then
  # SASS instruction count per kernel (the format kernels are issue-bound: this is their cost).
  cuobjdump -sass "$BIN" 2>/dev/null | awk '/Function :/ {name=$3} /^ +\/\*[0-9a-f]+\*\/ / {n[name]++} END {for (k in n) print n[k], k}' \
    | sort -k2 >"$OUT/sass_counts.txt"
  if [ -n "${NIBBLE_GPU_SASS_KERNELS:-}" ]; then
    # Full SASS of the kernels whose (mangled) name matches this regex, for reading the hot loop.
    cuobjdump -sass "$BIN" 2>/dev/null | awk -v re="$NIBBLE_GPU_SASS_KERNELS" \
      '/Function :/ {keep = ($3 ~ re)} keep' >"$OUT/sass_kernels.txt"
  fi
fi
if [ "${NIBBLE_GPU_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  # Hardware counters of five kernels on the quick (4096^2) bench: is it issue- or memory-bound?
  stamp "ncu profiles"
  for k in 'nvfp4_te_quantize_kernel<nibble::cuda::FormatsCodec, unsigned short' 'nvfp4_2level_bf16_k128_kernel<.int.2, .int.5, .bool.0' \
           'transpose_rht_requantize_kernel<nibble::cuda::FormatsCodec, .bool.1' 'rht16_transpose_bf16_kernel<.bool.1' \
           'fused_arithmetic_floor_kernel'; do
    NIBBLE_BENCH_QUICK=1 timeout 120 ncu --clock-control none --kernel-name-base demangled -k "regex:${k//[<>:,]/.}" -c 1 \
      --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section InstructionStats \
      "$BIN" --gtest_also_run_disabled_tests --gtest_filter='CudaBench.*' >>"$OUT/ncu.txt" 2>&1
  done
  grep -E "nvfp4|transpose_rht|floor_kernel|Executed Instructions  |Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|No Eligible|Duration" "$OUT/ncu.txt" | head -60
fi

# ---- the short table (also $OUT/table.txt) ------------------------------------------------------
{
  echo
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%Y-%m-%dT%H:%MZ), $(( $(date +%s) - START ))s"
  count() { [ -f "$1" ] && echo "$(grep -c '^\[       OK \]' "$1") OK, $(grep -c '^\[  FAILED  \]' "$1") failed lines, $(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$1") skipped" || echo "not run"; }
  echo "cuda backend tests rc=$TEST_RC ($(count "$OUT/tests.log"))"
  echo "op suite           rc=$OPS_RC ($(count "$OUT/ops_tests.log"))"
  echo "training step      rc=$TRAIN_RC ($(count "$OUT/train_tests.log"))"
  [ "$BENCH_RC" != skip ] && { echo "bandwidth bench    rc=$BENCH_RC"; grep -E '^(kernel |copy |nvfp4|mxfp|dequant |fused |floor|te rht)' "$OUT/bench.log"; }
  echo "bench train        rc=$BENCHT_RC   torch baseline rc=$TORCH_RC   attention rc=$ATTN_RC   dist rc=$DIST_RC   profile rc=$PROF_RC   rollout rc=$ROLL_RC   decode rc=$DEC_RC   decode graphs rc=$DG_RC   moe decode rc=$MD_RC   decode30b rc=$D30_RC   rl rc=$RL_RC   rlbench rc=$RLB_RC"
  python3 scripts/gpu_table.py "$OUT" 2>&1
} | tee "$OUT/table.txt"
ok() { [ "$1" = 0 ] || [ "$1" = skip ]; }
# A CLI without `bench train` yet, or a python3 without torch, is reported above, not a failure.
ok "$TEST_RC" && ok "$OPS_RC" && ok "$TRAIN_RC" && ok "$BENCH_RC" && ok "${BENCHT_RC/missing/skip}" && ok "${TORCH_RC/missing/skip}" && ok "$ATTN_RC" && ok "$DIST_RC" && ok "$PROF_RC" && ok "${ROLL_RC/missing/skip}" && ok "${DEC_RC/missing/skip}" && ok "$RL_RC" && ok "${RLB_RC/missing/skip}"
