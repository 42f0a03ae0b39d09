// Causal grouped-query self-attention on the CPU (scores, softmax, PV), forward and backward
// written out as in llm.c's attention_forward/backward, generalised to GQA the way transformers'
// repeat_kv does it: query head h reads key/value head h / (H / Hkv). Scale 1/sqrt(D).
// Templated on float and double; a BF16-precision variant (float in and out) mirrors the CUDA
// tensor-core kernels. O(T^2) per head: meant for T up to a few hundred.
#pragma once

#include <cstdint>

namespace nibble::cpu {

// Flash-style contract (06-backends.md): out: (B,T,H,D); lse: (B,H,T) log-sum-exp of each query
// row's scaled causal scores, saved for backward instead of the (B,H,T,T) probabilities;
// q: (B,T,H,D); k, v: (B,T,Hkv,D). H % Hkv == 0.
template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, int64_t B, int64_t Tn, int64_t H,
                       int64_t Hkv, int64_t D);

// dq: (B,T,H,D), dk, dv: (B,T,Hkv,D) all overwritten; dout, out: (B,T,H,D); lse from forward:
// the probabilities are recomputed as exp(scale q k^T - lse), delta_t = sum_d dout out.
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* lse, const T* q, const T* k,
                        const T* v,
                        int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D);

// BF16 precision (backend.h AttentionPrecision::kBf16), the readable scalar reference of the CUDA
// tensor-core kernels: q, k, v (backward: dout, out) rounded to BF16 first; every product and sum
// in double; forward P_ij = bf16(exp(s_ij - lse_i)) enters out = P v; backward recomputes
// P = exp(s - lse) from the given lse, dS = bf16(P (dP - delta)) with dP = dout v^T and
// delta_i = sum_d dout_id out_id, then dq = scale dS k, dk = scale dS^T q, dv = bf16(P)^T dout.
// Results rounded to float once. The GPU's online-softmax P differs from this P only by FP32
// error before its BF16 rounding (ops_test/attention_test.cpp derives the tolerance from that).
// Shapes as above.
void attention_forward_bf16(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                            int64_t Tn, int64_t H, int64_t Hkv, int64_t D);
void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                             const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                             int64_t Hkv, int64_t D);

}  // namespace nibble::cpu
