// OpenBLAS-backed matrix products (see gemm.h). Row-major cblas calls; beta = 1 accumulates.
// Threading: OpenBLAS's own pthread pool is switched to one thread and the output is split into
// row (or column) blocks over nibble's OpenMP pool instead. Two pools of spinning threads on the
// same cores (OpenMP for the elementwise ops, OpenBLAS pthreads for GEMMs) were measured to be
// 4-7x slower on a 2-core machine than one shared pool. The split depends only on the shape, so
// results are the same bit for bit for any thread count.
#include "backend/cpu/gemm.h"

#include <cblas.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
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

namespace {
// 16 float lanes, each updated by an exact fma: AVX-512, two AVX2 halves, or scalar std::fma. Every
// form gives the same bits (fma rounds once), so the row-invariant product is the same on any x86.
constexpr int kLanes = 16;
#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void fma(const Lanes& a, const Lanes& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
constexpr int kBlockRows = 4, kBlockCols = 4;  // 16 accumulators of the 32 zmm registers
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  __m256 lo, hi;
  static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void fma(const Lanes& a, const Lanes& b) {
    lo = _mm256_fmadd_ps(a.lo, b.lo, lo);
    hi = _mm256_fmadd_ps(a.hi, b.hi, hi);
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo), _mm256_storeu_ps(p + 8, hi); }
};
constexpr int kBlockRows = 2, kBlockCols = 2;  // 8 accumulators of the 16 ymm registers
#else
struct Lanes {
  float v[kLanes];
  static Lanes zero() { return {}; }
  static Lanes load(const float* p) {
    Lanes l;
    std::copy(p, p + kLanes, l.v);
    return l;
  }
  void fma(const Lanes& a, const Lanes& b) {
    for (int i = 0; i < kLanes; ++i) v[i] = std::fma(a.v[i], b.v[i], v[i]);
  }
  void store(float* p) const { std::copy(v, v + kLanes, p); }
};
constexpr int kBlockRows = 2, kBlockCols = 2;
#endif

// out[r][c] = dot(x[r], w[c]) over K in the fixed order of matmul_nt_row_invariant (lane l: fma over
// k = l, l + 16, ..., ascending; the last partial chunk zero-padded; then lanes added by a fixed
// tree), for an R x C block of rows and weights. The per-output operations are the same for every
// R, C, so edge blocks give the bits of full ones.
template <int R, int C>
inline void dot_block(float (&out)[R][C], const float* const (&x)[R], const float* const (&w)[C], int64_t K) {
  Lanes acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Lanes::zero();
  const int64_t k_full = K / kLanes * kLanes;
  for (int64_t k = 0; k < k_full; k += kLanes) {
    Lanes xv[R];
    for (int r = 0; r < R; ++r) xv[r] = Lanes::load(x[r] + k);
    for (int c = 0; c < C; ++c) {
      const Lanes wv = Lanes::load(w[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c].fma(xv[r], wv);
    }
  }
  if (k_full < K) {  // the last partial chunk, zero-padded
    alignas(64) float t[kLanes] = {};
    Lanes xv[R];
    for (int r = 0; r < R; ++r) {
      std::copy(x[r] + k_full, x[r] + K, t);
      xv[r] = Lanes::load(t);
    }
    for (int c = 0; c < C; ++c) {
      std::copy(w[c] + k_full, w[c] + K, t);
      const Lanes wv = Lanes::load(t);
      for (int r = 0; r < R; ++r) acc[r][c].fma(xv[r], wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      alignas(64) float a[kLanes];
      acc[r][c].store(a);
      for (int half = kLanes / 2; half >= 1; half /= 2)
        for (int l = 0; l < half; ++l) a[l] += a[l + half];
      out[r][c] = a[0];
    }
}

// The R x C block of y at rows m.., columns n.. (y = x . w^T, y += when accumulating).
template <int R, int C>
inline void store_block(float* y, const float* x, const float* w, int64_t m, int64_t n, int64_t N, int64_t K,
                        bool accumulate) {
  const float* xr[R];
  const float* wr[C];
  for (int r = 0; r < R; ++r) xr[r] = x + (m + r) * K;
  for (int c = 0; c < C; ++c) wr[c] = w + (n + c) * K;
  float out[R][C];
  dot_block<R, C>(out, xr, wr, K);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float& dst = y[(m + r) * N + n + c];
      dst = accumulate ? out[r][c] + dst : out[r][c];
    }
}
}  // namespace

void matmul_nt_row_invariant(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                             bool accumulate) {
  if (empty_product(y, M, N, K, accumulate)) return;
  constexpr int64_t kCols = 64;  // weight rows a task owns (a shape-only split: any thread count)
  parallel_for((N + kCols - 1) / kCols, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kCols, n1 = std::min(N, n0 + kCols);
      constexpr int R = kBlockRows, C = kBlockCols;
      int64_t m = 0;
      for (; m + R <= M; m += R) {
        int64_t n = n0;
        for (; n + C <= n1; n += C) store_block<R, C>(y, x, w, m, n, N, K, accumulate);
        for (; n < n1; ++n) store_block<R, 1>(y, x, w, m, n, N, K, accumulate);
      }
      for (; m < M; ++m) {
        int64_t n = n0;
        for (; n + C <= n1; n += C) store_block<1, C>(y, x, w, m, n, N, K, accumulate);
        for (; n < n1; ++n) store_block<1, 1>(y, x, w, m, n, N, K, accumulate);
      }
    }
  });
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
