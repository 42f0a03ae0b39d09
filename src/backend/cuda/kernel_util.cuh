// Small device helpers shared by nibble's CUDA format kernels: 16-byte vector loads/stores of
// element arrays held in registers, warp max-reductions, the grid-wide amax (atomicMax on the
// float bits: non-negative floats order like uint32), and the Philox block of a run of eight
// consecutive flat elements (the half-words formats::sr_uniform() draws one at a time), the
// double-block encode of a 16-element block (RTN or SR; a fast form for in-range NaN-free blocks),
// the sign gather of 8 values, two decoders of 8 packed E2M1 codes (the 2-level definition,
// and the byte-table decode e2m1_decode8_mul that the fused op and the dequantizers use), and the
// stores of decoded blocks that the dequantizers and the fused quantize + BF16 operand kernels
// share (so both give the same bits).
// Mirrors the vectorised load/store helpers of llm.c's dev/cuda (x128) and TE's Vec<>.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/bf16_e2m1.cuh"
#include "backend/cuda/element_codec.cuh"
#include "core/bits.h"
#include "core/philox.h"
#include "formats/e2m1.h"
#include "formats/nvfp4.h"

namespace nibble::cuda {

// N elements of type T that travel as whole 16-byte words (N * sizeof(T) % 16 == 0).
template <typename T, int N>
struct alignas(16) Vec {
  static_assert((N * sizeof(T)) % 16 == 0, "Vec must be a whole number of 16-byte words");
  static constexpr int kWords = static_cast<int>(N * sizeof(T) / 16);
  union {
    uint4 w[kWords];
    T e[N];
  };
  __device__ __forceinline__ Vec() {}
};

// Streaming 16-byte loads (read once: do not keep in L1) of N elements starting at p (16-B aligned).
template <typename T, int N>
__device__ __forceinline__ void load_vec(Vec<T, N>& v, const T* p) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < Vec<T, N>::kWords; ++i) v.w[i] = __ldcs(q + i);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int i = 0; i < Vec<T, N>::kWords; ++i) __stcs(q + i, v.w[i]);
}

// Packed bytes of n codes built in registers as 32-bit words (4 bytes each).
template <int kBytes>
struct alignas(16) PackedBytes {
  static_assert(kBytes % 4 == 0, "whole words");
  uint32_t w[kBytes / 4];
  __device__ __forceinline__ void set(int i, uint32_t byte) {  // i must be a compile-time constant after unrolling
    w[i / 4] = (i % 4 == 0) ? byte : (w[i / 4] | (byte << (8 * (i % 4))));
  }
};

template <int kBytes>
__device__ __forceinline__ void store_packed(uint8_t* p, const PackedBytes<kBytes>& b) {
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i)
      __stcs(reinterpret_cast<uint4*>(p) + i, make_uint4(b.w[4 * i], b.w[4 * i + 1], b.w[4 * i + 2], b.w[4 * i + 3]));
  } else if constexpr (kBytes == 8) {
    __stcs(reinterpret_cast<uint2*>(p), make_uint2(b.w[0], b.w[1]));
  } else {
#pragma unroll
    for (int i = 0; i < kBytes / 4; ++i) reinterpret_cast<uint32_t*>(p)[i] = b.w[i];
  }
}

// max over the lanes of groups of `kWidth` consecutive lanes (kWidth a power of two <= 32);
// NaN-free inputs (amax_update already dropped NaN), so plain max == formats::amax_update.
template <int kWidth>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = 1; o < kWidth; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// *amax_bits <- max(*amax_bits, bits(v)) for v >= 0 (or +0).
__device__ __forceinline__ void atomic_max_nonneg(float* amax, float v) {
  atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(v));
}

