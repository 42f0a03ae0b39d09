// CUDA kernels for TRACE rollout-guided rounding (01-formats.md §7): the trainer's codes for x
// under the ROLLOUT's scales, each element rounded to the E2M1 neighbour that the rollout's code
// (full guidance) or mantissa bit (1-bit guidance) selects. One thread per 1x16 block, calling
// formats/guided.h per element, as formats::nvfp4_*_quantize_guided_cpu does. The RL trainer's
// form (nvfp4_2level_guided_rows): gathered rows of a 2-level quantization re-rounded in place,
// with the element statistics summed per thread block and added with integer atomics.
#include <cuda_runtime.h>

#include "backend/cuda/block_reduce.cuh"
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

// Row rows[i] of (codes, inner, outer) <- the guided rounding of x row rows[i] under roll_inner
// row i, roll_outer row i; stats += the element statistics against the RTN codes it replaces.
// One thread per 16-block of the R gathered rows (nblocks = R * kb). The three counts of a
// thread block (each <= 256 * 16 < 2^21) travel packed in one u64 through block_reduce.
__global__ void __launch_bounds__(256) nvfp4_2level_guided_rows_kernel(
    uint8_t* codes, uint8_t* inner, float* outer, unsigned long long* stats, const float* x, const int32_t* rows,
    int64_t nblocks, int64_t kb, const uint8_t* roll_inner, const float* roll_outer, const uint8_t* guide,
    GuidanceKind kind) {
  __shared__ unsigned long long red[33];
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned long long counts = 0;
  if (b < nblocks) {
    const int64_t i = b / kb, cb = b - i * kb, no = (kb + 7) / 8;
    const int64_t mb = static_cast<int64_t>(rows[i]) * kb + cb;  // the 16-block in q
    const uint32_t si = roll_inner[b];
    const float so = roll_outer[i * no + cb / 8];
    const float sp = fm::nvfp4_2level_block_scale(si, so);
    Vec<float, 16> v;
    load_vec(v, x + mb * 16);
    const uint64_t gd = load_guide(guide, b, kind);
    const uint2 ow = *reinterpret_cast<const uint2*>(codes + mb * 8);
    const uint64_t own = (static_cast<uint64_t>(ow.y) << 32) | ow.x;  // nibble e = element e's RTN code
    PackedBytes<8> pk;
#pragma unroll
    for (int e = 0; e < 16; e += 2) {
      uint32_t c[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t g = guide_at(gd, e + j, kind);
        c[j] = fm::nvfp4_2level_encode_guided(v.e[e + j], sp, g, kind);
        const uint32_t f = fm::guided_element_stats(static_cast<uint32_t>((own >> (4 * (e + j))) & 0xFu), c[j], g, kind);
        counts += ((f & fm::kGuidedRtnMismatch) ? 1ull : 0ull) + ((f & fm::kGuidedOneStep) ? (1ull << 21) : 0ull) +
                  ((f & fm::kGuidedReproduced) ? (1ull << 42) : 0ull);
      }
      pk.set(e / 2, fm::e2m1_pack(c[0], c[1]));
    }
    store_packed(codes + mb * 8, pk);
    inner[mb] = static_cast<uint8_t>(si);
    if (cb % 8 == 0) outer[rows[i] * no + cb / 8] = so;
  }
  counts = block_reduce(counts, SumOp{}, 0ull, red);
  if (threadIdx.x == 0 && counts != 0) {
    constexpr unsigned long long kField = (1ull << 21) - 1;
    atomicAdd(stats + 0, counts & kField);
    atomicAdd(stats + 1, (counts >> 21) & kField);
    atomicAdd(stats + 2, counts >> 42);
  }
}

Status nvfp4_2level_guided_rows(uint8_t* codes, uint8_t* inner, float* outer, int64_t* stats, const float* x,
                                const int32_t* rows, int64_t R, int64_t K, const uint8_t* roll_inner,
                                const float* roll_outer, const uint8_t* guide, GuidanceKind kind,
                                cudaStream_t stream) {
  if (R < 0 || K <= 0 || K % 16 != 0)
    return invalid_argument("nvfp4_2level_guided_rows: K={} must be a positive multiple of 16 (R={})", K, R);
  const int64_t nblocks = R * (K / 16);
  if (nblocks == 0) return Status::ok();
  static_assert(sizeof(unsigned long long) == sizeof(int64_t));
  nvfp4_2level_guided_rows_kernel<<<ceil_div_int(nblocks, 256), 256, 0, stream>>>(
      codes, inner, outer, reinterpret_cast<unsigned long long*>(stats), x, rows, nblocks, K / 16, roll_inner,
      roll_outer, guide, kind);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

// Row r of out (stride P bytes) <- inner scales row r | outer row r | codes row r or their
// mantissa bits. One thread per 16-block; the row stride P is any byte count, so bytes are
// stored one at a time (records are small: cols/16 + 4 ceil(cols/128) + cols/2 or cols/8 bytes).
__global__ void __launch_bounds__(256) guidance_payload_rows_kernel(uint8_t* out, const uint8_t* codes,
                                                                    const uint8_t* inner, const float* outer,
                                                                    int64_t nblocks, int64_t kb, int64_t P,
                                                                    GuidanceKind kind) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const int64_t r = b / kb, cb = b - r * kb, no = (kb + 7) / 8;
  uint8_t* p = out + r * P;
  p[cb] = inner[b];
  if (cb % 8 == 0) {
    const uint32_t o = __float_as_uint(outer[r * no + cb / 8]);  // little-endian, as the host writes it
#pragma unroll
    for (int j = 0; j < 4; ++j) p[kb + 4 * (cb / 8) + j] = static_cast<uint8_t>(o >> (8 * j));
  }
  const uint2 w = *reinterpret_cast<const uint2*>(codes + b * 8);
  uint8_t* g = p + kb + 4 * no;
  if (kind == GuidanceKind::kFull) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      g[cb * 8 + j] = static_cast<uint8_t>(w.x >> (8 * j));
      g[cb * 8 + 4 + j] = static_cast<uint8_t>(w.y >> (8 * j));
    }
  } else {  // bit e of the pair = bit 0 of element e's code (bit 4e of the 16 codes' 64 bits)
    const uint64_t c = (static_cast<uint64_t>(w.y) << 32) | w.x;
    uint32_t bits = 0;
#pragma unroll
    for (int e = 0; e < 16; ++e) bits |= static_cast<uint32_t>((c >> (4 * e)) & 1u) << e;
    g[cb * 2] = static_cast<uint8_t>(bits);
    g[cb * 2 + 1] = static_cast<uint8_t>(bits >> 8);
  }
}

Status guidance_payload_rows(uint8_t* out, const uint8_t* codes, const uint8_t* inner, const float* outer, int64_t M,
                             int64_t K, GuidanceKind kind, cudaStream_t stream) {
  if (M < 0 || K <= 0 || K % 16 != 0)
    return invalid_argument("guidance_payload_rows: K={} must be a positive multiple of 16 (M={})", K, M);
  const int64_t kb = K / 16, no = (K + 127) / 128;
  const int64_t P = kb + 4 * no + (kind == GuidanceKind::kFull ? K / 2 : K / 8);
  const int64_t nblocks = M * kb;
  if (nblocks == 0) return Status::ok();
  guidance_payload_rows_kernel<<<ceil_div_int(nblocks, 256), 256, 0, stream>>>(out, codes, inner, outer, nblocks, kb,
                                                                                 P, kind);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
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
