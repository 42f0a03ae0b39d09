// NVFP4 per-element and per-block quantizers, host+device (01-formats.md §2-§3, §5; testdata
// README `nvfp4_te_*` and `nvfp4_tetrajet_v2_doubleblock_*`). Two families:
//  - TransformerEngine ("nvfp4", per-tensor amax + 1x16 E4M3 scales; 2-D 16x16 tiles reuse the
//    same functions with the tile amax), sign bit iff the scaled value < 0;
//  - TetraJet-v2 double block ("nvfp4-2level", 1x128 FP32 outer + 1x16 E4M3 inner), sign bit =
//    signbit(x). Every step is one IEEE binary32 operation in the order the README writes it.
// The CPU drivers (quantize_cpu.h) loop over these; CUDA threads call the same functions.
#pragma once

#include <cstdint>

#include "core/bits.h"
#include "core/host_device.h"
#include "core/philox.h"
#include "formats/e2m1.h"
#include "formats/e4m3.h"

namespace nibble::formats {

inline constexpr float kFltMax = 3.40282346638528859812e+38f;
inline constexpr float kRecip6 = 0x1.555556p-3f;     // fl(1/6)   = 0x3E2AAAAB
inline constexpr float kRecip448 = 0x1.24924Ap-9f;   // fl(1/448) = 0x3B124925
inline constexpr float kRecip2688 = 1.0f / 2688.0f;  // fl(1/2688), TE's dequant constant

// Input element -> binary32. uint16_t means BF16 bits throughout formats/.
NIB_HOST_DEVICE float load_f32(float x) { return x; }
NIB_HOST_DEVICE float load_f32(uint16_t bf16_bits) { return bf16_bits_to_f32(bf16_bits); }

// max(m, |x|) that ignores NaN (like fmaxf): the amax of a tensor/block skips NaN elements.
// m is never NaN and never -0 (it starts at +0 and only takes values |x|), so on the device
// fmaxf(m, |x|) is the same function in fewer instructions.
NIB_HOST_DEVICE float amax_update(float m, float x) {
#if defined(__CUDA_ARCH__)
  return fmaxf(m, fabsf(x));
#else
  float a = u32_as_float(float_as_u32(x) & 0x7FFFFFFFu);
  return a > m ? a : m;
#endif
}

// Stochastic-rounding randomness (the SR contract, 01-formats.md §5 as nibble defines it):
// element `index` of a (seed, stream) uses the 16-bit half-word index % 8 of Philox block
// index / 8: word (index % 8) / 2, its low half for even index, high half for odd, and
// u = h * 2^-16 (exact in binary32, u in [0, 1 - 2^-16]). One Philox4x32-10 call serves 8
// elements. With p = (a - down) / gap exact, P(round up) = P(h < p * 2^16) = ceil(p * 2^16) / 2^16,
// so the expected rounded value exceeds a by less than gap * 2^-16 (bias < 2^-16 of a grid step).
struct SrKey {
  uint64_t seed = 0;
  uint64_t stream = 0;
};
// Half-word j (0..7) of a Philox block: bits 16*(j%2) .. +15 of word j/2; its uniform h * 2^-16.
NIB_HOST_DEVICE uint32_t sr_halfword(const Philox4x32& r, uint32_t j) { return (r.v[j >> 1] >> ((j & 1u) * 16u)) & 0xFFFFu; }
NIB_HOST_DEVICE float sr_halfword_uniform(const Philox4x32& r, uint32_t j) {
  return static_cast<float>(sr_halfword(r, j)) * 1.52587890625e-05f;  // 2^-16
}
NIB_HOST_DEVICE float sr_uniform(const SrKey& key, uint64_t index) {
  return sr_halfword_uniform(philox_block(key.seed, key.stream, index >> 3), static_cast<uint32_t>(index & 7u));
}

// u[i] = sr_uniform(key, index0 + i) for i < n, computing one Philox block per 8 elements.
NIB_HOST_DEVICE void sr_uniforms(float* u, const SrKey& key, uint64_t index0, int n) {
  int i = 0;
  while (i < n) {
    uint64_t idx = index0 + static_cast<uint64_t>(i);
    Philox4x32 r = philox_block(key.seed, key.stream, idx >> 3);
    for (uint32_t j = static_cast<uint32_t>(idx & 7u); j < 8u && i < n; ++j, ++i) u[i] = sr_halfword_uniform(r, j);
  }
}

// ---- TransformerEngine NVFP4 -----------------------------------------------------------------

// Per-tensor constants derived from the stored amax (README order):
//   s_enc = min(fl(2688/amax), FLT_MAX)  (amax == 0 -> inf -> FLT_MAX); if s_enc == 0: 1
//   s_dec = fl(1/s_enc);  m = fl(s_enc * fl(1/6))
struct Nvfp4TeGlobal {
  float amax;
  float s_enc;
  float s_dec;
  float m;
};
NIB_HOST_DEVICE Nvfp4TeGlobal nvfp4_te_global(float amax) {
  float s_enc = 2688.0f / amax;
  s_enc = s_enc < kFltMax ? s_enc : kFltMax;
  if (s_enc == 0.0f) s_enc = 1.0f;
  Nvfp4TeGlobal g;
  g.amax = amax;
  g.s_enc = s_enc;
  g.s_dec = 1.0f / s_enc;
  g.m = s_enc * kRecip6;
  return g;
}

// E4M3 block-scale byte from the block (or 16x16 tile) amax: e4m3_rne(min(fl(bamax*m), 448)).
NIB_HOST_DEVICE uint32_t nvfp4_te_block_scale(float bamax, const Nvfp4TeGlobal& g) {
  float t = bamax * g.m;
  t = t < 448.0f ? t : 448.0f;
  return e4m3_rne_sat_magnitude(t);
}

// Encode multiplier of a block: min(fl(1 / fl(float(s) * s_dec)), FLT_MAX).
NIB_HOST_DEVICE float nvfp4_te_block_enc(uint32_t scale_byte, const Nvfp4TeGlobal& g) {
  float enc = 1.0f / (e4m3_decode(scale_byte) * g.s_dec);
  return enc < kFltMax ? enc : kFltMax;
}

// Element code, RTN: e2m1 of clamp(fl(x*enc), -6, 6), sign bit iff the scaled value < 0.
NIB_HOST_DEVICE uint32_t nvfp4_te_encode_rtn(float x, float enc) { return e2m1_rne_code_te(x * enc); }

// Element code, SR with uniform u: a = |clamp(fl(x*enc), -6, 6)|, e2m1_sr_index(a, u).
NIB_HOST_DEVICE uint32_t nvfp4_te_encode_sr(float x, float enc, float u) {
  float v = x * enc;
  float a = v < 0.0f ? -v : v;
  return e2m1_sr_index(a, u) | (static_cast<uint32_t>(v < 0.0f) << 3);
}

// The same with the element's random half-word h (u = h * 2^-16): e2m1_sr_index_h.
NIB_HOST_DEVICE uint32_t nvfp4_te_encode_sr_h(float x, float enc, uint32_t h) {
  float v = x * enc;
  float a = u32_as_float(float_as_u32(v) & 0x7FFFFFFFu);  // |v|; -0.0 and +0.0 both give index 0
  return e2m1_sr_index_h(a, h) | (static_cast<uint32_t>(v < 0.0f) << 3);
}

// Dequant factor, TE's kernel: fl(fl(float(s) * amax) * fl(1/2688)).
NIB_HOST_DEVICE float nvfp4_te_dequant_factor(uint32_t scale_byte, float amax) {
  return (e4m3_decode(scale_byte) * amax) * kRecip2688;
}
NIB_HOST_DEVICE float nvfp4_te_decode(uint32_t code, float factor) { return e2m1_decode(code) * factor; }

// One 1x16 block: x (16 contiguous elements) -> packed (8 bytes), returns the scale byte.
// bamax is the amax the scale comes from: the block's own (1x16) or its 16x16 tile's (2-D).
// sr == nullptr: RTN; else element i uses sr_uniform(*sr, index0 + i).
template <typename In>
NIB_HOST_DEVICE uint32_t nvfp4_te_quantize_block16(uint8_t* packed, const In* x, float bamax, const Nvfp4TeGlobal& g,
                                                   const SrKey* sr = nullptr, uint64_t index0 = 0) {
  uint32_t s = nvfp4_te_block_scale(bamax, g);
  float enc = nvfp4_te_block_enc(s, g);
  uint32_t c[16];
  if (sr == nullptr) {
    for (int i = 0; i < 16; ++i) c[i] = nvfp4_te_encode_rtn(load_f32(x[i]), enc);
  } else {
    float u[16];
    sr_uniforms(u, *sr, index0, 16);
    for (int i = 0; i < 16; ++i) c[i] = nvfp4_te_encode_sr(load_f32(x[i]), enc, u[i]);
  }
  for (int i = 0; i < 8; ++i) packed[i] = e2m1_pack(c[2 * i], c[2 * i + 1]);
  return s;
}

template <typename In>
NIB_HOST_DEVICE float block_amax(const In* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = amax_update(m, load_f32(x[i]));
  return m;
}

// y (16) <- dequantized block.
NIB_HOST_DEVICE void nvfp4_te_dequantize_block16(float* y, const uint8_t* packed, uint32_t scale_byte, float amax) {
  float f = nvfp4_te_dequant_factor(scale_byte, amax);
  for (int i = 0; i < 16; ++i) y[i] = nvfp4_te_decode(e2m1_unpack(packed, i), f);
}

// The TE block split for a BF16 GEMM (issue #13): a dequantized value is
// e2m1(code) × fl(fl(s × amax) × fl(1/2688)); the GEMM operand is e2m1(code) × s (<= 6
// significant bits: exact in BF16) and the per-tensor parts of both operands are its alpha.
NIB_HOST_DEVICE float nvfp4_te_bf16_operand(uint32_t code, uint32_t scale_byte) {
  return e2m1_decode(code) * e4m3_decode(scale_byte);
}
// alpha = fl(fl(amax_a × fl(1/2688)) × fl(amax_b × fl(1/2688))).
NIB_HOST_DEVICE float nvfp4_te_gemm_alpha(float amax_a, float amax_b) {
  return (amax_a * kRecip2688) * (amax_b * kRecip2688);
}

// ---- TetraJet-v2 double block ("nvfp4-2level") -----------------------------------------------

// Outer FP32 scale of a 1x128 block: so = fl(fl(amax * R448) * R6); 0 -> 1.
NIB_HOST_DEVICE float nvfp4_2level_outer_scale(float amax128) {
  float so = (amax128 * kRecip448) * kRecip6;
  return so == 0.0f ? 1.0f : so;
}

// Inner E4M3 byte of a 1x16 block: e4m3_rne(min(fl(fl(bamax / so) * R6), 448)); may be 0.
// `/` is the correctly rounded binary32 division (nvcc's default -prec-div=true).
NIB_HOST_DEVICE uint32_t nvfp4_2level_inner_scale(float bamax, float so) {
  float t = (bamax / so) * kRecip6;
  t = t < 448.0f ? t : 448.0f;
  return e4m3_rne_sat_magnitude(t);
}

// sp = fl(float(si) * so): the block's effective scale.
NIB_HOST_DEVICE float nvfp4_2level_block_scale(uint32_t inner_byte, float so) { return e4m3_decode(inner_byte) * so; }

// v = fl(|x| / sp), the correctly rounded quotient (0 when sp == 0), without a per-element
// division. r = nvfp4_2level_block_reciprocal(sp) is computed once per 16-block: fl(1/sp) when
// sp lies in [2^-60, 2^60], else 0 (meaning: divide). Per element, with a = |x| in [2^-60, 2^60]
// (or a == 0):
//   q0 = fl(a*r);  e0 = fma(-q0, sp, a);  q1 = fma(e0, r, q0);  e1 = fma(-q1, sp, a);  v = fma(e1, r, q1)
// Argument (every intermediate is a normal binary32 in these ranges: Q = a/sp in [2^-120, 2^120],
// residuals >= 2^-84, so the standard relative error bounds hold): r = RN(1/sp) is within half an
// ulp of 1/sp, so q0 is within 1.5 ulp of Q; q0 + e0*r = Q + (Q - q0)*O(2^-23), so q1 = RN(that)
// is a faithful approximation of Q (|q1 - Q| < ulp(Q)); for a faithful q1 the residual a - sp*q1
// is a multiple of ulp(sp)*ulp(q1) below 2^24 of those units, hence exact (e1 = a - sp*q1); and
// by Markstein's theorem (r within half an ulp of 1/sp, q1 within one ulp of Q, e1 exact)
// RN(q1 + e1*r) = RN(a/sp). fma is a single correctly rounded operation on both the CPU
// (std::fma) and the GPU (fmaf; --fmad=false does not touch explicit fmaf), so both agree. Out of
// range (tiny or huge a, NaN, Inf, tiny/huge/non-finite sp) the IEEE division is taken.
// Tested: equal to a / sp over all 2^30 (BF16 mantissa, sp mantissa) pairs plus random and edge
// sets on the GPU, and over a large random + edge sample on the CPU (quantize_test.cpp).
NIB_HOST_DEVICE float nvfp4_2level_block_reciprocal(float sp) {
  return (sp >= 0x1p-60f && sp <= 0x1p60f) ? 1.0f / sp : 0.0f;
}
// The fast-path steps alone (valid when sp, a in range as above; a == 0 gives +0).
NIB_HOST_DEVICE float nvfp4_2level_quotient_fma(float a, float sp, float r) {
  const float q0 = a * r;
  const float e0 = fma_f32(-q0, sp, a);
  const float q1 = fma_f32(e0, r, q0);
  const float e1 = fma_f32(-q1, sp, a);
  return fma_f32(e1, r, q1);
}
NIB_HOST_DEVICE float nvfp4_2level_scaled_magnitude(float x, float sp, float r) {
  const uint32_t ab = float_as_u32(x) & 0x7FFFFFFFu;
  const float a = u32_as_float(ab);
  // a in [2^-60, 2^60] (bits 0x21800000 .. 0x5D800000) or a == +0.
  const bool in_range = (ab - 0x21800000u) <= (0x5D800000u - 0x21800000u) || ab == 0u;
  if (sp == 0.0f) return 0.0f;
  if (r == 0.0f || !in_range) return a / sp;
  return nvfp4_2level_quotient_fma(a, sp, r);
}
// One range decision for a whole 16-block (the GPU kernels' form is
// cuda::nvfp4_2level_block_fast_nan_free): when sp is in [2^-60, 2^60] (r != 0) and every nonzero
// |x[i]| in [2^-60, 2^60], v[i] = nvfp4_2level_quotient_fma(|x[i]|, sp, r) = fl(|x[i]| / sp) for
// every i; otherwise each element takes nvfp4_2level_scaled_magnitude (its own decision).
// The weaker block condition that suffices when only the RTN index of each element is needed:
// r != 0 (sp in [2^-60, 2^60]) and bamax <= 2^60, with no per-element range check. Elements with
// |x| >= 2^-60 get the exact quotient as above. For smaller |x| the steps may meet subnormal
// residuals only when |x| < 2^-102 (a residual is about |x| * 2^-23), and then the true quotient
// is below 2^-102 / 2^-60 = 2^-42 while each subnormal rounding perturbs the result by at most
// 2^-150 * r <= 2^-90: the computed value stays far below 0.25, index 0, as the division gives.
// Tested: formats/quantize_test.cpp (every BF16 magnitude, extreme scales).
NIB_HOST_DEVICE bool nvfp4_2level_block_fast_rtn(float r, float bamax) { return r != 0.0f && bamax <= 0x1p60f; }
// Element code from its scaled magnitude v = fl(|x| / sp) and x (for the sign).
NIB_HOST_DEVICE uint32_t nvfp4_2level_code_rtn(float v, float x) {
  return e2m1_rne_index(v) | (signbit_nan_positive(x) << 3);
}
// The definition: fl(|x| / sp) by one IEEE division (0 when sp == 0).
NIB_HOST_DEVICE float nvfp4_2level_scaled_magnitude(float x, float sp) {
  float a = u32_as_float(float_as_u32(x) & 0x7FFFFFFFu);
  return sp == 0.0f ? 0.0f : a / sp;
}
NIB_HOST_DEVICE uint32_t nvfp4_2level_encode_rtn(float x, float sp, float r) {
  return e2m1_rne_index(nvfp4_2level_scaled_magnitude(x, sp, r)) | (signbit_nan_positive(x) << 3);
}
NIB_HOST_DEVICE uint32_t nvfp4_2level_encode_sr(float x, float sp, float r, float u) {
  return e2m1_sr_index(nvfp4_2level_scaled_magnitude(x, sp, r), u) | (signbit_nan_positive(x) << 3);
}
NIB_HOST_DEVICE uint32_t nvfp4_2level_encode_rtn(float x, float sp) {
  return nvfp4_2level_encode_rtn(x, sp, nvfp4_2level_block_reciprocal(sp));
}
NIB_HOST_DEVICE uint32_t nvfp4_2level_encode_sr(float x, float sp, float u) {
  return nvfp4_2level_encode_sr(x, sp, nvfp4_2level_block_reciprocal(sp), u);
}
// dequant = (sign ? -1 : 1) * fl(q * sp)
NIB_HOST_DEVICE float nvfp4_2level_decode(uint32_t code, float sp) {
  float v = e2m1_magnitude(code & 7u) * sp;
  return (code & 8u) ? -v : v;
}

// One 1x128 outer block (n elements, n % 16 == 0, 16 <= n <= 128; a shorter last block is the
// zero-padded 128-block): packed (n/2 bytes), inner (n/16 bytes), returns the outer scale.
template <typename In>
NIB_HOST_DEVICE float nvfp4_2level_quantize_block128(uint8_t* packed, uint8_t* inner, const In* x, int n,
                                                     const SrKey* sr = nullptr, uint64_t index0 = 0) {
  float so = nvfp4_2level_outer_scale(block_amax(x, n));
  for (int b = 0; b < n / 16; ++b) {
    const In* xb = x + 16 * b;
    uint32_t si = nvfp4_2level_inner_scale(block_amax(xb, 16), so);
    inner[b] = static_cast<uint8_t>(si);
    float sp = nvfp4_2level_block_scale(si, so);
    float r = nvfp4_2level_block_reciprocal(sp);
    uint32_t c[16];
    if (sr == nullptr) {
      for (int i = 0; i < 16; ++i) c[i] = nvfp4_2level_encode_rtn(load_f32(xb[i]), sp, r);
    } else {
      float u[16];
      sr_uniforms(u, *sr, index0 + 16 * static_cast<uint64_t>(b), 16);
      for (int i = 0; i < 16; ++i) c[i] = nvfp4_2level_encode_sr(load_f32(xb[i]), sp, r, u[i]);
    }
    for (int i = 0; i < 8; ++i) packed[8 * b + i] = e2m1_pack(c[2 * i], c[2 * i + 1]);
  }
  return so;
}

// y (n) <- dequantized outer block (n % 16 == 0).
NIB_HOST_DEVICE void nvfp4_2level_dequantize_block128(float* y, const uint8_t* packed, const uint8_t* inner, float so,
                                                      int n) {
  for (int b = 0; b < n / 16; ++b) {
    float sp = nvfp4_2level_block_scale(inner[b], so);
    for (int i = 0; i < 16; ++i) y[16 * b + i] = nvfp4_2level_decode(e2m1_unpack(packed, 16 * b + i), sp);
  }
}

}  // namespace nibble::formats
