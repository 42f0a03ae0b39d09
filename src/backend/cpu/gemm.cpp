// OpenBLAS-backed matrix products (see gemm.h). Row-major cblas calls; beta = 1 accumulates.
// Threading: OpenBLAS's own pthread pool is switched to one thread and the output is split into
// row (or column) blocks over nibble's OpenMP pool instead. Two pools of spinning threads on the
// same cores (OpenMP for the elementwise ops, OpenBLAS pthreads for GEMMs) were measured to be
// 4-7x slower on a 2-core machine than one shared pool. The split depends only on the shape, so
// results are the same bit for bit for any thread count.
#include "backend/cpu/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <mutex>
#include <type_traits>

#include "core/parallel.h"

extern "C" void openblas_set_num_threads(int);

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

// Below this many multiply-adds a GEMM runs on the calling thread.
constexpr int64_t kParallelGemmWork = 1 << 18;

void single_threaded_blas() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

// Runs the C (M,N) = op(A) op(B) product as independent blocks of C rows or columns, blocks of
// kGemmBlock along the longer side. The decomposition depends only on the shape (never on the
// thread count), and each block is one BLAS call on the thread that owns it, so the result is
// the same bit for bit for any number of threads. a_row(m0) / b_col(n0) give the operand
// pointers of a block starting at row m0 / column n0.
constexpr int64_t kGemmBlock = 128;

template <typename T, typename ARow, typename BCol>
void split_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t M, int64_t N, int64_t K, ARow a_row, int64_t lda,
                BCol b_col, int64_t ldb, T beta, T* c) {
  single_threaded_blas();
  if (M * N * K < kParallelGemmWork || (M <= kGemmBlock && N <= kGemmBlock)) {
    blas_gemm(ta, tb, M, N, K, a_row(0), lda, b_col(0), ldb, beta, c, N);
    return;
  }
  if (M >= N) {
    const int64_t blocks = (M + kGemmBlock - 1) / kGemmBlock;
    parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        int64_t m0 = blk * kGemmBlock, m1 = std::min(M, m0 + kGemmBlock);
        blas_gemm(ta, tb, m1 - m0, N, K, a_row(m0), lda, b_col(0), ldb, beta, c + m0 * N, N);
      }
    });
  } else {
    const int64_t blocks = (N + kGemmBlock - 1) / kGemmBlock;
    parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        int64_t n0 = blk * kGemmBlock, n1 = std::min(N, n0 + kGemmBlock);
        blas_gemm(ta, tb, M, n1 - n0, K, a_row(0), lda, b_col(n0), ldb, beta, c + n0, N);
      }
    });
  }
}

template <typename T>
void matmul_nt(T* y, const T* x, const T* w, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (empty_product(y, M, N, K, accumulate)) return;
  // x rows m: x + m*K; w^T columns n = w rows n: w + n*K
  split_gemm(CblasNoTrans, CblasTrans, M, N, K, [&](int64_t m) { return x + m * K; }, K,
             [&](int64_t n) { return w + n * K; }, K, accumulate ? T(1) : T(0), y);
}

template <typename T>
void matmul_nn(T* y, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (empty_product(y, M, N, K, accumulate)) return;
  // a rows m: a + m*K; b columns n: b + n (ld N)
  split_gemm(CblasNoTrans, CblasNoTrans, M, N, K, [&](int64_t m) { return a + m * K; }, K,
             [&](int64_t n) { return b + n; }, N, accumulate ? T(1) : T(0), y);
}

template <typename T>
void matmul_tn(T* y, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (empty_product(y, M, N, K, accumulate)) return;
  // a: (K,M), rows m of a^T are columns m of a: a + m (ld M); b columns n: b + n (ld N)
  split_gemm(CblasTrans, CblasNoTrans, M, N, K, [&](int64_t m) { return a + m; }, M,
             [&](int64_t n) { return b + n; }, N, accumulate ? T(1) : T(0), y);
}

template <typename T>
void gemm_serial(bool a_trans, bool b_trans, int64_t M, int64_t N, int64_t K, T alpha, const T* a, int64_t lda,
                 const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  single_threaded_blas();
  if (M == 0 || N == 0) return;
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, a_trans ? CblasTrans : CblasNoTrans, b_trans ? CblasTrans : CblasNoTrans, (int)M,
                (int)N, (int)K, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
  } else {
    cblas_dgemm(CblasRowMajor, a_trans ? CblasTrans : CblasNoTrans, b_trans ? CblasTrans : CblasNoTrans, (int)M,
                (int)N, (int)K, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
  }
}

template void gemm_serial<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                                 int64_t, float, float*, int64_t);
template void gemm_serial<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                                  const double*, int64_t, double, double*, int64_t);
template void matmul_nt<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, bool);
template void matmul_nt<double>(double*, const double*, const double*, int64_t, int64_t, int64_t, bool);
template void matmul_nn<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, bool);
template void matmul_nn<double>(double*, const double*, const double*, int64_t, int64_t, int64_t, bool);
template void matmul_tn<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, bool);
template void matmul_tn<double>(double*, const double*, const double*, int64_t, int64_t, int64_t, bool);

}  // namespace nibble::cpu
