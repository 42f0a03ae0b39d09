// CUDA optimizer ops (optimizer_ops.h): AdamW with the element arithmetic of
// train/optimizer.cpp line for line (FMA contraction is off in every nibble target, and f32
// sqrt and division are IEEE-rounded, so each element gets the CPU's bits), and the sum of
// squares in double with an order fixed by n (block partials over fixed ranges, block_reduce's
// tree, then the partials summed by one block).
#include "backend/cuda/optimizer_ops.h"

#include <algorithm>
#include <climits>

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

// The sum over piece c = [c*chunk, min(n, (c+1)*chunk)) of g in a fixed order (thread stride,
// then block_reduce's tree): every block of both chunk kernels sums its piece this way.
__device__ double piece_sum_squares(const float* g, int64_t n, int64_t c, int64_t chunk, float grad_scale,
                                    double* shared) {
  const int64_t b = c * chunk, e = b + chunk < n ? b + chunk : n;
  double s = 0;
  for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) {
    const double x = static_cast<double>(g[i] * grad_scale);
    s += x * x;
  }
  return block_reduce(s, SumOp{}, 0.0, shared);
}

// One block per chunk: partial[c] = the sum of piece c.
__global__ void sum_squares_chunk_kernel(double* partial, const float* g, int64_t n, int64_t chunk, float grad_scale) {
  __shared__ double shared[33];
  const double s = piece_sum_squares(g, n, blockIdx.x, chunk, grad_scale, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// The last range whose first index (`first` of each) is <= i: ranges ascend by it.
template <typename R, typename F>
__device__ int find_range(const R* ranges, int count, int64_t i, F first) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first(ranges[mid]) <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// One block per piece of every range: partials[chunk0 + c] = the sum of the range's piece c.
__global__ void sum_squares_chunks_multi_kernel(double* partials, const SumSquaresRange* ranges, int count,
                                                int64_t chunk, float grad_scale) {
  __shared__ double shared[33];
  const int64_t c = blockIdx.x;
  const SumSquaresRange r = ranges[find_range(ranges, count, c, [](const SumSquaresRange& x) { return x.chunk0; })];
  const double s = piece_sum_squares(r.g, r.n, c - r.chunk0, chunk, grad_scale, shared);
  if (threadIdx.x == 0) partials[c] = s;
}

// Element i of AdamW (train/optimizer.cpp's order, PyTorch's single-tensor AdamW).
__device__ __forceinline__ void adamw_element(float* w, float* m, float* v, const float* grad, int64_t i,
                                              const AdamWScalars& s, bool weight_decay) {
  const float g = grad[i] * s.grad_scale;
  float wi = w[i];
  if (weight_decay) wi = wi * s.decay;                     // param.mul_(1 - lr*wd)
  const float mi = m[i] + s.one_minus_b1 * (g - m[i]);     // exp_avg.lerp_(grad, 1-beta1)
  const float vi = v[i] * s.b2 + s.one_minus_b2 * (g * g); // exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
  const float denom = sqrtf(vi) / s.bc2_sqrt + s.eps;
  m[i] = mi;
  v[i] = vi;
  w[i] = wi + (-s.step_size) * (mi / denom);               // param.addcdiv_(m, denom, -step_size)
}

__global__ void adamw_kernel(float* w, float* m, float* v, const float* grad, int64_t n, AdamWScalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    adamw_element(w, m, v, grad, i, s, s.weight_decay);
}

// Block b updates elements [(b - block0) * tile, + tile) of its range.
__global__ void adamw_multi_kernel(const AdamWMultiRange* ranges, int count, AdamWScalars s) {
  const int64_t b = blockIdx.x;
  const AdamWMultiRange r = ranges[find_range(ranges, count, b, [](const AdamWMultiRange& x) { return x.block0; })];
  const int64_t begin = (b - r.block0) * kAdamWMultiTile;
  const int64_t end = begin + kAdamWMultiTile < r.n ? begin + kAdamWMultiTile : r.n;
  const bool wd = s.weight_decay && r.weight_decay != 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) adamw_element(r.w, r.m, r.v, r.g, i, s, wd);
}

}  // namespace

cudaError_t sum_squares_chunks_multi(double* partials, const SumSquaresRange* ranges, int count, int64_t total_chunks,
                                     int64_t chunk, float grad_scale, cudaStream_t stream) {
  if (count <= 0 || total_chunks <= 0) return cudaSuccess;
  if (total_chunks > INT32_MAX) return cudaErrorInvalidValue;
  sum_squares_chunks_multi_kernel<<<static_cast<unsigned>(total_chunks), kThreads, 0, stream>>>(partials, ranges, count,
                                                                                              chunk, grad_scale);
  return cudaGetLastError();
}

cudaError_t adamw_update_multi(const AdamWMultiRange* ranges, int count, int64_t total_blocks, const AdamWScalars& s,
                               cudaStream_t stream) {
  if (count <= 0 || total_blocks <= 0) return cudaSuccess;
  if (total_blocks > INT32_MAX) return cudaErrorInvalidValue;
  adamw_multi_kernel<<<static_cast<unsigned>(total_blocks), kThreads, 0, stream>>>(ranges, count, s);
  return cudaGetLastError();
}

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
