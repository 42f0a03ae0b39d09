// Timing of the CUDA attention op for `nibble bench attention` and docs/benchmarks.md: median
// forward and backward times of one causal GQA shape on random FP32 inputs, in FP32 (attention.h)
// or BF16 (attention_bf16.h, its BF16 pre-passes included), CUDA events on the caller's stream,
// with the FLOP counts the times are rated against (FlashAttention's convention: causal pairs
// only; backward counted as 2.5x the forward).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/backend.h"
#include "core/status.h"

namespace nibble::cuda {

struct AttentionBenchTimes {
  double forward_s = 0, backward_s = 0;          // medians
  double forward_flops = 0, backward_flops = 0;  // 4 D flops per causal (query, key) pair; backward 2.5x
};

// Median over `repeats` timed calls after 3 warm-up calls of each pass. Allocates q, k, v, dout
// (uniform values of variance 1), the outputs and the workspace, and frees them. Errors: shapes
// out of range (D <= 256 in FP32, <= 128 in BF16).
Result<AttentionBenchTimes> bench_attention(int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D, int repeats,
                                            cudaStream_t stream = nullptr,
                                            backend::AttentionPrecision precision = backend::AttentionPrecision::kFp32);

}  // namespace nibble::cuda
