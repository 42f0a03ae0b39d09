// Candidate device formulations of three per-element steps of src/formats/, for the formats
// owner to adopt or reject: each is claimed bit-identical to the formats/ function it shadows
// (codec_candidates_test.cu checks e2m1 index and SR step exhaustively over all 2^32 inputs on
// the GPU) and costs fewer instructions. Production kernels use formats/ (FormatsCodec); only
// the benchmark's "candidate codec" rows use CandidateCodec, to measure what adopting them buys.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/bits.h"
#include "formats/e2m1.h"
#include "formats/nvfp4.h"
#include "backend/cuda/quantize.h"

namespace nibble::cuda {

// formats::e2m1_rne_index(a) via integer rounding: for a >= 1, round the binary32 mantissa to
// one bit (RNE at bit 22) and read (exponent, mantissa) as the index; below 1 the two
// sub-1 thresholds. NaN, -0.0 and negative inputs give what the 7-compare chain gives.
__device__ __forceinline__ uint32_t e2m1_rne_index_intround(float a) {
  const uint32_t u = __float_as_uint(a);
  const uint32_t r = (u + 0x1FFFFFu + ((u >> 22) & 1u)) >> 22;  // 2*biased_exp + mantissa bit
  const uint32_t hi = min(r - 252u, 7u);                         // a >= 1: 2 + 2e + m, saturated
  const uint32_t lo = static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f);
  return a >= 1.0f ? hi : lo;
}

// formats::e2m1_sr_index with the division by the power-of-two gap replaced by the exact
// multiplication by its reciprocal ((a - down) / gap and (a - down) * (1 / gap) are the same real
// number, so their correctly rounded results agree), and the grid floor by the index trick.
__device__ __forceinline__ uint32_t e2m1_sr_index_mul(float a, float u) {
  uint32_t di = static_cast<uint32_t>(a >= 0.5f) + static_cast<uint32_t>(a >= 1.0f) + static_cast<uint32_t>(a >= 1.5f) +
                static_cast<uint32_t>(a >= 2.0f) + static_cast<uint32_t>(a >= 3.0f) + static_cast<uint32_t>(a >= 4.0f) +
                static_cast<uint32_t>(a >= 6.0f);
  const float down = formats::e2m1_magnitude(di);
  const float inv_gap = di < 4u ? 2.0f : (di < 6u ? 1.0f : 0.5f);
  const float frac = (a - down) * inv_gap;
  return di + ((di < 7u && u < frac) ? 1u : 0u);
}

// Production: the formats/ functions themselves.
struct FormatsCodec {
  static __device__ __forceinline__ float amax(float m, float x) { return formats::amax_update(m, x); }
  static __device__ __forceinline__ uint32_t te_rtn(float x, float enc) { return formats::nvfp4_te_encode_rtn(x, enc); }
  static __device__ __forceinline__ uint32_t te_sr(float x, float enc, float u) {
    return formats::nvfp4_te_encode_sr(x, enc, u);
  }
  static __device__ __forceinline__ uint32_t tl_rtn(float x, float sp) { return formats::nvfp4_2level_encode_rtn(x, sp); }
  static __device__ __forceinline__ uint32_t tl_sr(float x, float sp, float u) {
    return formats::nvfp4_2level_encode_sr(x, sp, u);
  }
};

// Candidates: fmaxf for the NaN-skipping max (m >= +0 is never NaN, so fmaxf(m, |x|) ==
// (|x| > m ? |x| : m)); |v| by clearing the sign bit (e2m1 index of -0.0 and of +0.0 agree);
// the index and SR step above.
struct CandidateCodec {
  static __device__ __forceinline__ float amax(float m, float x) { return fmaxf(m, fabsf(x)); }
  static __device__ __forceinline__ uint32_t te_rtn(float x, float enc) {
    const float v = x * enc;
    return e2m1_rne_index_intround(fabsf(v)) | (static_cast<uint32_t>(v < 0.0f) << 3);
  }
  static __device__ __forceinline__ uint32_t te_sr(float x, float enc, float u) {
    const float v = x * enc;
    return e2m1_sr_index_mul(fabsf(v), u) | (static_cast<uint32_t>(v < 0.0f) << 3);
  }
  static __device__ __forceinline__ uint32_t tl_rtn(float x, float sp) {
    return e2m1_rne_index_intround(formats::nvfp4_2level_scaled_magnitude(x, sp)) | ((__float_as_uint(x) >> 31) << 3);
  }
  static __device__ __forceinline__ uint32_t tl_sr(float x, float sp, float u) {
    return e2m1_sr_index_mul(formats::nvfp4_2level_scaled_magnitude(x, sp), u) | ((__float_as_uint(x) >> 31) << 3);
  }
};

// The benchmark's "candidate codec" variants of quantize.h's launchers (same contract).
template <typename In>
Status quantize_nvfp4_te_candidate(uint8_t* codes, uint8_t* scales, float* amax, const In* x, int64_t M, int64_t K,
                                   const SrKey* sr, AmaxMode amax_mode, ScaleLayout layout, cudaStream_t stream);
template <typename In>
Status quantize_nvfp4_2level_candidate(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t M, int64_t K,
                                       const SrKey* sr, ScaleLayout inner_layout, cudaStream_t stream);
Status nvfp4_2level_transpose_rht_requantize_candidate(uint8_t* codes_t, uint8_t* inner_t, float* outer_t,
                                                       const uint8_t* codes, const uint8_t* inner, const float* outer,
                                                       int64_t M, int64_t K, uint32_t sign_mask, const SrKey* sr,
                                                       cudaStream_t stream);

}  // namespace nibble::cuda