// An SR key (formats::SrKey) as the kernels take it: the stream and the seed's ten Philox round
// keys, computed on the host, so that each Philox call reads its round keys from the kernel's
// parameter space (a constant operand of the round's XOR) instead of computing the schedule.
struct SrKeyDevice {
  PhiloxRoundKeys round_keys{};
  uint64_t stream = 0;
  SrKeyDevice() = default;
  explicit SrKeyDevice(const formats::SrKey& key) : round_keys(philox_round_keys(key.seed)), stream(key.stream) {}
};

// The Philox block of flat elements 8q .. 8q+7 of (seed, stream): its half-word j is what
// formats::sr_uniform(key, 8q + j) turns into a uniform (formats::sr_halfword_uniform(w, j)).
__device__ __forceinline__ Philox4x32 sr_words(const SrKeyDevice& key, uint64_t q) {
  return philox4x32_10(philox_counter(key.stream, q), key.round_keys);
}

// max(a, b) that returns NaN when either is NaN (PTX max.NaN; fmaxf skips NaN).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// The top bytes of w[0..7] in two words, by six byte permutes: byte j of `even` is the top byte
// of w[2j], byte j of `odd` that of w[2j + 1].
__device__ __forceinline__ void gather_top_bytes8(const uint32_t (&w)[8], uint32_t& even, uint32_t& odd) {
  const auto top2 = [&](int i, int j) { return __byte_perm(w[i], w[j], 0x0073); };
  even = __byte_perm(top2(0, 2), top2(4, 6), 0x5410);
  odd = __byte_perm(top2(1, 3), top2(5, 7), 0x5410);
}

// The sign bits of v[0..7] at the code sign positions 4i + 3 (the other bits zero): the top bytes
// gathered (the even elements' sign at 8j + 7, wanted at 8j + 3; the odd ones' already in place).
__device__ __forceinline__ uint32_t sign_nibbles8(const float* v) {
  uint32_t w[8], even, odd;
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = __float_as_uint(v[i]);
  gather_top_bytes8(w, even, odd);
  return ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
}

// The code word of 8 elements (code i in nibble i) from their biased RTN indices biased_index(i)
// (e2m1_rne_index_biased, packed by pack_biased_indices8) and the sign bits of v[0..7]
// (sign_nibbles8; v NaN-free).
template <typename BiasedIndex>
__device__ __forceinline__ uint32_t e2m1_code_word8(const float* v, const BiasedIndex& biased_index) {
  return pack_biased_indices8(biased_index) | sign_nibbles8(v);
}

// formats::nvfp4_2level_block_scale for an inner byte that nvfp4_2level_inner_scale has just
// produced (0x00..0x7E, never a NaN byte): the bare hardware decode (e4m3_decode_any_nan), without
// the NaN fix that e4m3_decode spends two instructions on.
__device__ __forceinline__ float nvfp4_2level_block_scale_encoded(uint32_t inner_byte, float so) {
  return formats::e4m3_decode_any_nan(inner_byte) * so;
}

// The SR code word of 8 elements: X[i] = e2m1_sr_index_top_byte(magnitude(i), half-word i of
// `words`) carries the unsaturated index (<= 14: magnitude(i) in [0, 64)) in its top byte; six
// byte permutes gather the top bytes (even elements into the low nibbles, odd into the high), a
// nibble with bit 3 set (index >= 8) becomes 7 (bit 3 cleared, bits 0..2 set: over - over / 8),
// and the sign bits of v[0..7] (sign_nibbles8; v NaN-free) complete the codes.
template <typename Magnitude>
__device__ __forceinline__ uint32_t e2m1_sr_code_word8(const float* v, const Philox4x32& words,
                                                       const Magnitude& magnitude) {
  uint32_t x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = e2m1_sr_index_top_byte(magnitude(i), sr_carry_term(words, i));
  uint32_t even, odd;
  gather_top_bytes8(x, even, odd);
  const uint32_t idx = even + (odd << 4);  // one LEA
  const uint32_t over = idx & 0x88888888u;
  return ((idx ^ over) | (over - (over >> 3))) | sign_nibbles8(v);
}

