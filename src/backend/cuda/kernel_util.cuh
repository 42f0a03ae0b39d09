// Small device helpers shared by nibble's CUDA format kernels: 16-byte vector loads/stores of
// element arrays held in registers, warp max-reductions, the grid-wide amax (atomicMax on the
// float bits: non-negative floats order like uint32), and the Philox block of a run of eight
// consecutive flat elements (the half-words formats::sr_uniform() draws one at a time), the
// double-block encode of a 16-element block (RTN or SR) and decode of 8 packed codes.
// Mirrors the vectorised load/store helpers of llm.c's dev/cuda (x128) and TE's Vec<>.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/element_codec.cuh"
#include "core/bits.h"
#include "core/philox.h"
#include "formats/e2m1.h"
#include "formats/nvfp4.h"

namespace nibble::cuda {

// N elements of type T that travel as whole 16-byte words (N * sizeof(T) % 16 == 0).
template <typename T, int N>
struct alignas(16) Vec {
  static_assert((N * sizeof(T)) % 16 == 0, "Vec must be a whole number of 16-byte words");
  static constexpr int kWords = static_cast<int>(N * sizeof(T) / 16);
  union {
    uint4 w[kWords];
    T e[N];
  };
  __device__ __forceinline__ Vec() {}
};

// Streaming 16-byte loads (read once: do not keep in L1) of N elements starting at p (16-B aligned).
template <typename T, int N>
__device__ __forceinline__ void load_vec(Vec<T, N>& v, const T* p) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < Vec<T, N>::kWords; ++i) v.w[i] = __ldcs(q + i);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int i = 0; i < Vec<T, N>::kWords; ++i) __stcs(q + i, v.w[i]);
}

// Packed bytes of n codes built in registers as 32-bit words (4 bytes each).
template <int kBytes>
struct alignas(16) PackedBytes {
  static_assert(kBytes % 4 == 0, "whole words");
  uint32_t w[kBytes / 4];
  __device__ __forceinline__ void set(int i, uint32_t byte) {  // i must be a compile-time constant after unrolling
    w[i / 4] = (i % 4 == 0) ? byte : (w[i / 4] | (byte << (8 * (i % 4))));
  }
};

template <int kBytes>
__device__ __forceinline__ void store_packed(uint8_t* p, const PackedBytes<kBytes>& b) {
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i)
      __stcs(reinterpret_cast<uint4*>(p) + i, make_uint4(b.w[4 * i], b.w[4 * i + 1], b.w[4 * i + 2], b.w[4 * i + 3]));
  } else if constexpr (kBytes == 8) {
    __stcs(reinterpret_cast<uint2*>(p), make_uint2(b.w[0], b.w[1]));
  } else {
#pragma unroll
    for (int i = 0; i < kBytes / 4; ++i) reinterpret_cast<uint32_t*>(p)[i] = b.w[i];
  }
}

// max over the lanes of groups of `kWidth` consecutive lanes (kWidth a power of two <= 32);
// NaN-free inputs (amax_update already dropped NaN), so plain max == formats::amax_update.
template <int kWidth>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = 1; o < kWidth; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// *amax_bits <- max(*amax_bits, bits(v)) for v >= 0 (or +0).
__device__ __forceinline__ void atomic_max_nonneg(float* amax, float v) {
  atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(v));
}

// The Philox block of flat elements 8q .. 8q+7 of (seed, stream): its half-word j is what
// formats::sr_uniform(key, 8q + j) turns into a uniform (formats::sr_halfword_uniform(w, j)).
__device__ __forceinline__ Philox4x32 sr_words(const formats::SrKey& key, uint64_t q) {
  return philox_block(key.seed, key.stream, q);
}

// One nvfp4-2level inner block of 16 elements -> 8 packed code bytes, shared by the quantize
// kernel and the fused backward-operand kernel. xf: the 16 values (f32), sp/rp: the block
// scale and its reciprocal, bamax: the block max of |xf|. RTN, or (kSR) SR with half-words of
// the Philox blocks q0 and q0 + 1 (q0 = flat index of xf[0] / 8). The fast (division-free)
// quotient is chosen once per block, as formats::nvfp4_2level_block_fast decides.
template <bool kSR>
__device__ __forceinline__ PackedBytes<8> nvfp4_2level_encode_block16(const float* xf, float sp, float rp, float bamax,
                                                                      const formats::SrKey& key, uint64_t q0) {
  PackedBytes<8> packed;
  auto encode = [&](auto mag) {
    if constexpr (!kSR) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        packed.set(i, formats::e2m1_pack(formats::nvfp4_2level_code_rtn(mag(2 * i), xf[2 * i]),
                                         formats::nvfp4_2level_code_rtn(mag(2 * i + 1), xf[2 * i + 1])));
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Philox4x32 w = sr_words(key, q0 + h);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const int i = 8 * h + 2 * p;
          packed.set(4 * h + p,
                     formats::e2m1_pack(
                         e2m1_sr_index_ru(mag(i), formats::sr_halfword(w, 2 * p)) |
                             (formats::signbit_nan_positive(xf[i]) << 3),
                         e2m1_sr_index_ru(mag(i + 1), formats::sr_halfword(w, 2 * p + 1)) |
                             (formats::signbit_nan_positive(xf[i + 1]) << 3)));  // = nvfp4_2level_code_sr_h
        }
      }
    }
  };
  if (formats::nvfp4_2level_block_fast(xf, rp, bamax)) {
    encode([&](int i) { return formats::nvfp4_2level_scaled_magnitude_fast(xf[i], sp, rp); });
  } else {
    encode([&](int i) { return formats::nvfp4_2level_scaled_magnitude(xf[i], sp, rp); });
  }
  return packed;
}

// The 8 values of a word of 8 codes (code i in bits 4i..4i+3), = formats::nvfp4_2level_decode(code,
// sp) bit for bit in fewer instructions: the magnitude of index k >= 2 has the bits (k + 252) << 22
// (2k+252 = 2(e+126)+m for k = 2e+m), which gives t = 0.5 and 0.75 for k = 0, 1, where the value is
// 2t - 1 (0 and 0.5) and for k >= 2 2t - 1 >= t: so |q| = min(t, fma(t, 2, -1)) (exact); then
// fl(|q| * sp) as the definition, and the code's sign bit flips the result's sign (the definition
// negates the product: the same bits, NaN included). Checked against the definition for every
// code and a spread of scales (CudaVsCpu.Decode8EqualsDefinition).
__device__ __forceinline__ void nvfp4_2level_decode8(float (&y)[8], uint32_t w, float sp) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t k = (w >> (4 * i)) & 7u;
    const float t = __uint_as_float((k << 22) + 0x3F000000u);
    const float q = fminf(t, fmaf(t, 2.0f, -1.0f));
    y[i] = __uint_as_float(__float_as_uint(q * sp) ^ (((w >> (4 * i + 3)) & 1u) << 31));
  }
}

inline int ceil_div_int(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace nibble::cuda
