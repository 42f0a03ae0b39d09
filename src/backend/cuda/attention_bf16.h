// CUDA causal GQA attention in BF16 on tensor cores (issue #13), the AttentionPrecision::kBf16 side
// of Backend::attention_forward/backward (backend.h): FlashAttention-2 structure on
// mma.m16n8k16 (bf16 x bf16, f32 accumulate), ldmatrix, cp.async double buffering, online softmax
// in exp2, causal tile skipping. q, k, v (backward: dout, out) are rounded to BF16 in a pre-pass
// into the caller's workspace; P and dS are rounded to BF16 before their second product; lse f32.
// Backward is deterministic: dK/dV per KV tile, dQ per query tile, no atomics. Graduated from the
// sandbox dev/cuda/flash_attention_bf16.cu (same kernels). Pointers are device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace nibble::cuda {

// Largest head dim of the BF16 kernels (D is zero-padded to 16, 32, 64 or 128 inside).
constexpr int64_t kAttentionBf16MaxHeadDim = 128;

// Bytes of device workspace the BF16 forward (backward = false) or backward needs.
size_t attention_bf16_workspace_bytes(int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D, bool backward);

// out: (B,T,H,D), lse: (B,H,T) natural log-sum-exp of the scaled scores; q: (B,T,H,D);
// k, v: (B,T,Hkv,D), all f32. D <= kAttentionBf16MaxHeadDim, H % Hkv == 0, B*T*H*D < 2^31 rows.
// workspace: attention_bf16_workspace_bytes(..., false) bytes.
void attention_forward_bf16(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                            int64_t Tn, int64_t H, int64_t Hkv, int64_t D, void* workspace, cudaStream_t stream);
// dq: (B,T,H,D), dk, dv: (B,T,Hkv,D) overwritten; dout, out: (B,T,H,D); lse: (B,H,T) from the
// forward. workspace: attention_bf16_workspace_bytes(..., true) bytes.
void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                             const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                             int64_t Hkv, int64_t D, void* workspace, cudaStream_t stream);

}  // namespace nibble::cuda
