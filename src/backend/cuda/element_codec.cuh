// The element steps the CUDA format kernels call, as one struct (FormatsCodec): each is the
// src/formats/ function itself, so GPU and CPU drivers agree bit for bit (the nvfp4-2level steps
// are in kernel_util.cuh's nvfp4_2level_encode_block16) — except the SR index, e2m1_sr_index_ru
// below: the same function as formats::e2m1_sr_index_h in round-up fmas (device-only: the host
// has no per-operation rounding modes). element_codec_test.cu checks every step against its
// formats/ or former formulation over all 2^32 inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

struct FormatsCodec {
  static __device__ __forceinline__ float amax(float m, float x) { return formats::amax_update(m, x); }
  static __device__ __forceinline__ uint32_t te_rtn(float x, float enc) { return formats::nvfp4_te_encode_rtn(x, enc); }
  static __device__ __forceinline__ uint32_t te_sr(float x, float enc, uint32_t h) {  // = nvfp4_te_encode_sr_h
    const float v = x * enc;
    return e2m1_sr_index_ru(fabsf(v), h) | (static_cast<uint32_t>(v < 0.0f) << 3);
  }
};

}  // namespace nibble::cuda
