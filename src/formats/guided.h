// TRACE rollout-guided rounding, host+device (01-formats.md §7; 03-rl-and-trace.md §2). The
// trainer scales x by the ROLLOUT's block scale, takes the two E2M1 neighbours lo <= z <= hi of
// the scaled value z (equal when z is on the grid), and picks the one equal/closer to the
// rollout's code (full guidance) or the one whose mantissa bit (code bit 0) matches the
// rollout's (1-bit guidance). Guarantee (full): |q_guided - q_roll| <= |q_RTN - q_roll|, since
// q_RTN is lo or hi; (1-bit): the same whenever q_roll is lo or hi (adjacent E2M1 values always
// differ in the mantissa bit, so the match is exactly q_roll). No guidance: RTN, own scale.
#pragma once

#include <cstdint>

#include "core/bits.h"
#include "core/host_device.h"
#include "formats/e2m1.h"
#include "formats/nvfp4.h"

namespace nibble::formats {

// Magnitude indices of the grid neighbours of a = |z| (a clamped to [0, 6], NaN -> 0):
// down <= a <= up, down == up iff a is a grid value.
NIB_HOST_DEVICE void e2m1_neighbour_indices(float a, uint32_t& down, uint32_t& up) {
  a = a < 6.0f ? a : 6.0f;
  if (!(a >= 0.0f)) a = 0.0f;
  uint32_t di = static_cast<uint32_t>(a >= 0.5f) + static_cast<uint32_t>(a >= 1.0f) +
                static_cast<uint32_t>(a >= 1.5f) + static_cast<uint32_t>(a >= 2.0f) +
                static_cast<uint32_t>(a >= 3.0f) + static_cast<uint32_t>(a >= 4.0f) + static_cast<uint32_t>(a >= 6.0f);
  down = di;
  up = e2m1_magnitude(di) == a ? di : di + 1u;
}

// z: signed scaled value (x * rollout encode factor); sign_bit: the code's sign bit under the
// caller's convention (TE: z < 0; TetraJet: signbit(x)); roll_code: the rollout's 4-bit code.
// Returns the guided code (magnitude index | sign_bit << 3).
NIB_HOST_DEVICE uint32_t guided_code_full(float z, uint32_t roll_code, uint32_t sign_bit) {
  float a = u32_as_float(float_as_u32(z) & 0x7FFFFFFFu);
  uint32_t down, up;
  e2m1_neighbour_indices(a, down, up);
  float q_roll = e2m1_decode(roll_code);
  bool neg = float_as_u32(z) >> 31;
  float v_down = neg ? -e2m1_magnitude(down) : e2m1_magnitude(down);
  float v_up = neg ? -e2m1_magnitude(up) : e2m1_magnitude(up);
  // The closer of the two neighbours to q_roll; q_roll is a grid value, so it is never strictly
  // between them: it is <= the lower or >= the higher one.
  float lower = neg ? v_up : v_down;
  uint32_t idx_lower = neg ? up : down, idx_higher = neg ? down : up;
  uint32_t idx = q_roll <= lower ? idx_lower : idx_higher;
  return idx | (sign_bit << 3);
}

// 1-bit guidance: roll_mbit = rollout code & 1.
NIB_HOST_DEVICE uint32_t guided_code_mbit(float z, uint32_t roll_mbit, uint32_t sign_bit) {
  float a = u32_as_float(float_as_u32(z) & 0x7FFFFFFFu);
  uint32_t down, up;
  e2m1_neighbour_indices(a, down, up);
  uint32_t idx = (down & 1u) == (roll_mbit & 1u) ? down : up;
  return idx | (sign_bit << 3);
}

// Guidance of one element: full code (kFull), mantissa bit only (kMantissaBit).
enum class GuidanceKind : uint8_t { kFull, kMantissaBit };

// NVFP4 TE element with the rollout's scale: z = fl(x * enc_roll) where enc_roll =
// nvfp4_te_block_enc(rollout scale byte, nvfp4_te_global(rollout amax)) — the rollout's own
// encode chain, so an x equal to the rollout's input reproduces the rollout's RTN code exactly.
NIB_HOST_DEVICE uint32_t nvfp4_te_encode_guided(float x, float enc_roll, uint32_t guide, GuidanceKind kind) {
  float z = x * enc_roll;
  uint32_t sign = static_cast<uint32_t>(z < 0.0f);
  return kind == GuidanceKind::kFull ? guided_code_full(z, guide, sign) : guided_code_mbit(z, guide, sign);
}

// NVFP4 double-block element with the rollout's block scale sp_roll = fl(si_roll * so_roll):
// magnitude |x| / sp_roll, sign bit = signbit(x).
NIB_HOST_DEVICE uint32_t nvfp4_2level_encode_guided(float x, float sp_roll, uint32_t guide, GuidanceKind kind) {
  float a = nvfp4_2level_scaled_magnitude(x, sp_roll);
  uint32_t sign = signbit_nan_positive(x);
  float z = sign ? -a : a;
  return kind == GuidanceKind::kFull ? guided_code_full(z, guide, sign) : guided_code_mbit(z, guide, sign);
}

// True when E2M1 codes a and b (sign | magnitude index) are adjacent values of the signed grid
// (-0 and +0 are the same value, index 0).
NIB_HOST_DEVICE bool e2m1_one_step_apart(uint32_t a, uint32_t b) {
  const int sa = (a & 8u) ? -static_cast<int>(a & 7u) : static_cast<int>(a & 7u);
  const int sb = (b & 8u) ? -static_cast<int>(b & 7u) : static_cast<int>(b & 7u);
  return sa - sb == 1 || sb - sa == 1;
}

// The TRACE statistics of one guided element (03-rl-and-trace.md §2; rl::GuidedSiteStats), as
// bits: kGuidedRtnMismatch (the trainer's own RTN code `own` differs in value from the rollout's
// code), kGuidedOneStep (and the two are adjacent grid values), kGuidedReproduced (the guided code
// `gc` equals the rollout's (kFull: `guide` is its code, ±0 equal) or has its mantissa bit
// (kMantissaBit: `guide` is that bit)). Under 1-bit guidance the rollout's code is not known: the
// guided code stands for it in the mismatch count.
inline constexpr uint32_t kGuidedRtnMismatch = 1u, kGuidedOneStep = 2u, kGuidedReproduced = 4u;
NIB_HOST_DEVICE uint32_t guided_element_stats(uint32_t own, uint32_t gc, uint32_t guide, GuidanceKind kind) {
  const uint32_t roll = kind == GuidanceKind::kFull ? guide : gc;
  const bool same = kind == GuidanceKind::kFull ? (gc == roll || ((gc & 7u) == 0 && (roll & 7u) == 0))
                                                : (gc & 1u) == (guide & 1u);
  const bool mism = own != roll && !((own & 7u) == 0 && (roll & 7u) == 0);
  return (mism ? kGuidedRtnMismatch : 0u) | (mism && e2m1_one_step_apart(own, roll) ? kGuidedOneStep : 0u) |
         (same ? kGuidedReproduced : 0u);
}

}  // namespace nibble::formats
