// Flash-decoding paged attention: the CUDA kernel of Backend::paged_attention (issue #15 item 4).
// The context of each (row, kv head) is cut into chunks of kFlashDecodingChunk positions, one
// block per (chunk, kv head, row), all query heads of a GQA group together, so each K/V slot is
// read once per group; K/V travel 8 elements per lane (16 B of BF16) and FP8 / NVFP4 runs are
// decoded with their codec scale once per run. The op's rounding points stay (P normalised before
// P v): (1) scores and each chunk's (max, sum exp), (2) P = exp(s - lse) (BF16: rounded) times V
// per chunk, (3) the chunks' partial outputs summed in chunk order. Deterministic (fixed trees, no
// atomics) and batch-invariant (the chunking depends on positions only). docs/architecture.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "backend/backend.h"

namespace nibble::cuda {

// Positions per chunk (one block of each kernel per chunk): a fixed constant, so a row's result
// never depends on the batch. 64: a 512-token context of the 16-kv-head 1B shape is 128 blocks.
constexpr int64_t kFlashDecodingChunk = 64;

// Whether flash_decoding takes this shape: D % 8 == 0 and D <= 256 (one 8-element run per lane
// of a power-of-two lane group), H % Hkv == 0, Hkv <= 65535, q 16-byte aligned, BF16 / F32 pages
// 16-byte and FP8 / NVFP4 pages 4-byte aligned (a layer of a PagedKvCache always is). The
// backend runs the one-block-per-head kernel (paged_attention.h) otherwise.
bool flash_decoding_supports(backend::KvPageFormat format, const float* q, const void* k_pages, const void* v_pages,
                             int64_t H, int64_t Hkv, int64_t D);

// Workspace bytes flash_decoding needs per row of the batch (scores, chunk statistics, partial
// outputs of the row's H heads over max_context = max_blocks * page_size positions). Given less
// than N rows' worth, it runs the batch in row groups (the results are the same bits).
size_t flash_decoding_workspace_bytes_per_row(int64_t H, int64_t max_context, int64_t D);

// out (N,H,D) f32 <- paged attention of q (N,H,D) f32, shapes and semantics as
// Backend::paged_attention (backend.h); a context_len outside [1, max_blocks * page_size] is
// clamped into it. bf16: AttentionPrecision::kBf16 (q, k, v and P rounded to BF16; FP32 sums).
// workspace: workspace_bytes of device memory, at least flash_decoding_workspace_bytes_per_row.
// cudaErrorInvalidValue for a shape flash_decoding_supports refuses or a workspace too small.
cudaError_t flash_decoding(float* out, const float* q, const void* k_pages, const void* v_pages,
                           backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                           const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                           int64_t page_size, bool bf16, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);

}  // namespace nibble::cuda