// The SR code words of kWords groups of 8 NaN-free values v of any magnitude (min(|v|, 8) keeps
// e2m1_sr_code_word8 in its range; from 6 up, Inf included, the index saturates at 7 either way),
// group q drawing from Philox block q0 + q: the TE and MXFP4 SR fast paths.
template <int kWords>
__device__ __forceinline__ void e2m1_sr_code_words_clamped(uint32_t* out, const float* v, const SrKeyDevice& key,
                                                           uint64_t q0) {
#pragma unroll
  for (int q = 0; q < kWords; ++q)
    out[q] = e2m1_sr_code_word8(v + 8 * q, sr_words(key, q0 + q), [&](int i) { return fminf(fabsf(v[8 * q + i]), 8.0f); });
}

// nvfp4_2level_encode_block16 on the fast path only, in fewer instructions per element: for a
// block that passed the range check (every v[i] zero or |v[i]| in [c 2^-60, c 2^60], no NaN) with
// sp / r its scale and reciprocal times c / over c (c a power of two, v = c x exactly: the
// quotient steps then see c times their operands, so every step is exact or the same rounding and
// v / sp gives the bits x / sp gives). Per element: the 5-step quotient, then RTN: the biased
// index (e2m1_rne_index_biased) multiply-added into the packed word (the bias removed once per
// word) with the signs from sign_nibbles8; SR: e2m1_sr_code_word8. The quotient is below 9.1
// there (< 64 as e2m1_sr_index_top_byte needs): sp = fl(si * so) with si the E4M3 RNE of
// t = 448 bamax / amax_128 (<= 448, up to rounding), which is at least t / 1.5 when nonzero (the
// worst case: t just below 1.5 * 2^-9 rounding down to the subnormal 2^-9), so |x| / sp <=
// 6 * 1.5 (1 + O(2^-23)).
template <bool kSR>
__device__ __forceinline__ PackedBytes<8> nvfp4_2level_encode_block16_fast(const float* v, float sp, float r,
                                                                          const SrKeyDevice& key, uint64_t q0) {
  PackedBytes<8> packed;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const auto quotient = [&](int i) { return formats::nvfp4_2level_quotient_fma(fabsf(v[8 * h + i]), sp, r); };
    if constexpr (kSR)
      packed.w[h] = e2m1_sr_code_word8(v + 8 * h, sr_words(key, q0 + h), quotient);
    else
      packed.w[h] = e2m1_code_word8(v + 8 * h, [&](int i) { return e2m1_rne_index_biased(quotient(i)); });
  }
  return packed;
}

// The block test of the fast 2-level encode (formats/nvfp4.h, "one range decision for a whole
// 16-block"), one pass: r != 0 (sp in [2^-60, 2^60]) and every nonzero |x[i]| in [2^-60, 2^60],
// which excludes NaN and Inf. Such a block can take nvfp4_2level_encode_block16_fast.
__device__ __forceinline__ bool nvfp4_2level_block_fast_nan_free(const float* x, float r) {
  uint32_t hi, lo;  // NaN and Inf exceed 2^60; zeros never fail the lower bound
  magnitude_bit_range(x, 16, hi, lo);
  return r != 0.0f && hi <= 0x5D800000u && lo >= 0x21800000u - 1u;
}

