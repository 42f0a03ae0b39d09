// E2M1 RTN codes of a 16-element BF16 block, written for Hopper's issue limits (FP32 fma runs at
// twice the rate of integer/logic operations): per element the caller's exact scaled magnitude v
// (TE: one multiply; 2-level: the division-free quotient) and formats::e2m1_rne_index_bits_min3
// (three fmas and one 3-input integer min) instead of ~10 integer steps of E2M1 rounding; the eight
// indices of a word packed by multiply-adds (16^i weights) and the sign bits of four input words
// added with four byte-permutes (sign-replicating prmt) and two LOP3s. Block-level helpers (max of
// |x| bits, -0.0 detection) work on two BF16 halves per 32-bit word (VIMNMX.U16x2 / S16x2).
// Input: 8 words, element 2p in the low half of word p. Output: 2 words, even element in the low
// nibble. Blocks holding a NaN are the caller's (the index step assumes 0 <= v <= 6.5).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "formats/e2m1.h"

namespace nibble::cuda {

// prmt.b32 in its default mode: result byte i = byte (s >> 4i) & 7 of {b:a} (a = bytes 0-3),
// replaced by 8 copies of that byte's top bit when (s >> 4i) & 8.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// w[0..3] <- the four words of q (8 BF16 elements, element 2p in the low half of word p).
__device__ __forceinline__ void bf16_words4(uint32_t* w, const uint4& q) {
  w[0] = q.x; w[1] = q.y; w[2] = q.z; w[3] = q.w;
}

// The 8 words of a 16-element BF16 block held as two uint4.
__device__ __forceinline__ void bf16_block_words(uint32_t (&w)[8], const uint4& lo, const uint4& hi) {
  bf16_words4(w, lo);
  bf16_words4(w + 4, hi);
}

// max over the block (N words, 2N elements) of the 15-bit |x| patterns (> 0x7F80 iff the block
// holds a NaN); a[p] = w[p] with the sign bits cleared, reused by the codes.
template <int N>
__device__ __forceinline__ uint32_t bf16_block_absmax_bits(uint32_t (&a)[N], const uint32_t (&w)[N]) {
  uint32_t m = 0;
#pragma unroll
  for (int p = 0; p < N; ++p) {
    a[p] = w[p] & 0x7FFF7FFFu;
    m = __vmaxu2(m, a[p]);
  }
  return max(m & 0xFFFFu, m >> 16);
}

// True iff some element of the N words is -0.0 (0x8000, the smallest signed 16-bit value).
template <int N>
__device__ __forceinline__ bool bf16_block_has_negative_zero(const uint32_t (&w)[N]) {
  uint32_t m = 0x7FFF7FFFu;
#pragma unroll
  for (int p = 0; p < N; ++p) m = __vmins2(m, w[p]);
  return (m & 0xFFFFu) == 0x8000u || (m >> 16) == 0x8000u;
}

// Indices 0..7 of 8 elements packed into nibbles (element i in nibble i) from their biased
// forms biased_index(i) = 0x4B000000 + index (formats::e2m1_rne_index_bits_min3 and the capped
// e2m1_rne_index_biased): sum_i t_i * 16^i keeps index i in nibble i (no carries: index <= 7); the
// 0x4B000000 parts contribute 0x4B000000 + 0xB0000000 (i = 0, 1; the rest overflow out of 32
// bits), removed by one subtraction.
template <typename BiasedIndex>
__device__ __forceinline__ uint32_t pack_biased_indices8(const BiasedIndex& biased_index) {
  uint32_t word = 0u - 0xFB000000u;
#pragma unroll
  for (int i = 0; i < 8; ++i) word += biased_index(i) << (4 * i);
  return word;
}

// The 8 codes of words w[4j .. 4j+3] (magnitudes a[...]): index_bits(|x|) = 0x4B000000 + index
// (formats::e2m1_rne_index_bits_min3 of the element's scaled magnitude), sign bit = the BF16 sign
// bit (TetraJet convention; for TE the caller excludes -0.0, the one input where they differ).
template <typename IndexBits>
__device__ __forceinline__ uint32_t bf16_codes8(const uint32_t* w, const uint32_t* a, const IndexBits& index_bits) {
  const uint32_t word = pack_biased_indices8([&](int i) {  // element 2p in the low half of a[p]
    return index_bits(__uint_as_float((i & 1) ? a[i >> 1] & 0xFFFF0000u : a[i >> 1] << 16));
  });
  // Sign bits: byte masks of the 8 signs (bytes 1 and 3 of each word, sign-replicated), regrouped
  // into even / odd elements, then bit 3 of each nibble.
  constexpr uint32_t kSigns = 0xFDB9u;
  const uint32_t s03 = prmt(w[0], w[1], kSigns), s47 = prmt(w[2], w[3], kSigns);
  const uint32_t ev = prmt(s03, s47, 0x6420u), od = prmt(s03, s47, 0x7531u);
  const uint32_t s = (ev & 0x0F0F0F0Fu) | (od & 0xF0F0F0F0u);
  return word | (s & 0x88888888u);
}

// The 16 codes of a block (two words).
template <typename IndexBits>
__device__ __forceinline__ uint2 bf16_codes16(const uint32_t (&w)[8], const uint32_t (&a)[8], const IndexBits& index_bits) {
  return make_uint2(bf16_codes8(w, a, index_bits), bf16_codes8(w + 4, a + 4, index_bits));
}

}  // namespace nibble::cuda
