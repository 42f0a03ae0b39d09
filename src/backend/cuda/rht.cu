// CUDA kernels for the 16-point random Hadamard transform paths (see quantize.h):
//  - TE wgrad operand: y_t (K, M) bf16 = per-16-group-along-M RHT of x^T, formats::rht16_bf16_exact;
//  - TetraJet-v2 rows transform in FP32 (formats::rht16_f32);
//  - the fused backward-operand op: nvfp4-2level [M, K] -> dequantize -> transpose -> RHT16 along M
//    -> nvfp4-2level requantize with SR along M -> [K, M], in one pass through a shared-memory tile;
//  - a plain tiled transpose (used by the unfused reference chain in tests).
// Mirrors TE's hadamard_transform_cast_fusion (tile transpose + RHT + cast) in structure.
#include <cuda_runtime.h>

#include <type_traits>

#include "backend/cuda/element_codec.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/quantize.h"
#include "formats/e2m1.h"
#include "formats/nvfp4.h"
#include "formats/rht.h"

namespace nibble::cuda {

namespace fm = ::nibble::formats;

// ---- transpose -------------------------------------------------------------------------------

// y (K, M) <- x (M, K)^T through a 32x33 shared tile; block 32x8 threads.
template <typename T>
__global__ void transpose_kernel(T* y, const T* x, int64_t M, int64_t K) {
  __shared__ T tile[32][33];
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * 32, k0 = static_cast<int64_t>(blockIdx.x) * 32;
  for (int r = threadIdx.y; r < 32; r += 8) {
    int64_t m = m0 + r, k = k0 + threadIdx.x;
    if (m < M && k < K) tile[r][threadIdx.x] = x[m * K + k];
  }
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += 8) {
    int64_t k = k0 + r, m = m0 + threadIdx.x;
    if (m < M && k < K) y[k * M + m] = tile[threadIdx.x][r];
  }
}

template <typename T>
Status transpose(T* y, const T* x, int64_t M, int64_t K, cudaStream_t stream) {
  if (M < 0 || K < 0) return invalid_argument("transpose: negative shape");
  if (M == 0 || K == 0) return Status::ok();
  dim3 grid(ceil_div_int(K, 32), ceil_div_int(M, 32));
  transpose_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(y, x, M, K);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}
template Status transpose<float>(float*, const float*, int64_t, int64_t, cudaStream_t);
template Status transpose<uint16_t>(uint16_t*, const uint16_t*, int64_t, int64_t, cudaStream_t);
template Status transpose<uint8_t>(uint8_t*, const uint8_t*, int64_t, int64_t, cudaStream_t);

// ---- shared tile layout of the transposing RHT kernels ------------------------------------------

