// 16-point random Hadamard transform, host+device (01-formats.md §6; testdata README
// `nvfp4_te_rht_normal`): x' = x_tile(1x16) · (1/4) · diag(s) · H16, Sylvester H16[i][j] =
// (-1)^popcount(i&j). Sign vectors are 16-bit masks, bit i set <=> s[i] = -1.
//  - TE (fixed signs, BF16 output): the exact sum (in double) rounded once to BF16; a tile whose
//    values span at most 12 binades has exact binary32 sums, and rht16_bf16_f32 forms them there.
//  - TetraJet-v2 (random signs from Philox, FP32): y_i = s_i x_i, then the 4-stage in-place
//    butterfly for h = 1, 2, 4, 8 ((a, b) -> (a + b, a - b) on pairs i, i+h with i & h == 0),
//    then each output * 0.25f. Plain binary32 adds (no FMA), so CPU and GPU agree bit for bit.
#pragma once

#include <cstdint>

#include "core/bits.h"
#include "core/host_device.h"
#include "core/philox.h"

namespace nibble::formats {

// TE's fixed vector s = (+1,+1,+1,-1,+1,-1,-1,-1,-1,-1,-1,+1,-1,+1,-1,-1).
inline constexpr uint32_t kRhtTeSignMask = (1u << 3) | (1u << 5) | (1u << 6) | (1u << 7) | (1u << 8) | (1u << 9) |
                                           (1u << 10) | (1u << 12) | (1u << 14) | (1u << 15);

// Random sign mask of one layer call: the low 16 bits of word 0 of Philox block 0 of
// (seed, stream), i.e. philox_word(seed, stream, 0) & 0xFFFF.
NIB_HOST_DEVICE uint32_t rht_random_sign_mask(uint64_t seed, uint64_t stream) {
  return philox_word(seed, stream, 0) & 0xFFFFu;
}

// H16 entry (+1/-1) and the full transform matrix entry T[i][j] = s_i H[i][j] / 4.
NIB_HOST_DEVICE int rht_h16(int i, int j) {
  unsigned v = static_cast<unsigned>(i & j) & 15u;
  v ^= v >> 2;
  v ^= v >> 1;
  return (v & 1u) ? -1 : 1;
}

// The butterfly alone, in place: t <- t · H16 (no signs, no 1/4), in the fixed order above. T is
// float, or a CPU vector type holding one column per lane (quantize_cpu.cpp's 16x16 tiles).
template <typename T>
NIB_HOST_DEVICE void rht16_butterfly(T* t) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int h = 1; h < 16; h <<= 1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      T a = t[i], b = t[i + h];
      t[i] = a + b;
      t[i + h] = a - b;
    }
  }
}
NIB_HOST_DEVICE void rht16_butterfly_f32(float* t) { rht16_butterfly(t); }
// y (16) <- x (16) · (1/4) diag(s) H16 in binary32, fixed order (see the file comment).
// y may alias x.
NIB_HOST_DEVICE void rht16_f32(float* y, const float* x, uint32_t sign_mask) {
  float t[16];
  for (int i = 0; i < 16; ++i) t[i] = ((sign_mask >> i) & 1u) ? -x[i] : x[i];
  rht16_butterfly_f32(t);
  for (int j = 0; j < 16; ++j) y[j] = t[j] * 0.25f;
}

