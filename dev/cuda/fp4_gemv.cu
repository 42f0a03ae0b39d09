// Sandbox (spec 06 principle 7) for the rollout engine's decode GEMV on packed two-level NVFP4
// weights, issue #15 §4: the kernel of src/backend/cuda/fp4_gemv.cuh (included, not copied), a
// double CPU reference on the dequantized weights, a check within the FP32 accumulation bound
// |y - y_ref| <= 2 (K + 2) u sum_k |w_k x_k| (u = 2^-24: any summation order of K terms), and
// timing against cuBLASLt's BF16 GEMM (M x N x K, FP32 accumulation) of the dequantized weights
// rounded to BF16 at the OLMo-2 1B decode shapes, batches 1, 16, 64. No dependency beyond CUDA:
//   nvcc -O3 -std=c++17 -arch=sm_90a --fmad=false dev/cuda/fp4_gemv.cu -lcublasLt -o fp4_gemv && ./fp4_gemv
// Exits non-zero when a check fails.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "sandbox_check.h"

#include "../../src/backend/cuda/fp4_gemv.cuh"


namespace g = nibble_fp4_gemv;

struct Weights {
  int N, K;
  std::vector<uint8_t> codes, inner;
  std::vector<float> outer;
  std::vector<float> deq;  // (N, K) dequantized
};

// Random codes, inner scales in E4M3's normal range and a few subnormal/zero ones, outer scales
// around 1/2688 (as the quantizer makes for N(0, 1) weights).
Weights random_weights(int N, int K, uint32_t seed) {
  std::mt19937 rng(seed);
  Weights w{N, K, {}, {}, {}, {}};
  w.codes.resize(size_t(N) * K / 2);
  w.inner.resize(size_t(N) * K / 16);
  w.outer.resize(size_t(N) * ((K + 127) / 128));
  for (auto& c : w.codes) c = uint8_t(rng());
  for (auto& s : w.inner) {
    uint32_t r = rng() % 64;
    s = r == 0 ? 0 : r == 1 ? uint8_t(rng() % 8) : uint8_t(0x30 + rng() % 0x40);
  }
  for (auto& o : w.outer) o = std::ldexp(1.0f + float(rng() % 1024) / 1024.0f, -12);
  w.deq.resize(size_t(N) * K);
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const float sp = g::e4m3_to_f32(w.inner[size_t(n) * K / 16 + k / 16]) * w.outer[size_t(n) * ((K + 127) / 128) + k / 128];
      const uint32_t code = (w.codes[(size_t(n) * K + k) / 2] >> ((k & 1) * 4)) & 0xFu;
      w.deq[size_t(n) * K + k] = g::decode(code, sp);
    }
  return w;
}

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// cuBLASLt: y (M, N) f32 = x (M, K) bf16 . w (N, K) bf16 ^T, row-major, as column-major
// y^T (N, M) = w (K, N)^T-op . x^T (K, M).
struct LtGemm {
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, c;
  cublasLtMatmulAlgo_t algo;
  void* ws;
  size_t ws_bytes = 32 << 20;
  LtGemm(int M, int N, int K) {
    CKB(cublasLtCreate(&h));
    CKB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    CKB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt));
    CKB(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, K, N, K));
    CKB(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, K, M, K));
    CKB(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, N, M, N));
    CK(cudaMalloc(&ws, ws_bytes));
    cublasLtMatmulPreference_t pref;
    CKB(cublasLtMatmulPreferenceCreate(&pref));
    CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    CKB(cublasLtMatmulAlgoGetHeuristic(h, op, a, b, c, c, pref, 1, &res, &found));
    if (found == 0) {
      std::fprintf(stderr, "cuBLASLt: no algorithm for %d x %d x %d\n", M, N, K);
      std::exit(2);
    }
    algo = res.algo;
    cublasLtMatmulPreferenceDestroy(pref);
  }
  void run(float* y, const __nv_bfloat16* x, const __nv_bfloat16* w) {
    const float one = 1.0f, zero = 0.0f;
    CKB(cublasLtMatmul(h, op, &one, w, a, x, b, &zero, y, c, y, c, &algo, ws, ws_bytes, 0));
  }
  ~LtGemm() {
    cublasLtMatrixLayoutDestroy(a), cublasLtMatrixLayoutDestroy(b), cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(h);
    cudaFree(ws);
  }
};

