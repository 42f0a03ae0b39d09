// Launchers of the CUDA backend's per-token layers (the CUDA side of backend.h's embedding,
// RMSNorm, RoPE, SwiGLU, cross-entropy and elementwise ops), with the formulas and operation
// order of backend/cpu/nn_ops.cpp. Deterministic: every reduction has a fixed order set by the
// shapes alone (block trees, per-chunk partials summed in chunk order), no float atomics.
// Pointers are device memory; each launcher enqueues on `stream` and returns the launch error.
// error_flags: (1) u32 in device memory; a kernel that meets an id outside its range ORs in
// its bit (kErrorTokenId / kErrorTargetId) and never reads out of bounds.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace nibble::cuda {

constexpr uint32_t kErrorTokenId = 1u;   // embedding: token outside [0, V)
constexpr uint32_t kErrorTargetId = 2u;  // cross-entropy: target >= V

// out: (N,C) = wte: (V,C)[tokens: (N)]; an out-of-range token's row is NaN.
cudaError_t embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V, int64_t C,
                              uint32_t* error_flags, cudaStream_t stream);
// dwte: (V,C) += dout: (N,C) scattered by tokens, each row of dwte summed in token order n
// (the CPU's order: the same bits). workspace: embedding_backward_workspace_bytes(N) bytes.
size_t embedding_backward_workspace_bytes(int64_t N);
cudaError_t embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V, int64_t C,
                               void* workspace, uint32_t* error_flags, cudaStream_t stream);

// out: (R,C), rstd: (R); x: (R,C), w: (C).
cudaError_t rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C, double eps,
                            cudaStream_t stream);
// dx: (R,C) overwritten, dw: (C) += (per-chunk partials of rows, summed in chunk order).
// workspace: rmsnorm_backward_workspace_bytes(R, C) bytes.
size_t rmsnorm_backward_workspace_bytes(int64_t R, int64_t C);
cudaError_t rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                             const float* rstd, int64_t R, int64_t C, void* workspace, cudaStream_t stream);

// out/x: (B,T,H,D) (may alias); cos/sin: (P, D/2); positions: (B,T) or null. sign +1 forward,
// -1 backward (the inverse rotation).
cudaError_t rope_apply(float* out, const float* x, const float* cos, const float* sin, const int32_t* positions,
                       int64_t B, int64_t Tn, int64_t H, int64_t D, float sign, cudaStream_t stream);

// out: (N,I) = silu(gate) * up; gu: (N,2I).  dgu: (N,2I) overwritten; dout: (N,I).
cudaError_t swiglu_forward(float* out, const float* gu, int64_t N, int64_t I, cudaStream_t stream);
cudaError_t swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I, cudaStream_t stream);

// Cross-entropy with z-loss. sums: (4) f64 device <- {sum ce, sum lse^2, n_valid, 0} over the
// valid rows, in a fixed order. lse: (N); token_ce: (N) or null; logits: (N,V); targets: (N).
cudaError_t cross_entropy_forward(double* sums, float* lse, float* token_ce, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V, uint32_t* error_flags,
                                  cudaStream_t stream);
// dlogits: (N,V) (may alias logits); token_ce required.
cudaError_t cross_entropy_forward_backward(double* sums, float* dlogits, float* lse, float* token_ce,
                                           const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                           double ce_scale, double z_scale, uint32_t* error_flags,
                                           cudaStream_t stream);

// y (n) += x (n); y (n) = a (n) + b (n); x (n) *= s.
cudaError_t add_inplace(float* y, const float* x, int64_t n, cudaStream_t stream);
cudaError_t add(float* y, const float* a, const float* b, int64_t n, cudaStream_t stream);
cudaError_t scale(float* x, int64_t n, float s, cudaStream_t stream);
// dst (rows, cols) ld dst_ld <- src (rows, cols) ld src_ld.
cudaError_t copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols,
                    cudaStream_t stream);

}  // namespace nibble::cuda
