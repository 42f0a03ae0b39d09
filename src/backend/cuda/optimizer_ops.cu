// CUDA optimizer ops (optimizer_ops.h): AdamW with the element arithmetic of
// train/optimizer.cpp line for line (FMA contraction is off in every nibble target, and f32
// sqrt and division are IEEE-rounded, so each element gets the CPU's bits), and the sum of
// squares in double with an order fixed by n (block partials over fixed ranges, block_reduce's
// tree, then the partials summed by one block).
#include "backend/cuda/optimizer_ops.h"

#include <algorithm>

#include "backend/cuda/block_reduce.cuh"

namespace nibble::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxSumBlocks = 1024;
constexpr int64_t kElemsPerBlock = 16 * kThreads;  // before the block count is capped

int64_t sum_blocks(int64_t n) { return std::max<int64_t>(1, std::min(kMaxSumBlocks, (n + kElemsPerBlock - 1) / kElemsPerBlock)); }

// partial (gridDim.x) <- sums over the grid-stride ranges of each block.
__global__ void sum_squares_partial_kernel(double* partial, const float* g, int64_t n, float grad_scale) {
  __shared__ double shared[33];
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double x = static_cast<double>(g[i] * grad_scale);
    s += x * x;
  }
  s = block_reduce(s, SumOp{}, 0.0, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(double* out, const double* partial, int64_t count) {
  __shared__ double shared[33];
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = block_reduce(s, SumOp{}, 0.0, shared);
  if (threadIdx.x == 0) out[0] = s;
}

// One block per chunk: partial[c] = sum over [c*chunk, min(n, (c+1)*chunk)) in a fixed order.
__global__ void sum_squares_chunk_kernel(double* partial, const float* g, int64_t n, int64_t chunk, float grad_scale) {
  __shared__ double shared[33];
  const int64_t b = blockIdx.x * chunk, e = b + chunk < n ? b + chunk : n;
  double s = 0;
  for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
    const double x = static_cast<double>(g[i] * grad_scale);
    s += x * x;
  }
  s = block_reduce(s, SumOp{}, 0.0, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void adamw_kernel(float* w, float* m, float* v, const float* grad, int64_t n, AdamWScalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = grad[i] * s.grad_scale;
    float wi = w[i];
    if (s.weight_decay) wi = wi * s.decay;                   // param.mul_(1 - lr*wd)
    const float mi = m[i] + s.one_minus_b1 * (g - m[i]);     // exp_avg.lerp_(grad, 1-beta1)
    const float vi = v[i] * s.b2 + s.one_minus_b2 * (g * g); // exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
    const float denom = sqrtf(vi) / s.bc2_sqrt + s.eps;
    m[i] = mi;
    v[i] = vi;
    w[i] = wi + (-s.step_size) * (mi / denom);               // param.addcdiv_(m, denom, -step_size)
  }
}

}  // namespace

size_t sum_squares_workspace_bytes(int64_t n) { return static_cast<size_t>(sum_blocks(n)) * sizeof(double); }

cudaError_t sum_squares(double* out, const float* g, int64_t n, float grad_scale, void* workspace,
                        cudaStream_t stream) {
  const int64_t blocks = sum_blocks(n);
  auto* partial = static_cast<double*>(workspace);
  sum_squares_partial_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(partial, g, std::max<int64_t>(n, 0),
                                                                                   grad_scale);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  sum_partials_kernel<<<1, 1024, 0, stream>>>(out, partial, blocks);
  return cudaGetLastError();
}

cudaError_t sum_squares_chunks(double* partials, const float* g, int64_t n, int64_t chunk, float grad_scale,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t count = (n + chunk - 1) / chunk;
  sum_squares_chunk_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(partials, g, n, chunk, grad_scale);
  return cudaGetLastError();
}

cudaError_t adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s,
                         cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20));
  adamw_kernel<<<blocks, kThreads, 0, stream>>>(w, m, v, g, n, s);
  return cudaGetLastError();
}

}  // namespace nibble::cuda