namespace {
// CTA tile: 128 input rows (m) x 64 input columns (k) = 64 output rows x 128 m-values.
// Shared row (one k) holds 128 m-values as 8 groups of 16, each group padded to 20 floats so the
// 16-byte reads of the 8 groups of a row hit distinct banks. Group g of row k sits in slot
// g ^ ((k >> 3) & 7): phase 1 writes 8 rows k = 8c + i (c = 0..7) of one group in one store
// instruction, and the swizzle spreads those over the 8 slots, so that store is conflict-free too.
constexpr int kTileM = 128, kTileK = 64, kTileThreads = 256;
constexpr int kGroupStride = 20, kRowStride = 8 * kGroupStride;
constexpr int kTileSmemBytes = kTileK * kRowStride * 4;
__device__ __forceinline__ int tile_pos(int k, int m) {
  return k * kRowStride + ((m >> 4) ^ ((k >> 3) & 7)) * kGroupStride + (m & 15);
}
// Phase 1's store: thread (c, q) holds y[r][i] = the value of row 4q + r, column 8c + i; column
// 8c + i's four values go to shared memory as one 16-byte store.
__device__ __forceinline__ void store_tile_columns(float* tile, int c, int q, const float (&y)[4][8]) {
  float* dst = tile + tile_pos(8 * c, 4 * q);  // rows 8c + i share the slot
#pragma unroll
  for (int i = 0; i < 8; ++i)
    *reinterpret_cast<float4*>(dst + i * kRowStride) = make_float4(y[0][i], y[1][i], y[2][i], y[3][i]);
}
// Phase 2's load: the 16 m-values of group g of tile row kk.
__device__ __forceinline__ void load_tile_group(float (&v)[16], const float* tile, int kk, int g) {
  const float4* src = reinterpret_cast<const float4*>(tile + tile_pos(kk, 16 * g));
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 f = src[q];
    v[4 * q] = f.x; v[4 * q + 1] = f.y; v[4 * q + 2] = f.z; v[4 * q + 3] = f.w;
  }
}
// Phase 2's walk over the tile: lane group of 8 = one tile row kk (one output row), lane g its
// m-group 16g .. 16g+15; 32 rows per pass, 2 passes. body(kk, g, v) gets the group's 16 values.
template <typename Body>
__device__ __forceinline__ void for_each_tile_group(const float* tile, const Body& body) {
  const int g = threadIdx.x & 7;
#pragma unroll 1
  for (int pass = 0; pass < kTileK / 32; ++pass) {
    const int kk = pass * 32 + (threadIdx.x >> 3);
    float v[16];
    load_tile_group(v, tile, kk, g);
    body(kk, g, v);
  }
}
}  // namespace

// ---- TE wgrad RHT: x (M, K) bf16 -> y_t (K, M) bf16 ----------------------------------------------

