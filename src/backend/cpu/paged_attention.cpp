// Paged KV cache write and paged attention on the CPU (see paged_attention.h).
#include "backend/cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/work_grain.h"
#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"

namespace nibble::cpu {

namespace {

// One element of a page as f32.
inline float load_kv(const void* pages, backend::KvPageFormat f, int64_t i) {
  return f == backend::KvPageFormat::kF32 ? static_cast<const float*>(pages)[i]
                                          : bf16_bits_to_f32(static_cast<const uint16_t*>(pages)[i]);
}

}  // namespace

void kv_cache_write(void* k_pages, void* v_pages, backend::KvPageFormat format, const float* k, const float* v,
                    const int32_t* slots, int64_t N, int64_t Hkv, int64_t D) {
  const int64_t W = Hkv * D;
  for (int64_t n = 0; n < N; ++n) {
    NIB_CHECK_MSG(slots[n] >= 0, "kv_cache_write: negative slot {} at row {}", slots[n], n);
    const int64_t at = static_cast<int64_t>(slots[n]) * W;
    if (format == backend::KvPageFormat::kF32) {
      for (int64_t i = 0; i < W; ++i) {
        static_cast<float*>(k_pages)[at + i] = k[n * W + i];
        static_cast<float*>(v_pages)[at + i] = v[n * W + i];
      }
    } else {
      for (int64_t i = 0; i < W; ++i) {
        static_cast<uint16_t*>(k_pages)[at + i] = f32_to_bf16_bits(k[n * W + i]);
        static_cast<uint16_t*>(v_pages)[at + i] = f32_to_bf16_bits(v[n * W + i]);
      }
    }
  }
}

void paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                     backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                     const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                     backend::AttentionPrecision precision) {
  NIB_CHECK(H % Hkv == 0 && page_size > 0 && max_blocks > 0);
  const int64_t group = H / Hkv, W = Hkv * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t n = 0; n < N; ++n)
    NIB_CHECK_MSG(context_len[n] >= 1 && context_len[n] <= max_blocks * page_size,
                  "paged_attention: context length {} of row {} outside [1, {}]", context_len[n], n,
                  max_blocks * page_size);
  int64_t longest = 1;
  for (int64_t n = 0; n < N; ++n) longest = std::max<int64_t>(longest, context_len[n]);
  if (precision == backend::AttentionPrecision::kBf16) {
    // attention_forward_bf16's arithmetic (backend/cpu/attention.cpp), one row at a time
    const double dscale = 1.0 / std::sqrt(double(D));
    parallel_for(N * H, grain_for(longest * D * 2), [&](int64_t i0, int64_t i1) {
      std::vector<double> s(static_cast<size_t>(longest)), o(static_cast<size_t>(D));
      std::vector<float> qb(static_cast<size_t>(D)), kv(static_cast<size_t>(D));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n = i / H, h = i % H, hk = h / group, len = context_len[n];
        for (int64_t d = 0; d < D; ++d) qb[d] = round_to_bf16(q[(n * H + h) * D + d]);
        const int32_t* blocks = block_table + n * max_blocks;
        auto base_of = [&](int64_t j) {
          return (static_cast<int64_t>(blocks[j / page_size]) * page_size + j % page_size) * W + hk * D;
        };
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < len; ++j) {
          const int64_t base = base_of(j);
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += double(qb[d]) * round_to_bf16(load_kv(k_pages, format, base + d));
          s[j] = acc * dscale;
          mx = std::max(mx, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < len; ++j) l += std::exp(s[j] - mx);
        const double lse = mx + std::log(l);
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = 0; j < len; ++j) {
          const double p = round_to_bf16(static_cast<float>(std::exp(s[j] - lse)));  // P enters P v as BF16
          const int64_t base = base_of(j);
          for (int64_t d = 0; d < D; ++d) o[d] += p * round_to_bf16(load_kv(v_pages, format, base + d));
        }
        for (int64_t d = 0; d < D; ++d) out[(n * H + h) * D + d] = static_cast<float>(o[d]);
      }
    });
    return;
  }
  parallel_for(N * H, grain_for(longest * D * 2), [&](int64_t i0, int64_t i1) {
    std::vector<float> p(static_cast<size_t>(longest));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / H, h = i % H, hk = h / group, len = context_len[n];
      const float* qr = q + (n * H + h) * D;  // (D)
      const int32_t* blocks = block_table + n * max_blocks;
      auto slot_of = [&](int64_t j) { return static_cast<int64_t>(blocks[j / page_size]) * page_size + j % page_size; };
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < len; ++j) {
        const int64_t base = slot_of(j) * W + hk * D;
        float s = 0;
        for (int64_t d = 0; d < D; ++d) s += qr[d] * load_kv(k_pages, format, base + d);
        s *= scale;
        p[j] = s;
        mx = s > mx ? s : mx;
      }
      float sum = 0;
      for (int64_t j = 0; j < len; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
      }
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < len; ++j) p[j] *= inv;
      float* o = out + (n * H + h) * D;  // (D)
      for (int64_t d = 0; d < D; ++d) o[d] = 0;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t base = slot_of(j) * W + hk * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p[j] * load_kv(v_pages, format, base + d);
      }
    }
  });
}

}  // namespace nibble::cpu
