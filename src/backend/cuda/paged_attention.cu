// Paged KV cache write and paged attention kernels (see paged_attention.h).
#include "backend/cuda/paged_attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/block_reduce.cuh"
#include "backend/kv_page_codec.h"
#include "core/bits.h"

namespace nibble::cuda {

namespace {

constexpr int kWriteThreads = 256;
constexpr int kAttnThreads = 128;  // 4 warps per (row, head)

using backend::KvPageFormat;

// BF16 / F32 pages: one thread per element (the rounding is per element).
template <KvPageFormat F>
__global__ void kv_cache_write_kernel(void* k_pages, void* v_pages, const float* k, const float* v,
                                      const int32_t* slots, int64_t N, int64_t W) {
  const int64_t total = N * W;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / W, e = i % W;
    const int64_t at = static_cast<int64_t>(slots[n]) * W + e;
    if constexpr (F == KvPageFormat::kF32) {
      static_cast<float*>(k_pages)[at] = k[i];
      static_cast<float*>(v_pages)[at] = v[i];
    } else {
      static_cast<uint16_t*>(k_pages)[at] = f32_to_bf16_bits(k[i]);
      static_cast<uint16_t*>(v_pages)[at] = f32_to_bf16_bits(v[i]);
    }
  }
}

// FP8 / NVFP4 pages: one thread per (row n, kv head hk) quantizes its D elements with the
// codec's scale (kv_page_codec.h, the CPU backend's function: the same bytes).
template <KvPageFormat F>
__global__ void kv_cache_quantize_kernel(uint8_t* k_pages, uint8_t* v_pages, const float* k, const float* v,
                                         const int32_t* slots, int64_t N, int64_t Hkv, int64_t D,
                                         backend::kv::TokenLayout L) {
  const int64_t total = N * Hkv;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / Hkv, hk = i % Hkv, at = static_cast<int64_t>(slots[n]) * L.bytes;
    const int64_t from = n * Hkv * D + hk * D;
    backend::kv::encode_head(k_pages + at, L, F, D, hk, k + from);
    backend::kv::encode_head(v_pages + at, L, F, D, hk, v + from);
  }
}

template <KvPageFormat F>
__device__ __forceinline__ float load_kv(const void* pages, const backend::kv::TokenLayout& L, int64_t slot,
                                         int64_t hk, int64_t D, int64_t d) {
  return backend::kv::decode_element(static_cast<const uint8_t*>(pages) + slot * L.bytes, L, F, D, hk, d);
}

// One block per (row n, head h) = blockIdx.x. Dynamic shared memory: q (D) then scores (len).
// Scores: warp w takes positions j = w, w + warps, ...; its lanes split d and a shuffle tree sums
// (fixed order). Softmax as the CPU: max, exp(s - max), block-sum, times 1/sum. Output: thread d
// sums p_j v_jd over j in order.
template <KvPageFormat F, bool kBf16>
__global__ void paged_attention_kernel(float* out, const float* q, const void* k_pages, const void* v_pages,
                                       const int32_t* block_table, int64_t max_blocks, const int32_t* context_len,
                                       int64_t H, int64_t Hkv, int64_t D, int64_t page_size, float scale,
                                       backend::kv::TokenLayout L) {
  extern __shared__ float smem[];
  __shared__ float red[33];
  const int64_t n = blockIdx.x / H, h = blockIdx.x % H, hk = h / (H / Hkv);
  const int64_t cap = max_blocks * page_size;
  const int64_t len = context_len[n] < 1 ? 1 : (context_len[n] > cap ? cap : context_len[n]);
  float* qs = smem;      // (D)
  float* p = smem + D;   // (len)
  const float* qr = q + (n * H + h) * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) qs[d] = kBf16 ? round_to_bf16(qr[d]) : qr[d];
  __syncthreads();
  const int32_t* blocks = block_table + n * max_blocks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t j = warp; j < len; j += warps) {
    const int64_t slot = static_cast<int64_t>(blocks[j / page_size]) * page_size + j % page_size;
    float s = 0;
    for (int64_t d = lane; d < D; d += 32) {
      const float kd = load_kv<F>(k_pages, L, slot, hk, D, d);
      s += qs[d] * (kBf16 ? round_to_bf16(kd) : kd);
    }
    s = warp_reduce(s, SumOp{});
    if (lane == 0) p[j] = s * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) mx = p[j] > mx ? p[j] : mx;
  mx = block_reduce(mx, MaxOp{}, -INFINITY, red);
  float part = 0;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
    p[j] = expf(p[j] - mx);
    part += p[j];
  }
  const float sum = block_reduce(part, SumOp{}, 0.0f, red);  // ends with a barrier: p is visible
  const float inv = 1.0f / sum;
  if (kBf16) {  // P = bf16(exp(s - lse)) as the BF16 attention (block_reduce ended with a barrier)
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) p[j] = round_to_bf16(p[j] * inv);
    __syncthreads();
  }
  float* o = out + (n * H + h) * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0;
    for (int64_t j = 0; j < len; ++j) {
      const int64_t slot = static_cast<int64_t>(blocks[j / page_size]) * page_size + j % page_size;
      const float vd = load_kv<F>(v_pages, L, slot, hk, D, d);
      if (kBf16) acc += p[j] * round_to_bf16(vd);
      else acc += (p[j] * inv) * vd;
    }
    o[d] = acc;
  }
}

}  // namespace