// grid = (ceil(K / 64), ceil(M / 128)), 256 threads. Phase 1: thread (c = t % 8, q = t / 8) loads
// columns k0 + 8c .. +7 of rows m0 + 4q .. +3 (one 16-byte load per row when kVec: K % 8 == 0 and
// x 16-byte aligned; else element by element), applies each row's RHT sign (row m's sign is bit
// m % 16 of sign_mask: negation is exact, as the definition's sign step), and stores the tile
// transposed (zeros outside the tensor). Phase 2: lane group of 8 = one output row k, lane g =
// its m-group 16g .. 16g+15; 32 rows per pass, 2 passes: formats::rht16_bf16_f32 when the
// tile's sums fit binary32 (rht16_bf16_sums_fit_f32) in every lane of the warp, else the double
// form formats::rht16_bf16_exact (warp-uniform, so a rare wide tile costs one warp's pass, not a
// divergent branch per lane); two 16-byte stores of 8 BF16 each.
template <bool kVec>
__global__ void __launch_bounds__(kTileThreads) rht16_transpose_bf16_kernel(uint16_t* y_t, const uint16_t* x, int64_t M,
                                                                         int64_t K, uint32_t sign_mask) {
  extern __shared__ float4 smem_f4[];
  float* tile = reinterpret_cast<float*>(smem_f4);
  const uint64_t uM = static_cast<uint64_t>(M), uK = static_cast<uint64_t>(K);
  const uint64_t m0 = static_cast<uint64_t>(blockIdx.y) * kTileM, k0 = static_cast<uint64_t>(blockIdx.x) * kTileK;
  {
    const int c = threadIdx.x % 8, q = threadIdx.x / 8;
    const uint64_t kc = k0 + 8 * c;
    float y[4][8];
    if constexpr (kVec) {
      uint4 w[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint64_t m = m0 + 4 * q + r;
        w[r] = (m < uM && kc < uK) ? __ldcs(reinterpret_cast<const uint4*>(x + m * uK + kc)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t flip = ((sign_mask >> ((4 * q + r) & 15)) & 1u) * 0x80008000u;  // m0 % 16 == 0
        uint32_t words[4];
        bf16_words4(words, w[r]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          y[r][2 * j] = __uint_as_float((words[j] ^ flip) << 16);
          y[r][2 * j + 1] = __uint_as_float((words[j] ^ flip) & 0xFFFF0000u);
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint64_t m = m0 + 4 * q + r;
        const bool neg = (sign_mask >> ((4 * q + r) & 15)) & 1u;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float v = (m < uM && kc + i < uK) ? bf16_bits_to_f32(x[m * uK + kc + i]) : 0.0f;
          y[r][i] = neg ? -v : v;
        }
      }
    }
    store_tile_columns(tile, c, q, y);
  }
  __syncthreads();
  for_each_tile_group(tile, [&](int kk, int g, float (&v)[16]) {
    uint16_t out[16];
    if (__all_sync(0xFFFFFFFFu, fm::rht16_bf16_sums_fit_f32(v)))
      fm::rht16_bf16_f32(out, v, 0u);  // the signs were applied in phase 1
    else
      fm::rht16_bf16_exact(out, v, 0u);
    const uint64_t k = k0 + kk, m = m0 + 16 * g;
    if (k < uK && m < uM) {  // M % 16 == 0: a group is all in or all out
      Vec<uint16_t, 16> o;
#pragma unroll
      for (int i = 0; i < 16; ++i) o.e[i] = out[i];
      store_vec(y_t + k * uM + m, o);
    }
  });
}

Status rht16_transpose_bf16(uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K, uint32_t sign_mask,
                            cudaStream_t stream) {
  if (M < 0 || K < 0 || M % 16 != 0) return invalid_argument("rht16_transpose_bf16: M={} must be a multiple of 16", M);
  if ((reinterpret_cast<uintptr_t>(y_t) & 15u) || (M * 2) % 16 != 0)
    return invalid_argument("rht16_transpose_bf16: y_t rows must be 16-byte aligned");
  if (M == 0 || K == 0) return Status::ok();
  dim3 grid(ceil_div_int(K, kTileK), ceil_div_int(M, kTileM));
  if (K % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15u) == 0)
    rht16_transpose_bf16_kernel<true><<<grid, kTileThreads, kTileSmemBytes, stream>>>(y_t, x, M, K, sign_mask);
  else
    rht16_transpose_bf16_kernel<false><<<grid, kTileThreads, kTileSmemBytes, stream>>>(y_t, x, M, K, sign_mask);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status quantize_nvfp4_te_rht_t(uint8_t* codes_t, uint8_t* scales_t, float* amax_t, uint16_t* y_t, const uint16_t* x,
                               int64_t M, int64_t K, const SrKey* sr, cudaStream_t stream, uint16_t* operand) {
  NIB_RETURN_IF_ERROR(rht16_transpose_bf16(y_t, x, M, K, fm::kRhtTeSignMask, stream));
  return quantize_nvfp4_te(codes_t, scales_t, amax_t, static_cast<const uint16_t*>(y_t), K, M, sr, AmaxMode::kCompute,
                           ScaleLayout::kLinear, stream, operand);
}

// ---- TetraJet-v2 RHT along rows, FP32 ------------------------------------------------------------

__global__ void __launch_bounds__(256) rht16_rows_f32_kernel(float* y, const float* x, int64_t ngroups,
                                                             uint32_t sign_mask) {
  const int64_t gidx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gidx >= ngroups) return;
  Vec<float, 16> v;
  load_vec(v, x + gidx * 16);
  fm::rht16_f32(v.e, v.e, sign_mask);
  store_vec(y + gidx * 16, v);
}

