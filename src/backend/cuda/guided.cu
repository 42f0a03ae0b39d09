// CUDA kernels for TRACE rollout-guided rounding (01-formats.md §7): the trainer's codes for x
// under the ROLLOUT's scales, each element rounded to the E2M1 neighbour that the rollout's code
// (full guidance) or mantissa bit (1-bit guidance) selects. One thread per 1x16 block, calling
// formats/guided.h per element, as formats::nvfp4_*_quantize_guided_cpu does.
#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/quantize.h"
#include "formats/guided.h"
#include "formats/nvfp4.h"

namespace nibble::cuda {

namespace fm = ::nibble::formats;

namespace {

// Guidance of element i (0..15) of a block: kFull -> nibble i of the 8 guide bytes g8;
// kMantissaBit -> bit i of the 2 guide bytes (bit j of byte k = element 8k + j).
__device__ __forceinline__ uint32_t guide_at(uint64_t g, int i, GuidanceKind kind) {
  return kind == GuidanceKind::kFull ? static_cast<uint32_t>((g >> (4 * i)) & 0xFu) : static_cast<uint32_t>((g >> i) & 1u);
}

__device__ __forceinline__ uint64_t load_guide(const uint8_t* guide, int64_t b, GuidanceKind kind) {
  if (kind == GuidanceKind::kFull) {
    uint2 w = *reinterpret_cast<const uint2*>(guide + b * 8);
    return (static_cast<uint64_t>(w.y) << 32) | w.x;
  }
  return *reinterpret_cast<const uint16_t*>(guide + b * 2);
}

}  // namespace

// Block b of x (16 elements) -> codes: element i encoded by encode(x_i, guidance of i).
template <typename In, typename Encode>
__device__ __forceinline__ void guided_block16(uint8_t* codes, const In* x, int64_t b, const uint8_t* guide,
                                               GuidanceKind kind, const Encode& encode) {
  Vec<In, 16> v;
  load_vec(v, x + b * 16);
  const uint64_t gd = load_guide(guide, b, kind);
  PackedBytes<8> pk;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    pk.set(i, fm::e2m1_pack(encode(fm::load_f32(v.e[2 * i]), guide_at(gd, 2 * i, kind)),
                            encode(fm::load_f32(v.e[2 * i + 1]), guide_at(gd, 2 * i + 1, kind))));
  store_packed(codes + b * 8, pk);
}

// codes (M, K/2) <- x (M, K); roll_scales (M, K/16) e4m3; roll_amax (1) f32; guide (M, K/2) or (M, K/8).
template <typename In>
__global__ void __launch_bounds__(256) nvfp4_te_guided_kernel(uint8_t* codes, const In* x, int64_t nblocks,
                                                              const uint8_t* roll_scales, const float* roll_amax,
                                                              const uint8_t* guide, GuidanceKind kind) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const float enc = fm::nvfp4_te_block_enc(roll_scales[b], fm::nvfp4_te_global(*roll_amax));
  guided_block16(codes, x, b, guide, kind,
                 [enc, kind](float xi, uint32_t gi) { return fm::nvfp4_te_encode_guided(xi, enc, gi, kind); });
}

// codes (M, K/2) <- x (M, K); roll_inner (M, K/16) e4m3; roll_outer (M, ceil(K/128)) f32; guide as above.
template <typename In>
__global__ void __launch_bounds__(256) nvfp4_2level_guided_kernel(uint8_t* codes, const In* x, int64_t nblocks,
                                                                  int64_t kb, const uint8_t* roll_inner,
                                                                  const float* roll_outer, const uint8_t* guide,
                                                                  GuidanceKind kind) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const int64_t r = b / kb, cb = b - r * kb;
  const float sp = fm::nvfp4_2level_block_scale(roll_inner[b], roll_outer[r * ((kb + 7) / 8) + cb / 8]);
  guided_block16(codes, x, b, guide, kind,
                 [sp, kind](float xi, uint32_t gi) { return fm::nvfp4_2level_encode_guided(xi, sp, gi, kind); });
}

template <typename In>
Status quantize_nvfp4_te_guided(uint8_t* codes, const In* x, int64_t M, int64_t K, const uint8_t* roll_scales,
                                const float* roll_amax, const uint8_t* guide, GuidanceKind kind, cudaStream_t stream) {
  if (M < 0 || K <= 0 || K % 16 != 0) return invalid_argument("quantize_nvfp4_te_guided: K={} must be a positive multiple of 16", K);
  const int64_t nblocks = M * K / 16;
  if (nblocks == 0) return Status::ok();
  nvfp4_te_guided_kernel<In><<<ceil_div_int(nblocks, 256), 256, 0, stream>>>(codes, x, nblocks, roll_scales, roll_amax, guide, kind);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

template <typename In>
Status quantize_nvfp4_2level_guided(uint8_t* codes, const In* x, int64_t M, int64_t K, const uint8_t* roll_inner,
                                    const float* roll_outer, const uint8_t* guide, GuidanceKind kind,
                                    cudaStream_t stream) {
  if (M < 0 || K <= 0 || K % 16 != 0) return invalid_argument("quantize_nvfp4_2level_guided: K={} must be a positive multiple of 16", K);
  const int64_t nblocks = M * K / 16;
  if (nblocks == 0) return Status::ok();
  nvfp4_2level_guided_kernel<In><<<ceil_div_int(nblocks, 256), 256, 0, stream>>>(codes, x, nblocks, K / 16, roll_inner,
                                                                                roll_outer, guide, kind);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

template Status quantize_nvfp4_te_guided<float>(uint8_t*, const float*, int64_t, int64_t, const uint8_t*, const float*,
                                                const uint8_t*, GuidanceKind, cudaStream_t);
template Status quantize_nvfp4_te_guided<uint16_t>(uint8_t*, const uint16_t*, int64_t, int64_t, const uint8_t*,
                                                   const float*, const uint8_t*, GuidanceKind, cudaStream_t);
template Status quantize_nvfp4_2level_guided<float>(uint8_t*, const float*, int64_t, int64_t, const uint8_t*,
                                                    const float*, const uint8_t*, GuidanceKind, cudaStream_t);
template Status quantize_nvfp4_2level_guided<uint16_t>(uint8_t*, const uint16_t*, int64_t, int64_t, const uint8_t*,
                                                       const float*, const uint8_t*, GuidanceKind, cudaStream_t);

}  // namespace nibble::cuda