// One nvfp4-2level inner block of 16 elements -> 8 packed code bytes, shared by the quantize
// kernel and the fused backward-operand kernel. xf: the 16 values (f32), sp/rp: the block
// scale and its reciprocal (nvfp4_2level_block_reciprocal). RTN, or (kSR) SR with half-words of
// the Philox blocks q0 and q0 + 1 (q0 = flat index of xf[0] / 8). A block that passes
// nvfp4_2level_block_fast_nan_free takes nvfp4_2level_encode_block16_fast; any other block (NaN,
// extreme magnitudes or scale) the per-element definition (formats::nvfp4_2level_scaled_magnitude).
template <bool kSR>
__device__ __forceinline__ PackedBytes<8> nvfp4_2level_encode_block16(const float* xf, float sp, float rp,
                                                                      const SrKeyDevice& key, uint64_t q0) {
  PackedBytes<8> packed;
  auto encode = [&](auto mag) {
    if constexpr (!kSR) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        packed.set(i, formats::e2m1_pack(formats::nvfp4_2level_code_rtn(mag(2 * i), xf[2 * i]),
                                         formats::nvfp4_2level_code_rtn(mag(2 * i + 1), xf[2 * i + 1])));
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Philox4x32 w = sr_words(key, q0 + h);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const int i = 8 * h + 2 * p;
          packed.set(4 * h + p,
                     formats::e2m1_pack(
                         e2m1_sr_index_ru(mag(i), formats::sr_halfword(w, 2 * p)) |
                             (formats::signbit_nan_positive(xf[i]) << 3),
                         e2m1_sr_index_ru(mag(i + 1), formats::sr_halfword(w, 2 * p + 1)) |
                             (formats::signbit_nan_positive(xf[i + 1]) << 3)));  // = e2m1_sr_index_h | signbit
        }
      }
    }
  };
  if (nvfp4_2level_block_fast_nan_free(xf, rp)) return nvfp4_2level_encode_block16_fast<kSR>(xf, sp, rp, key, q0);
  encode([&](int i) { return formats::nvfp4_2level_scaled_magnitude(xf[i], sp, rp); });
  return packed;
}

// The 8 values of a word of 8 codes (code i in bits 4i..4i+3), = formats::nvfp4_2level_decode(code,
// sp) bit for bit in fewer instructions: the magnitude of index k >= 2 has the bits (k + 252) << 22
// (2k+252 = 2(e+126)+m for k = 2e+m), which gives t = 0.5 and 0.75 for k = 0, 1, where the value is
// 2t - 1 (0 and 0.5) and for k >= 2 2t - 1 >= t: so |q| = min(t, fma(t, 2, -1)) (exact); then
// fl(|q| * sp) as the definition, and the code's sign bit flips the result's sign (the definition
// negates the product: the same bits, NaN included). Checked against the definition for every
// code and a spread of scales (CudaVsCpu.Decode8EqualsDefinition).
__device__ __forceinline__ void nvfp4_2level_decode8(float (&y)[8], uint32_t w, float sp) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t k = (w >> (4 * i)) & 7u;
    const float t = __uint_as_float((k << 22) + 0x3F000000u);
    const float q = fminf(t, fmaf(t, 2.0f, -1.0f));
    y[i] = __uint_as_float(__float_as_uint(q * sp) ^ (((w >> (4 * i + 3)) & 1u) << 31));
  }
}

// y[i] = fl(e2m1_decode(code i) * factor) for the 8 codes of w, for any factor: the TE and MXFP4
// decode definitions, and nvfp4_2level_decode8 whenever sp is finite (that definition negates the
// product, which differs only in NaN bits). From byte tables instead of per-code arithmetic: a
// magnitude |q| of E2M1 index k is a BF16 value whose two bytes come from 8-entry tables indexed
// by k (one byte permute gives four codes' bytes; the selector nibble is the code with its sign
// bit masked). The codes' signs go into the high bytes: permuting `sign_table` (all 0x80, or all
// 0x7F to flip every sign: the RHT sign of a row in the fused op) with the unmasked codes as
// selector yields, per byte, 0x80 / 0xFF (0x7F / 0x00) for a clear / set sign bit, whose bit 6 is
// the wanted sign. A permute pairs two elements' bytes into a BF16x2 word, each half widens to
// binary32 exactly, and one multiply gives y. Checked against the definitions
// (CudaVsCpu.DecodeMulEqualsDefinitions).
__device__ __forceinline__ void e2m1_decode8_mul(float (&y)[8], uint32_t w, float factor, uint32_t sign_table = 0x80808080u) {
  constexpr uint32_t kHi03 = 0x3F3F3F00u, kHi47 = 0x40404040u;  // high byte of |q|, k = 0..3, 4..7
  constexpr uint32_t kLo03 = 0xC0800000u, kLo47 = 0xC0804000u;  // low byte of |q| (BF16)
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // codes 4*half .. 4*half + 3
    const uint32_t sel = half ? w >> 16 : w;
    const uint32_t k = sel & 0x7777u;
    const uint32_t sg = prmt(sign_table, sign_table, sel);  // sign-replicate mode where the sign bit is set
    const uint32_t hi = __byte_perm(kHi03, kHi47, k) | ((sg << 1) & 0x80808080u);
    const uint32_t lo = __byte_perm(kLo03, kLo47, k);
    const uint32_t p01 = __byte_perm(lo, hi, 0x5140), p23 = __byte_perm(lo, hi, 0x7362);  // BF16 pairs
    y[4 * half + 0] = __uint_as_float(p01 << 16) * factor;
    y[4 * half + 1] = __uint_as_float(p01 & 0xFFFF0000u) * factor;
    y[4 * half + 2] = __uint_as_float(p23 << 16) * factor;
    y[4 * half + 3] = __uint_as_float(p23 & 0xFFFF0000u) * factor;
  }
}