Status rht16_rows_f32(float* y, const float* x, int64_t M, int64_t K, uint32_t sign_mask, cudaStream_t stream) {
  if (M < 0 || K <= 0 || K % 16 != 0) return invalid_argument("rht16_rows_f32: K={} must be a multiple of 16", K);
  const int64_t ngroups = M * K / 16;
  if (ngroups == 0) return Status::ok();
  rht16_rows_f32_kernel<<<ceil_div_int(ngroups, 256), 256, 0, stream>>>(y, x, ngroups, sign_mask);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

// ---- fused backward-operand op -----------------------------------------------------------------

namespace {
constexpr int kFusedMinBlocks = 4;  // 64 registers
}  // namespace

// codes_t (K, M/2), inner_t (K, M/16), outer_t (K, M/128) <- codes (M, K/2), inner (M, K/16),
// outer (M, K/128). grid = (K/64, M/128). kOperand: operand_t (K, M) bf16 receives each output
// block's BF16 GEMM operand (store_2level_block16), and codes_t / inner_t (null together) and
// outer_t (null) may be skipped; a template flag, so the plain instances keep their registers.
// The RHT's sign s_m of input row m (the m-th element of its 16-group along M) is applied while
// decoding, by flipping the sign of that row's codes (negating a decoded value is exact, as the
// formats::rht16_f32 sign step), so phase 2 transforms with no sign step.
template <typename Codec, bool kSR, bool kOperand>
__global__ void __launch_bounds__(kTileThreads, kFusedMinBlocks) nvfp4_2level_transpose_rht_requantize_kernel(
    uint8_t* codes_t, uint8_t* inner_t, float* outer_t, uint16_t* operand_t, const uint8_t* codes, const uint8_t* inner,
    const float* outer, int64_t M, int64_t K, uint32_t sign_mask, SrKeyDevice key) {
  extern __shared__ float4 smem_f4[];
  float* tile = reinterpret_cast<float*>(smem_f4);
  // Offsets are unsigned (every index here is non-negative), which keeps the divisions by 2, 16
  // and 128 single shifts.
  const uint64_t uM = static_cast<uint64_t>(M), uK = static_cast<uint64_t>(K);
  const uint64_t m0 = static_cast<uint64_t>(blockIdx.y) * kTileM, k0 = static_cast<uint64_t>(blockIdx.x) * kTileK;

  // Phase 1: thread (c = t % 8, q = t / 8) decodes code word c (input columns k0 + 8c .. +7) of the
  // four rows m0 + 4q .. +3 and stores each column's four values as one 16-byte shared store
  // (columns past K are zero-filled; their rows are not stored). A warp's loads read whole 32-byte
  // row segments of four rows; all twelve loads are issued before the first decode, so that their
  // latencies overlap.
  bool scales_tame = true;  // every block scale sp of this thread's rows is 0 or in [2^-33, 2^55]
  {
    const int c = threadIdx.x % 8, q = threadIdx.x / 8;
    const uint64_t kc = k0 + 8 * c;
    float y[4][8];
    if (kc < uK) {
      const uint64_t row0 = m0 + 4 * q;
      const uint64_t code_stride = uK / 2, inner_stride = uK / 16, outer_stride = (uK + 127) / 128;
      const uint8_t* code_row = codes + row0 * code_stride + kc / 2;
      const uint8_t* inner_row = inner + row0 * inner_stride + kc / 16;
      const float* outer_row = outer + row0 * outer_stride + kc / 128;
      uint32_t w[4], inner_byte[4];
      float so[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        w[r] = __ldg(reinterpret_cast<const uint32_t*>(code_row + r * code_stride));
        inner_byte[r] = __ldg(inner_row + r * inner_stride);
        so[r] = __ldg(outer_row + r * outer_stride);
      }
      const uint32_t flips = sign_mask >> ((4 * q) & 15);  // bit r: the RHT sign of row 4q + r
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t flip = (flips >> r) & 1u;
        const float sp = fm::e4m3_decode_any_nan(inner_byte[r]) * so[r];  // = the block scale when finite
        scales_tame &= sp == 0.0f || (sp >= 0x1p-33f && sp <= 0x1p55f);  // NaN fails
        if (isfinite(sp))
          e2m1_decode8_mul(y[r], w[r], sp, 0x80808080u - flip * 0x01010101u);  // or 0x7F7F7F7F
        else
          nvfp4_2level_decode8(y[r], w[r] ^ (flip * 0x88888888u), fm::nvfp4_2level_block_scale(inner_byte[r], so[r]));
      }
    } else {
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int i = 0; i < 8; ++i) y[r][i] = 0.0f;
    }
    store_tile_columns(tile, c, q, y);
  }
  // With tame scales everywhere in the tile, every decoded value is 0 or a normal binary32 of
  // magnitude in [2^-34, 6 * 2^55], hence a multiple of 2^-57; the butterfly's sums of such values
  // stay multiples of 2^-57 (a sum below 2^-33 is exact, a larger one rounds to a multiple of its
  // ulp >= 2^-56), so every nonzero |v| is >= 2^-57, and |v| <= 16 * 6 * 2^55 (1 + 2^-20) < 2^62:
  // phase 2's block test holds without being computed.
  const bool tile_tame = __syncthreads_and(scales_tame);

  // Phase 2: lane group of 8 = one output row k (8 groups g of 16 m's); 32 rows per pass, 2 passes.
  // The butterfly leaves v = 4 x (x = the RHT output the reference quantizes: v * 0.25f). A block
  // whose v are all zero or in [2^-58, 2^62] (no NaN: the NaN-propagating max fails the test) has
  // exact x = v / 4 and takes the fast encode on v with the scale times 4; any other block forms x
  // and takes the general encode. In a tame tile (above) every block passes, and only its max is
  // needed.
  for_each_tile_group(tile, [&](int kk, int g, float (&v)[16]) {
    fm::rht16_butterfly_f32(v);  // the signs were applied in phase 1; the 1/4 below
    float vmax = 0.0f;
    bool fast = true;
    if (tile_tame) {
#pragma unroll
      for (int i = 0; i < 16; ++i) vmax = fmaxf(vmax, fabsf(v[i]));
    } else {
      uint32_t dmin = 0xFFFFFFFFu;  // min over i of 2 bits(|v_i|) - 2 (mod 2^32: zeros give the maximum)
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        vmax = fmax_nan(fmax_nan(vmax, fabsf(v[i])), fabsf(v[i + 1]));
        dmin = __vimin3_u32(dmin, __float_as_uint(v[i]) * 2u - 2u, __float_as_uint(v[i + 1]) * 2u - 2u);
      }
      fast = vmax <= 0x1p62f && dmin >= 2u * 0x22800000u - 2u;  // 0x22800000 = bits(2^-58)
    }
    float bamax;
    if (fast) {
      bamax = vmax * 0.25f;  // exact (vmax is 0 or >= 2^-58) and NaN-free
    } else {
      bamax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        v[i] *= 0.25f;
        bamax = Codec::amax(bamax, v[i]);
      }
    }
    const float so = fm::nvfp4_2level_outer_scale(group_max<8>(bamax));
    const uint32_t si = fm::nvfp4_2level_inner_scale(bamax, so);
    const float sp = nvfp4_2level_block_scale_encoded(si, so);
    const float rp = fm::nvfp4_2level_block_reciprocal(sp);
    const uint64_t orow = k0 + kk, ocol = m0 + 16 * g;
    const uint64_t q0 = (orow * uM + ocol) / 8;
    PackedBytes<8> packed;
    if (fast && rp != 0.0f) {  // rp in [2^-60, 2^60]: 4 sp and rp / 4 are exact
      packed = nvfp4_2level_encode_block16_fast<kSR>(v, 4.0f * sp, 0.25f * rp, key, q0);
    } else {
      if (fast) {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] *= 0.25f;
      }
      packed = nvfp4_2level_encode_block16<kSR>(v, sp, rp, key, q0);
    }
    if (orow < uK) {  // the shuffles above ran on whole warps
      if constexpr (kOperand)
        store_2level_block16(operand_t + orow * uM + ocol, make_uint2(packed.w[0], packed.w[1]),
                             fm::nvfp4_2level_block_scale(si, so));
      if (!kOperand || codes_t != nullptr) {
        store_packed(codes_t + orow * (uM / 2) + ocol / 2, packed);
        inner_t[orow * (uM / 16) + ocol / 16] = static_cast<uint8_t>(si);
      }
      if ((!kOperand || outer_t != nullptr) && g == 0) outer_t[orow * (uM / 128) + m0 / 128] = so;
    }
  });
}

