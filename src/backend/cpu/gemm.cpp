// OpenBLAS-backed matrix products (see gemm.h). Row-major cblas calls; beta = 1 accumulates.
#include "backend/cpu/gemm.h"

#include <cblas.h>

namespace nibble::cpu {

namespace {
void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t M, int64_t N, int64_t K, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, (int)M, (int)N, (int)K, 1.0f, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}
void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t M, int64_t N, int64_t K, const double* a, int64_t lda,
               const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, (int)M, (int)N, (int)K, 1.0, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}
template <typename T>
bool empty_product(T* y, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (M == 0 || N == 0) return true;
  if (K == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M * N; ++i) y[i] = T(0);
    return true;
  }
  return false;
}
}  // namespace

template <typename T>
void matmul_nt(T* y, const T* x, const T* w, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (empty_product(y, M, N, K, accumulate)) return;
  blas_gemm(CblasNoTrans, CblasTrans, M, N, K, x, K, w, K, accumulate ? T(1) : T(0), y, N);
}

template <typename T>
void matmul_nn(T* y, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (empty_product(y, M, N, K, accumulate)) return;
  blas_gemm(CblasNoTrans, CblasNoTrans, M, N, K, a, K, b, N, accumulate ? T(1) : T(0), y, N);
}

template <typename T>
void matmul_tn(T* y, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (empty_product(y, M, N, K, accumulate)) return;
  blas_gemm(CblasTrans, CblasNoTrans, M, N, K, a, M, b, N, accumulate ? T(1) : T(0), y, N);
}

template void matmul_nt<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, bool);
template void matmul_nt<double>(double*, const double*, const double*, int64_t, int64_t, int64_t, bool);
template void matmul_nn<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, bool);
template void matmul_nn<double>(double*, const double*, const double*, int64_t, int64_t, int64_t, bool);
template void matmul_tn<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, bool);
template void matmul_tn<double>(double*, const double*, const double*, int64_t, int64_t, int64_t, bool);

}  // namespace nibble::cpu
