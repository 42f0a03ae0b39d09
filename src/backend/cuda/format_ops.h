// Launchers of the CUDA backend's small format utilities the recipes use: BF16 rounding, BF16
// bits, the channel gather (with BF16 rounding and zero padding) and its scatters, and the
// column sums of squares of outlier calibration. Each element is computed with core/bits.h's
// host+device functions, so results equal the CPU's bit for bit. Pointers are device memory;
// each launcher enqueues on `stream` and returns the launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace nibble::cuda {

// dst (n) <- round_to_bf16(src (n)) (may alias).
cudaError_t round_to_bf16(float* dst, const float* src, int64_t n, cudaStream_t stream);
// dst (n) bf16 bits <- src (n) f32, round to nearest even.
cudaError_t to_bf16_bits(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream);
// dst (n) f32 <- src (n) bf16 bits widened (exact).
cudaError_t from_bf16_bits(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream);
// alpha (1) <- formats::nvfp4_te_gemm_alpha(*amax_a, *amax_b): the BF16 GEMM's alpha of two TE
// operands, computed on the device (one thread).
cudaError_t nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b, cudaStream_t stream);
// dst (rows_p, cols_p) <- bf16(src[r, idx[j]]) for r < rows, j < n_idx (idx null: j), else 0.
// src: (rows, src_cols); idx: (n_idx) i64.
cudaError_t gather_columns_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t src_cols,
                                const int64_t* idx, int64_t n_idx, int64_t cols_p, cudaStream_t stream);
// dw[n, idx[j]] += t[n, j] (accumulate) or dst[n, idx[j]] = t[n, j], n < N, j < n_idx;
// t: (N, ld), dw/dst: (N, K). idx entries are distinct (a channel partition), so no two threads
// write one element.
cudaError_t scatter_columns(float* dst, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                            int64_t ld, bool accumulate, cudaStream_t stream);
// sums (K) f64 += column sums of squares of x (M,K), each column summed in row order in double
// (the CPU recipe's order: same bits).
cudaError_t column_sumsq_accumulate(double* sums, const float* x, int64_t M, int64_t K, cudaStream_t stream);

}  // namespace nibble::cuda
