// E8M0 (MX block scale) codec and the three MX scale-exponent rules of the testdata README
// (`mxfp4_e2m1_*`, `mxfp8_e4m3_*`): OCP floor, cuBLAS/torchao RCEIL, TransformerEngine ceil,
// written bit for bit as there, including FP32-subnormal block maxima. A byte b means 2^(b-127);
// 0xFF is NaN. Host+device, integer bit manipulation plus one FP32 multiply/divide per rule.
#pragma once

#include <cstdint>

#include "core/bits.h"
#include "core/host_device.h"

namespace nibble::formats {

// 2^(byte - 127) as binary32 (byte 0 -> the subnormal 2^-127); 0xFF -> NaN.
NIB_HOST_DEVICE float e8m0_decode(uint32_t byte) {
  if (byte == 0xFFu) return u32_as_float(0x7FC00000u);
  return byte == 0u ? u32_as_float(0x00400000u) : u32_as_float(byte << 23);
}

// 2^(127 - byte) as binary32, the element multiplier (byte 254 -> 2^-127 subnormal,
// byte 0 -> 2^127, byte 255 -> 2^-128 subnormal; a NaN scale byte is the caller's business).
NIB_HOST_DEVICE float e8m0_inverse(uint32_t byte) {
  int32_t e = 127 - static_cast<int32_t>(byte);  // unbiased exponent of the result, -128..127
  if (e >= -126) return u32_as_float(static_cast<uint32_t>(e + 127) << 23);
  return u32_as_float(0x00400000u >> static_cast<uint32_t>(-127 - e));  // 2^-127, 2^-128
}

// OCP floor rule: E = (biased exponent field of bamax) - 127 - emax_elem, clamped to
// [-127, 128], byte = E + 127; bamax Inf/NaN -> 0xFF; zero/FP32-subnormal -> byte 0.
// emax_elem = 2 for E2M1 (MXFP4), 8 for E4M3 (MXFP8).
NIB_HOST_DEVICE uint32_t e8m0_floor(float bamax, int32_t emax_elem) {
  uint32_t u = float_as_u32(bamax) & 0x7FFFFFFFu;
  if (u >= 0x7F800000u) return 0xFFu;
  int32_t e = static_cast<int32_t>(u >> 23) - 127 - emax_elem;
  e = e < -127 ? -127 : (e > 128 ? 128 : e);
  return static_cast<uint32_t>(e + 127);
}

// Byte that rounds binary32 d >= 0 up to a power of two: biased exponent field of d, plus 1 if
// any mantissa bit is set; FP32-subnormal d: plus 1 iff mantissa > 0x400000 (d > 2^-127).
// d Inf/NaN -> 0xFF; results above 0xFE (d > 2^127) give 0xFF.
NIB_HOST_DEVICE uint32_t e8m0_round_up_bits(float d) {
  uint32_t u = float_as_u32(d) & 0x7FFFFFFFu;
  if (u >= 0x7F800000u) return 0xFFu;
  uint32_t e = u >> 23, m = u & 0x7FFFFFu;
  uint32_t byte = e == 0u ? (m > 0x400000u ? 1u : 0u) : e + (m != 0u ? 1u : 0u);
  return byte > 0xFFu ? 0xFFu : byte;
}

// RCEIL (cuBLAS / torchao RCEIL): d = fl(bamax * r) with r = fl(1/6) (MXFP4, 0x3E2AAAAB) or
// fl(1/448) (MXFP8, 0x3B124925); byte = e8m0_round_up_bits(d).
NIB_HOST_DEVICE uint32_t e8m0_rceil(float bamax, float recip_elem_max) {
  return e8m0_round_up_bits(bamax * recip_elem_max);
}

// TransformerEngine pow-2 ceil rule (MXFP4): d = fl(bamax / 6); E = ceil(log2 d) clamped to
// [-127, 127] (bamax == 0 -> -127); byte = E + 127. For normal d this is the exponent plus one
// if the mantissa is non-zero; for subnormal d, E = -127 iff d <= 2^-127, else -126.
NIB_HOST_DEVICE uint32_t e8m0_te_ceil(float bamax) {
  float d = bamax / 6.0f;
  uint32_t u = float_as_u32(d) & 0x7FFFFFFFu;
  if (u >= 0x7F800000u) return 0xFFu;
  uint32_t byte = e8m0_round_up_bits(d);
  return byte > 254u ? 254u : byte;  // clamp E to 127
}

}  // namespace nibble::formats
