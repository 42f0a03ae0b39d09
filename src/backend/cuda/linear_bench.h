// The baseline of `nibble bench train --linear` (issue #13 item 5): one BF16 linear layer's
// forward + backward as cuBLASLt runs it for a PyTorch/TransformerEngine user, Y = X W^T with
// BF16 X (M,K), W (N,K), dY (M,N): forward and dgrad write BF16, wgrad writes FP32 (the master
// gradient), FP32 accumulation, tensor cores. Timed with CUDA events on the caller's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/status.h"

namespace nibble::cuda {

struct LinearBenchTimes {
  double forward_s = 0, dgrad_s = 0, wgrad_s = 0;  // medians
  double total_s() const { return forward_s + dgrad_s + wgrad_s; }
};

// Median over `repeats` timed runs after 3 warm-up runs of each GEMM. Allocates its operands
// (random BF16 values) and frees them before returning.
Result<LinearBenchTimes> bench_bf16_linear_cublaslt(int64_t M, int64_t N, int64_t K, int repeats,
                                                    cudaStream_t stream = nullptr);

}  // namespace nibble::cuda
