// The element steps the CUDA format kernels call, as one struct (FormatsCodec): each is the
// src/formats/ function itself, so GPU and CPU drivers agree bit for bit (the nvfp4-2level steps
// are in kernel_util.cuh's nvfp4_2level_encode_block16) — except the SR index, e2m1_sr_index_ru
// below: the same function as formats::e2m1_sr_index_h in round-up fmas (device-only: the host
// has no per-operation rounding modes), and its biased forms for the packed fast paths
// (e2m1_sr_index_ru_biased, e2m1_rne_index_biased). element_codec_test.cu checks every step
// against its formats/ or former formulation over all 2^32 inputs.
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

// The same SR index for a >= 0, +Inf included (no NaN step: callers route NaN blocks elsewhere) in the
// form the fast block encoders use: g = 128 + h * 2^-16 (sr_offset_g: in [128, 256) the binary32
// unit is 2^-16, so g's bits are 0x43000000 | h, one byte permute from a Philox word), and the
// result is biased, 0x4B000001 + index, for packing. y = fma_ru(a, m, -g) = ru(m a - 128 - h');
// ru never passes the integer ceil, so ceil(y) = ceil(m a - h') - 128, and fadd_ru(y, 2^23 + 129 +
// c) lands in [2^23, 2^24) (m a - 128 - h' > -129) where ru is the integer ceil: 2^23 + 1 + c +
// ceil(m a - h'), as above. For a >= 6 every piece is >= 7 (+Inf stays +Inf) and the cap 7
// applies. Equal to formats::e2m1_sr_index_h for every binary32 a in [0, +Inf] at the boundary and
// random h (ElementCodec.ExhaustiveAgainstFormerFormulations).
__device__ __forceinline__ float sr_offset_g(uint32_t halfword_bits_0_15) {
  return __uint_as_float(0x43000000u | halfword_bits_0_15);
}
// g of half-word j (0..7) of a Philox block (formats::sr_halfword(r, j)): one byte permute.
__device__ __forceinline__ float sr_offset_g(const Philox4x32& r, int j) {
  return __uint_as_float(__byte_perm(r.v[j >> 1], 0x43000000u, (j & 1) ? 0x7632 : 0x7610));
}
constexpr uint32_t kSrIndexBias = 0x4B000001u;   // e2m1_sr_index_ru_biased = kSrIndexBias + index
constexpr uint32_t kRtnIndexBias = 0x4B000000u;  // e2m1_rne_index_biased = kRtnIndexBias + index
__device__ __forceinline__ uint32_t e2m1_sr_index_ru_biased(float a, float g) {
  const uint32_t t1 = __float_as_uint(__fadd_ru(__fmaf_ru(a, 2.0f, -g), 8388737.0f));  // 2^23 + 129
  const uint32_t t2 = __float_as_uint(__fadd_ru(__fadd_ru(a, -g), 8388739.0f));
  const uint32_t t3 = __float_as_uint(__fadd_ru(__fmaf_ru(a, 0.5f, -g), 8388741.0f));
  return min(__vimin3_u32(t1, t2, t3), 0x4B000008u);
}
// RTN counterpart for any a in [0, +Inf]: formats::e2m1_rne_index_bits_min3 (exact below 7) capped
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
