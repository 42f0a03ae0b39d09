// Sandbox (spec 06 principle 7) for the small-batch GEMM on packed two-level NVFP4 weights with BF16
// tensor cores, issue #15 §4: the kernels of src/backend/cuda/fp4_weight_mma.cuh (included, not
// copied) against a double CPU reference on the dequantized weights within the bound of
// src/backend/ops_test/packed_weight_gemm_test.cpp (odd shapes, BF16 and FP32 activations, forced K
// splits), then timing of the GEMV (fp4_gemv.cuh), the tensor-core kernel (automatic K split and a
// sweep of forced splits) and cuBLASLt's BF16 GEMM (FP32 accumulation) of the dequantized weights
// rounded to BF16, at the OLMo-2 1B decode linears (fused qkv 6144x2048, o 2048x2048, fused
// gate|up 16384x2048, down 2048x8192) and M = 1, 16, 64, 256, with a sum over the 16 layers.
// No dependency beyond CUDA:
//   nvcc -O3 -std=c++17 -arch=sm_90a --fmad=false dev/cuda/fp4_weight_gemm.cu -lcublasLt -o fp4_weight_gemm && ./fp4_weight_gemm
// Exits non-zero when a check fails.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "sandbox_check.h"

#include "../../src/backend/cuda/fp4_weight_mma.cuh"

namespace g = nibble_fp4_gemv;

struct Weights {
  int N, K;
  std::vector<uint8_t> codes, inner;
  std::vector<float> outer;
  std::vector<float> deq;  // (N, K) dequantized: +-(e2m1 * fl(e4m3 * outer)), as Backend::dequantize
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
  CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// The op test's bound (packed_weight_gemm_test.cpp): 2 max(K + 2, 2 + 288 parts + 2 ceil(K/128)) u mag.
double bound_of(int K, bool x_bf16, double mag) {
  const double tc = 2.0 + 288.0 * (x_bf16 ? 1 : 3) + 2.0 * ((K + 127) / 128);
  return 2.0 * std::max(double(K + 2), tc) * 0x1.0p-24 * mag;
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
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // correctness: the dispatcher (GEMV for M <= 8) and the MMA kernel with forced splits, odd
  // shapes (N % 64 != 0, K % 128 != 0, M across the 16/32/64-row tiles and past 64)
  struct Shape { int M, N, K; bool x_bf16; int split; };
  for (Shape sh : {Shape{3, 64, 160, true, 0}, Shape{8, 130, 256, true, 0}, Shape{9, 37, 96, true, 0},
                   Shape{16, 64, 128, true, 0}, Shape{17, 130, 160, true, 0}, Shape{33, 65, 224, true, 0},
                   Shape{64, 200, 2048, true, 0}, Shape{70, 64, 352, true, 0}, Shape{256, 96, 1024, true, 0},
                   Shape{40, 70, 288, false, 0}, Shape{12, 48, 512, false, 0}, Shape{33, 130, 1024, true, 3},
                   Shape{64, 64, 2048, true, 16}, Shape{20, 40, 640, false, 5}}) {
    Weights w = random_weights(sh.N, sh.K, 7 + sh.N);
    std::mt19937 rng(11 + sh.M);
    std::normal_distribution<float> nd;
    std::vector<float> x(size_t(sh.M) * sh.K);
    for (auto& v : x) v = sh.x_bf16 ? __bfloat162float(__float2bfloat16(nd(rng))) : nd(rng);
    uint8_t* dc = to_device(w.codes);
    uint8_t* di = to_device(w.inner);
    float* dout = to_device(w.outer);
    float* dx = to_device(x);
    float* dy = nullptr;
    CK(cudaMalloc(&dy, size_t(sh.M) * sh.N * sizeof(float)));
    const size_t ws_bytes = sh.split > 0 ? g::nvfp4_mma_workspace_bytes(sh.M, sh.N, sh.K, sh.split)
                                         : g::nvfp4_weight_gemm_workspace_bytes(sh.M, sh.N, sh.K);
    void* ws = nullptr;
    if (ws_bytes > 0) CK(cudaMalloc(&ws, ws_bytes));
    auto run = [&] {
      if (sh.split > 0) return g::nvfp4_mma(dy, dx, dc, di, dout, sh.M, sh.N, sh.K, ws, ws_bytes, 0, sh.split);
      return g::nvfp4_weight_gemm(dy, dx, dc, di, dout, sh.M, sh.N, sh.K, ws, ws_bytes, 0);
    };
    CK(run());
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
        const double bound = bound_of(sh.K, sh.x_bf16, mag);
        const double err = std::fabs(y[size_t(m) * sh.N + n] - ref);
        worst = std::max(worst, bound > 0 ? err / bound : err);
        if (!(err <= bound)) {
          if (failures < 10) std::printf("FAIL M=%d N=%d K=%d y[%d,%d] = %.9g ref %.9g bound %.3g\n", sh.M, sh.N, sh.K, m, n, y[size_t(m) * sh.N + n], ref, bound);
          ++failures;
        }
      }
    std::vector<float> y2(y.size());  // determinism: the same bits again
    CK(run());
    CK(cudaMemcpy(y2.data(), dy, y2.size() * sizeof(float), cudaMemcpyDeviceToHost));
    if (std::memcmp(y.data(), y2.data(), y.size() * sizeof(float)) != 0) {
      std::printf("FAIL M=%d N=%d K=%d: a second run gave other bits\n", sh.M, sh.N, sh.K);
      ++failures;
    }
    // batch invariance of the MMA path: the first 9 rows alone give the same bits (automatic split)
    if (sh.M > 9 && sh.split == 0) {
      std::vector<float> y9(size_t(9) * sh.N);
      CK(g::nvfp4_weight_gemm(dy, dx, dc, di, dout, 9, sh.N, sh.K, ws, ws_bytes, 0));
      CK(cudaMemcpy(y9.data(), dy, y9.size() * sizeof(float), cudaMemcpyDeviceToHost));
      if (std::memcmp(y.data(), y9.data(), y9.size() * sizeof(float)) != 0) {
        std::printf("FAIL M=%d N=%d K=%d: rows 0..8 differ when run with M = 9\n", sh.M, sh.N, sh.K);
        ++failures;
      }
    }
    std::printf("check M=%-3d N=%-4d K=%-5d x %s split %-2d worst err / bound = %.4f\n", sh.M, sh.N, sh.K,
                sh.x_bf16 ? "bf16" : "f32 ", sh.split, worst);
    cudaFree(dc), cudaFree(di), cudaFree(dout), cudaFree(dx), cudaFree(dy), cudaFree(ws);
  }

