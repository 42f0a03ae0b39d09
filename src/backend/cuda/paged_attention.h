// CUDA side of the paged KV-cache ops (Backend::kv_cache_write / paged_attention, backend.h; the
// rollout engine's decode attention). Pointers are device memory; shapes as in
// backend/cpu/paged_attention.h. paged_attention here is the one-block-per-(row, head) kernel:
// CudaBackend runs flash_decoding.h's kernels instead wherever they take the shape, unless
// NIBBLE_PAGED_ATTENTION=one-block (paged_attention_one_block_selected). Deterministic: each (row, head) is one block with fixed
// reduction trees (block_reduce.cuh), no atomics; a row's result does not depend on the other
// rows of the batch. Scores of one (row, head) are held in shared memory: max_blocks * page_size
// positions at most paged_attention_max_context() (the device's opt-in shared memory / 4 bytes,
// minus the query; ~58K positions on an H100/H200).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/backend.h"

namespace nibble::cuda {

// k_pages/v_pages slots (N) <- k, v (N, Hkv*D) f32 rounded or quantized to `format`
// (backend/kv_page_codec.h: BF16/F32 one thread per element, FP8/NVFP4 one per (row, kv head)).
cudaError_t kv_cache_write(void* k_pages, void* v_pages, backend::KvPageFormat format, const float* k, const float* v,
                           const int32_t* slots, int64_t N, int64_t Hkv, int64_t D, cudaStream_t stream);

// Whether CudaBackend::paged_attention runs this file's one-block-per-(row, head) kernel instead
// of flash_decoding.h's: only when the environment variable NIBBLE_PAGED_ATTENTION=one-block
// (read once per process). By default flash decoding runs wherever flash_decoding_supports the
// shape (it passed its tests and the decode bench on the H200 at 2449f48: docs/benchmarks.md).
bool paged_attention_one_block_selected();

// The longest context (positions) paged_attention takes for head dim D on the current device.
int64_t paged_attention_max_context(int64_t D);

// out (N,H,D) f32 <- paged causal attention of q (N,H,D); max_blocks * page_size at most
// paged_attention_max_context(D). A context_len outside [1, max_blocks * page_size] is clamped
// into it (the CPU backend refuses it; here it must never read past the shared scores). bf16:
// Backend's AttentionPrecision::kBf16 (q, k, v and P rounded to BF16; FP32 sums here).
cudaError_t paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                            backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                            const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                            int64_t page_size, bool bf16, cudaStream_t stream);

}  // namespace nibble::cuda
