// Sandbox (spec 06 principle 7) for the rollout engine's paged decode attention, issue #15 item 4:
// the flash-decoding kernels of src/backend/cuda/flash_decoding.cu against the one-block-per-head
// kernel of src/backend/cuda/paged_attention.cu (both included, not copied) at the OLMo-2 1B
// shape (H = Hkv = 16, D = 128, page 16, BF16 pages, BF16 attention) and a GQA-8 shape, batches
// 1, 16, 64, contexts 512 and 4096: a check that the two agree within 2^-7 max|v| (each may round
// a P_j to the neighbouring BF16 value, 2^-8 P_j, so sum_j |dP_j| <= 2^-7) and the time per call
// (CUDA events, 200 calls) with the K/V bytes per second. Build and run from the repository root:
//   nvcc -O3 -std=c++20 -arch=sm_90a --fmad=false --expt-relaxed-constexpr -DFMT_CONSTEVAL= -DFMT_USE_CONSTEXPR=1 \
//     -Isrc dev/cuda/flash_decoding.cu -lfmt -o fd && ./fd
// Exits non-zero when a check fails.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "sandbox_check.h"

#include "../../src/backend/cuda/flash_decoding.cu"
#include "../../src/backend/cuda/paged_attention.cu"

namespace {

using nibble::backend::KvPageFormat;

struct Shape {
  int64_t N, H, Hkv, D, context;
};

int run(const Shape& s, float* k_pages, float* v_pages, double max_v, void* ws, size_t ws_bytes) {
  const int64_t page = 16, blocks = s.context / page, D = s.D;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(s.N * s.H * D));
  for (float& x : q) x = nd(rng);
  std::vector<int32_t> table(static_cast<size_t>(s.N * blocks)), len(static_cast<size_t>(s.N));
  for (int64_t n = 0; n < s.N; ++n) {  // row n: pages n * blocks ..., all of its context
    for (int64_t b = 0; b < blocks; ++b) table[n * blocks + b] = static_cast<int32_t>(n * blocks + b);
    len[n] = static_cast<int32_t>(s.context);
  }
  float *qd, *o1, *o2;
  int32_t *td, *ld;
  const size_t out_bytes = q.size() * sizeof(float);
  CK(cudaMalloc(&qd, out_bytes));
  CK(cudaMalloc(&o1, out_bytes));
  CK(cudaMalloc(&o2, out_bytes));
  CK(cudaMalloc(&td, table.size() * 4));
  CK(cudaMalloc(&ld, len.size() * 4));
  CK(cudaMemcpy(qd, q.data(), out_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(td, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ld, len.data(), len.size() * 4, cudaMemcpyHostToDevice));
  auto flash = [&] {
    return nibble::cuda::flash_decoding(o1, qd, k_pages, v_pages, KvPageFormat::kBf16, td, blocks, ld, s.N, s.H,
                                        s.Hkv, D, page, true, ws, ws_bytes, nullptr);
  };
  auto one_block = [&] {
    return nibble::cuda::paged_attention(o2, qd, k_pages, v_pages, KvPageFormat::kBf16, td, blocks, ld, s.N, s.H,
                                         s.Hkv, D, page, true, nullptr);
  };
  CK(flash());
  CK(one_block());
  CK(cudaDeviceSynchronize());
  std::vector<float> a(q.size()), b(q.size());
  CK(cudaMemcpy(a.data(), o1, out_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), o2, out_bytes, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::fmax(worst, std::fabs(double(a[i]) - b[i]));
  const double tol = 0x1.0p-7 * max_v + 1e-5;  // + FP32 sums: (n + 3) u max|v| < 1e-5 at n = 4096
  const bool ok = worst <= tol && std::isfinite(worst);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float ms[2];
  for (int kernel = 0; kernel < 2; ++kernel) {
    CK(cudaEventRecord(e0));
    for (int r = 0; r < 200; ++r) CK(kernel == 0 ? flash() : one_block());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms[kernel], e0, e1));
    ms[kernel] /= 200;
  }
  const double kv_bytes = 2.0 * s.N * s.context * s.Hkv * D * 2;
  std::printf("N=%-3lld H=%-2lld Hkv=%-2lld D=%lld ctx=%-5lld  flash %8.2f us (%6.0f GB/s)  one-block %9.2f us  "
              "max|diff| %.2e %s\n",
              static_cast<long long>(s.N), static_cast<long long>(s.H), static_cast<long long>(s.Hkv),
              static_cast<long long>(D), static_cast<long long>(s.context), ms[0] * 1e3, kv_bytes / (ms[0] * 1e6),
              ms[1] * 1e3, worst, ok ? "ok" : "FAIL");
  CK(cudaFree(qd));
  CK(cudaFree(o1));
  CK(cudaFree(o2));
  CK(cudaFree(td));
  CK(cudaFree(ld));
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  const Shape shapes[] = {{1, 16, 16, 128, 512},  {16, 16, 16, 128, 512}, {64, 16, 16, 128, 512},
                          {1, 16, 16, 128, 4096}, {16, 16, 16, 128, 4096}, {1, 32, 4, 128, 4096},
                          {16, 32, 4, 128, 4096}};
  // pages for the largest shape: N * context slots of Hkv * D BF16 (random bits of N(0, 1) values)
  int64_t slots = 0, bytes_ws = 0;
  for (const Shape& s : shapes) {
    slots = std::max<int64_t>(slots, s.N * s.context * s.Hkv * s.D);
    bytes_ws = std::max<int64_t>(
        bytes_ws, s.N * nibble::cuda::flash_decoding_workspace_bytes_per_row(s.H, s.context, s.D));
  }
  std::vector<uint16_t> host(static_cast<size_t>(slots));
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (uint16_t& x : host) x = nibble::f32_to_bf16_bits(nd(rng));
  float *k, *v;
  void* ws;
  CK(cudaMalloc(&k, host.size() * 2));
  CK(cudaMalloc(&v, host.size() * 2));
  CK(cudaMalloc(&ws, static_cast<size_t>(bytes_ws)));
  CK(cudaMemcpy(k, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  double max_v = 0;
  for (uint16_t& x : host) {
    x = nibble::f32_to_bf16_bits(nd(rng));
    max_v = std::fmax(max_v, std::fabs(double(nibble::bf16_bits_to_f32(x))));
  }
  CK(cudaMemcpy(v, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  int failed = 0;
  for (const Shape& s : shapes) failed += run(s, k, v, max_v, ws, static_cast<size_t>(bytes_ws));
  CK(cudaFree(k));
  CK(cudaFree(v));
  CK(cudaFree(ws));
  return failed == 0 ? 0 : 1;
}
