// Paged KV cache ops on the CPU (Backend::kv_cache_write / paged_attention, the rollout engine's
// decode attention; semantics in backend/backend.h). Scalar loops in a fixed order per
// (row, head): scores are FP32 dot products summed over d in order, the softmax follows
// cpu::attention_forward (max, exp(s - max), sum, multiply by 1/sum), and the output sums
// p_j v_j over j in order. Rows never share a reduction, so a row's result is the same in any
// batch (batch-invariant) and for any thread count. kBf16 precision is cpu::attention_forward's
// BF16 path row by row (q, k, v rounded to BF16, scores and sums in double, P = bf16(exp(s - lse))),
// so a row gives the bits of the training forward's BF16 attention.
#pragma once

#include <cstdint>

#include "backend/backend.h"

namespace nibble::cpu {

// k_pages/v_pages slots (N) <- k, v (N, Hkv*D) f32 rounded or quantized to `format`
// (backend/kv_page_codec.h; one (row, kv head) at a time).
void kv_cache_write(void* k_pages, void* v_pages, backend::KvPageFormat format, const float* k, const float* v,
                    const int32_t* slots, int64_t N, int64_t Hkv, int64_t D);

// out (N,H,D) f32 <- paged causal attention of q (N,H,D) (see Backend::paged_attention).
void paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                     backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                     const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                     backend::AttentionPrecision precision = backend::AttentionPrecision::kFp32);

}  // namespace nibble::cpu