// double -> BF16 bits, one rounding to nearest even (no intermediate binary32 rounding);
// overflow -> +-Inf, BF16 subnormals handled at their fixed step 2^-133. Finite input assumed
// (NaN/Inf go through the binary32 path).
NIB_HOST_DEVICE uint16_t f64_to_bf16_bits(double d) {
  if (d != d) return f32_to_bf16_bits(static_cast<float>(d));  // NaN: quiet, sign kept
  uint64_t u;
#if NIB_ON_DEVICE
  u = static_cast<uint64_t>(__double_as_longlong(d));
#else
  __builtin_memcpy(&u, &d, 8);
#endif
  uint32_t sign = static_cast<uint32_t>(u >> 48) & 0x8000u;  // -0.0 keeps its sign
  u &= ~(uint64_t{1} << 63);
  double a = d < 0 ? -d : d;
  if (a == 0.0) return static_cast<uint16_t>(sign);
  if (a < 0x1p-126) {  // below 2^-126: BF16 subnormal step 2^-133
    double q = a * 0x1p133;                                    // exact scaling
    double r = (q + 4503599627370496.0) - 4503599627370496.0;  // RNE to integer (q < 2^52)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));  // r <= 128 (= min normal)
  }
  // Normal: round the double's 52-bit mantissa to 7 bits, RNE at bit 45.
  uint64_t ur = u + ((uint64_t{1} << 44) - 1) + ((u >> 45) & 1u);
  int64_t e = static_cast<int64_t>(ur >> 52) - 1023;  // unbiased exponent after rounding
  if (e > 127) return static_cast<uint16_t>(sign | 0x7F80u);
  uint32_t bits = (static_cast<uint32_t>(e + 127) << 7) | static_cast<uint32_t>((ur >> 45) & 0x7Fu);
  return static_cast<uint16_t>(sign | bits);
}

// TE's transform of one 16-element tile of BF16 values: y_bf16[j] = BF16_RNE(Σ_i x_i T[i][j])
// with the sum formed exactly in double (exact whenever the tile's non-zero magnitudes span
// less than 2^41, always true for real activations/gradients; beyond that one extra rounding
// in the double sum may occur).
NIB_HOST_DEVICE void rht16_bf16_exact(uint16_t* y_bf16, const float* x_bf16_values, uint32_t sign_mask) {
  double t[16];
  for (int i = 0; i < 16; ++i) {
    double v = static_cast<double>(x_bf16_values[i]);
    t[i] = ((sign_mask >> i) & 1u) ? -v : v;
  }
  for (int h = 1; h < 16; h <<= 1)
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      double a = t[i], b = t[i + h];
      t[i] = a + b;
      t[i + h] = a - b;
    }
  for (int j = 0; j < 16; ++j) y_bf16[j] = f64_to_bf16_bits(t[j] * 0.25);
}

// The test of rht16_bf16_sums_fit_f32 (below) from a tile's magnitude bit range
// (magnitude_bit_range: its largest bits(|x|) `hi`, its smallest nonzero bits(|x|) minus one `lo`).
NIB_HOST_DEVICE bool rht16_bf16_fit_from_bounds(uint32_t hi, uint32_t lo) {
  const uint32_t emax = hi >> 23, emin = (lo + 1u) >> 23, eq = emin > 1u ? emin : 1u;  // all zero: emin 0
  return emax <= 250u && emax <= eq + 12u;
}

// Whether rht16_bf16_f32 gives rht16_bf16_exact's bits for this tile of BF16 values: every
// value is a multiple of its quantum 2^(max(E, 1) - 134) (E its biased exponent, 8 significant
// bits), hence of q = 2^(Eq - 134) with Eq the smallest max(E, 1) of the nonzero values, and each
// partial sum of the butterfly (at most 16 terms) lies below 16 * 2^(Emax - 126); when Emax - Eq
// <= 12 such a multiple of q needs at most 24 significant bits, so every binary32 add and subtract
// of the butterfly is exact and yields the double path's value (the same operations in the same
// order, signed zeros included). Emax <= 250 keeps the sums far below binary32 overflow; * 0.25 is
// exact (its quantum 2^(Eq - 136) >= 2^-135 is representable), and f32_to_bf16_bits rounds that
// exact value once, as f64_to_bf16_bits does. NaN / Inf (E = 255) fail the test.
NIB_HOST_DEVICE bool rht16_bf16_sums_fit_f32(const float* x_bf16_values) {
  uint32_t hi, lo;
  magnitude_bit_range(x_bf16_values, 16, hi, lo);
  return rht16_bf16_fit_from_bounds(hi, lo);
}

// rht16_bf16_exact for a tile that passes rht16_bf16_sums_fit_f32: rht16_f32, then one BF16
// rounding per output.
NIB_HOST_DEVICE void rht16_bf16_f32(uint16_t* y_bf16, const float* x_bf16_values, uint32_t sign_mask) {
  float t[16];
  rht16_f32(t, x_bf16_values, sign_mask);
  for (int j = 0; j < 16; ++j) y_bf16[j] = f32_to_bf16_bits(t[j]);
}

}  // namespace nibble::formats
