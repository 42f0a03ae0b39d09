// Causal grouped-query self-attention on the CPU (scores, softmax, PV), forward and backward
// written out as in llm.c's attention_forward/backward, generalised to GQA the way transformers'
// repeat_kv does it: query head h reads key/value head h / (H / Hkv). Scale 1/sqrt(D).
// Templated on float and double. O(T^2) per head: meant for T up to a few hundred.
#pragma once

#include <cstdint>

namespace nibble::cpu {

// out: (B,T,H,D); att: (B,H,T,T) softmax probabilities saved for backward (entries t2 > t are 0);
// q: (B,T,H,D); k, v: (B,T,Hkv,D). H % Hkv == 0.
template <typename T>
void attention_forward(T* out, T* att, const T* q, const T* k, const T* v, int64_t B, int64_t Tn, int64_t H,
                       int64_t Hkv, int64_t D);

// dq: (B,T,H,D), dk, dv: (B,T,Hkv,D) all overwritten; dout: (B,T,H,D); att from forward.
template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* att, const T* q, const T* k, const T* v,
                        int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D);

}  // namespace nibble::cpu