  // timing: OLMo-2 1B decode linears (hidden 2048, intermediate 8192, 16 layers)
  std::printf("\n%d SMs. fp4 bytes: codes + scales + x f32 + y f32; MMA split S auto = %d blocks/SM target\n", sms,
              g::kMmaBlocksPerSm);
  std::printf("%-8s %4s %6s %5s %9s %9s %4s %9s %9s %8s %8s %8s\n", "linear", "M", "N", "K", "gemv us", "mma us", "S",
              "best-S us", "bf16 us", "vs bf16", "mma GB/s", "TFLOP/s");
  struct Lin { const char* name; int N, K; };
  const Lin lins[] = {{"qkv", 6144, 2048}, {"o", 2048, 2048}, {"gate_up", 16384, 2048}, {"down", 2048, 8192}};
  const int Ms[] = {1, 16, 64, 256};
  struct Row { float gemv, mma, best, bf; int s_auto, best_s; double bytes, flops; };
  Row rows[4][4];
  for (int li = 0; li < 4; ++li) {  // one weight per linear (the host decode of 33 M weights is slow), every M
    const Lin l = lins[li];
    Weights w = random_weights(l.N, l.K, 3);
    std::vector<__nv_bfloat16> wb(w.deq.size());
    for (size_t i = 0; i < wb.size(); ++i) wb[i] = __float2bfloat16(w.deq[i]);
    uint8_t* dc = to_device(w.codes);
    uint8_t* di = to_device(w.inner);
    float* dout = to_device(w.outer);
    __nv_bfloat16* dwb = to_device(wb);
    for (int mi = 0; mi < 4; ++mi) {
      const int M = Ms[mi];
      std::vector<__nv_bfloat16> xb(size_t(M) * l.K);
      std::vector<float> x(size_t(M) * l.K);
      std::mt19937 rng(5);
      std::normal_distribution<float> nd;
      for (size_t i = 0; i < x.size(); ++i) xb[i] = __float2bfloat16(nd(rng)), x[i] = __bfloat162float(xb[i]);
      float* dx = to_device(x);
      __nv_bfloat16* dxb = to_device(xb);
      float* dy = nullptr;
      CK(cudaMalloc(&dy, size_t(M) * l.N * sizeof(float)));
      const int chunks = (l.K + 127) / 128;
      void* ws = nullptr;
      const size_t ws_bytes = size_t(chunks) * M * l.N * sizeof(float);  // enough for any split
      CK(cudaMalloc(&ws, ws_bytes));
      LtGemm lt(M, l.N, l.K);
      Row& r = rows[mi][li];
      r.gemv = time_ms([&] { CK(g::nvfp4_gemv(dy, dx, dc, di, dout, M, l.N, l.K, 0)); }, 50);
      r.mma = time_ms([&] { CK(g::nvfp4_mma(dy, dx, dc, di, dout, M, l.N, l.K, ws, ws_bytes, 0)); }, 50);
      r.s_auto = g::nvfp4_mma_splits(l.N, l.K, sms);
      r.best = r.mma, r.best_s = r.s_auto;
      for (int s : {1, 2, 4, 8, 16, 32}) {
        if (g::nvfp4_mma_splits(l.N, l.K, sms, s) != s) continue;  // not an even split of the chunks
        const float t = time_ms([&] { CK(g::nvfp4_mma(dy, dx, dc, di, dout, M, l.N, l.K, ws, ws_bytes, 0, s)); }, 50);
        if (t < r.best) r.best = t, r.best_s = s;
      }
      r.bf = time_ms([&] { lt.run(dy, dxb, dwb); }, 50);
      r.bytes = double(l.N) * l.K * (0.5 + 1.0 / 16) + 4.0 * l.N * chunks + 4.0 * M * l.K + 4.0 * M * l.N;
      r.flops = 2.0 * M * l.N * l.K;
      cudaFree(dx), cudaFree(dxb), cudaFree(dy), cudaFree(ws);
    }
    cudaFree(dc), cudaFree(di), cudaFree(dout), cudaFree(dwb);
  }
  for (int mi = 0; mi < 4; ++mi) {
    const int M = Ms[mi];
    double sum_fp4 = 0, sum_bf = 0;
    for (int li = 0; li < 4; ++li) {
      const Lin l = lins[li];
      const Row& r = rows[mi][li];
      const float fp4 = M < g::kMmaMinRows ? r.gemv : r.mma;  // what the backend runs
      sum_fp4 += fp4, sum_bf += r.bf;
      std::printf("%-8s %4d %6d %5d %9.2f %9.2f %4d %6.2f@%-2d %9.2f %8.2f %8.0f %8.1f\n", l.name, M, l.N, l.K,
                  r.gemv * 1e3, r.mma * 1e3, r.s_auto, r.best * 1e3, r.best_s, r.bf * 1e3, r.bf / fp4,
                  r.bytes / (r.mma * 1e-3) / 1e9, r.flops / (r.mma * 1e-3) / 1e12);
    }
    std::printf("M=%-3d 16 layers of linears: fp4 (backend's pick) %.3f ms, bf16 %.3f ms, %.2fx\n\n", M,
                16 * sum_fp4, 16 * sum_bf, sum_bf / sum_fp4);
  }
  if (failures) {
    std::printf("%d checks FAILED\n", failures);
    return 1;
  }
  std::printf("all checks passed\n");
  return 0;
}
