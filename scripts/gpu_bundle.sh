#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, the self-contained bundle the GPU machine runs: the CUDA
# build's binaries (the `nibble` CLI, the CUDA backend's tests, the op-test suite over every
# backend, the train tests with their CPU-vs-CUDA step comparisons) plus every shared library
# they load that a bare CUDA image lacks (OpenBLAS, sentencepiece, fmt, spdlog, libpng, ...), in
# .gpubin/ (git-ignored; name it in the device call's `carry`), with a copy of ../shared/testdata
# (golden files; ../shared does not travel) in .gpubin/testdata. Unpacked that is ~70 MB (OpenBLAS
# alone 36), over the 64 MiB a device call carries, so it is then packed into
# .gpubin/bundle.tar.xz (~14 MB) and the unpacked files removed (NIBBLE_BUNDLE_PACK=0 keeps them
# instead); gpu_check.sh unpacks it. Then on the GPU machine:
#   NIBBLE_GPU_PREBUILT=.gpubin bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-.gpubin}
TARGETS=(nibble nibble_backend_cuda_tests nibble_backend_ops_tests nibble_train_tests nibble_model_tests nibble_dist_nccl_tests nibble_rollout_tests)
# NIBBLE_BUNDLE_CUDA_FLAGS: extra nvcc flags for this bundle (e.g. -DNIB_FA_BWD_STAGE_ROWS=1 to check a
# kernel knob on the GPU before it becomes a default); set on every configure, so it never lingers.
cmake -S . -B build/cuda -G Ninja -DNIBBLE_CUDA=ON -DNIBBLE_BENCH=OFF -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_CUDA_FLAGS=${NIBBLE_BUNDLE_CUDA_FLAGS:-}" \
  ${NIBBLE_CCACHE:+-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache} >/dev/null
cmake --build build/cuda -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}"
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/lib"
cp build/cuda/bin/nibble "$OUTDIR/"
for t in "${TARGETS[@]:1}"; do [ -x "build/cuda/tests/$t" ] && cp "build/cuda/tests/$t" "$OUTDIR/"; done
# Shared libraries outside glibc, the CUDA driver and the CUDA toolkit (the GPU machine has its
# own driver and toolkit under /usr/local/cuda, and cuBLASLt alone is larger than a carry).
for bin in "$OUTDIR"/nibble*; do
  ldd "$bin" | awk '/=> \// {print $3}'
done | sort -u | grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libcuda|libcudart|libcublas|libcublasLt|libnccl|libcudnn)\.so' | while read -r lib; do
  cp -L "$lib" "$OUTDIR/lib/"
done
if [ -d ../shared/testdata ]; then cp -r ../shared/testdata "$OUTDIR/testdata"; else echo "no ../shared/testdata: golden tests will fail"; fi
git rev-parse --short HEAD >"$OUTDIR/COMMIT"
if [ "${NIBBLE_BUNDLE_PACK:-1}" = 1 ]; then
  tar -C "$OUTDIR" -cf - . | xz -T0 -6 >"$OUTDIR.tar.xz.tmp"
  find "$OUTDIR" -mindepth 1 -delete
  mv "$OUTDIR.tar.xz.tmp" "$OUTDIR/bundle.tar.xz"
fi
du -sh "$OUTDIR"
