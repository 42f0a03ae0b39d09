// E4M3 "fn" codec (OCP float8_e4m3fn: bias 7, max 448, subnormal step 2^-9, no Inf, 0x7F/0xFF
// NaN), used unsigned as the NVFP4 block scale and signed as the MXFP8 element
// (01-formats.md §1, testdata README). Conversion from binary32 is round to nearest even with
// saturation at 448 (also for +-Inf); NaN -> 0x7F | sign. Host+device: bit manipulation, and on
// sm_89+ devices the hardware conversions, proven equal on the GPU for every input.
#pragma once

#include <cstdint>

#include "core/bits.h"
#include "core/host_device.h"

namespace nibble::formats {

// E4M3 byte -> binary32 (exact). 0x7F/0xFF -> NaN. The bit manipulation (every target); on
// sm_89+ devices e4m3_decode uses the hardware conversion (e4m3 -> f16 -> f32, both exact) and
// returns this function's NaN bits for 0x7F/0xFF, so it is the same function (all 256 bytes are
// compared on the GPU, ElementCodec.HardwareE4m3EqualsBitManipulation).
NIB_HOST_DEVICE float e4m3_decode_bits(uint32_t byte) {
  uint32_t sign = (byte & 0x80u) << 24;
  uint32_t e = (byte >> 3) & 0xFu, m = byte & 7u;
  if (e == 15u && m == 7u) return u32_as_float(sign | 0x7FC00000u);
  float mag = e == 0u ? static_cast<float>(m) * 0.001953125f  // m * 2^-9, exact
                      : u32_as_float(((e + 120u) << 23) | (m << 20));
  return u32_as_float(float_as_u32(mag) | sign);
}

// e4m3_decode for every byte but the NaNs 0x7F / 0xFF, which give some NaN: on sm_89+ the bare
// hardware conversion (two instructions fewer), for callers that test the result for finiteness
// before using it.
NIB_HOST_DEVICE float e4m3_decode_any_nan(uint32_t byte) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short h;
  asm("{\n\t.reg .b32 t;\n\tcvt.rn.f16x2.e4m3x2 t, %1;\n\tmov.b32 {%0, _}, t;\n\t}" : "=h"(h) : "h"(static_cast<unsigned short>(byte & 0xFFu)));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return e4m3_decode_bits(byte);
#endif
}

NIB_HOST_DEVICE float e4m3_decode(uint32_t byte) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return (byte & 0x7Fu) == 0x7Fu ? u32_as_float(((byte & 0x80u) << 24) | 0x7FC00000u) : e4m3_decode_any_nan(byte);
#else
  return e4m3_decode_bits(byte);
#endif
}

// |v| -> E4M3 magnitude byte (0x00..0x7E), RNE, saturating (>= 448 and +Inf -> 0x7E); a >= 0
// and not NaN (NaN gives 0x7E here; e4m3_rne_sat handles it). Branch-free so that loops over
// many blocks vectorise. The bit manipulation (every target); e4m3_rne_sat_magnitude uses the
// sm_89+ hardware conversion (RNE, satfinite) on the device, equal for every binary32 in
// [0, +Inf] (all 2^31 patterns compared on the GPU, ElementCodec.HardwareE4m3EqualsBitManipulation).
NIB_HOST_DEVICE uint32_t e4m3_rne_sat_magnitude_bits(float a) {
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

NIB_HOST_DEVICE uint32_t e4m3_rne_sat_magnitude(float a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(a));  // a -> low byte
  return pair & 0xFFu;
#else
  return e4m3_rne_sat_magnitude_bits(a);
#endif
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
