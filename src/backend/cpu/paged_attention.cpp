// Paged KV cache write and paged attention on the CPU (see paged_attention.h).
#include "backend/cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/work_grain.h"
#include "backend/kv_page_codec.h"
#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"

namespace nibble::cpu {

void kv_cache_write(void* k_pages, void* v_pages, backend::KvPageFormat format, const float* k, const float* v,
                    const int32_t* slots, int64_t N, int64_t Hkv, int64_t D) {
  NIB_CHECK_MSG(format != backend::KvPageFormat::kNvfp4 || D % 16 == 0,
                "kv_cache_write: nvfp4 pages need a head dim that is a multiple of 16 (got {})", D);
  const backend::kv::TokenLayout L = backend::kv::token_layout(format, Hkv, D);
  const int64_t W = Hkv * D;
  for (int64_t n = 0; n < N; ++n)
    NIB_CHECK_MSG(slots[n] >= 0, "kv_cache_write: negative slot {} at row {}", slots[n], n);
  parallel_for(N * Hkv, grain_for(D * 8), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / Hkv, hk = i % Hkv, at = static_cast<int64_t>(slots[n]) * L.bytes;
      backend::kv::encode_head(static_cast<uint8_t*>(k_pages) + at, L, format, D, hk, k + n * W + hk * D);
      backend::kv::encode_head(static_cast<uint8_t*>(v_pages) + at, L, format, D, hk, v + n * W + hk * D);
    }
  });
}

void paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                     backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                     const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                     backend::AttentionPrecision precision) {
  NIB_CHECK(H % Hkv == 0 && page_size > 0 && max_blocks > 0);
  NIB_CHECK_MSG(format != backend::KvPageFormat::kNvfp4 || D % 16 == 0,
                "paged_attention: nvfp4 pages need a head dim that is a multiple of 16 (got {})", D);
  const int64_t group = H / Hkv;
  const backend::kv::TokenLayout L = backend::kv::token_layout(format, Hkv, D);
  // kvr (D) <- the (position j, kv head hk) row of `pages` through the row's block table, decoded
  auto load_row = [&](float* kvr, const void* pages, const int32_t* blocks, int64_t j, int64_t hk) {
    const int64_t slot = static_cast<int64_t>(blocks[j / page_size]) * page_size + j % page_size;
    const uint8_t* rec = static_cast<const uint8_t*>(pages) + slot * L.bytes;
    for (int64_t d = 0; d < D; ++d) kvr[d] = backend::kv::decode_element(rec, L, format, D, hk, d);
  };
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
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < len; ++j) {
          load_row(kv.data(), k_pages, blocks, j, hk);
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += double(qb[d]) * round_to_bf16(kv[d]);
          s[j] = acc * dscale;
          mx = std::max(mx, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j < len; ++j) l += std::exp(s[j] - mx);
        const double lse = mx + std::log(l);
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = 0; j < len; ++j) {
          const double p = round_to_bf16(static_cast<float>(std::exp(s[j] - lse)));  // P enters P v as BF16
          load_row(kv.data(), v_pages, blocks, j, hk);
          for (int64_t d = 0; d < D; ++d) o[d] += p * round_to_bf16(kv[d]);
        }
        for (int64_t d = 0; d < D; ++d) out[(n * H + h) * D + d] = static_cast<float>(o[d]);
      }
    });
    return;
  }
  parallel_for(N * H, grain_for(longest * D * 2), [&](int64_t i0, int64_t i1) {
    std::vector<float> p(static_cast<size_t>(longest)), kv(static_cast<size_t>(D));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / H, h = i % H, hk = h / group, len = context_len[n];
      const float* qr = q + (n * H + h) * D;  // (D)
      const int32_t* blocks = block_table + n * max_blocks;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < len; ++j) {
        load_row(kv.data(), k_pages, blocks, j, hk);
        float s = 0;
        for (int64_t d = 0; d < D; ++d) s += qr[d] * kv[d];
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
        load_row(kv.data(), v_pages, blocks, j, hk);
        for (int64_t d = 0; d < D; ++d) o[d] += p[j] * kv[d];
      }
    }
  });
}

}  // namespace nibble::cpu