// One instance of the fused kernel, its shared-memory size set once.
template <typename Codec, bool kSR, bool kOperand>
void launch_fused(dim3 grid, uint8_t* codes_t, uint8_t* inner_t, float* outer_t, uint16_t* operand_t,
                  const uint8_t* codes, const uint8_t* inner, const float* outer, int64_t M, int64_t K,
                  uint32_t sign_mask, const SrKeyDevice& key, cudaStream_t stream) {
  static bool attr_set = [] {
    NIB_CUDA_CHECK(cudaFuncSetAttribute(nvfp4_2level_transpose_rht_requantize_kernel<Codec, kSR, kOperand>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kTileSmemBytes));
    return true;
  }();
  (void)attr_set;
  nvfp4_2level_transpose_rht_requantize_kernel<Codec, kSR, kOperand><<<grid, kTileThreads, kTileSmemBytes, stream>>>(
      codes_t, inner_t, outer_t, operand_t, codes, inner, outer, M, K, sign_mask, key);
  NIB_CUDA_CHECK_LAUNCH();
}

template <typename Codec>
Status fused_impl(uint8_t* codes_t, uint8_t* inner_t, float* outer_t, const uint8_t* codes, const uint8_t* inner,
                  const float* outer, int64_t M, int64_t K, uint32_t sign_mask, const SrKey* sr, cudaStream_t stream,
                  uint16_t* operand_t) {
  if (M < 0 || K < 0 || M % 128 != 0 || K % 16 != 0)
    return invalid_argument("nvfp4_2level_transpose_rht_requantize: M={} must be a multiple of 128 and K={} of 16", M, K);
  const bool skipped = codes_t == nullptr || outer_t == nullptr;
  if ((codes_t == nullptr) != (inner_t == nullptr) || (skipped && operand_t == nullptr))
    return invalid_argument("nvfp4_2level_transpose_rht_requantize: codes and scales may be skipped only when the BF16 "
                            "operand is written (codes and inner scales together)");
  if ((reinterpret_cast<uintptr_t>(operand_t) & 15u) != 0)
    return invalid_argument("nvfp4_2level_transpose_rht_requantize: the operand must be 16-byte aligned");
  if (M == 0 || K == 0) return Status::ok();
  dim3 grid(ceil_div_int(K, kTileK), ceil_div_int(M, kTileM));
  const SrKeyDevice key = sr ? SrKeyDevice(*sr) : SrKeyDevice{};
  auto launch = [&](auto kernel_sr, auto kernel_operand) {
    launch_fused<Codec, decltype(kernel_sr)::value, decltype(kernel_operand)::value>(
        grid, codes_t, inner_t, outer_t, operand_t, codes, inner, outer, M, K, sign_mask, key, stream);
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (operand_t != nullptr) sr ? launch(Yes{}, Yes{}) : launch(No{}, Yes{});
  else sr ? launch(Yes{}, No{}) : launch(No{}, No{});
  return Status::ok();
}

Status nvfp4_2level_transpose_rht_requantize(uint8_t* codes_t, uint8_t* inner_t, float* outer_t, const uint8_t* codes,
                                             const uint8_t* inner, const float* outer, int64_t M, int64_t K,
                                             uint32_t sign_mask, const SrKey* sr, cudaStream_t stream,
                                             uint16_t* operand_t) {
  return fused_impl<FormatsCodec>(codes_t, inner_t, outer_t, codes, inner, outer, M, K, sign_mask, sr, stream,
                                  operand_t);
}

}  // namespace nibble::cuda
