// CUDA format utilities of the backend (format_ops.h): elementwise BF16 rounding through
// core/bits.h (bit-exact with the CPU), the gather/scatter of channel subsets the TetraJet-v2
// recipe's outlier split uses, and the calibration's column sums of squares, each column summed
// by one thread in row order (the CPU's order), with eight rows' loads in flight at a time.
#include "backend/cuda/format_ops.h"

#include <algorithm>

#include "core/bits.h"
#include "formats/nvfp4.h"

namespace nibble::cuda {

namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20)));
}

#define NIB_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__global__ void round_to_bf16_kernel(float* dst, const float* src, int64_t n) {
  NIB_GRID_STRIDE(i, n) dst[i] = ::nibble::round_to_bf16(src[i]);
}

__global__ void to_bf16_bits_kernel(uint16_t* dst, const float* src, int64_t n) {
  NIB_GRID_STRIDE(i, n) dst[i] = f32_to_bf16_bits(src[i]);
}

__global__ void from_bf16_bits_kernel(float* dst, const uint16_t* src, int64_t n) {
  NIB_GRID_STRIDE(i, n) dst[i] = bf16_bits_to_f32(src[i]);
}

__global__ void gather_columns_bf16_kernel(float* dst, const float* src, int64_t rows, int64_t src_cols,
                                           const int64_t* idx, int64_t n_idx, int64_t cols_p, int64_t total) {
  NIB_GRID_STRIDE(i, total) {
    const int64_t r = i / cols_p, j = i % cols_p;
    float v = 0.0f;
    if (r < rows && j < n_idx) v = ::nibble::round_to_bf16(src[r * src_cols + (idx ? idx[j] : j)]);
    dst[i] = v;
  }
}

template <bool kAccumulate>
__global__ void scatter_columns_kernel(float* dst, const float* t, int64_t K, const int64_t* idx, int64_t n_idx,
                                       int64_t ld, int64_t total) {
  NIB_GRID_STRIDE(i, total) {
    const int64_t n = i / n_idx, j = i % n_idx;
    float* d = dst + n * K + idx[j];
    if constexpr (kAccumulate)
      *d += t[n * ld + j];
    else
      *d = t[n * ld + j];
  }
}

// One thread per column k: sums[k] += x[m, k]^2 for m = 0 .. M-1 in order (double).
__global__ void column_sumsq_kernel(double* sums, const float* x, int64_t M, int64_t K) {
  const int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (k >= K) return;
  double s = sums[k];
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = x[(m + u) * K + k];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const double d = v[u];
      s += d * d;
    }
  }
  for (; m < M; ++m) {
    const double d = x[m * K + k];
    s += d * d;
  }
  sums[k] = s;
}

__global__ void nvfp4_te_alpha_kernel(float* alpha, const float* amax_a, const float* amax_b) {
  *alpha = formats::nvfp4_te_gemm_alpha(*amax_a, *amax_b);
}

}  // namespace

cudaError_t round_to_bf16(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  round_to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  return cudaGetLastError();
}

cudaError_t nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b, cudaStream_t stream) {
  nvfp4_te_alpha_kernel<<<1, 1, 0, stream>>>(alpha, amax_a, amax_b);
  return cudaGetLastError();
}

cudaError_t to_bf16_bits(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  to_bf16_bits_kernel<<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  return cudaGetLastError();
}

cudaError_t from_bf16_bits(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  from_bf16_bits_kernel<<<grid_for(n), kThreads, 0, stream>>>(dst, src, n);
  return cudaGetLastError();
}

cudaError_t gather_columns_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t src_cols,
                                const int64_t* idx, int64_t n_idx, int64_t cols_p, cudaStream_t stream) {
  const int64_t total = rows_p * cols_p;
  if (total <= 0) return cudaSuccess;
  gather_columns_bf16_kernel<<<grid_for(total), kThreads, 0, stream>>>(dst, src, rows, src_cols, idx, n_idx, cols_p,
                                                                       total);
  return cudaGetLastError();
}

cudaError_t scatter_columns(float* dst, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                            int64_t ld, bool accumulate, cudaStream_t stream) {
  const int64_t total = N * n_idx;
  if (total <= 0) return cudaSuccess;
  if (accumulate)
    scatter_columns_kernel<true><<<grid_for(total), kThreads, 0, stream>>>(dst, t, K, idx, n_idx, ld, total);
  else
    scatter_columns_kernel<false><<<grid_for(total), kThreads, 0, stream>>>(dst, t, K, idx, n_idx, ld, total);
  return cudaGetLastError();
}

cudaError_t column_sumsq_accumulate(double* sums, const float* x, int64_t M, int64_t K, cudaStream_t stream) {
  if (K <= 0 || M <= 0) return cudaSuccess;
  column_sumsq_kernel<<<static_cast<unsigned>((K + 127) / 128), 128, 0, stream>>>(sums, x, M, K);
  return cudaGetLastError();
}

}  // namespace nibble::cuda
