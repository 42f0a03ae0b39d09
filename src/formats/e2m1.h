// E2M1 (FP4) element codec shared by the CPU reference and CUDA kernels (01-formats.md §1):
// code <-> value, round-to-nearest-even with saturation at 6 under both sign conventions
// (TransformerEngine: sign bit iff the scaled value < 0; TetraJet/MX: sign bit = signbit(x)),
// the stochastic-rounding step of §5, and nibble packing (even element in the low nibble).
// Everything is NIB_HOST_DEVICE, branch-light and written with +,-,*,/ and compares only, so
// GCC vectorises the CPU loops and nvcc (--fmad=false) produces the same bits.
#pragma once

#include <cstdint>

#include "core/bits.h"
#include "core/host_device.h"

namespace nibble::formats {

// Magnitude of E2M1 index 0..7: {0, 0.5, 1, 1.5, 2, 3, 4, 6} (built from bits, no table, so
// device code needs no __constant__ array).
NIB_HOST_DEVICE float e2m1_magnitude(uint32_t idx) {
  uint32_t e = idx >> 1, m = idx & 1u;
  uint32_t bits = idx < 2u ? (idx == 0u ? 0u : 0x3F000000u) : (((e + 126u) << 23) | (m << 22));
  return u32_as_float(bits);
}

// Value of a 4-bit code (bit 3 = sign). Code 0x8 decodes to -0.0.
NIB_HOST_DEVICE float e2m1_decode(uint32_t code) {
  float m = e2m1_magnitude(code & 7u);
  return (code & 8u) ? -m : m;
}

// fma(a, b, c) with one rounding, identical on CPU (__builtin_fmaf; -ffp-contract=off does not
// affect explicit fma) and GPU (fmaf; --fmad=false neither).
NIB_HOST_DEVICE float fma_f32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}

// Round-to-nearest-even magnitude index of a >= 0, saturating to 7 (=6.0); NaN gives 0.
// Decision thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, ties to the even code. Computed by
// integer rounding: for a >= 1 the E2M1 grid of a's binade is "1 mantissa bit", so rounding the
// binary32 bits to nearest-even at bit 22 (add 0x1FFFFF + bit 22) leaves 2*biased_exp + m in
// bits 22.., and idx = that - 252 (2 + 2e + m), saturated at 7. Below 1 the grid is 0, 0.5, 1 =
// index/2, so idx = rint(2a) with ties to even (0.25 -> 0, 0.75 -> 2): fl(2a + 2^23) rounds the
// exact 2a to an integer, ties to even, read from the bits (one fma; a NaN or -0.0 is first
// mapped to +0). Equal to the 7-compare chain (e2m1_rne_index_ref in the tests) for all 2^32
// inputs (ElementCodec.ExhaustiveAgainstFormerFormulations on the GPU; threshold neighbourhoods
// and every 61st pattern on the CPU).
NIB_HOST_DEVICE uint32_t e2m1_rne_index(float a) {
  const uint32_t u = float_as_u32(a);
  const uint32_t r = (u + 0x1FFFFFu + ((u >> 22) & 1u)) >> 22;
  const uint32_t h = r - 252u;
  const uint32_t hi = h < 7u ? h : 7u;
#if defined(__CUDA_ARCH__)
  const float a0 = fmaxf(a, 0.0f);  // NaN -> 0
#else
  const float a0 = a > 0.0f ? a : 0.0f;
#endif
  const uint32_t lo = float_as_u32(fma_f32(a0, 2.0f, 8388608.0f)) - 0x4B000000u;
  return a >= 1.0f ? hi : lo;
}

// e2m1_rne_index(a) for 0 <= a < 7 (not NaN), returned as the binary32 bits 0x4B000000 + index
// (so the index sits in the low bits for packing), in four operations that suit GPUs whose fma
// rate is twice their integer rate: the E2M1 grid has step 0.5 on [0, 2], 1 on [2, 4], 2 on
// [4, 8); rint(2a), rint(a + 2), rint(a/2 + 4) map each piece onto the integer indices, the map
// min(2a, a + 2, a/2 + 4) is concave (slopes 2, 1, 1/2) so rint of the minimum is the minimum of
// the rints, and every decision value of the index (0.25 0.75 1.25 1.75 2.5 3.5 5) lands on a
// half-integer where rint's ties-to-even picks the even code, as e2m1_rne_index does. Each rint is
// one fma with 2^23 + c (fl(z + 2^23) = 2^23 + rint(z) for 0 <= z < 2^22); the three results are
// positive floats, which order like their bits, so the minimum is an unsigned integer minimum.
// (At a = 7, rint(a/2 + 4) = 8: the callers bound a.) Equal to e2m1_rne_index for every binary32
// in [0, 7) (all of them on the GPU,
// ElementCodec.ExhaustiveAgainstFormerFormulations; near every boundary on the CPU).
NIB_HOST_DEVICE uint32_t e2m1_rne_index_bits_min3(float a) {
  const uint32_t t1 = float_as_u32(fma_f32(a, 2.0f, 8388608.0f));
  const uint32_t t2 = float_as_u32(fma_f32(a, 1.0f, 8388610.0f));
  const uint32_t t3 = float_as_u32(fma_f32(a, 0.5f, 8388612.0f));
  const uint32_t m = t1 < t2 ? t1 : t2;
  return m < t3 ? m : t3;
}

