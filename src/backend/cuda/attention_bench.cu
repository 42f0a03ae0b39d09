// Timing of the CUDA attention op (attention_bench.h): random FP32 operands from a hash of the
// element index, then forward and backward timed separately with CUDA events (median of repeats),
// in FP32 or BF16 precision.
#include "backend/cuda/attention_bench.h"

#include <algorithm>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_bf16.h"
#include "backend/cuda/cuda_check.h"

namespace nibble::cuda {
namespace {

// x (n) <- uniform in [-sqrt(3), sqrt(3)) (variance 1) from a hash of (i, seed).
__global__ void fill_uniform_kernel(float* x, int64_t n, uint32_t seed) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed * 0x9E3779B9u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  x[i] = (static_cast<float>(h >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * 1.7320508f;
}

}  // namespace

Result<AttentionBenchTimes> bench_attention(int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D, int repeats,
                                            cudaStream_t stream, backend::AttentionPrecision precision) {
  const bool bf16 = precision == backend::AttentionPrecision::kBf16;
  const int64_t max_d = bf16 ? kAttentionBf16MaxHeadDim : 256;
  if (B <= 0 || Tn <= 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D > max_d || repeats <= 0 ||
      Tn >= (int64_t{1} << 31))
    return invalid_argument("attention bench: B={} T={} H={} Hkv={} D={} repeats={} (positive, H % Hkv == 0, D <= {})",
                            B, Tn, H, Hkv, D, repeats, max_d);
  const int64_t nq = B * Tn * H * D, nkv = B * Tn * Hkv * D, nl = B * H * Tn;
  const size_t ws_bytes = std::max<size_t>(bf16 ? attention_bf16_workspace_bytes(B, Tn, H, Hkv, D, true)
                                                : attention_backward_workspace_bytes(B, Tn, H, Hkv, D),
                                           1);
  float *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr, *out = nullptr, *lse = nullptr, *dq = nullptr,
        *dk = nullptr, *dv = nullptr;
  void* ws = nullptr;
  for (auto [p, n] : {std::pair{&q, nq}, {&dout, nq}, {&out, nq}, {&dq, nq}, {&k, nkv}, {&v, nkv}, {&dk, nkv},
                      {&dv, nkv}, {&lse, nl}})
    NIB_CUDA_CHECK(cudaMalloc(p, sizeof(float) * static_cast<size_t>(n)));
  NIB_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
  uint32_t seed = 1;
  for (auto [p, n] : {std::pair{q, nq}, {dout, nq}, {k, nkv}, {v, nkv}}) {
    fill_uniform_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(p, n, seed++);
    NIB_CUDA_CHECK_LAUNCH();
  }
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
  AttentionBenchTimes t;
  if (bf16) {
    t.forward_s = time([&] { attention_forward_bf16(out, lse, q, k, v, B, Tn, H, Hkv, D, ws, stream); });
    t.backward_s =
        time([&] { attention_backward_bf16(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D, ws, stream); });
  } else {
    t.forward_s = time([&] { attention_forward(out, lse, q, k, v, B, Tn, H, Hkv, D, stream); });
    t.backward_s =
        time([&] { attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D, ws, stream); });
  }
  t.forward_flops = 4.0 * static_cast<double>(B * H) * static_cast<double>(Tn) * static_cast<double>(Tn + 1) / 2 *
                    static_cast<double>(D);
  t.backward_flops = 2.5 * t.forward_flops;
  NIB_CUDA_CHECK(cudaEventDestroy(e0));
  NIB_CUDA_CHECK(cudaEventDestroy(e1));
  for (float* p : {q, k, v, dout, out, lse, dq, dk, dv}) NIB_CUDA_CHECK(cudaFree(p));
  NIB_CUDA_CHECK(cudaFree(ws));
  return t;
}

}  // namespace nibble::cuda
