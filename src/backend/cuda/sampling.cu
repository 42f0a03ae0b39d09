// Backend::greedy_rows on CUDA (see sampling.h). One block of 256 threads per row:
//  1. the first largest logit (a NaN never larger; NaN at index 0 gives 0, as the host scan) and
//     mx, by a block reduction ordered by (value, lower index): exact, order-free;
//  2. z = sum of exp_f64(l_i - mx) in softmax_f64.h's order: lane j (of 8) adds the terms
//     i = j mod 8 in ascending i, then ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)). The terms of a tile of
//     2048 ids are made by all threads into shared memory, then 8 threads add their lane's 256 in
//     order: the host's roundings, so the same bits (nvcc --fmad=false: no contraction).
// One row costs ~V/8 dependent f64 additions (~60 us at V = 100k); rows run in parallel.
#include "backend/cuda/sampling.h"

#include <cmath>

#include "core/exp_f64.h"

namespace nibble::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 2048;  // ids per tile: 16 KiB of f64 terms

__global__ void __launch_bounds__(kThreads)
    greedy_rows_kernel(int32_t* __restrict__ token, double* __restrict__ stats, const float* __restrict__ logits,
                       int64_t V) {
  __shared__ float best_v[kThreads];
  __shared__ int64_t best_i[kThreads];
  __shared__ double terms[kTile];
  __shared__ double lane_sum[8];
  const int tid = threadIdx.x;
  const float* l = logits + static_cast<int64_t>(blockIdx.x) * V;
  // 1. the first largest non-NaN logit
  float bv = -INFINITY;
  int64_t bi = V;  // none yet
  for (int64_t i = tid; i < V; i += kThreads) {
    const float v = l[i];
    if (v > bv || (v == bv && i < bi)) bv = v, bi = i;  // NaN: both false
  }
  best_v[tid] = bv, best_i[tid] = bi;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (tid < half) {
      const float v = best_v[tid + half];
      const int64_t i = best_i[tid + half];
      if (v > best_v[tid] || (v == best_v[tid] && i < best_i[tid])) best_v[tid] = v, best_i[tid] = i;
    }
    __syncthreads();
  }
  // mx: the largest as double (-inf when every logit is NaN, as softmax_scaled_max)
  const double mx = best_i[0] < V ? static_cast<double>(best_v[0]) : -INFINITY;
  // 2. the lanes' sums, tile by tile
  double s = 0.0;  // lane tid's running sum (threads 0..7)
  for (int64_t base = 0; base < V; base += kTile) {
    const int64_t n = V - base < kTile ? V - base : kTile;
    for (int64_t k = tid; k < n; k += kThreads) terms[k] = exp_f64(static_cast<double>(l[base + k]) - mx);
    __syncthreads();
    if (tid < 8)
      for (int64_t k = tid; k < n; k += 8) s = s + terms[k];
    __syncthreads();
  }
  if (tid < 8) lane_sum[tid] = s;
  __syncthreads();
  if (tid == 0) {
    const int64_t t = isnan(l[0]) || best_i[0] >= V ? 0 : best_i[0];
    const double z = ((lane_sum[0] + lane_sum[1]) + (lane_sum[2] + lane_sum[3])) +
                     ((lane_sum[4] + lane_sum[5]) + (lane_sum[6] + lane_sum[7]));
    token[blockIdx.x] = static_cast<int32_t>(t);
    double* st = stats + 3 * static_cast<int64_t>(blockIdx.x);
    st[0] = static_cast<double>(l[t]);
    st[1] = mx;
    st[2] = z;
  }
}

}  // namespace

cudaError_t greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V,
                        cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || rows > INT32_MAX || V <= 0) return cudaErrorInvalidValue;
  greedy_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(token, stats, logits, V);
  return cudaGetLastError();
}

}  // namespace nibble::cuda
