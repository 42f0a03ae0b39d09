// Causal grouped-query self-attention on the CPU (scores, softmax, PV), forward and backward
// written out as in llm.c's attention_forward/backward, generalised to GQA the way transformers'
// repeat_kv does it: query head h reads key/value head h / (H / Hkv). Scale 1/sqrt(D).
// Templated on float and double. O(T^2) per head: meant for T up to a few hundred.
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

}  // namespace nibble::cpu
