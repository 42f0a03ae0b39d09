// CUDA causal GQA attention, flash-style (saves the log-sum-exp, recomputes the probabilities in
// backward), the CUDA side of Backend::attention_forward/backward (backend.h). Scale 1/sqrt(D),
// query head h reads kv head h / (H / Hkv). FP32 in and out. Deterministic: fixed reduction
// order, no float atomics. Pointers are device memory; shapes as in backend/cpu/attention.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace nibble::cuda {

// out: (B,T,H,D), lse: (B,H,T); q: (B,T,H,D); k, v: (B,T,Hkv,D). D <= 256, H % Hkv == 0.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t Tn,
                       int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream);
// dq: (B,T,H,D), dk, dv: (B,T,Hkv,D) overwritten; dout, out: (B,T,H,D); lse: (B,H,T).
// workspace: attention_backward_workspace_bytes(...) bytes of device memory (or 0 needed).
size_t attention_backward_workspace_bytes(int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D);
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                        int64_t Hkv, int64_t D, void* workspace, cudaStream_t stream);

}  // namespace nibble::cuda
