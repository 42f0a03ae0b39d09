// Per-token layers of the transformer on the CPU, llm.c style: each forward and backward written
// out by hand with its shapes, destination first, the caller allocates. Templated on float and
// double (double is used to check every backward against finite differences).
// Conventions: backward functions OVERWRITE input gradients (dx = ...) and ACCUMULATE parameter
// gradients (dw += ...). N = number of token rows (B*T). Mirrors transformers' Olmo2/Qwen3 math.
#pragma once

#include <cstdint>

namespace nibble::cpu {

// ---- embedding ---------------------------------------------------------------------------
// out: (N,C) = wte: (V,C) [tokens: (N) i32 in [0,V)]
template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, int64_t N, int64_t V, int64_t C);
// dwte: (V,C) += scatter of dout: (N,C) by tokens
template <typename T>
void embedding_backward(T* dwte, const T* dout, const int32_t* tokens, int64_t N, int64_t V, int64_t C);

// ---- RMSNorm (HF Olmo2RMSNorm / Qwen3MoeRMSNorm): y = w * x / sqrt(mean(x^2) + eps) -------
// out: (R,C), rstd: (R) saved for backward; x: (R,C), w: (C). out may not alias x.
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int64_t R, int64_t C, double eps);
// dx: (R,C) (overwritten), dw: (C) (+=); dout, x: (R,C); rstd: (R) from forward.
template <typename T>
void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int64_t R, int64_t C);

// ---- rotary position embedding, HF "rotate_half" convention ------------------------------
// cos, sin: (P, D/2): angle(p, j) = p * theta^(-2j/D), computed in binary32 like transformers'
// default RoPE (inv_freq and p*inv_freq in f32), then stored as T.
template <typename T>
void rope_table(T* cos, T* sin, int64_t P, int64_t D, double theta);
// out: (B,T,H,D) = rotate(x: (B,T,H,D)); out may alias x. positions: (B,T) i32 or nullptr
// (then position = t). For j < D/2:  out[j] = x[j] c - x[j+D/2] s;  out[j+D/2] = x[j+D/2] c + x[j] s.
template <typename T>
void rope_forward(T* out, const T* x, const T* cos, const T* sin, const int32_t* positions, int64_t B, int64_t Tn,
                  int64_t H, int64_t D);
// dx: (B,T,H,D) = inverse rotation of dout (may alias).
template <typename T>
void rope_backward(T* dx, const T* dout, const T* cos, const T* sin, const int32_t* positions, int64_t B, int64_t Tn,
                   int64_t H, int64_t D);

// ---- SwiGLU activation: out = silu(gate) * up, gu rows are [gate (I) | up (I)] -------------
// out: (N,I); gu: (N,2I)
template <typename T>
void swiglu_forward(T* out, const T* gu, int64_t N, int64_t I);
// dgu: (N,2I) (overwritten); dout: (N,I); gu: (N,2I)
template <typename T>
void swiglu_backward(T* dgu, const T* dout, const T* gu, int64_t N, int64_t I);

// ---- softmax cross-entropy with z-loss ---------------------------------------------------
// Rows with target < 0 (e.g. -100) are ignored. Per valid row: lse = logsumexp(logits),
// ce = lse - logits[target] (computed in T), z = lse^2. The loss the model reports is
//   (sum ce + z_coef * sum z) / n_valid.
struct CrossEntropySums {
  double ce_sum = 0;   // sum over valid rows of ce
  double z_sum = 0;    // sum over valid rows of lse^2
  int64_t n_valid = 0;
};
// lse: (N) (written for every row); token_ce: (N) or nullptr (ce per row, 0 where ignored);
// logits: (N,V); targets: (N) i32.
template <typename T>
CrossEntropySums cross_entropy_forward(T* lse, T* token_ce, const T* logits, const int32_t* targets, int64_t N,
                                       int64_t V);
// dlogits: (N,V) = ce_scale * (softmax - onehot(target)) + z_scale * 2 lse softmax on valid
// rows, 0 on ignored rows. dlogits may alias logits. For the mean loss above:
// ce_scale = 1/n_valid, z_scale = z_coef/n_valid.
template <typename T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets, int64_t N, int64_t V,
                            double ce_scale, double z_scale);

// Forward and backward in one pass over the logits (one exp per element instead of two):
// fills lse (N), token_ce (N) (required), dlogits (N,V) exactly as cross_entropy_backward would
// (may alias logits), and returns the sums. ce_scale/z_scale as above (the caller counts the
// valid targets first).
template <typename T>
CrossEntropySums cross_entropy_forward_backward(T* dlogits, T* lse, T* token_ce, const T* logits,
                                                const int32_t* targets, int64_t N, int64_t V, double ce_scale,
                                                double z_scale);

// ---- small helpers -------------------------------------------------------------------------
// y: (n) += x: (n)
template <typename T>
void add_inplace(T* y, const T* x, int64_t n);
// y: (n) = a: (n) + b: (n)
template <typename T>
void add(T* y, const T* a, const T* b, int64_t n);

}  // namespace nibble::cpu