cudaError_t kv_cache_write(void* k_pages, void* v_pages, backend::KvPageFormat format, const float* k, const float* v,
                           const int32_t* slots, int64_t N, int64_t Hkv, int64_t D, cudaStream_t stream) {
  const bool per_element = format == KvPageFormat::kF32 || format == KvPageFormat::kBf16;
  const int64_t total = per_element ? N * Hkv * D : N * Hkv;
  if (total <= 0) return cudaSuccess;
  if (format == KvPageFormat::kNvfp4 && D % 16 != 0) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((total + kWriteThreads - 1) / kWriteThreads, 65535));
  const backend::kv::TokenLayout L = backend::kv::token_layout(format, Hkv, D);
  auto* kp = static_cast<uint8_t*>(k_pages);
  auto* vp = static_cast<uint8_t*>(v_pages);
  switch (format) {
    case KvPageFormat::kF32:
      kv_cache_write_kernel<KvPageFormat::kF32><<<grid, kWriteThreads, 0, stream>>>(k_pages, v_pages, k, v, slots, N,
                                                                                   Hkv * D);
      break;
    case KvPageFormat::kBf16:
      kv_cache_write_kernel<KvPageFormat::kBf16><<<grid, kWriteThreads, 0, stream>>>(k_pages, v_pages, k, v, slots, N,
                                                                                    Hkv * D);
      break;
    case KvPageFormat::kFp8:
      kv_cache_quantize_kernel<KvPageFormat::kFp8><<<grid, kWriteThreads, 0, stream>>>(kp, vp, k, v, slots, N, Hkv, D,
                                                                                      L);
      break;
    case KvPageFormat::kNvfp4:
      kv_cache_quantize_kernel<KvPageFormat::kNvfp4><<<grid, kWriteThreads, 0, stream>>>(kp, vp, k, v, slots, N, Hkv,
                                                                                        D, L);
      break;
  }
  return cudaGetLastError();
}

bool paged_attention_one_block_selected() {
  static const bool one_block = [] {
    const char* v = std::getenv("NIBBLE_PAGED_ATTENTION");
    return v != nullptr && std::strcmp(v, "one-block") == 0;
  }();
  return one_block;
}

int64_t paged_attention_max_context(int64_t D) {
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
  const int64_t static_bytes = 33 * sizeof(float);
  return std::max<int64_t>(0, (static_cast<int64_t>(optin) - static_bytes) / static_cast<int64_t>(sizeof(float)) - D);
}

cudaError_t paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                            backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                            const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                            int64_t page_size, bool bf16, cudaStream_t stream) {
  if (N * H <= 0) return cudaSuccess;
  const size_t shared = static_cast<size_t>(D + max_blocks * page_size) * sizeof(float);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const unsigned grid = static_cast<unsigned>(N * H);
  const backend::kv::TokenLayout L = backend::kv::token_layout(format, Hkv, D);
  if (format == KvPageFormat::kNvfp4 && D % 16 != 0) return cudaErrorInvalidValue;
  auto launch = [&](auto kernel) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (e != cudaSuccess) return e;
    kernel<<<grid, kAttnThreads, shared, stream>>>(out, q, k_pages, v_pages, block_table, max_blocks, context_len, H,
                                                   Hkv, D, page_size, scale, L);
    return cudaGetLastError();
  };
  switch (format) {
    case KvPageFormat::kF32:
      return bf16 ? launch(paged_attention_kernel<KvPageFormat::kF32, true>)
                  : launch(paged_attention_kernel<KvPageFormat::kF32, false>);
    case KvPageFormat::kBf16:
      return bf16 ? launch(paged_attention_kernel<KvPageFormat::kBf16, true>)
                  : launch(paged_attention_kernel<KvPageFormat::kBf16, false>);
    case KvPageFormat::kFp8:
      return bf16 ? launch(paged_attention_kernel<KvPageFormat::kFp8, true>)
                  : launch(paged_attention_kernel<KvPageFormat::kFp8, false>);
    case KvPageFormat::kNvfp4:
      return bf16 ? launch(paged_attention_kernel<KvPageFormat::kNvfp4, true>)
                  : launch(paged_attention_kernel<KvPageFormat::kNvfp4, false>);
  }
  return cudaErrorInvalidValue;
}

}  // namespace nibble::cuda
