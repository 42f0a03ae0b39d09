// The element steps the CUDA format kernels call, as one struct (FormatsCodec): each is the
// src/formats/ function itself, so GPU and CPU drivers agree bit for bit (the nvfp4-2level steps
// are in kernel_util.cuh's nvfp4_2level_encode_block16) — except the SR index, e2m1_sr_index_ru
// below: the same function as formats::e2m1_sr_index_h in round-up fmas (device-only: the host
// has no per-operation rounding modes), and the forms the packed fast paths use (the SR index in
// the top byte of e2m1_sr_index_top_byte, the biased RTN index e2m1_rne_index_biased).
// element_codec_test.cu checks every step against its formats/ or former formulation over all
// 2^32 inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/philox.h"
#include "formats/e2m1.h"
#include "formats/nvfp4.h"

namespace nibble::cuda {

// The SR index of formats::e2m1_sr_index_h (the nibble SR contract: a >= 0 or NaN, the element's
// 16-bit half-word h, round up iff h * 2^-16 < (a - down) / gap) in fmas with round-up rounding,
// which Hopper issues at twice the rate of the integer compares of the formats/ form. On each
// piece of the E2M1 grid (step 1/2 on [0, 2), 1 on [2, 4), 2 on [4, 6)) the index is
// c + floor(m a) + [frac(m a) > h'] = c + ceil(m a - h') with h' = h * 2^-16, (m, c) = (2, 0),
// (1, 2), (1/2, 4); the three are ordered like the pieces (2a <= 2 + a iff a <= 2, 2 + a <= 4 + a/2
// iff a <= 4, ...), so the index is min(ceil(2a - h'), 2 + ceil(a - h'), 4 + ceil(a/2 - h'), 7),
// the 7 covering a >= 6 (saturation, never up). Each ceil is two round-up operations:
// y = fma_ru(a, m, -H) with H = 1 + h' (exact: built from the bits of h), then fadd_ru(y, 2^23 + 2 + c);
// ru(x) never passes the integer ceil(x) (integers are representable there), so ceil(y) = ceil(x)
// with x = m a - H > -2, and the sum lies in [2^23, 2^24) where the unit is 1: the result is
// 2^23 + 1 + c + ceil(m a - h'). NaN is mapped to 0 first (index 0, as the formats/ form).
// Equal to formats::e2m1_sr_index_h for every binary32 a >= 0 at the decision-boundary h and
// random h (ElementCodec.ExhaustiveAgainstFormerFormulations).
__device__ __forceinline__ uint32_t e2m1_sr_index_ru(float a, uint32_t h) {
  const float H = __uint_as_float(0x3F800000u | (h << 7));  // 1 + h * 2^-16, exactly
  a = fmaxf(a, 0.0f);                                        // NaN -> 0
  const uint32_t t1 = __float_as_uint(__fadd_ru(__fmaf_ru(a, 2.0f, -H), 8388610.0f));
  const uint32_t t2 = __float_as_uint(__fadd_ru(__fmaf_ru(a, 1.0f, -H), 8388612.0f));
  const uint32_t t3 = __float_as_uint(__fadd_ru(__fmaf_ru(a, 0.5f, -H), 8388614.0f));
  const uint32_t m = min(min(t1, t2), min(t3, 0x4B000008u));  // 0x4B000001 + index
  return m - 0x4B000001u;
}

// The SR index in the bit form, for the packed SR paths: formats::e2m1_sr_index_h's own test on
// a >= 1 ("h << 6 < the low 22 mantissa bits"), carried below 1 by a scaling. b = ru(a * 2^-126)
// lays E2M1's grid on binary32's: for a >= 1, b is exact and bits(b) >> 22 = 2 + 2e + m for
// a = 2^e (1 + m/2 + ...) (the floor index k on [1, 8)), its low 22 bits the fraction of the gap
// times 2^22; for a < 1, b is subnormal, bits(b) = N = ceil(2^22 * 2a), and N >> 22 = floor(2a)
// with N mod 2^22 = ceil(2^22 frac(2a)) (E2M1 is uniform with step 1/2 there, like a subnormal
// range). In both cases bits(b) = 2^22 k + ceil(r) with r = 2^22 * (fraction of the gap) in
// [0, 2^22), and up iff h * 2^-16 < r / 2^22 iff 64h < r iff 64h < ceil(r) (64h an integer).
// With t = 2^24 - 1 - 256h (sr_carry_term), X = 4 bits(b) + t = 2^24 k + 4 ceil(r) + 2^24 - 1 -
// 256h carries into bit 24 exactly when 4 ceil(r) >= 256h + 1, i.e. ceil(r) > 64h: X >> 24 =
// k + up, the unsaturated index. Valid for a in [0, 64) (X >> 24 <= 14, no overflow); the caller
// caps it at 7 (a >= 6 never rounds up: k = 7 there, or more above 8). t's bytes are
// [0xFF, ~h, 0x00]: one byte permute of the inverted Philox word. Equal to
// formats::e2m1_sr_index_h (capped) for every binary32 a in [0, 64) at the boundary and random h
// (ElementCodec.ExhaustiveAgainstFormerFormulations).
__device__ __forceinline__ uint32_t sr_carry_term(uint32_t h) { return 0xFFFFFFu - (h << 8); }
// t of half-word j (0..7) of a Philox block (formats::sr_halfword(r, j)).
__device__ __forceinline__ uint32_t sr_carry_term(const Philox4x32& r, int j) {
  return __byte_perm(~r.v[j >> 1], 0x000000FFu, (j & 1) ? 0x5324 : 0x5104);
}
__device__ __forceinline__ uint32_t e2m1_sr_index_top_byte(float a, uint32_t carry_term) {
  return (__float_as_uint(__fmul_ru(a, 0x1p-126f)) << 2) + carry_term;
}

constexpr uint32_t kRtnIndexBias = 0x4B000000u;  // e2m1_rne_index_biased = kRtnIndexBias + index
// The RTN index for any a in [0, +Inf], biased for packing: formats::e2m1_rne_index_bits_min3 (exact below 7) capped
// at 0x4B000000 + 7 (for a >= 7 its third piece is already >= 8, and the index of a >= 5 is 7).
__device__ __forceinline__ uint32_t e2m1_rne_index_biased(float a) {
  return min(formats::e2m1_rne_index_bits_min3(a), 0x4B000007u);
}

struct FormatsCodec {
  static __device__ __forceinline__ float amax(float m, float x) { return formats::amax_update(m, x); }
  static __device__ __forceinline__ uint32_t te_rtn(float x, float enc) { return formats::nvfp4_te_encode_rtn(x, enc); }
  static __device__ __forceinline__ uint32_t te_sr(float x, float enc, uint32_t h) {  // = nvfp4_te_encode_sr_h
    const float v = x * enc;
    return e2m1_sr_index_ru(fabsf(v), h) | (static_cast<uint32_t>(v < 0.0f) << 3);
  }
};

}  // namespace nibble::cuda
