// MX block quantizers, host+device (01-formats.md §4; testdata README `mxfp4_e2m1_*`,
// `mxfp8_e4m3_*`): one E8M0 scale per 1x32 block. MXFP4 (E2M1 elements) under three named
// scale rules (OCP floor, RCEIL, TransformerEngine ceil) and MXFP8 (E4M3 elements) under floor
// and RCEIL. floor/rceil use the signbit convention (-0.0 -> 0x8 / 0x80); te-ceil uses TE's
// (sign iff the scaled value < 0). Element = RNE (or SR for MXFP4) of fl(x * 2^(127-byte)).
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "formats/e2m1.h"
#include "formats/e4m3.h"
#include "formats/e8m0.h"
#include "formats/nvfp4.h"

namespace nibble::formats {

enum class MxScaleRule : uint8_t { kFloor, kRceil, kTeCeil };

NIB_HOST_DEVICE uint32_t mxfp4_scale_byte(float bamax, MxScaleRule rule) {
  switch (rule) {
    case MxScaleRule::kFloor: return e8m0_floor(bamax, 2);
    case MxScaleRule::kRceil: return e8m0_rceil(bamax, kRecip6);
    default: return e8m0_te_ceil(bamax);
  }
}
NIB_HOST_DEVICE uint32_t mxfp8_scale_byte(float bamax, MxScaleRule rule) {
  return rule == MxScaleRule::kFloor ? e8m0_floor(bamax, 8) : e8m0_rceil(bamax, kRecip448);
}

// Element code from v = fl(x * inv).
NIB_HOST_DEVICE uint32_t mxfp4_encode_rtn(float x, float inv, MxScaleRule rule) {
  float v = x * inv;
  return rule == MxScaleRule::kTeCeil ? e2m1_rne_code_te(v) : e2m1_rne_code_signbit(v);
}
NIB_HOST_DEVICE uint32_t mxfp4_encode_sr(float x, float inv, MxScaleRule rule, float u) {
  float v = x * inv;
  uint32_t sign = rule == MxScaleRule::kTeCeil ? static_cast<uint32_t>(v < 0.0f) : signbit_nan_positive(v);
  float a = u32_as_float(float_as_u32(v) & 0x7FFFFFFFu);
  return e2m1_sr_index(a, u) | (sign << 3);
}
// dequant = fl(e2m1(code) * 2^(byte-127))
NIB_HOST_DEVICE float mxfp4_decode(uint32_t code, uint32_t scale_byte) { return e2m1_decode(code) * e8m0_decode(scale_byte); }

// One 1x32 block: packed (16 bytes) <- x (32), returns the E8M0 byte.
template <typename In>
NIB_HOST_DEVICE uint32_t mxfp4_quantize_block32(uint8_t* packed, const In* x, MxScaleRule rule,
                                                const SrKey* sr = nullptr, uint64_t index0 = 0) {
  uint32_t byte = mxfp4_scale_byte(block_amax(x, 32), rule);
  float inv = e8m0_inverse(byte);
  uint32_t c[32];
  if (sr == nullptr) {
    for (int i = 0; i < 32; ++i) c[i] = mxfp4_encode_rtn(load_f32(x[i]), inv, rule);
  } else {
    float u[32];
    sr_uniforms(u, *sr, index0, 32);
    for (int i = 0; i < 32; ++i) c[i] = mxfp4_encode_sr(load_f32(x[i]), inv, rule, u[i]);
  }
  for (int i = 0; i < 16; ++i) packed[i] = e2m1_pack(c[2 * i], c[2 * i + 1]);
  return byte;
}
NIB_HOST_DEVICE void mxfp4_dequantize_block32(float* y, const uint8_t* packed, uint32_t scale_byte) {
  for (int i = 0; i < 32; ++i) y[i] = mxfp4_decode(e2m1_unpack(packed, i), scale_byte);
}

// MXFP8 element byte: e4m3_rne_sat(fl(x * inv)) (saturation = the floor rule's clamp to 448).
NIB_HOST_DEVICE uint32_t mxfp8_encode_rtn(float x, float inv) { return e4m3_rne_sat(x * inv); }
NIB_HOST_DEVICE float mxfp8_decode(uint32_t elem, uint32_t scale_byte) { return e4m3_decode(elem) * e8m0_decode(scale_byte); }

template <typename In>
NIB_HOST_DEVICE uint32_t mxfp8_quantize_block32(uint8_t* elems, const In* x, MxScaleRule rule) {
  uint32_t byte = mxfp8_scale_byte(block_amax(x, 32), rule);
  float inv = e8m0_inverse(byte);
  for (int i = 0; i < 32; ++i) elems[i] = static_cast<uint8_t>(mxfp8_encode_rtn(load_f32(x[i]), inv));
  return byte;
}
NIB_HOST_DEVICE void mxfp8_dequantize_block32(float* y, const uint8_t* elems, uint32_t scale_byte) {
  for (int i = 0; i < 32; ++i) y[i] = mxfp8_decode(elems[i], scale_byte);
}

}  // namespace nibble::formats