// TransformerEngine convention: sign bit iff v < 0 (so -0.0 -> 0x0, a small negative that
// rounds to zero -> 0x8). |v| > 6 saturates. NaN -> 0x0.
NIB_HOST_DEVICE uint32_t e2m1_rne_code_te(float v) {
  float a = u32_as_float(float_as_u32(v) & 0x7FFFFFFFu);  // |v| (the index of -0.0 and +0.0 is 0)
  return e2m1_rne_index(a) | (static_cast<uint32_t>(v < 0.0f) << 3);
}

// Sign bit of v for the signbit convention, with NaN counted as positive: IEEE leaves the sign
// of a NaN produced by arithmetic unspecified (x86 makes -NaN, CUDA +NaN), so a NaN's code must not
// depend on it for CPU and GPU to agree bit for bit.
NIB_HOST_DEVICE uint32_t signbit_nan_positive(float v) { return (float_as_u32(v) >> 31) & static_cast<uint32_t>(v == v); }

// TetraJet / MX convention: sign bit = signbit(v) (-0.0 -> 0x8). NaN -> 0x0 (any NaN sign).
NIB_HOST_DEVICE uint32_t e2m1_rne_code_signbit(float v) {
  uint32_t s = signbit_nan_positive(v);
  float a = u32_as_float(float_as_u32(v) & 0x7FFFFFFFu);
  return e2m1_rne_index(a) | (s << 3);
}

// Stochastic rounding of a magnitude a >= 0 on the E2M1 grid (01-formats.md §5), given a
// uniform u in [0,1): down = largest grid value <= a, gap = 0.5 on [0,2), 1 on [2,4), 2 on
// [4,6); round up iff u < (a - down) / gap. a - down is exact (Sterbenz, or down == 0) and
// gap is a power of two, so (a - down) * (1/gap) is the exact quotient (a multiplication by an
// exact power of two: the same real number as the division, hence the same binary32), and the
// probability is computed exactly. a >= 6 -> 7 (saturate); NaN -> 0. The result is always
// `down` or the next grid value: never more than one step.
NIB_HOST_DEVICE uint32_t e2m1_sr_index(float a, float u) {
  uint32_t di = static_cast<uint32_t>(a >= 0.5f) + static_cast<uint32_t>(a >= 1.0f) +
                static_cast<uint32_t>(a >= 1.5f) + static_cast<uint32_t>(a >= 2.0f) +
                static_cast<uint32_t>(a >= 3.0f) + static_cast<uint32_t>(a >= 4.0f) + static_cast<uint32_t>(a >= 6.0f);
  float down = e2m1_magnitude(di);
  float inv_gap = di < 4u ? 2.0f : (di < 6u ? 1.0f : 0.5f);
  float frac = (a - down) * inv_gap;
  uint32_t up = (di < 7u && u < frac) ? 1u : 0u;
  return di + up;
}

// e2m1_sr_index(a, u) for u = h * 2^-16 (h the element's 16-bit random half-word, nvfp4.h
// sr_uniform; h = 65536 acts as u = 1: never rounds up), by integer comparisons on the bits of a:
//  a in [1, 8): down = a truncated to one mantissa bit, gap = 2^(e-1), so (a - down)/gap =
//    L / 2^22 with L = the low 22 mantissa bits, and u < L/2^22 <=> h * 64 < L (exact);
//    floor index = 2 + 2e + m = (bits >> 22) - 252 (e = unbiased exponent, m = mantissa bit 22),
//    saturated at 7 (a >= 6: index 7, never rounds up);
//  a in [0.5, 1): down = 0.5, (a - 0.5)/0.5 = M / 2^23 (M = the 23 mantissa bits): h * 128 < M;
//  a < 0.5 (also -0.0, NaN): down = 0, p = 2a: u < 2a <=> h * 2^-17 < a (exact binary32 compare;
//    false for NaN and -0.0, as in e2m1_sr_index).
// Each branch is the same exact real comparison u < (a - down)/gap as e2m1_sr_index, so the
// results are equal for every a and h (tested: all 2^32 a at boundary and random h on the GPU).
NIB_HOST_DEVICE uint32_t e2m1_sr_index_h(float a, uint32_t h) {
  const uint32_t u = float_as_u32(a);
  const uint32_t f = (u >> 22) - 252u;
  const uint32_t di_hi = f < 7u ? f : 7u;
  const uint32_t up_hi = (di_hi < 7u && (h << 6) < (u & 0x3FFFFFu)) ? 1u : 0u;
  const uint32_t up_mid = (h << 7) < (u & 0x7FFFFFu) ? 1u : 0u;
  const uint32_t up_lo = static_cast<float>(h) * 7.62939453125e-06f < a ? 1u : 0u;  // h * 2^-17
  return a >= 1.0f ? di_hi + up_hi : (a >= 0.5f ? 1u + up_mid : up_lo);
}

// Pack two codes into one byte: even element low nibble, odd element high nibble.
NIB_HOST_DEVICE uint8_t e2m1_pack(uint32_t even_code, uint32_t odd_code) {
  return static_cast<uint8_t>((even_code & 0xFu) | ((odd_code & 0xFu) << 4));
}

// Code of element i of a packed row (i-th element, byte i/2).
NIB_HOST_DEVICE uint32_t e2m1_unpack(const uint8_t* packed, int64_t i) {
  return (static_cast<uint32_t>(packed[i >> 1]) >> ((i & 1) * 4)) & 0xFu;
}

}  // namespace nibble::formats