// ---- decoded blocks to memory ------------------------------------------------------------------

template <typename Out>
__device__ __forceinline__ Out from_f32(float v) {
  if constexpr (std::is_same_v<Out, float>) return v;
  else return f32_to_bf16_bits(v);
}

// N decoded values -> y (16-byte aligned, N % 8 == 0): f32 as they are, BF16 by the hardware RNE
// conversion, two per instruction (= f32_to_bf16_bits for every value GPU arithmetic produces: its
// NaN is the canonical 0x7FFFFFFF, which both turn into 0x7FFF).
template <typename Out, int N>
__device__ __forceinline__ void store_values(Out* y, const float (&f)[N]) {
  Vec<Out, N> v;
  if constexpr (std::is_same_v<Out, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) v.e[i] = f[i];
  } else {
    uint32_t* w = reinterpret_cast<uint32_t*>(v.w);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
  }
  store_vec(y, v);
}

// The 16 values of a 1x16 block of packed codes c: fl(e2m1_decode(code) * factor) each.
__device__ __forceinline__ void decode16_mul(float (&f)[16], const uint2& c, float factor) {
  float lo[8], hi[8];
  e2m1_decode8_mul(lo, c.x, factor);
  e2m1_decode8_mul(hi, c.y, factor);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[i] = lo[i];
    f[8 + i] = hi[i];
  }
}

// y (16) <- the TE BF16 GEMM operand of a 1x16 block (formats::nvfp4_te_bf16_operand: code ×
// E4M3 scale byte s, exact): what dequantize_nvfp4_te writes with amax null.
__device__ __forceinline__ void store_te_operand16(uint16_t* y, const uint2& c, uint32_t s) {
  float f[16];
  decode16_mul(f, c, formats::e4m3_decode(s));
  store_values(y, f);
}

// y (16) <- the nvfp4-2level dequantization of a 1x16 block (codes c, block scale sp =
// formats::nvfp4_2level_block_scale(inner, outer)), f32 or rounded to BF16.
template <typename Out>
__device__ __forceinline__ void store_2level_block16(Out* y, const uint2& c, float sp) {
  if (isfinite(sp)) {  // the table decode (e2m1_decode8_mul) equals nvfp4_2level_decode here
    float f[16];
    decode16_mul(f, c, sp);
    store_values(y, f);
  } else {  // the definition, whose NaN may carry a sign: the software BF16 rounding keeps it
    Vec<Out, 16> v;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      v.e[i] = from_f32<Out>(formats::nvfp4_2level_decode(((i < 8 ? c.x : c.y) >> (4 * (i % 8))) & 15u, sp));
    store_vec(y, v);
  }
}

inline int ceil_div_int(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace nibble::cuda
