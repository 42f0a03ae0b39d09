#!/usr/bin/env bash
# What the GPU machine runs (one call does everything): build the CUDA backend's GPU tests,
# run them (golden files + CPU-vs-GPU bit-exactness), the op-test suite over every backend
# (nibble_backend_ops_tests: each op on "cpu" and "cuda" against the CPU reference; needs the
# prebuilt bundle or the CMake build: the direct nvcc build has no CPU backend), then the
# bandwidth benchmark of the format kernels against a device-to-device copy; logs go to $OUT
# (default ./gpu_out), a short table last.
# Build strategies, first that works: (1) NIBBLE_GPU_PREBUILT=<dir> holding nibble_backend_cuda_tests
# (+ lib/ with its shared libraries) built elsewhere from this tree; (2) the project's CMake build
# (-DNIBBLE_CUDA=ON -DNIBBLE_CUDA_ARCH=90a -DNIBBLE_BENCH=OFF), target nibble_backend_cuda_tests only;
# (3) a direct nvcc/g++ build of that same binary from src/ with headers carried in .gpudeps/
# (fmt header-only, nlohmann, googletest sources) for machines without the Debian packages.
# Test data: $NIBBLE_TESTDATA_DIR, else ./.testdata (a copy of ../shared/testdata). Options:
# NIBBLE_GPU_NCU=1 (ncu counters of five kernels: TE and 2-level BF16 RTN quantize, fused SR, TE wgrad RHT,
# the fused op's arithmetic floor), NIBBLE_GPU_SANITIZE=1 (compute-sanitizer).
# Files under $OUT: steps.log, tests.log, ops_tests.log, bench.log, and with the options ncu.txt, sanitizer.log,
# sass_counts.txt (instructions per kernel), and with NIBBLE_GPU_SASS_KERNELS=<regex> sass_kernels.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
export NIBBLE_TESTDATA_DIR=${NIBBLE_TESTDATA_DIR:-$ROOT/.testdata}
JOBS=$(nproc)
START=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/steps.log"; }

stamp "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/steps.log"
# A prebuilt binary names its own commit (the copied tree's git metadata may be older).
COMMIT=""
[ -n "${NIBBLE_GPU_PREBUILT:-}" ] && COMMIT=$(cat "$NIBBLE_GPU_PREBUILT/COMMIT" 2>/dev/null)
echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" | tee -a "$OUT/steps.log"

BIN=""
OPS_BIN=""  # the op-test suite, where the build strategy provides it
try_prebuilt() {
  local dir=${NIBBLE_GPU_PREBUILT:-}
  [ -n "$dir" ] && [ -x "$dir/nibble_backend_cuda_tests" ] || return 1
  export LD_LIBRARY_PATH="$ROOT/$dir/lib:${LD_LIBRARY_PATH:-}"
  if "$dir/nibble_backend_cuda_tests" --gtest_list_tests >/dev/null 2>"$OUT/prebuilt_check.err"; then
    rm -f "$OUT/prebuilt_check.err"; BIN="$ROOT/$dir/nibble_backend_cuda_tests"
    [ -x "$dir/nibble_backend_ops_tests" ] && OPS_BIN="$ROOT/$dir/nibble_backend_ops_tests"
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
  cmake --build build-gpu -j "$JOBS" --target nibble_backend_ops_tests >>"$OUT/cmake_build.log" 2>&1 \
    && OPS_BIN="$ROOT/build-gpu/tests/nibble_backend_ops_tests"
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
elif try_direct; then stamp "built directly with nvcc: $BIN"
else stamp "no build strategy worked"; exit 1; fi

stamp "GPU tests"
"$BIN" --gtest_brief=0 >"$OUT/tests.log" 2>&1
TEST_RC=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|differ|cuda tests" "$OUT/tests.log" | head -60
stamp "GPU tests exit code $TEST_RC"

OPS_RC=0
if [ -n "$OPS_BIN" ]; then
  stamp "op-test suite (every op on cpu and cuda against the CPU reference)"
  "$OPS_BIN" --gtest_brief=0 >"$OUT/ops_tests.log" 2>&1
  OPS_RC=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|unavailable" "$OUT/ops_tests.log" | head -60
  stamp "op-test suite exit code $OPS_RC"
else
  stamp "op-test suite not built by this strategy (needs the bundle or the CMake build)"
fi

stamp "bandwidth benchmark"
BENCH_RC=0
for run in $(seq "${NIBBLE_GPU_BENCH_RUNS:-1}"); do  # repeat to see the run-to-run spread
  "$BIN" --gtest_also_run_disabled_tests --gtest_filter='CudaBench.*' >>"$OUT/bench.log" 2>&1 || BENCH_RC=$?
done
stamp "bench exit code $BENCH_RC"
if [ "${NIBBLE_GPU_SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  # Out-of-bounds / misaligned accesses and races in the kernels, on the small test shapes
  # (the 2^32-input exhaustive check is left out: too slow under the sanitizer).
  stamp "compute-sanitizer memcheck + racecheck"
  timeout 240 compute-sanitizer --tool memcheck --leak-check no "$BIN" \
    --gtest_filter='CudaGolden.*:CudaVsCpu.*:ElementCodec.KernelsMatchCpu' >"$OUT/sanitizer.log" 2>&1
  echo "memcheck rc=$? $(grep 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)" | tee -a "$OUT/steps.log"
  timeout 120 compute-sanitizer --tool racecheck "$BIN" \
    --gtest_filter='CudaVsCpu.FusedBackwardOperand:CudaVsCpu.Absmax:CudaVsCpu.RhtAndTranspose' >>"$OUT/sanitizer.log" 2>&1
  echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)" | tee -a "$OUT/steps.log"
  if [ -n "$OPS_BIN" ]; then  # the op suite's CUDA cases
    timeout 300 compute-sanitizer --tool memcheck --leak-check no "$OPS_BIN" --gtest_filter='*/cuda' \
      >"$OUT/sanitizer_ops.log" 2>&1
    echo "ops memcheck rc=$? $(grep 'ERROR SUMMARY' "$OUT/sanitizer_ops.log" | tail -1)" | tee -a "$OUT/steps.log"
    timeout 300 compute-sanitizer --tool racecheck "$OPS_BIN" --gtest_filter='*/cuda' >>"$OUT/sanitizer_ops.log" 2>&1
    echo "ops racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/sanitizer_ops.log" | tail -1)" | tee -a "$OUT/steps.log"
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

echo
echo "tests rc=$TEST_RC bench rc=$BENCH_RC ($(grep -c '^\[       OK \]' "$OUT/tests.log") tests OK, $(grep -c '^\[  FAILED  \]' "$OUT/tests.log") failed lines)"
[ -n "$OPS_BIN" ] && echo "ops rc=$OPS_RC ($(grep -c '^\[       OK \]' "$OUT/ops_tests.log") op tests OK, $(grep -c '^\[  FAILED  \]' "$OUT/ops_tests.log") failed lines)"
grep -E '^(kernel |copy |nvfp4|mxfp|dequant |fused |floor|te rht)' "$OUT/bench.log" || tail -20 "$OUT/bench.log"
[ $TEST_RC = 0 ] && [ $BENCH_RC = 0 ] && [ $OPS_RC = 0 ]
