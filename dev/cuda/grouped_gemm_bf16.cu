// Sandbox (spec 06 principle 7) for nibble's grouped BF16 GEMM, issue #13 (MoE experts): the
// kernel of src/backend/cuda/grouped_gemm_bf16.cuh (included, not copied), checked in all three
// layouts (forward NT, dX NN, dW TN) against a double CPU reference over ragged groups with empty
// ones, then timed at the qwen3moe-768 shapes (64 experts, C 768, Im 256, batch 8 x seq 4096 x
// top-8 = about 262144 rows, ragged) against a loop of one cuBLAS BF16 GEMM (cublasGemmEx, FP32 compute) per
// expert. No dependency beyond CUDA:
//   nvcc -O3 -std=c++17 -arch=sm_90a -I src dev/cuda/grouped_gemm_bf16.cu -lcublas -o gg && ./gg
// Exits non-zero when a check fails.
#include <cublas_v2.h>
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

#include "backend/cuda/grouped_gemm_bf16.cuh"


namespace gg = nibble::cuda::grouped_gemm;
using gg::Layout;

static float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t f32_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
struct Dev {
  T* p = nullptr;
  explicit Dev(const std::vector<T>& h) {
    CK(cudaMalloc(&p, std::max<size_t>(h.size(), 1) * sizeof(T)));
    if (!h.empty()) CK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> get(size_t n) const {
    std::vector<T> h(n);
    CK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// A case: G groups of `sizes` rows (kNT/kNN) or reduction rows (kTN); per-group operand (N,K),
// (K,N) or output (M,N). Checks every output (or `samples` random ones) against a double
// reference with the bound (n + 2) u alpha sum|a||b| + u |y_old| (n terms in FP32, u = 2^-24).
static bool run_case(const char* name, Layout layout, const std::vector<int64_t>& sizes, int64_t M, int64_t N,
                     int64_t K, bool with_alpha, bool accumulate, int64_t samples, std::mt19937& rng) {
  const int64_t G = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> off(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) off[g + 1] = off[g] + sizes[g];
  const int64_t extent = off[G];
  std::normal_distribution<float> nd(0.f, 1.f);
  auto rand_bf16 = [&](int64_t n) {
    std::vector<uint16_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = f32_to_bf16(nd(rng));
    return v;
  };
  // a: kNT/kNN (extent, K); kTN (extent, M). b: kNT (G, N, K); kNN (G, K, N); kTN (extent, N).
  const bool tn = layout == Layout::kTN;
  std::vector<uint16_t> a = rand_bf16(extent * (tn ? M : K));
  std::vector<uint16_t> b = rand_bf16(tn ? extent * N : G * N * K);
  const int64_t y_count = tn ? G * M * N : extent * N;
  std::vector<float> y0(static_cast<size_t>(y_count));
  for (auto& v : y0) v = nd(rng);
  std::vector<float> alpha(static_cast<size_t>(G));
  for (auto& v : alpha) v = std::ldexp(1.f + 0.5f * std::abs(nd(rng)), -3);
  Dev<uint16_t> da(a), db(b);
  Dev<float> dy(y0), dal(alpha);
  Dev<int64_t> doff(off);
  CK(gg::launch(layout, dy.p, da.p, db.p, doff.p, G, extent, tn ? M : 0, N, tn ? 0 : K, tn ? M * N : N * K,
                with_alpha ? dal.p : nullptr, accumulate, 0));
  CK(cudaDeviceSynchronize());
  std::vector<float> y = dy.get(static_cast<size_t>(y_count));

  const double u = std::ldexp(1.0, -24);
  int64_t bad = 0, checked = 0;
  double worst = 0;
  auto check = [&](int64_t g, int64_t row, int64_t col, int64_t idx) {
    double s = 0, sa = 0;
    int64_t n = 0;
    if (!tn) {
      n = K;
      for (int64_t k = 0; k < K; ++k) {
        const double av = bf16_to_f32(a[(off[g] + row) * K + k]);
        const double bv = layout == Layout::kNT ? bf16_to_f32(b[g * N * K + col * K + k])
                                                : bf16_to_f32(b[g * N * K + k * N + col]);
        s += av * bv, sa += std::abs(av * bv);
      }
    } else {
      n = off[g + 1] - off[g];
      for (int64_t r = off[g]; r < off[g + 1]; ++r) {
        const double av = bf16_to_f32(a[r * M + row]), bv = bf16_to_f32(b[r * N + col]);
        s += av * bv, sa += std::abs(av * bv);
      }
    }
    const double al = with_alpha ? alpha[g] : 1.0;
    const double ref = al * s + (accumulate ? y0[idx] : 0.0);
    const double tol = (n + 2) * u * al * sa + (accumulate ? u * std::abs(ref) + u * std::abs(y0[idx]) : 0.0) + 1e-30;
    const double err = std::abs(y[idx] - ref);
    worst = std::max(worst, err / tol);
    ++checked;
    if (!(err <= tol) && bad++ < 5)
      std::printf("  %s: g=%lld row=%lld col=%lld got %.9g want %.9g (tol %.3g)\n", name, (long long)g,
                  (long long)row, (long long)col, y[idx], ref, tol);
  };
  auto check_flat = [&](int64_t idx) {
    if (!tn) {
      const int64_t r = idx / N, col = idx % N;
      int64_t g = 0;
      while (off[g + 1] <= r) ++g;
      check(g, r - off[g], col, idx);
    } else {
      check(idx / (M * N), idx % (M * N) / N, idx % N, idx);
    }
  };
  if (samples <= 0 || samples >= y_count) {
    for (int64_t i = 0; i < y_count; ++i) check_flat(i);
  } else {
    std::uniform_int_distribution<int64_t> pick(0, y_count - 1);
    for (int64_t i = 0; i < samples; ++i) check_flat(pick(rng));
  }
  std::printf("%-34s %s  (%lld outputs checked, worst err/tol %.3f)\n", name, bad ? "FAIL" : "ok",
              (long long)checked, worst);
  return bad == 0;
}

// Times the grouped kernel and a loop of one cublasGemmEx per non-empty group (row-major
// problems through the column-major API: C^T = B^T A^T).
static void time_layout(const char* name, Layout layout, const std::vector<int64_t>& sizes, int64_t M, int64_t N,
                        int64_t K, cublasHandle_t h) {
  const int64_t G = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> off(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) off[g + 1] = off[g] + sizes[g];
  const int64_t extent = off[G];
  const bool tn = layout == Layout::kTN;
  const int64_t a_n = extent * (tn ? M : K), b_n = tn ? extent * N : G * N * K, y_n = tn ? G * M * N : extent * N;
  uint16_t *a, *b;
  float* y;
  int64_t* doff;
  CK(cudaMalloc(&a, a_n * 2));
  CK(cudaMalloc(&b, b_n * 2));
  CK(cudaMalloc(&y, y_n * 4));
  CK(cudaMalloc(&doff, (G + 1) * 8));
  CK(cudaMemset(a, 0x3c, a_n * 2));
  CK(cudaMemset(b, 0x3c, b_n * 2));
  CK(cudaMemcpy(doff, off.data(), (G + 1) * 8, cudaMemcpyHostToDevice));
  const float one = 1.f, zero = 0.f;
  auto grouped = [&] {
    CK(gg::launch(layout, y, a, b, doff, G, extent, tn ? M : 0, N, tn ? 0 : K, tn ? M * N : N * K, nullptr, false, 0));
  };
  auto loop = [&] {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rows = sizes[g];
      if (rows == 0) continue;
      if (layout == Layout::kNT)
        CKB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, rows, K, &one, b + g * N * K, CUDA_R_16BF, K,
                        a + off[g] * K, CUDA_R_16BF, K, &zero, y + off[g] * N, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT));
      else if (layout == Layout::kNN)
        CKB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, rows, K, &one, b + g * N * K, CUDA_R_16BF, N,
                        a + off[g] * K, CUDA_R_16BF, K, &zero, y + off[g] * N, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT));
      else
        CKB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, N, M, rows, &one, b + off[g] * N, CUDA_R_16BF, N,
                        a + off[g] * M, CUDA_R_16BF, M, &zero, y + g * M * N, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT));
    }
  };
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time = [&](auto&& f) {
    for (int i = 0; i < 3; ++i) f();
    CK(cudaEventRecord(e0));
    const int reps = 20;
    for (int i = 0; i < reps; ++i) f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms / reps;
  };
  const double flops = 2.0 * extent * (tn ? M : K) * N;
  const float tg = time(grouped), tl = time(loop);
  std::printf("%-22s grouped %8.3f ms (%6.1f TFLOP/s)   cuBLAS loop %8.3f ms (%6.1f TFLOP/s)\n", name, tg,
              flops / tg * 1e-9, tl, flops / tl * 1e-9);
  cudaFree(a), cudaFree(b), cudaFree(y), cudaFree(doff);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
}

