// The element steps the CUDA format kernels call, as one struct (FormatsCodec): each is the
// src/formats/ function itself (so GPU and CPU drivers agree bit for bit), with the nvfp4-2level
// steps taking the block's reciprocal r = formats::nvfp4_2level_block_reciprocal(sp) computed once
// per 16-block. The former candidate steps (integer-rounding E2M1 index, SR step by the exact
// reciprocal of the gap, fmaxf max) now live in formats/ itself; element_codec_test.cu checks
// them against the former formulations over all 2^32 inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "formats/e2m1.h"
#include "formats/nvfp4.h"

namespace nibble::cuda {

struct FormatsCodec {
  static __device__ __forceinline__ float amax(float m, float x) { return formats::amax_update(m, x); }
  static __device__ __forceinline__ uint32_t te_rtn(float x, float enc) { return formats::nvfp4_te_encode_rtn(x, enc); }
  static __device__ __forceinline__ uint32_t te_sr(float x, float enc, uint32_t h) {
    return formats::nvfp4_te_encode_sr_h(x, enc, h);
  }
  static __device__ __forceinline__ uint32_t tl_rtn(float x, float sp, float r) {
    return formats::nvfp4_2level_encode_rtn(x, sp, r);
  }
  static __device__ __forceinline__ uint32_t tl_sr(float x, float sp, float r, uint32_t h) {
    return formats::e2m1_sr_index_h(formats::nvfp4_2level_scaled_magnitude(x, sp, r), h) |
           (formats::signbit_nan_positive(x) << 3);
  }
};

}  // namespace nibble::cuda
