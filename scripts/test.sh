#!/usr/bin/env bash
# README command 2: installs what is missing, then builds and runs every test that needs no GPU.
#   1. CPU build (CUDA off), all unit/integration tests through ctest.
#   2. CUDA build where nvcc exists (compile-only without a GPU; GPU tests skip with code 77).
#   3. clang build with AddressSanitizer + UndefinedBehaviorSanitizer: unit tests once more, and
#      the safetensors parser fuzzed by libFuzzer for a bounded time.
# Environment: NIBBLE_SKIP_SETUP=1 skips the package check, NIBBLE_FUZZ_SECONDS (default 60),
# NIBBLE_SKIP_SANITIZE=1 / NIBBLE_SKIP_CUDA=1 skip steps 3 / 2 (for quick local loops).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
START=$(date +%s)
# Tests run in parallel on few cores: idle OpenMP threads must sleep, not spin.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
stamp() { echo "== [$(( $(date +%s) - START ))s] $*"; }

[ "${NIBBLE_SKIP_SETUP:-0}" = 1 ] || ./scripts/setup.sh

stamp "1/3 CPU build and tests"
cmake -S . -B build/cpu -G Ninja -DNIBBLE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpu -j "$JOBS"
ctest --test-dir build/cpu --output-on-failure -j "$JOBS" --timeout 900

if [ "${NIBBLE_SKIP_CUDA:-0}" != 1 ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  stamp "2/3 CUDA build (sm_${NIBBLE_CUDA_ARCH:-90a}); GPU tests run only where a GPU is present"
  cmake -S . -B build/cuda -G Ninja -DNIBBLE_CUDA=ON -DNIBBLE_BENCH=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build/cuda -j "$JOBS" --target nibble nibble_backend_cuda nibble_backend_cuda_tests nibble_backend_ops_tests nibble_dist_nccl_tests
  ctest --test-dir build/cuda -L gpu --output-on-failure
else
  stamp "2/3 skipped: no nvcc"
fi

if [ "${NIBBLE_SKIP_SANITIZE:-0}" != 1 ]; then
  stamp "3/3 ASan+UBSan build (clang), unit tests, fuzzing"
  CC=clang CXX=clang++ cmake -S . -B build/asan -G Ninja -DNIBBLE_CUDA=OFF -DNIBBLE_SANITIZE=ON \
    -DNIBBLE_FUZZ=ON -DNIBBLE_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build/asan -j "$JOBS"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  ctest --test-dir build/asan --output-on-failure -j "$JOBS" -LE slow --timeout 900
  for fuzzer in build/asan/bin/*_fuzz; do
    [ -x "$fuzzer" ] || continue
    name=$(basename "$fuzzer")
    corpus=build/asan/corpus/$name
    mkdir -p "$corpus"
    cp -n fuzz/corpus/"$name"/* "$corpus"/ 2>/dev/null || true
    stamp "fuzzing $name for ${NIBBLE_FUZZ_SECONDS:-60}s"
    "$fuzzer" -max_total_time="${NIBBLE_FUZZ_SECONDS:-60}" -print_final_stats=0 "$corpus" 2>&1 | tail -n 3
  done
fi
stamp "all tests passed"
