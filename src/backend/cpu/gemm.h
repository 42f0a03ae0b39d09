// Dense matrix products for the CPU backend, through OpenBLAS (cblas_sgemm / cblas_dgemm), and a
// batch-invariant NT product of nibble's own (matmul_nt_row_invariant) for inference.
// Convention as in CUTLASS and the spec's linear layer: A (M,K) x B (N,K) -> C (M,N), all
// row-major and contiguous. The three products a linear layer needs (forward, dgrad, wgrad)
// are spelled out so callers never pass transpose flags. Templated on float and double.
#pragma once

#include <cstdint>

namespace nibble::cpu {

// y: (M,N) = x: (M,K) . w: (N,K)^T            (y += ... when accumulate)
template <typename T>
void matmul_nt(T* y, const T* x, const T* w, int64_t M, int64_t N, int64_t K, bool accumulate = false);

// y: (M,N) = a: (M,K) . b: (K,N)              (dgrad: dx (M,K) = dy (M,N) . w (N,K))
template <typename T>
void matmul_nn(T* y, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool accumulate = false);

// y: (M,N) = a: (K,M)^T . b: (K,N)            (wgrad: dw (N,K) += dy (M,N)^T . x (M,K))
template <typename T>
void matmul_tn(T* y, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool accumulate = false);

// y: (M,N) = x: (M,K) . w: (N,K)^T (y += ... when accumulate), each y[m,n] by one fixed sequence
// of operations on x row m and w row n alone: 16 lanes over k (lane l sums k = l, l + 16, ... by
// fma, ascending; the last partial chunk zero-padded), the lanes added by a fixed tree, then y's
// old value added when accumulating. So a row's result never depends on M, on the other rows or
// on the thread count: batch-invariant (OpenBLAS's sgemm picks kernels by shape, and on some
// CPUs, e.g. its SkylakeX kernels, row m's bits change with M). For inference (Backend::
// set_batch_invariant); slower than sgemm on large M.
void matmul_nt_row_invariant(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                             bool accumulate = false);

// The raw strided product on the calling thread (for callers already inside a parallel_for):
// c: (M,N) ld ldc = alpha * op(a) . op(b) + beta * c; op(a): (M,K), op(b): (K,N); a_trans /
// b_trans select the transpose of a row-major a: (K,M) ld lda / b: (N,K) ld ldb.
template <typename T>
void gemm_serial(bool a_trans, bool b_trans, int64_t M, int64_t N, int64_t K, T alpha, const T* a, int64_t lda,
                 const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

}  // namespace nibble::cpu
