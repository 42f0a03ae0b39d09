// E4M3 "fn" codec (OCP float8_e4m3fn: bias 7, max 448, subnormal step 2^-9, no Inf, 0x7F/0xFF
// NaN), used unsigned as the NVFP4 block scale and signed as the MXFP8 element
// (01-formats.md §1, testdata README). Conversion from binary32 is round to nearest even with
// saturation at 448 (also for +-Inf); NaN -> 0x7F | sign. Host+device, bit manipulation only.
#pragma once

#include <cstdint>

#include "core/bits.h"
#include "core/host_device.h"

namespace nibble::formats {

// E4M3 byte -> binary32 (exact). 0x7F/0xFF -> NaN.
NIB_HOST_DEVICE float e4m3_decode(uint32_t byte) {
  uint32_t sign = (byte & 0x80u) << 24;
  uint32_t e = (byte >> 3) & 0xFu, m = byte & 7u;
  if (e == 15u && m == 7u) return u32_as_float(sign | 0x7FC00000u);
  float mag = e == 0u ? static_cast<float>(m) * 0.001953125f  // m * 2^-9, exact
                      : u32_as_float(((e + 120u) << 23) | (m << 20));
  return u32_as_float(float_as_u32(mag) | sign);
}

// |v| -> E4M3 magnitude byte (0x00..0x7E), RNE, saturating (>= 448 and +Inf -> 0x7E); a >= 0
// and not NaN (NaN gives 0x7E here; e4m3_rne_sat handles it). Branch-free so that loops over
// many blocks vectorise.
NIB_HOST_DEVICE uint32_t e4m3_rne_sat_magnitude(float a) {
  // Subnormal range (a < 2^-6): q = rne(a * 2^9) in [0, 8]; q == 8 is code 0x08 = 2^-6.
  bool sub = a < 0.015625f;
  float s = (sub ? a : 0.0f) * 512.0f;                         // exact (power-of-two scaling)
  uint32_t q = static_cast<uint32_t>((s + 8388608.0f) - 8388608.0f);  // RNE to integer (s < 8)
  // Normal range: RNE at mantissa bit 20 (keep 3 bits); a carry moves into the exponent.
  uint32_t u = float_as_u32(sub ? 1.0f : a);
  uint32_t ur = u + 0x7FFFFu + ((u >> 20) & 1u);
  uint32_t code = ((((ur >> 23) & 0xFFu) - 120u) << 3) | ((ur >> 20) & 7u);  // exponent >= 121 here
  code = code > 0x7Eu ? 0x7Eu : code;                          // > 448 (incl. Inf) saturates
  return sub ? q : code;
}

// binary32 -> E4M3 byte, round to nearest even, saturating at +-448; sign bit = signbit(v)
// (-0.0 -> 0x80); NaN -> 0x7F whatever its sign (NaN signs differ between CPU and GPU).
NIB_HOST_DEVICE uint32_t e4m3_rne_sat(float v) {
  uint32_t u = float_as_u32(v);
  uint32_t sign = (u >> 24) & 0x80u;
  uint32_t au = u & 0x7FFFFFFFu;
  if (au > 0x7F800000u) return 0x7Fu;
  return sign | e4m3_rne_sat_magnitude(u32_as_float(au));
}

}  // namespace nibble::formats
