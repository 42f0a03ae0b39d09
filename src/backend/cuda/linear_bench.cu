// cuBLASLt BF16 linear forward + backward timing (linear_bench.h). Row-major operands are passed
// to column-major cuBLASLt as their transposes: Y^T (N,M) = W (N,K) . X^T; dX^T (K,M) = W^T dY^T;
// dW^T (K,N) = X^T dY (see each call). Heuristic algorithm choice with a 64 MiB workspace.
#include "backend/cuda/linear_bench.h"

#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_check.h"

namespace nibble::cuda {
namespace {

__global__ void fill_bf16_kernel(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  x[i] = __float2bfloat16((static_cast<float>(h & 0xFFFF) / 65536.0f - 0.5f) * 0.1f);
}

struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~LtGemm() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
};

// Column-major C (m,n) = op(A) . op(B); A is (ta ? k x m : m x k) with leading dim lda, etc.
void setup(LtGemm& g, cublasLtHandle_t lt, bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
           int64_t ldc, cudaDataType_t c_type, size_t workspace) {
  NIB_CUBLAS_CHECK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  NIB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  NIB_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  NIB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, ta ? k : m, ta ? m : k, lda));
  NIB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_16BF, tb ? n : k, tb ? k : n, ldb));
  NIB_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.c, c_type, m, n, ldc));
  cublasLtMatmulPreference_t pref = nullptr;
  NIB_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  NIB_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                        sizeof(workspace)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  NIB_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.a, g.b, g.c, g.c, pref, 1, &result, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  NIB_CHECK_MSG(found > 0, "cuBLASLt found no BF16 algorithm for ({}, {}, {})", m, n, k);
  g.algo = result.algo;
}

}  // namespace

Result<LinearBenchTimes> bench_bf16_linear_cublaslt(int64_t M, int64_t N, int64_t K, int repeats,
                                                    cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || repeats <= 0)
    return invalid_argument("bf16 linear bench: shape ({}, {}, {}) and repeats {} must be positive", M, N, K, repeats);
  cublasLtHandle_t lt = nullptr;
  NIB_CUBLAS_CHECK(cublasLtCreate(&lt));
  const size_t ws_bytes = size_t(64) << 20;
  __nv_bfloat16 *x = nullptr, *w = nullptr, *dy = nullptr, *y = nullptr, *dx = nullptr;
  float* dw = nullptr;
  void* ws = nullptr;
  NIB_CUDA_CHECK(cudaMalloc(&x, sizeof(__nv_bfloat16) * M * K));
  NIB_CUDA_CHECK(cudaMalloc(&w, sizeof(__nv_bfloat16) * N * K));
  NIB_CUDA_CHECK(cudaMalloc(&dy, sizeof(__nv_bfloat16) * M * N));
  NIB_CUDA_CHECK(cudaMalloc(&y, sizeof(__nv_bfloat16) * M * N));
  NIB_CUDA_CHECK(cudaMalloc(&dx, sizeof(__nv_bfloat16) * M * K));
  NIB_CUDA_CHECK(cudaMalloc(&dw, sizeof(float) * N * K));
  NIB_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  auto fill = [&](__nv_bfloat16* p, int64_t n, uint32_t seed) {
    fill_bf16_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(p, n, seed);
    NIB_CUDA_CHECK_LAUNCH();
  };
  fill(x, M * K, 1);
  fill(w, N * K, 2);
  fill(dy, M * N, 3);
  LtGemm fwd, dgrad, wgrad;
  setup(fwd, lt, true, false, N, M, K, K, K, N, CUDA_R_16BF, ws_bytes);     // Y^T = W . X^T
  setup(dgrad, lt, false, false, K, M, N, K, N, K, CUDA_R_16BF, ws_bytes);  // dX^T = W^T . dY^T
  setup(wgrad, lt, false, true, K, N, M, K, N, K, CUDA_R_32F, ws_bytes);    // dW^T = X^T . dY
  const float one = 1.0f, zero = 0.0f;
  auto run = [&](LtGemm& g, const void* A, const void* B, void* C, const float* beta) {
    NIB_CUBLAS_CHECK(cublasLtMatmul(lt, g.op, &one, A, g.a, B, g.b, beta, C, g.c, C, g.c, &g.algo, ws, ws_bytes, stream));
  };
  cudaEvent_t e0, e1;
  NIB_CUDA_CHECK(cudaEventCreate(&e0));
  NIB_CUDA_CHECK(cudaEventCreate(&e1));
  auto time = [&](auto&& fn) {
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> ms(static_cast<size_t>(repeats));
    for (int i = 0; i < repeats; ++i) {
      NIB_CUDA_CHECK(cudaEventRecord(e0, stream));
      fn();
      NIB_CUDA_CHECK(cudaEventRecord(e1, stream));
      NIB_CUDA_CHECK(cudaEventSynchronize(e1));
      NIB_CUDA_CHECK(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e-3;
  };
  LinearBenchTimes t;
  t.forward_s = time([&] { run(fwd, w, x, y, &zero); });
  t.dgrad_s = time([&] { run(dgrad, w, dy, dx, &zero); });
  t.wgrad_s = time([&] { run(wgrad, x, dy, dw, &one); });  // dW += (gradient accumulation)
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(dy), static_cast<void*>(y),
                  static_cast<void*>(dx), static_cast<void*>(dw), ws})
    NIB_CUDA_CHECK(cudaFree(p));
  cublasLtDestroy(lt);
  return t;
}

}  // namespace nibble::cuda
