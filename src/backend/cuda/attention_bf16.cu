// BF16 tensor-core flash attention (attention_bf16.h): argument checks around the kernels of
// flash_attention_bf16.cuh, which the sandbox dev/cuda/flash_attention_bf16.cu also compiles (with a
// double CPU reference, the derivation of the tolerances and a timing driver). Fragment layouts (PTX ISA, mma.m16n8k16):
// g = lane/4, t = lane%4; A {(g,2t..), (g+8,2t..), (g,2t+8..), (g+8,2t+8..)}, B {(k 2t.., n g),
// (k 2t+8.., n g)}, C {(g,2t), (g,2t+1), (g+8,2t), (g+8,2t+1)}; S's C fragments are reused in
// registers as P's A fragments. Shared tiles are padded to a row stride of D + 8 (no ldmatrix
// bank conflicts).
#include "backend/cuda/attention_bf16.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_check.h"

#define NIB_FA_CHECK(expr) NIB_CUDA_CHECK(expr)
#include "backend/cuda/flash_attention_bf16.cuh"

namespace nibble::cuda {

size_t attention_bf16_workspace_bytes(int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D, bool backward) {
  return fa::workspace_bytes(B, Tn, H, Hkv, D, backward);
}

// out: (B,T,H,D), lse: (B,H,T); q: (B,T,H,D), k, v: (B,T,Hkv,D), all f32 device memory; D <= 128;
// workspace: workspace_bytes(..., false) bytes.
void attention_forward_bf16(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                            int64_t Tn, int64_t H, int64_t Hkv, int64_t D, void* workspace, cudaStream_t st) {
  NIB_CHECK_MSG(D >= 1 && D <= kAttentionBf16MaxHeadDim && Hkv > 0 && H % Hkv == 0 && workspace != nullptr,
                "attention_forward_bf16: D={} H={} Hkv={}", D, H, Hkv);
  if (B * Tn * H == 0) return;
  fa::run_forward(out, lse, q, k, v, B, Tn, H, Hkv, D, workspace, st);
}

// dq: (B,T,H,D), dk, dv: (B,T,Hkv,D) overwritten; dout, out: (B,T,H,D); lse: (B,H,T);
// workspace: workspace_bytes(..., true) bytes.
void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                             const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                             int64_t Hkv, int64_t D, void* workspace, cudaStream_t st) {
  NIB_CHECK_MSG(D >= 1 && D <= kAttentionBf16MaxHeadDim && Hkv > 0 && H % Hkv == 0 && workspace != nullptr,
                "attention_backward_bf16: D={} H={} Hkv={}", D, H, Hkv);
  if (B * Tn * H == 0) return;
  fa::run_backward(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D, workspace, st);
}

}  // namespace nibble::cuda
