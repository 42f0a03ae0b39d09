#!/usr/bin/env bash
# README command 2: installs what is missing, then builds and runs every test that needs no GPU.
#   1. One Release build of every target and the whole ctest. Where nvcc exists the build has the
#      CUDA backend on (CPU tests run; the GPU-labelled ones skip with code 77 without a GPU);
#      without nvcc (or with NIBBLE_SKIP_CUDA=1) it is the CUDA=OFF build.
#   2. clang build with AddressSanitizer + UndefinedBehaviorSanitizer, CUDA off (so the CUDA=OFF
#      configuration is compiled on every machine): unit tests once more, and the parsers fuzzed
#      by libFuzzer for a bounded time each (the fuzzers side by side, one per core).
# Environment: NIBBLE_SKIP_SETUP=1 skips the package check, NIBBLE_FUZZ_SECONDS (default 60),
# NIBBLE_SKIP_SANITIZE=1 skips step 2, NIBBLE_SKIP_CUDA=1 builds step 1 without CUDA (quick loops).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
START=$(date +%s)
# Tests run in parallel on few cores: idle OpenMP threads must sleep, not spin.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
stamp() { echo "== [$(( $(date +%s) - START ))s] $*"; }

[ "${NIBBLE_SKIP_SETUP:-0}" = 1 ] || ./scripts/setup.sh

if [ "${NIBBLE_SKIP_CUDA:-0}" != 1 ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  CUDA=ON BUILD=build/cuda WHAT="CUDA on, sm_90a; GPU tests run only where a GPU is present"
else
  CUDA=OFF BUILD=build/cpu WHAT="CUDA off: no nvcc or NIBBLE_SKIP_CUDA=1"
fi
stamp "1/2 Release build ($WHAT) and every test"
cmake -S . -B "$BUILD" -G Ninja -DNIBBLE_CUDA=$CUDA -DNIBBLE_BENCH=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "$JOBS"
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" --timeout 900

if [ "${NIBBLE_SKIP_SANITIZE:-0}" != 1 ]; then
  stamp "2/2 ASan+UBSan build (clang, CUDA off), unit tests, fuzzing"
  # -O1 and line tables only (file:line in sanitizer reports, no variable info): the back end is
  # most of an ASan compile, and this halves it (docs/benchmarks.md "CI time").
  CC=clang CXX=clang++ cmake -S . -B build/asan -G Ninja -DNIBBLE_CUDA=OFF -DNIBBLE_SANITIZE=ON \
    -DNIBBLE_FUZZ=ON -DNIBBLE_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG" >/dev/null
  cmake --build build/asan -j "$JOBS"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  ctest --test-dir build/asan --output-on-failure -j "$JOBS" -LE slow --timeout 900
  # The fuzzers run side by side, at most JOBS at once (libFuzzer fuzzes on one thread, so each
  # still gets its whole time on a core); a crash fails the script with the fuzzer's log.
  pids=() names=()
  wait_fuzzers() {
    for i in "${!pids[@]}"; do
      if ! wait "${pids[$i]}"; then
        tail -n 40 "build/asan/${names[$i]}.log"
        echo "fuzzer ${names[$i]} failed (log: build/asan/${names[$i]}.log)"
        exit 1
      fi
      echo "${names[$i]}:"; tail -n 3 "build/asan/${names[$i]}.log"
    done
    pids=() names=()
  }
  for fuzzer in build/asan/bin/*_fuzz; do
    [ -x "$fuzzer" ] || continue
    name=$(basename "$fuzzer")
    corpus=build/asan/corpus/$name
    mkdir -p "$corpus"
    cp -n fuzz/corpus/"$name"/* "$corpus"/ 2>/dev/null || true
    stamp "fuzzing $name for ${NIBBLE_FUZZ_SECONDS:-60}s"
    "$fuzzer" -max_total_time="${NIBBLE_FUZZ_SECONDS:-60}" -print_final_stats=0 "$corpus" >"build/asan/$name.log" 2>&1 &
    pids+=($!) names+=("$name")
    [ ${#pids[@]} -lt "$JOBS" ] || wait_fuzzers
  done
  wait_fuzzers
fi
stamp "all tests passed"
