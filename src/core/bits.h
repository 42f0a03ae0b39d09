// Bit-level helpers shared by host and device: float <-> uint32 reinterpretation, the magnitude
// bit range of a run of floats, and the BF16 and FP16 conversions (round to nearest even, NaN kept quiet). BF16 is the upper half
// of an IEEE binary32; these are the conversions every BF16 tensor in nibble goes through.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace nibble {

NIB_HOST_DEVICE uint32_t float_as_u32(float f) {
#if NIB_ON_DEVICE
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

NIB_HOST_DEVICE float u32_as_float(uint32_t u) {
#if NIB_ON_DEVICE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// binary32 -> bf16 bits, round to nearest even; NaN -> quiet NaN with the sign kept.
NIB_HOST_DEVICE uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = float_as_u32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// The magnitude range of x[0..n) as binary32 bits: `max_bits` = the largest bits(|x|) (NaN and
// Inf above every finite value), `min_nonzero_bits_minus1` = the smallest bits(|x|) - 1 with
// zeros wrapping to 0xFFFFFFFF (so it is the smallest nonzero magnitude's bits minus one, or
// 0xFFFFFFFF when all are zero). One pass of integer min/max; the block tests build on it.
NIB_HOST_DEVICE void magnitude_bit_range(const float* x, int n, uint32_t& max_bits, uint32_t& min_nonzero_bits_minus1) {
  uint32_t hi = 0, lo = 0xFFFFFFFFu;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < n; ++i) {
    const uint32_t b = float_as_u32(x[i]) & 0x7FFFFFFFu;
    hi = b > hi ? b : hi;
    lo = b - 1u < lo ? b - 1u : lo;
  }
  max_bits = hi;
  min_nonzero_bits_minus1 = lo;
}

NIB_HOST_DEVICE float bf16_bits_to_f32(uint16_t b) { return u32_as_float(static_cast<uint32_t>(b) << 16); }

// Round a binary32 to the nearest bf16 value, returned as binary32.
NIB_HOST_DEVICE float round_to_bf16(float f) { return bf16_bits_to_f32(f32_to_bf16_bits(f)); }

// binary32 -> IEEE binary16 bits, round to nearest even, overflow -> inf, NaN kept.
NIB_HOST_DEVICE uint16_t f32_to_f16_bits(float f) {
  uint32_t u = float_as_u32(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                              // f16 subnormal or zero
    // value = a_float; f16 subnormal step 2^-24: result = rne(value * 2^24).
    float v = u32_as_float(a) * 16777216.0f;  // exact: scaling by a power of two
    // rne of v to integer (v < 1024)
    uint32_t iv = static_cast<uint32_t>(v);
    float frac = v - static_cast<float>(iv);
    if (frac > 0.5f || (frac == 0.5f && (iv & 1u))) ++iv;
    return static_cast<uint16_t>(sign | iv);
  }
  uint32_t mant_round = a + 0x0fffu + ((a >> 13) & 1u);  // RNE at bit 13
  uint32_t e = ((mant_round >> 23) & 0xffu) - 127u + 15u;
  return static_cast<uint16_t>(sign | (e << 10) | ((mant_round >> 13) & 0x3ffu));
}

NIB_HOST_DEVICE float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  if (e == 0) {
    float v = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return u32_as_float(float_as_u32(v) | sign);
  }
  if (e == 31) return u32_as_float(sign | 0x7f800000u | (m << 13));
  return u32_as_float(sign | ((e - 15u + 127u) << 23) | (m << 13));
}

}  // namespace nibble