int main() {
  std::mt19937 rng(1234);
  bool ok = true;
  // Small ragged cases with empty groups (first, middle, last), sizes off the tile grid, K and N
  // not multiples of 8 (scalar load path) and multiples (vector path).
  const std::vector<int64_t> ragged = {0, 37, 1, 0, 200, 129, 0};
  const std::vector<int64_t> single = {300};
  for (bool acc : {false, true})
    for (bool al : {false, true}) {
      char nm[64];
      std::snprintf(nm, sizeof nm, "NT ragged K=72 N=136 a%d acc%d", al, acc);
      ok &= run_case(nm, Layout::kNT, ragged, 0, 136, 72, al, acc, 0, rng);
      std::snprintf(nm, sizeof nm, "NN ragged K=72 N=136 a%d acc%d", al, acc);
      ok &= run_case(nm, Layout::kNN, ragged, 0, 136, 72, al, acc, 0, rng);
      std::snprintf(nm, sizeof nm, "TN ragged M=136 N=72 a%d acc%d", al, acc);
      ok &= run_case(nm, Layout::kTN, ragged, 136, 72, 0, al, acc, 0, rng);
    }
  ok &= run_case("NT odd K=13 N=21", Layout::kNT, ragged, 0, 21, 13, true, false, 0, rng);
  ok &= run_case("NN odd K=13 N=21", Layout::kNN, ragged, 0, 21, 13, true, false, 0, rng);
  ok &= run_case("TN odd M=13 N=21", Layout::kTN, ragged, 13, 21, 0, true, false, 0, rng);
  ok &= run_case("NT single K=256 N=768", Layout::kNT, single, 0, 768, 256, false, false, 0, rng);
  ok &= run_case("TN single M=512 N=768", Layout::kTN, single, 512, 768, 0, false, true, 0, rng);
  ok &= run_case("TN all empty (zero fill)", Layout::kTN, {0, 0, 0}, 40, 24, 0, true, false, 0, rng);

  // qwen3moe-768 at batch 8 x seq 4096: 262144 routed rows over 64 experts, ragged around 4096.
  std::vector<int64_t> moe(64);
  {
    std::uniform_int_distribution<int> jitter(-1500, 1500);
    for (auto& m : moe) m = 4096 + jitter(rng);
    moe[6] += moe[5], moe[5] = 0;  // one empty expert
  }
  ok &= run_case("NT moe gate_up (sampled)", Layout::kNT, moe, 0, 512, 768, true, false, 4000, rng);
  ok &= run_case("NN moe dX down (sampled)", Layout::kNN, moe, 0, 256, 768, false, false, 4000, rng);
  ok &= run_case("TN moe dW gate_up (sampled)", Layout::kTN, moe, 512, 768, 0, false, true, 2000, rng);
  if (!ok) {
    std::printf("CHECK FAILED\n");
    return 1;
  }
  cublasHandle_t h;
  CKB(cublasCreate(&h));
  time_layout("fwd gate_up NT", Layout::kNT, moe, 0, 512, 768, h);
  time_layout("fwd down NT", Layout::kNT, moe, 0, 768, 256, h);
  time_layout("dX gate_up NN", Layout::kNN, moe, 0, 768, 512, h);
  time_layout("dX down NN", Layout::kNN, moe, 0, 256, 768, h);
  time_layout("dW gate_up TN", Layout::kTN, moe, 512, 768, 0, h);
  time_layout("dW down TN", Layout::kTN, moe, 768, 256, 0, h);
  CKB(cublasDestroy(h));
  std::printf("all checks passed\n");
  return 0;
}
