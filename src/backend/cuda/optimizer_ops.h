// Launchers of the CUDA backend's optimizer ops: the fixed-order sum of squares behind the
// global gradient norm, and AdamW on one flat range in exactly the FP32 operation order of
// train/optimizer.cpp (PyTorch's single-tensor AdamW), so the update has the CPU's bits.
// Pointers are device memory; each launcher enqueues on `stream` and returns the launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace nibble::cuda {

// out: (1) f64 device <- sum_i double(g[i] * grad_scale)^2, in an order fixed by n alone
// (per-block partials over fixed ranges, then one block sums them). workspace: bytes below.
size_t sum_squares_workspace_bytes(int64_t n);
cudaError_t sum_squares(double* out, const float* g, int64_t n, float grad_scale, void* workspace,
                        cudaStream_t stream);

// partials: (ceil(n / chunk)) f64 device <- the sum of squares of each consecutive `chunk`-element
// piece of g (n) times grad_scale, one block per piece, in a fixed order.
cudaError_t sum_squares_chunks(double* partials, const float* g, int64_t n, int64_t chunk, float grad_scale,
                               cudaStream_t stream);

// The step's scalars, computed on the host as train/optimizer.cpp does (from doubles, then f32).
struct AdamWScalars {
  float decay = 1;         // 1 - lr * weight_decay
  bool weight_decay = false;
  float one_minus_b1 = 0, b2 = 0, one_minus_b2 = 0;
  float step_size = 0;     // lr / (1 - beta1^t)
  float bc2_sqrt = 1;      // sqrt(1 - beta2^t)
  float eps = 0;
  float grad_scale = 1;
};
// w, m, v: (n) updated in place from g: (n).
cudaError_t adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s,
                         cudaStream_t stream);

// ---- multi-range forms: one launch for a whole parameter list (descriptors in device memory) ----
// A range of sum_squares_chunks_multi: its pieces are partials[chunk0 ..].
struct SumSquaresRange {
  const float* g;
  int64_t n;       // > 0
  int64_t chunk0;  // index of its first piece; ascending over the ranges
};
// partials (total_chunks) <- every range's sum_squares_chunks pieces, each as that kernel sums it.
cudaError_t sum_squares_chunks_multi(double* partials, const SumSquaresRange* ranges, int count, int64_t total_chunks,
                                     int64_t chunk, float grad_scale, cudaStream_t stream);
// A range of adamw_update_multi: blocks [block0, block0 + ceil(n / kAdamWMultiTile)) update it.
constexpr int64_t kAdamWMultiTile = 4096;
struct AdamWMultiRange {
  float* w;
  float* m;
  float* v;
  const float* g;
  int64_t n;       // > 0
  int64_t block0;  // ascending over the ranges
  int weight_decay;
};
// Each range updated as adamw_update would (s.weight_decay where the range has it).
cudaError_t adamw_update_multi(const AdamWMultiRange* ranges, int count, int64_t total_blocks, const AdamWScalars& s,
                               cudaStream_t stream);

}  // namespace nibble::cuda