template <typename F>
float time_ms(F&& f, int reps) {
  cudaEvent_t s, e;
  CK(cudaEventCreate(&s));
  CK(cudaEventCreate(&e));
  for (int i = 0; i < 3; ++i) f();
  CK(cudaEventRecord(s));
  for (int i = 0; i < reps; ++i) f();
  CK(cudaEventRecord(e));
  CK(cudaEventSynchronize(e));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, s, e));
  cudaEventDestroy(s), cudaEventDestroy(e);
  return ms / reps;
}

int main() {
  int failures = 0;
  // correctness: odd shapes (N not a multiple of the warps, K with a partial outer block), all M paths
  struct Shape { int M, N, K; };
  for (Shape sh : {Shape{1, 37, 96}, Shape{1, 130, 2048}, Shape{1, 2048, 8192}, Shape{3, 64, 160}, Shape{8, 130, 256},
                   Shape{13, 64, 2048}, Shape{64, 33, 512}}) {
    Weights w = random_weights(sh.N, sh.K, 7 + sh.N);
    std::mt19937 rng(11);
    std::normal_distribution<float> nd;
    std::vector<float> x(size_t(sh.M) * sh.K);
    for (auto& v : x) v = __bfloat162float(__float2bfloat16(nd(rng)));  // the BF16 activation
    uint8_t* dc = to_device(w.codes);
    uint8_t* di = to_device(w.inner);
    float* dout = to_device(w.outer);
    float* dx = to_device(x);
    float* dy = nullptr;
    CK(cudaMalloc(&dy, size_t(sh.M) * sh.N * sizeof(float)));
    CK(g::nvfp4_gemv(dy, dx, dc, di, dout, sh.M, sh.N, sh.K, 0));
    std::vector<float> y(size_t(sh.M) * sh.N);
    CK(cudaMemcpy(y.data(), dy, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int m = 0; m < sh.M; ++m)
      for (int n = 0; n < sh.N; ++n) {
        double ref = 0, mag = 0;
        for (int k = 0; k < sh.K; ++k) {
          ref += double(w.deq[size_t(n) * sh.K + k]) * x[size_t(m) * sh.K + k];
          mag += std::fabs(double(w.deq[size_t(n) * sh.K + k]) * x[size_t(m) * sh.K + k]);
        }
        const double bound = 2.0 * (sh.K + 2) * 0x1.0p-24 * mag;
        const double err = std::fabs(y[size_t(m) * sh.N + n] - ref);
        worst = std::max(worst, bound > 0 ? err / bound : err);
        if (!(err <= bound)) {
          if (failures < 10) std::printf("FAIL M=%d N=%d K=%d y[%d,%d] = %.9g ref %.9g bound %.3g\n", sh.M, sh.N, sh.K, m, n, y[size_t(m) * sh.N + n], ref, bound);
          ++failures;
        }
      }
    // determinism: the same bits again
    std::vector<float> y2(y.size());
    CK(g::nvfp4_gemv(dy, dx, dc, di, dout, sh.M, sh.N, sh.K, 0));
    CK(cudaMemcpy(y2.data(), dy, y2.size() * sizeof(float), cudaMemcpyDeviceToHost));
    if (std::memcmp(y.data(), y2.data(), y.size() * sizeof(float)) != 0) {
      std::printf("FAIL M=%d N=%d K=%d: a second run gave other bits\n", sh.M, sh.N, sh.K);
      ++failures;
    }
    if (sh.M == 1) {  // the column-blocked M = 1 kernel gives the per-column kernel's bits
      const int per_block = g::kWarpsPerBlock * g::kColsPerWarp;
      g::nvfp4_gemv_row_kernel<<<(sh.N + per_block - 1) / per_block, g::kWarpsPerBlock * 32>>>(dy, dx, dc, di, dout,
                                                                                            sh.N, sh.K);
      CK(cudaGetLastError());
      CK(cudaMemcpy(y.data(), dy, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
      const dim3 grid((sh.N + g::kWarpsPerBlock - 1) / g::kWarpsPerBlock, 1);
      g::nvfp4_gemv_kernel<1><<<grid, g::kWarpsPerBlock * 32>>>(dy, dx, dc, di, dout, 1, sh.N, sh.K);
      CK(cudaGetLastError());
      CK(cudaMemcpy(y2.data(), dy, y2.size() * sizeof(float), cudaMemcpyDeviceToHost));
      if (std::memcmp(y.data(), y2.data(), y.size() * sizeof(float)) != 0) {
        std::printf("FAIL M=1 N=%d K=%d: the row kernel and the per-column kernel differ\n", sh.N, sh.K);
        ++failures;
      }
    }
    std::printf("check M=%-3d N=%-4d K=%-5d worst err / bound = %.3f\n", sh.M, sh.N, sh.K, worst);
    cudaFree(dc), cudaFree(di), cudaFree(dout), cudaFree(dx), cudaFree(dy);
  }
  // timing: OLMo-2 1B decode linears (hidden 2048, intermediate 8192, 16 heads of 128)
  std::printf("\n%-10s %5s %6s %6s %10s %10s %8s %10s %10s\n", "linear", "M", "N", "K", "fp4 us", "bf16 us", "speedup",
              "fp4 GB/s", "bf16 GB/s");
  struct Lin { const char* name; int N, K; };
  for (Lin l : {Lin{"qkv", 6144, 2048}, Lin{"o", 2048, 2048}, Lin{"gate_up", 16384, 2048}, Lin{"down", 2048, 8192}})
    for (int M : {1, 16, 64}) {
      Weights w = random_weights(l.N, l.K, 3);
      std::vector<__nv_bfloat16> wb(w.deq.size()), xb(size_t(M) * l.K);
      for (size_t i = 0; i < wb.size(); ++i) wb[i] = __float2bfloat16(w.deq[i]);
      std::vector<float> x(size_t(M) * l.K);
      std::mt19937 rng(5);
      std::normal_distribution<float> nd;
      for (size_t i = 0; i < x.size(); ++i) xb[i] = __float2bfloat16(x[i] = nd(rng));
      uint8_t* dc = to_device(w.codes);
      uint8_t* di = to_device(w.inner);
      float* dout = to_device(w.outer);
      float* dx = to_device(x);
      __nv_bfloat16* dwb = to_device(wb);
      __nv_bfloat16* dxb = to_device(xb);
      float* dy = nullptr;
      CK(cudaMalloc(&dy, size_t(M) * l.N * sizeof(float)));
      LtGemm lt(M, l.N, l.K);
      const float fp4 = time_ms([&] { CK(g::nvfp4_gemv(dy, dx, dc, di, dout, M, l.N, l.K, 0)); }, 50);
      const float bf = time_ms([&] { lt.run(dy, dxb, dwb); }, 50);
      if (M == 1) {  // the per-column kernel the M = 1 path replaced, for the record
        const dim3 grid((l.N + g::kWarpsPerBlock - 1) / g::kWarpsPerBlock, 1);
        const float col = time_ms([&] {
          g::nvfp4_gemv_kernel<1><<<grid, g::kWarpsPerBlock * 32>>>(dy, dx, dc, di, dout, 1, l.N, l.K);
          CK(cudaGetLastError());
        }, 50);
        std::printf("%-10s %5d %6d %6d %10.2f   (per-column kernel, before)\n", l.name, M, l.N, l.K, col * 1e3);
      }
      const double fp4_bytes = double(l.N) * l.K * (0.5 + 1.0 / 16) + 4.0 * l.N * ((l.K + 127) / 128) +
                               4.0 * M * l.K + 4.0 * M * l.N;
      const double bf_bytes = 2.0 * l.N * l.K + 2.0 * M * l.K + 4.0 * M * l.N;
      std::printf("%-10s %5d %6d %6d %10.2f %10.2f %8.2f %10.0f %10.0f\n", l.name, M, l.N, l.K, fp4 * 1e3, bf * 1e3,
                  bf / fp4, fp4_bytes / (fp4 * 1e-3) / 1e9, bf_bytes / (bf * 1e-3) / 1e9);
      cudaFree(dc), cudaFree(di), cudaFree(dout), cudaFree(dx), cudaFree(dwb), cudaFree(dxb), cudaFree(dy);
    }
  if (failures) {
    std::printf("%d checks FAILED\n", failures);
    return 1;
  }
  std::printf("all checks passed\n");
  return 0;
}
