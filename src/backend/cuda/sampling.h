// CUDA greedy decoding where the logits are, the CUDA side of Backend::greedy_rows (backend.h):
// each row's first largest logit and the f64 softmax sums the host sampler takes its log-prob
// from (core/softmax_f64.h's lane order, core/exp_f64.h's exp), to the bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace nibble::cuda {

// token (rows) i32, stats (rows, 3) f64 = (logits[token], mx, z); logits (rows, V) f32; device memory.
cudaError_t greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V,
                        cudaStream_t stream);

}  // namespace nibble::cuda
