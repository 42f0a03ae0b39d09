// CUDA kernels and launchers for nibble's block formats (see quantize.h). One thread owns whole
// blocks (16, 32, or one or two eighths of a 128-block) held in registers: 16-byte streaming
// loads, the per-block math of src/formats/ (the functions the CPU drivers call), 8/16-byte code
// stores. BF16 RTN (TE and 2-level with K % 128 == 0) takes the packed element path of
// bf16_e2m1.cuh; other 2-level cases a persistent grid-stride kernel (next block's load in flight).
// Grid-wide amax: per-thread max -> warp -> CTA -> one atomicMax on the float bits. SR draws one
// Philox block per eight consecutive elements (16-bit half-words, as formats::sr_uniform()).
// Mirrors TE's cast kernels (one thread per 1x16 block) and llm.c's vectorised elementwise style.
#include "backend/cuda/quantize.h"

#include <cuda_runtime.h>

#include <type_traits>

#include "backend/cuda/bf16_e2m1.cuh"
#include "backend/cuda/element_codec.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernel_util.cuh"
#include "formats/e2m1.h"
#include "formats/mx.h"
#include "formats/nvfp4.h"
#include "formats/rht.h"
#include "formats/swizzle.h"

namespace nibble::cuda {

namespace fm = ::nibble::formats;

namespace {

constexpr int kThreads = 256;

int sm_count() {
  static int n = [] {
    int dev = 0, v = 0;
    NIB_CUDA_CHECK(cudaGetDevice(&dev));
    NIB_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The fused quantize + BF16 operand contract (quantize.h): codes and scales are stored or skipped
// together, skipped only when the operand is written, and a swizzled layout needs its scales.
Status check_skipped_parts(const char* op, const void* codes, const void* scales, const void* operand,
                           ScaleLayout layout) {
  if ((codes == nullptr) != (scales == nullptr))
    return invalid_argument("{}: codes and scales are stored or skipped together", op);
  if (codes == nullptr && (operand == nullptr || layout != ScaleLayout::kLinear))
    return invalid_argument("{}: codes may be skipped only when the BF16 operand is written (linear scales)", op);
  return Status::ok();
}

template <typename T>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

__device__ __forceinline__ int64_t scale_index(int64_t block, int64_t blocks_per_row, bool swizzled) {
  if (!swizzled) return block;
  return fm::swizzled_scale_offset(block / blocks_per_row, block % blocks_per_row, blocks_per_row);
}

// u for element 8q + j of the Philox block w = sr_words(key, q) (j compile-time after unrolling),
// and its 16-bit half-word h (u = h * 2^-16).
__device__ __forceinline__ float word_uniform(const Philox4x32& w, int j) {
  return fm::sr_halfword_uniform(w, static_cast<uint32_t>(j));
}
__device__ __forceinline__ uint32_t word_half(const Philox4x32& w, int j) {
  return fm::sr_halfword(w, static_cast<uint32_t>(j));
}

}  // namespace

// ---- amax ------------------------------------------------------------------------------------

// amax (1) f32 (zeroed by the launcher) <- max |x|, x (n). Each thread keeps 4 x 16-byte loads
// in flight per step of a grid-stride loop.
template <typename In>
__global__ void __launch_bounds__(kThreads) absmax_kernel(float* amax, const In* x, int64_t n) {
  constexpr int V = kVecElems<In>;
  constexpr int U = 4;
  const int64_t nvec = n / V;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float m = 0.0f;
  int64_t v0 = tid;
  for (; v0 + (U - 1) * nthreads < nvec; v0 += U * nthreads) {
    Vec<In, V> r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) load_vec(r[u], x + (v0 + u * nthreads) * V);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < V; ++i) m = fm::amax_update(m, fm::load_f32(r[u].e[i]));
  }
  for (; v0 < nvec; v0 += nthreads) {
    Vec<In, V> r;
    load_vec(r, x + v0 * V);
#pragma unroll
    for (int i = 0; i < V; ++i) m = fm::amax_update(m, fm::load_f32(r.e[i]));
  }
  for (int64_t i = nvec * V + tid; i < n; i += nthreads) m = fm::amax_update(m, fm::load_f32(x[i]));
  m = group_max<32>(m);
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < blockDim.x / 32 ? warp_max[threadIdx.x] : 0.0f;
    w = group_max<32>(w);
    if (threadIdx.x == 0) atomic_max_nonneg(amax, w);
  }
}

template <typename In>
Status absmax(float* amax, const In* x, int64_t n, cudaStream_t stream) {
  if (n < 0) return invalid_argument("absmax: negative length {}", n);
  if (!aligned16(x)) return invalid_argument("absmax: x must be 16-byte aligned");
  NIB_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (n == 0) return Status::ok();
  int64_t nvec = (n + kVecElems<In> - 1) / kVecElems<In>;
  int64_t want = (nvec + 4 * kThreads - 1) / (4 * kThreads);
  int grid = static_cast<int>(std::min<int64_t>(std::max<int64_t>(want, 1), static_cast<int64_t>(sm_count()) * 8));
  absmax_kernel<In><<<grid, kThreads, 0, stream>>>(amax, x, n);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

// ---- NVFP4 TE 1x16 ---------------------------------------------------------------------------

// max over 16 elements with the codec's NaN-skipping max (formats::block_amax for FormatsCodec).
template <typename Codec, typename In>
__device__ __forceinline__ float block16_amax(const In* x) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = Codec::amax(m, fm::load_f32(x[i]));
  return m;
}

// Whether TE BF16 RTN may take the packed path (bf16_e2m1.cuh: v = fl(|x| * enc), its index by
// e2m1_rne_index_bits_min3) for the elements of words w (max |x| bits abits) under scale byte s
// (from their own amax, or their 16x16 tile's), and the enc it uses: only when they hold no NaN,
// no -0.0 (TE codes it 0x0, the packed sign 0x8), max |x| * enc <= 6.5 and enc > 2^-17 (sd <= 2^16:
// every nonzero x has a nonzero product, so the TE sign "v < 0" is the BF16 sign bit); all zeros
// use enc = 0.
template <int N>
__device__ __forceinline__ bool nvfp4_te_bf16_packed_enc(float& enc, const uint32_t (&w)[N], uint32_t abits, uint32_t s,
                                                         const fm::Nvfp4TeGlobal& g) {
  if (abits > 0x7F80u || bf16_block_has_negative_zero(w)) return false;
  enc = 0.0f;
  if (abits != 0u) {
    const float sd = fm::e4m3_decode(s) * g.s_dec;  // enc = fl(1 / sd) (nvfp4_te_block_enc)
    if (!(sd >= 0x1p-100f && sd <= 0x1p16f)) return false;
    enc = fm::nvfp4_te_block_enc(s, g);
    if (!(u32_as_float(abits << 16) * enc <= 6.5f)) return false;
  }
  return true;
}
// The 16 codes of a TE BF16 block by the packed path; false (codes untouched) where it may not.
__device__ __forceinline__ bool nvfp4_te_bf16_rtn_block16(uint2& codes, const uint32_t (&w)[8], const uint32_t (&a)[8],
                                                          uint32_t abits, uint32_t s, const fm::Nvfp4TeGlobal& g) {
  float enc;
  if (!nvfp4_te_bf16_packed_enc(enc, w, abits, s, g)) return false;
  codes = bf16_codes16(w, a, [enc](float m) { return fm::e2m1_rne_index_bits_min3(m * enc); });
  return true;
}

// One thread quantizes NB consecutive 1x16 blocks starting at flat block b0 (all in range):
// the steps of formats::nvfp4_te_quantize_block16, with the element step from Codec. codes null:
// codes and scales are not stored; operand set: the blocks' BF16 GEMM operand goes there too.
template <typename Codec, typename In, int NB, bool kSR>
__device__ __forceinline__ void nvfp4_te_blocks(uint8_t* codes, uint8_t* scales, uint16_t* operand, const In* x,
                                                int64_t b0, const fm::Nvfp4TeGlobal& g, int64_t kb, bool swizzled,
                                                const SrKeyDevice& key) {
  Vec<In, 16 * NB> v;
  load_vec(v, x + b0 * 16);
  PackedBytes<8 * NB> packed;
  uint32_t s[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const In* xb = &v.e[16 * b];
    if constexpr (std::is_same_v<In, uint16_t> && !kSR) {
      uint32_t w[8], a[8];
      bf16_block_words(w, v.w[2 * b], v.w[2 * b + 1]);
      const uint32_t abits = bf16_block_absmax_bits(a, w);
      if (abits <= 0x7F80u) {
        s[b] = fm::nvfp4_te_block_scale(u32_as_float(abits << 16), g);
        uint2 c;
        if (nvfp4_te_bf16_rtn_block16(c, w, a, abits, s[b], g)) {
          packed.w[2 * b] = c.x;
          packed.w[2 * b + 1] = c.y;
          continue;
        }
      }
    }
    s[b] = fm::nvfp4_te_block_scale(block16_amax<Codec>(xb), g);
    const float enc = fm::nvfp4_te_block_enc(s[b], g);
    if constexpr (!kSR) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        packed.set(8 * b + i, fm::e2m1_pack(Codec::te_rtn(fm::load_f32(xb[2 * i]), enc),
                                            Codec::te_rtn(fm::load_f32(xb[2 * i + 1]), enc)));
    } else {
      const uint64_t q0 = static_cast<uint64_t>(b0 + b) * 2;  // flat element (b0+b)*16, / 8
      // Fast form when no v = x * enc is NaN: v + 0 turns -0 into +0, so its sign bit is TE's
      // "v < 0" (e2m1_sr_code_words_clamped).
      float v[16], vmax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        v[i] = fm::load_f32(xb[i]) * enc + 0.0f;
        vmax = fmax_nan(vmax, fabsf(v[i]));
      }
      if (vmax == vmax) {
        e2m1_sr_code_words_clamped<2>(packed.w + 2 * b, v, key, q0);
        continue;
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        Philox4x32 w = sr_words(key, q0 + q);
#pragma unroll
        for (int p = 0; p < 4; ++p)
          packed.set(8 * b + 4 * q + p,
                     fm::e2m1_pack(Codec::te_sr(fm::load_f32(xb[8 * q + 2 * p]), enc, word_half(w, 2 * p)),
                                   Codec::te_sr(fm::load_f32(xb[8 * q + 2 * p + 1]), enc, word_half(w, 2 * p + 1))));
      }
    }
  }
  if (operand != nullptr) {
#pragma unroll
    for (int b = 0; b < NB; ++b)
      store_te_operand16(operand + (b0 + b) * 16, make_uint2(packed.w[2 * b], packed.w[2 * b + 1]), s[b]);
  }
  if (codes == nullptr) return;
  store_packed(codes + b0 * 8, packed);
  if (!swizzled && NB == 2) {
    *reinterpret_cast<uint16_t*>(scales + b0) = static_cast<uint16_t>(s[0] | (s[1] << 8));
  } else {
#pragma unroll
    for (int b = 0; b < NB; ++b) scales[scale_index(b0 + b, kb, swizzled)] = static_cast<uint8_t>(s[b]);
  }
}

// codes (M, K/2), scales (M, K/16) or swizzled (null: not stored), operand (M, K) bf16 or null;
// amax (1) already holds max |x|; x (M, K) flat as nblocks 1x16 blocks. Thread t owns blocks 2t, 2t+1.
template <typename Codec, typename In, bool kSR>
__global__ void __launch_bounds__(kThreads) nvfp4_te_quantize_kernel(uint8_t* codes, uint8_t* scales,
                                                                    uint16_t* operand, const float* amax,
                                                                    const In* x, int64_t nblocks, int64_t kb,
                                                                    bool swizzled, SrKeyDevice key) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b0 = 2 * t;
  if (b0 >= nblocks) return;
  const fm::Nvfp4TeGlobal g = fm::nvfp4_te_global(*amax);
  if (b0 + 1 < nblocks) nvfp4_te_blocks<Codec, In, 2, kSR>(codes, scales, operand, x, b0, g, kb, swizzled, key);
  else nvfp4_te_blocks<Codec, In, 1, kSR>(codes, scales, operand, x, b0, g, kb, swizzled, key);
}

template <typename Codec, typename In>
Status quantize_nvfp4_te_impl(uint8_t* codes, uint8_t* scales, float* amax, const In* x, int64_t M, int64_t K,
                              const SrKey* sr, AmaxMode amax_mode, ScaleLayout layout, cudaStream_t stream,
                              uint16_t* operand) {
  if (M < 0 || K <= 0 || K % 16 != 0) return invalid_argument("quantize_nvfp4_te: K={} must be a positive multiple of 16", K);
  if (!aligned16(x) || !aligned16(codes) || !aligned16(operand))
    return invalid_argument("quantize_nvfp4_te: x, codes and operand must be 16-byte aligned");
  NIB_RETURN_IF_ERROR(check_skipped_parts("quantize_nvfp4_te", codes, scales, operand, layout));
  const int64_t kb = K / 16, nblocks = M * kb;
  const bool swz = layout == ScaleLayout::kSwizzled;
  if (swz) NIB_CUDA_CHECK(cudaMemsetAsync(scales, 0, fm::swizzled_scale_bytes(M, kb), stream));
  if (amax_mode == AmaxMode::kCompute) NIB_RETURN_IF_ERROR(absmax(amax, x, M * K, stream));
  if (nblocks == 0) return Status::ok();
  const int64_t threads = (nblocks + 1) / 2;
  const int grid = ceil_div_int(threads, kThreads);
  const SrKeyDevice key = sr ? SrKeyDevice(*sr) : SrKeyDevice{};
  if (sr)
    nvfp4_te_quantize_kernel<Codec, In, true><<<grid, kThreads, 0, stream>>>(codes, scales, operand, amax, x, nblocks, kb,
                                                                             swz, key);
  else
    nvfp4_te_quantize_kernel<Codec, In, false><<<grid, kThreads, 0, stream>>>(codes, scales, operand, amax, x, nblocks, kb,
                                                                              swz, key);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

template <typename In>
Status quantize_nvfp4_te(uint8_t* codes, uint8_t* scales, float* amax, const In* x, int64_t M, int64_t K,
                         const SrKey* sr, AmaxMode amax_mode, ScaleLayout layout, cudaStream_t stream,
                         uint16_t* operand) {
  return quantize_nvfp4_te_impl<FormatsCodec>(codes, scales, amax, x, M, K, sr, amax_mode, layout, stream, operand);
}

// ---- NVFP4 TE 2-D (16x16 tiles) --------------------------------------------------------------

// CTA = 128 rows x 64 columns (8 x 4 tiles), 256 threads. Warp w = tile row w of the CTA (rows
// 16w .. 16w+15); lane (qq = lane / 8, c = lane % 8) = rows 4qq .. 4qq+3 of that tile row and
// columns 8c .. 8c+7 (half c & 1 of column block c / 2). Each load instruction of a warp reads four
// rows x 64 contiguous columns; the tile amax is a max over the 8 lanes of the tile (lane bits 0,
// 3, 4); each lane encodes its 4 x 8 elements with the tile's scale (BF16: the packed path,
// bf16_codes8, when nvfp4_te_bf16_packed_enc allows it; otherwise the per-element definition) and
// stores one 4-byte code word per row (8 lanes: 32 contiguous bytes). Columnwise outputs: since
// the tile scale is shared, code (m, k) of x^T equals code (k, m) of x; each lane regroups its 4
// x 8 nibbles into 8 columns of 4 nibbles, stages them in shared memory as [column][row quad],
// and after a barrier each thread writes 16 contiguous bytes of one column of codes_t. The BF16
// GEMM operand (operand non-null): each lane decodes its 4 code words with the tile's scale
// (store_te_operand16's steps on 8 codes) and stores 16 bytes per row; codes null: the rowwise
// codes and scales are not stored.
constexpr int kTe2dRows = 128, kTe2dCols = 64;
constexpr int kTe2dStageStride = 34;  // uint16 per staged column: 32 quads + 2 (2-way bank conflicts)

template <typename In>
__global__ void __launch_bounds__(kThreads) nvfp4_te_2d_quantize_kernel(uint8_t* codes, uint8_t* scales,
                                                                       uint8_t* codes_t, uint8_t* scales_t,
                                                                       uint16_t* operand, const float* amax,
                                                                       const In* x, int64_t M, int64_t kb,
                                                                       bool swizzled) {
  __shared__ uint16_t stage[kTe2dCols * kTe2dStageStride];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = lane & 7, qq = lane >> 3;
  const int64_t K = kb * 16, m0 = static_cast<int64_t>(blockIdx.y) * kTe2dRows;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTe2dCols, col = col0 + 8 * c, cb = col / 16;
  const int64_t row0 = m0 + 16 * warp + 4 * qq;  // this lane's rows: row0 .. row0 + 3
  const bool col_ok = col < K;                   // K % 16 == 0: a column block is in or out
  const fm::Nvfp4TeGlobal g = fm::nvfp4_te_global(*amax);

  Vec<In, 8> v[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    if (col_ok && row0 + r < M) load_vec(v[r], x + (row0 + r) * K + col);
    else
#pragma unroll
      for (int i = 0; i < 8; ++i) v[r].e[i] = In(0);  // zero padding does not change the tile amax
  }
  uint32_t w[16], a[16], abits = 0;  // BF16: the lane's 16 words (4 per row) and their magnitudes
  float lane_amax = 0.0f;
  if constexpr (std::is_same_v<In, uint16_t>) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      bf16_words4(w + 4 * r, v[r].w[0]);
    }
    abits = bf16_block_absmax_bits(a, w);
    if (abits <= 0x7F80u) lane_amax = u32_as_float(abits << 16);  // else a NaN: the float max below
  }
  if (!std::is_same_v<In, uint16_t> || abits > 0x7F80u) {
#pragma unroll
    for (int r = 0; r < 4; ++r) lane_amax = fm::amax_update(lane_amax, fm::block_amax(v[r].e, 8));
  }
  float tile_amax = lane_amax;
  tile_amax = fmaxf(tile_amax, __shfl_xor_sync(0xFFFFFFFFu, tile_amax, 1));
  tile_amax = fmaxf(tile_amax, __shfl_xor_sync(0xFFFFFFFFu, tile_amax, 8));
  tile_amax = fmaxf(tile_amax, __shfl_xor_sync(0xFFFFFFFFu, tile_amax, 16));
  const uint32_t s = fm::nvfp4_te_block_scale(tile_amax, g);

  uint32_t cw[4];  // code word of each row: code of column 8c + i in nibble i
  float enc;
  bool packed = false;
  if constexpr (std::is_same_v<In, uint16_t>) packed = nvfp4_te_bf16_packed_enc(enc, w, abits, s, g);
  if (packed) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
      cw[r] = bf16_codes8(w + 4 * r, a + 4 * r, [enc](float m) { return fm::e2m1_rne_index_bits_min3(m * enc); });
  } else {
    enc = fm::nvfp4_te_block_enc(s, g);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      cw[r] = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) cw[r] |= fm::nvfp4_te_encode_rtn(fm::load_f32(v[r].e[i]), enc) << (4 * i);
    }
  }
  if (operand != nullptr) {
    const float factor = fm::e4m3_decode(s);  // the TE operand: code × E4M3 scale, exact
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (col_ok && row0 + r < M) {
        float f[8];
        e2m1_decode8_mul(f, cw[r], factor);
        store_values(operand + (row0 + r) * K + col, f);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    if (codes != nullptr && col_ok && row0 + r < M) {
      *reinterpret_cast<uint32_t*>(codes + (row0 + r) * (K / 2) + col / 2) = cw[r];
      if ((c & 1) == 0) scales[scale_index((row0 + r) * kb + cb, kb, swizzled)] = static_cast<uint8_t>(s);
    }
  }

  const int64_t mt = (M + 15) / 16, tile_row = m0 / 16 + warp;
  if (scales_t != nullptr && qq == 0 && col_ok && tile_row < mt) {
#pragma unroll
    for (int j = 0; j < 8; ++j) scales_t[(col + j) * mt + tile_row] = static_cast<uint8_t>(s);
  }
  if (codes_t == nullptr) return;  // CTA-uniform
  // Nibble transpose: column j's 4 codes (rows 4qq .. +3) as one uint16. even/odd: byte b holds
  // column 2b / 2b + 1 of rows (0, 1) or (2, 3); a byte permute pairs the two row halves.
  const uint32_t e01 = (cw[0] & 0x0F0F0F0Fu) | ((cw[1] & 0x0F0F0F0Fu) << 4);
  const uint32_t o01 = ((cw[0] >> 4) & 0x0F0F0F0Fu) | (cw[1] & 0xF0F0F0F0u);
  const uint32_t e23 = (cw[2] & 0x0F0F0F0Fu) | ((cw[3] & 0x0F0F0F0Fu) << 4);
  const uint32_t o23 = ((cw[2] >> 4) & 0x0F0F0F0Fu) | (cw[3] & 0xF0F0F0F0u);
  const uint32_t cols[4] = {__byte_perm(e01, e23, 0x5140), __byte_perm(o01, o23, 0x5140), __byte_perm(e01, e23, 0x7362),
                            __byte_perm(o01, o23, 0x7362)};  // columns (0, 2), (1, 3), (4, 6), (5, 7)
  uint16_t* st = stage + 8 * c * kTe2dStageStride + (4 * warp + qq);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int j = (p & 1) + 4 * (p >> 1);  // low half: column j, high half: column j + 2
    st[j * kTe2dStageStride] = static_cast<uint16_t>(cols[p]);
    st[(j + 2) * kTe2dStageStride] = static_cast<uint16_t>(cols[p] >> 16);
  }
  __syncthreads();
  // Thread t: column k = t / 4 of the CTA, bytes 16 (t % 4) .. +15 of its 64 (rows m0 + 32 (t % 4) ..).
  const int k = threadIdx.x >> 2, chunk = threadIdx.x & 3;
  if (col0 + k >= K) return;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(stage + k * kTe2dStageStride + 8 * chunk);
  const uint4 bytes16 = make_uint4(src[0], src[1], src[2], src[3]);
  const int64_t b0 = m0 / 2 + 16 * chunk, row_bytes = M / 2;  // M is even
  uint8_t* dst = codes_t + (col0 + k) * row_bytes + b0;
  if (b0 + 16 <= row_bytes && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
    *reinterpret_cast<uint4*>(dst) = bytes16;
  } else {
    const uint32_t words[4] = {bytes16.x, bytes16.y, bytes16.z, bytes16.w};
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (b0 + i < row_bytes) dst[i] = static_cast<uint8_t>(words[i / 4] >> (8 * (i % 4)));
  }
}

template <typename In>
Status quantize_nvfp4_te_2d(uint8_t* codes, uint8_t* scales, uint8_t* codes_t, uint8_t* scales_t, float* amax,
                            const In* x, int64_t M, int64_t K, AmaxMode amax_mode, ScaleLayout layout,
                            cudaStream_t stream, uint16_t* operand) {
  if (M < 0 || K <= 0 || K % 16 != 0) return invalid_argument("quantize_nvfp4_te_2d: K={} must be a positive multiple of 16", K);
  if (codes_t != nullptr && M % 2 != 0) return invalid_argument("quantize_nvfp4_te_2d: columnwise codes need an even M, got {}", M);
  if (!aligned16(x) || !aligned16(operand) || (reinterpret_cast<uintptr_t>(codes) & 7u) ||
      (reinterpret_cast<uintptr_t>(codes_t) & 7u))
    return invalid_argument("quantize_nvfp4_te_2d: misaligned pointers");
  NIB_RETURN_IF_ERROR(check_skipped_parts("quantize_nvfp4_te_2d", codes, scales, operand, layout));
  const int64_t kb = K / 16;
  const bool swz = layout == ScaleLayout::kSwizzled;
  if (swz) NIB_CUDA_CHECK(cudaMemsetAsync(scales, 0, fm::swizzled_scale_bytes(M, kb), stream));
  if (amax_mode == AmaxMode::kCompute) NIB_RETURN_IF_ERROR(absmax(amax, x, M * K, stream));
  if (M == 0) return Status::ok();
  dim3 grid(ceil_div_int(K, kTe2dCols), ceil_div_int(M, kTe2dRows));
  nvfp4_te_2d_quantize_kernel<In><<<grid, kThreads, 0, stream>>>(codes, scales, codes_t, scales_t, operand, amax, x, M,
                                                                   kb, swz);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

// ---- NVFP4 TE dequantize -----------------------------------------------------------------------

// y (nblocks*16) <- codes/scales (linear); thread per 1x16 block:
// formats::nvfp4_te_dequantize_block16 by the table decode (e2m1_decode8_mul).
template <typename Out>
__global__ void __launch_bounds__(kThreads) nvfp4_te_dequantize_kernel(Out* y, const uint8_t* codes,
                                                                      const uint8_t* scales, const float* amax,
                                                                      int64_t nblocks) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const uint2 c = __ldcs(reinterpret_cast<const uint2*>(codes + b * 8));
  float f[16];
  // amax null: the BF16 GEMM operand e2m1 × E4M3 scale (fm::nvfp4_te_bf16_operand), exact
  decode16_mul(f, c, amax != nullptr ? fm::nvfp4_te_dequant_factor(scales[b], *amax) : fm::e4m3_decode(scales[b]));
  store_values(y + b * 16, f);
}

template <typename Out>
Status dequantize_nvfp4_te(Out* y, const uint8_t* codes, const uint8_t* scales, const float* amax, int64_t M, int64_t K,
                           cudaStream_t stream) {
  if (M < 0 || K <= 0 || K % 16 != 0) return invalid_argument("dequantize_nvfp4_te: K={} must be a positive multiple of 16", K);
  const int64_t nblocks = M * K / 16;
  if (nblocks == 0) return Status::ok();
  nvfp4_te_dequantize_kernel<Out><<<ceil_div_int(nblocks, kThreads), kThreads, 0, stream>>>(y, codes, scales, amax, nblocks);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

// ---- nvfp4-2level (TetraJet-v2 double block) ---------------------------------------------------

// Resident CTAs of `kernel` (kThreads threads) on the whole device: the grid of a persistent kernel.
template <typename Kernel>
int resident_grid(Kernel kernel) {
  int per_sm = 0;
  NIB_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  return std::max(per_sm, 1) * sm_count();
}

// Eight consecutive lanes form one 128-block of a row: lane q of block (r, j) owns the inner
// 1x16 block at columns c = 128j + 16q .. +15 of row r (K % 16 == 0: a row's last 128-block may
// be partial; lanes past K hold zeros, which is the zero-padded 128-block's outer amax, and store
// nothing). Outer amax by 3 shuffles; per lane one inner scale, 16 codes (8 bytes), one scale byte.
// Lane t's first element is e = r*K + c (= 16t when K % 128 == 0: no division); its inner block
// is e/16, its outer block t/8.
struct TwoLevelLane {
  int64_t e;
  bool ok;
};
__device__ __forceinline__ TwoLevelLane two_level_lane(int64_t t, int64_t nlanes, int64_t M, int64_t K, int64_t no,
                                                       bool k128) {
  if (k128) return {16 * t, t < nlanes};
  const int64_t o = t >> 3, r = o / no, c = 128 * (o - r * no) + 16 * (t & 7);
  return {r * K + c, t < nlanes && r < M && c < K};
}

template <typename In>
__device__ __forceinline__ void load_or_zero(Vec<In, 16>& v, const In* x, const TwoLevelLane& l) {
  if (l.ok) {
    load_vec(v, x + l.e);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v.e[i] = In(0);
  }
}

// One BF16 inner block, RTN, given its words w / magnitudes a (bf16_e2m1.cuh), whether it is
// NaN-free, its NaN-skipping max bamax and scale sp. The packed path (bf16_e2m1.cuh): v = the
// division-free quotient and its index by e2m1_rne_index_bits_min3, when the block has no NaN,
// passes nvfp4_2level_block_fast_rtn (no per-element range check is needed for RTN indices) and
// max |x| * r <= 6.5; sp == 0 (every v is 0) runs the same steps with r = 0, which give v = 0.
// Otherwise the per-element functions (nvfp4_2level_encode_block16).
__device__ __forceinline__ PackedBytes<8> nvfp4_2level_bf16_rtn_block16(const uint16_t* xb, const uint32_t (&w)[8],
                                                                        const uint32_t (&a)[8], bool nan_free,
                                                                        float bamax, float sp) {
  const float rp = fm::nvfp4_2level_block_reciprocal(sp);
  PackedBytes<8> packed;
  if (nan_free && (sp == 0.0f || (fm::nvfp4_2level_block_fast_rtn(rp, bamax) && bamax * rp <= 6.5f))) {
    const uint2 c = bf16_codes16(w, a, [sp, rp](float m) {
      return fm::e2m1_rne_index_bits_min3(fm::nvfp4_2level_quotient_fma(m, sp, rp));
    });
    packed.w[0] = c.x;
    packed.w[1] = c.y;
  } else {
    float xf[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) xf[i] = fm::load_f32(xb[i]);
    packed = nvfp4_2level_encode_block16<false>(xf, sp, rp, SrKeyDevice{}, 0);
  }
  return packed;
}

// The NaN-free flag, magnitudes and max of a BF16 block: the max as the unsigned max of the |x|
// bit patterns (= the NaN-skipping float max when no NaN is present); with a NaN, the float max.
__device__ __forceinline__ float bf16_block_max(bool& nan_free, uint32_t (&w)[8], uint32_t (&a)[8], const uint4& lo,
                                                const uint4& hi, const uint16_t* xb) {
  bf16_block_words(w, lo, hi);
  const uint32_t abits = bf16_block_absmax_bits(a, w);
  nan_free = abits <= 0x7F80u;
  return nan_free ? u32_as_float(abits << 16) : block16_amax<FormatsCodec>(xb);
}

// The lane's inner block v (zeros when !l.ok): all lanes of the warp call it (shuffles). codes
// null: codes and inner scales are not stored; outer null: nor the outer scales; operand set: the
// block's BF16 GEMM operand (store_2level_block16 with the block scale dequantize_nvfp4_2level forms).
template <typename Codec, typename In, bool kSR>
__device__ __forceinline__ void nvfp4_2level_lane(uint8_t* codes, uint8_t* inner, float* outer, uint16_t* operand,
                                                  const Vec<In, 16>& v, int64_t t, const TwoLevelLane& l, int64_t kb,
                                                  bool swizzled, const SrKeyDevice& key) {
  constexpr bool kBf16Rtn = std::is_same_v<In, uint16_t> && !kSR;
  uint32_t w[8], a[8];
  bool nan_free = false;
  float bamax;
  if constexpr (kBf16Rtn) bamax = bf16_block_max(nan_free, w, a, v.w[0], v.w[1], v.e);
  else bamax = block16_amax<Codec>(v.e);
  const float so = fm::nvfp4_2level_outer_scale(group_max<8>(bamax));
  if (!l.ok) return;
  const uint32_t si = fm::nvfp4_2level_inner_scale(bamax, so);
  const float sp = nvfp4_2level_block_scale_encoded(si, so);
  PackedBytes<8> packed;
  if constexpr (kBf16Rtn) {
    packed = nvfp4_2level_bf16_rtn_block16(v.e, w, a, nan_free, bamax, sp);
  } else {
    const float rp = fm::nvfp4_2level_block_reciprocal(sp);
    float xf[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) xf[i] = fm::load_f32(v.e[i]);
    packed = nvfp4_2level_encode_block16<kSR>(xf, sp, rp, key, static_cast<uint64_t>(l.e) / 8);  // e % 16 == 0
  }
  if (operand != nullptr)
    store_2level_block16(operand + l.e, make_uint2(packed.w[0], packed.w[1]), fm::nvfp4_2level_block_scale(si, so));
  if (codes != nullptr) {
    store_packed(codes + l.e / 2, packed);  // 8-byte aligned: e/2 is a multiple of 8
    inner[scale_index(l.e / 16, kb, swizzled)] = static_cast<uint8_t>(si);
  }
  if (outer != nullptr && (t & 7) == 0) outer[t >> 3] = so;
}

// codes (M, K/2), inner (M, K/16) or swizzled, outer (M, ceil(K/128)) f32; x (M, K). Persistent
// grid-stride loop over lanes t = global thread, t + stride, ... (nlanes = 8 per 128-block); the
// loop condition is CTA-uniform so whole warps shuffle; the next lane's 32 bytes are loaded
// before the current inner block is encoded (a load in flight while the thread computes).
template <typename Codec, typename In, bool kSR>
__global__ void __launch_bounds__(kThreads) nvfp4_2level_quantize_kernel(uint8_t* codes, uint8_t* inner, float* outer,
                                                                        uint16_t* operand, const In* x, int64_t M,
                                                                        int64_t K, bool swizzled, SrKeyDevice key) {
  const int64_t no = (K + 127) / 128, kb = K / 16, nlanes = M * no * 8;
  const bool k128 = (K & 127) == 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x;
  int64_t t = base + threadIdx.x;
  TwoLevelLane l = two_level_lane(t, nlanes, M, K, no, k128);
  Vec<In, 16> v;
  load_or_zero(v, x, l);
  for (; base < nlanes; base += stride, t += stride) {
    const TwoLevelLane ln = two_level_lane(t + stride, nlanes, M, K, no, k128);
    Vec<In, 16> vn;
    load_or_zero(vn, x, ln);
    nvfp4_2level_lane<Codec, In, kSR>(codes, inner, outer, operand, v, t, l, kb, swizzled, key);
    v = vn;
    l = ln;
  }
}

// CTAs per SM the SR instance of the kernel below is compiled for: 4 (<= 64 registers) measured
// 0.460 of copy against 0.447 for 3 (69 registers) on an H200 (docs/benchmarks.md).
constexpr int kSrMinBlocks = 4;

// BF16 with K % 128 == 0 (the common case), one pass, no grid-stride loop: thread t owns kNB
// consecutive inner blocks (elements 16 kNB t ..), 8 / kNB consecutive threads one 128-block
// (outer amax by shuffles); RTN by the packed path (nvfp4_2level_bf16_rtn_block16), SR by
// nvfp4_2level_encode_block16; the code bytes, inner scale bytes and (first thread of the group)
// the outer scale are stored directly. Threads past the end (whole groups: nthreads is a multiple
// of 8 / kNB) run the shuffles on zeros and store nothing. kOperand: the blocks' BF16 GEMM operand
// is stored too (store_2level_block16), and codes / inner (null together) and outer (null) may be
// skipped; a template flag so that the plain instances keep their register budget.
template <int kNB, int kMinBlocks, bool kSR, bool kOperand>
__global__ void __launch_bounds__(kThreads, kMinBlocks) nvfp4_2level_bf16_k128_kernel(uint8_t* codes, uint8_t* inner,
                                                                                     float* outer, uint16_t* operand,
                                                                                     const uint16_t* x,
                                                                                     int64_t nthreads, int64_t kb,
                                                                                     bool swizzled, SrKeyDevice key) {
  constexpr int kGroup = 8 / kNB;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool ok = t < nthreads;
  Vec<uint16_t, 16 * kNB> v;
  if (ok) {
    load_vec(v, x + 16 * kNB * t);
  } else {
#pragma unroll
    for (int i = 0; i < 2 * kNB; ++i) v.w[i] = make_uint4(0u, 0u, 0u, 0u);
  }
  uint32_t w[kNB][8], a[kNB][8];
  bool nan_free[kNB];
  float bamax[kNB], m = 0.0f;
#pragma unroll
  for (int b = 0; b < kNB; ++b) {
    bamax[b] = bf16_block_max(nan_free[b], w[b], a[b], v.w[2 * b], v.w[2 * b + 1], v.e + 16 * b);
    m = fmaxf(m, bamax[b]);
  }
  const float so = fm::nvfp4_2level_outer_scale(group_max<kGroup>(m));
  if (!ok) return;
  PackedBytes<8 * kNB> packed;
  uint32_t si[kNB];
#pragma unroll
  for (int b = 0; b < kNB; ++b) {
    si[b] = fm::nvfp4_2level_inner_scale(bamax[b], so);
    const float sp = nvfp4_2level_block_scale_encoded(si[b], so);
    PackedBytes<8> p;
    if constexpr (kSR) {
      float xf[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) xf[i] = fm::load_f32(v.e[16 * b + i]);
      const uint64_t q0 = static_cast<uint64_t>(16 * kNB * t + 16 * b) / 8;  // flat element / 8
      p = nvfp4_2level_encode_block16<true>(xf, sp, fm::nvfp4_2level_block_reciprocal(sp), key, q0);
    } else {
      p = nvfp4_2level_bf16_rtn_block16(v.e + 16 * b, w[b], a[b], nan_free[b], bamax[b], sp);
    }
    packed.w[2 * b] = p.w[0];
    packed.w[2 * b + 1] = p.w[1];
    if constexpr (kOperand)
      store_2level_block16(operand + 16 * kNB * t + 16 * b, make_uint2(p.w[0], p.w[1]),
                           fm::nvfp4_2level_block_scale(si[b], so));
  }
  if (!kOperand || codes != nullptr) {
    store_packed(codes + 8 * kNB * t, packed);
    if (!swizzled && kNB == 2) {
      *reinterpret_cast<uint16_t*>(inner + 2 * t) = static_cast<uint16_t>(si[0] | (si[kNB - 1] << 8));
    } else {
#pragma unroll
      for (int b = 0; b < kNB; ++b) inner[scale_index(kNB * t + b, kb, swizzled)] = static_cast<uint8_t>(si[b]);
    }
  }
  if ((!kOperand || outer != nullptr) && (t & (kGroup - 1)) == 0) outer[t / kGroup] = so;
}

template <typename Codec, typename In>
Status quantize_nvfp4_2level_impl(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t M, int64_t K,
                                  const SrKey* sr, ScaleLayout inner_layout, cudaStream_t stream, uint16_t* operand) {
  if (M < 0 || K <= 0 || K % 16 != 0) return invalid_argument("quantize_nvfp4_2level: K={} must be a positive multiple of 16", K);
  if (!aligned16(x) || !aligned16(codes) || !aligned16(operand))
    return invalid_argument("quantize_nvfp4_2level: x, codes and operand must be 16-byte aligned");
  NIB_RETURN_IF_ERROR(check_skipped_parts("quantize_nvfp4_2level", codes, inner, operand, inner_layout));
  if (outer == nullptr && operand == nullptr)
    return invalid_argument("quantize_nvfp4_2level: outer scales may be skipped only when the BF16 operand is written");
  const int64_t kb = K / 16, n128 = M * ((K + 127) / 128);
  const bool swz = inner_layout == ScaleLayout::kSwizzled;
  if (swz) NIB_CUDA_CHECK(cudaMemsetAsync(inner, 0, fm::swizzled_scale_bytes(M, kb), stream));
  if (n128 == 0) return Status::ok();
  const SrKeyDevice key = sr ? SrKeyDevice(*sr) : SrKeyDevice{};
  auto launch = [&](auto kernel) {
    const int grid = static_cast<int>(std::min<int64_t>(ceil_div_int(n128 * 8, kThreads), resident_grid(kernel)));
    kernel<<<grid, kThreads, 0, stream>>>(codes, inner, outer, operand, x, M, K, swz, key);
  };
  if constexpr (std::is_same_v<In, uint16_t> && std::is_same_v<Codec, FormatsCodec>) {
    if (K % 128 == 0) {
      // Two inner blocks per thread, one pass. RTN at <= 48 registers (5 CTAs of 256 per SM):
      // measured on an H200 against one block per thread at 40 registers (0.76 of copy), two at
      // 40 / 64 registers (0.83 / 0.82) and this (0.86); SR at <= 64 (docs/benchmarks.md).
      constexpr int kNB = 2;
      const int64_t nthreads = M * K / (16 * kNB);
      const int grid = ceil_div_int(nthreads, kThreads);
      // The operand instances run at <= 64 registers (4 CTAs): room for the 2 x 16 decoded values.
      if (operand != nullptr && sr)
        nvfp4_2level_bf16_k128_kernel<kNB, kSrMinBlocks, true, true><<<grid, kThreads, 0, stream>>>(
            codes, inner, outer, operand, x, nthreads, kb, swz, key);
      else if (operand != nullptr)
        nvfp4_2level_bf16_k128_kernel<kNB, kSrMinBlocks, false, true><<<grid, kThreads, 0, stream>>>(
            codes, inner, outer, operand, x, nthreads, kb, swz, SrKeyDevice{});
      else if (sr)
        nvfp4_2level_bf16_k128_kernel<kNB, kSrMinBlocks, true, false><<<grid, kThreads, 0, stream>>>(
            codes, inner, outer, nullptr, x, nthreads, kb, swz, key);
      else
        nvfp4_2level_bf16_k128_kernel<kNB, 5, false, false><<<grid, kThreads, 0, stream>>>(
            codes, inner, outer, nullptr, x, nthreads, kb, swz, SrKeyDevice{});
      NIB_CUDA_CHECK_LAUNCH();
      return Status::ok();
    }
  }
  if (sr) launch(nvfp4_2level_quantize_kernel<Codec, In, true>);
  else launch(nvfp4_2level_quantize_kernel<Codec, In, false>);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

template <typename In>
Status quantize_nvfp4_2level(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t M, int64_t K,
                             const SrKey* sr, ScaleLayout inner_layout, cudaStream_t stream, uint16_t* operand) {
  return quantize_nvfp4_2level_impl<FormatsCodec>(codes, inner, outer, x, M, K, sr, inner_layout, stream, operand);
}

// y <- dequantized; thread per 1x16 block.
template <typename Out>
__global__ void __launch_bounds__(kThreads) nvfp4_2level_dequantize_kernel(Out* y, const uint8_t* codes,
                                                                          const uint8_t* inner, const float* outer,
                                                                          int64_t nblocks, int64_t kb) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  const uint2 c = __ldcs(reinterpret_cast<const uint2*>(codes + b * 8));
  const int64_t r = b / kb, cb = b - r * kb;  // outer (M, ceil(K/128)): block (r, cb) -> (r, cb/8)
  store_2level_block16(y + b * 16, c, fm::nvfp4_2level_block_scale(inner[b], outer[r * ((kb + 7) / 8) + cb / 8]));
}

template <typename Out>
Status dequantize_nvfp4_2level(Out* y, const uint8_t* codes, const uint8_t* inner, const float* outer, int64_t M,
                               int64_t K, cudaStream_t stream) {
  if (M < 0 || K <= 0 || K % 16 != 0) return invalid_argument("dequantize_nvfp4_2level: K={} must be a positive multiple of 16", K);
  const int64_t nblocks = M * K / 16;
  if (nblocks == 0) return Status::ok();
  nvfp4_2level_dequantize_kernel<Out><<<ceil_div_int(nblocks, kThreads), kThreads, 0, stream>>>(y, codes, inner, outer, nblocks, K / 16);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

// ---- MXFP4 / MXFP8 -----------------------------------------------------------------------------

// Thread per 1x32 block.
template <typename In, MxScaleRule kRule, bool kSR>
__global__ void __launch_bounds__(kThreads) mxfp4_quantize_kernel(uint8_t* codes, uint8_t* scales, const In* x,
                                                                 int64_t nblocks, int64_t kb, bool swizzled,
                                                                 SrKeyDevice key) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  Vec<In, 32> v;
  load_vec(v, x + b * 32);
  PackedBytes<16> packed;
  uint32_t byte;
  // floor / RCEIL (sign bit = signbit(x * inv) = signbit(x): inv is a positive power of two) on a
  // NaN-free block: the packed paths. BF16 RTN: bf16_codes8 with the capped min3 index of fl(|x| *
  // inv); SR: e2m1_sr_code_words_clamped on x * inv. TE-ceil (sign iff x * inv < 0) and
  // blocks holding a NaN take the per-element definition.
  bool done = false;
  if constexpr (kRule != MxScaleRule::kTeCeil && !kSR && std::is_same_v<In, uint16_t>) {
    uint32_t w[16], a[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) bf16_words4(w + 4 * i, v.w[i]);
    const uint32_t abits = bf16_block_absmax_bits(a, w);
    if (abits <= 0x7F80u) {
      byte = fm::mxfp4_scale_byte(u32_as_float(abits << 16), kRule);
      const float inv = fm::e8m0_inverse(byte);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        packed.w[q] = bf16_codes8(w + 4 * q, a + 4 * q, [inv](float m) { return e2m1_rne_index_biased(m * inv); });
      done = true;
    }
  }
  if constexpr (kRule != MxScaleRule::kTeCeil && kSR) {
    float xv[32], vmax = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      xv[i] = fm::load_f32(v.e[i]);
      vmax = fmax_nan(vmax, fabsf(xv[i]));
    }
    if (vmax == vmax) {  // no NaN: vmax is the block's amax
      byte = fm::mxfp4_scale_byte(vmax, kRule);
      const float inv = fm::e8m0_inverse(byte);
#pragma unroll
      for (int i = 0; i < 32; ++i) xv[i] *= inv;
      e2m1_sr_code_words_clamped<4>(packed.w, xv, key, static_cast<uint64_t>(b) * 4);  // elements 32b ..
      done = true;
    }
  }
  if (!done) {  // the per-element definition
    if constexpr (!kSR) {
      uint8_t p[16];
      byte = fm::mxfp4_quantize_block32(p, v.e, kRule);
#pragma unroll
      for (int i = 0; i < 16; ++i) packed.set(i, p[i]);
    } else {
      byte = fm::mxfp4_scale_byte(fm::block_amax(v.e, 32), kRule);
      const float inv = fm::e8m0_inverse(byte);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        Philox4x32 w = sr_words(key, static_cast<uint64_t>(b) * 4 + q);  // elements 32b + 8q ..
#pragma unroll
        for (int p = 0; p < 4; ++p)
          packed.set(4 * q + p,
                     fm::e2m1_pack(fm::mxfp4_encode_sr(fm::load_f32(v.e[8 * q + 2 * p]), inv, kRule, word_uniform(w, 2 * p)),
                                   fm::mxfp4_encode_sr(fm::load_f32(v.e[8 * q + 2 * p + 1]), inv, kRule,
                                                       word_uniform(w, 2 * p + 1))));
      }
    }
  }
  store_packed(codes + b * 16, packed);
  scales[scale_index(b, kb, swizzled)] = static_cast<uint8_t>(byte);
}

template <typename In, bool kSR>
void launch_mxfp4(uint8_t* codes, uint8_t* scales, const In* x, int64_t nblocks, int64_t kb, bool swz, MxScaleRule rule,
                  const SrKeyDevice& key, cudaStream_t stream) {
  const int grid = ceil_div_int(nblocks, kThreads);
  switch (rule) {
    case MxScaleRule::kFloor:
      mxfp4_quantize_kernel<In, MxScaleRule::kFloor, kSR><<<grid, kThreads, 0, stream>>>(codes, scales, x, nblocks, kb, swz, key);
      break;
    case MxScaleRule::kRceil:
      mxfp4_quantize_kernel<In, MxScaleRule::kRceil, kSR><<<grid, kThreads, 0, stream>>>(codes, scales, x, nblocks, kb, swz, key);
      break;
    default:
      mxfp4_quantize_kernel<In, MxScaleRule::kTeCeil, kSR><<<grid, kThreads, 0, stream>>>(codes, scales, x, nblocks, kb, swz, key);
      break;
  }
  NIB_CUDA_CHECK_LAUNCH();
}

template <typename In>
Status quantize_mxfp4(uint8_t* codes, uint8_t* scales, const In* x, int64_t M, int64_t K, MxScaleRule rule,
                      const SrKey* sr, ScaleLayout layout, cudaStream_t stream) {
  if (M < 0 || K <= 0 || K % 32 != 0) return invalid_argument("quantize_mxfp4: K={} must be a positive multiple of 32", K);
  if (!aligned16(x) || !aligned16(codes)) return invalid_argument("quantize_mxfp4: x and codes must be 16-byte aligned");
  const int64_t kb = K / 32, nblocks = M * kb;
  const bool swz = layout == ScaleLayout::kSwizzled;
  if (swz) NIB_CUDA_CHECK(cudaMemsetAsync(scales, 0, fm::swizzled_scale_bytes(M, kb), stream));
  if (nblocks == 0) return Status::ok();
  if (sr) launch_mxfp4<In, true>(codes, scales, x, nblocks, kb, swz, rule, SrKeyDevice(*sr), stream);
  else launch_mxfp4<In, false>(codes, scales, x, nblocks, kb, swz, rule, SrKeyDevice{}, stream);
  return Status::ok();
}

// y (16) <- the dequantization of 16 E4M3 elements e under the E8M0 scale byte, f32 or rounded to
// BF16 (the MXFP8 dequantizer and the fused quantize + BF16 operand kernel).
template <typename Out>
__device__ __forceinline__ void store_mxfp8_values16(Out* y, const uint8_t* e, uint32_t byte) {
  Vec<Out, 16> v;
#pragma unroll
  for (int i = 0; i < 16; ++i) v.e[i] = from_f32<Out>(fm::mxfp8_decode(e[i], byte));
  store_vec(y, v);
}

// Thread per 1x32 block; elems / scales null: not stored; operand set: the block's BF16 operand.
template <typename In, MxScaleRule kRule>
__global__ void __launch_bounds__(kThreads) mxfp8_quantize_kernel(uint8_t* elems, uint8_t* scales, uint16_t* operand,
                                                                 const In* x, int64_t nblocks, int64_t kb,
                                                                 bool swizzled) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  Vec<In, 32> v;
  load_vec(v, x + b * 32);
  uint8_t p[32];
  const uint32_t byte = fm::mxfp8_quantize_block32(p, v.e, kRule);
  if (operand != nullptr) {
    store_mxfp8_values16(operand + b * 32, p, byte);
    store_mxfp8_values16(operand + b * 32 + 16, p + 16, byte);
  }
  if (elems == nullptr) return;
  PackedBytes<32> packed;
#pragma unroll
  for (int i = 0; i < 32; ++i) packed.set(i, p[i]);
  store_packed(elems + b * 32, packed);
  scales[scale_index(b, kb, swizzled)] = static_cast<uint8_t>(byte);
}

template <typename In>
Status quantize_mxfp8(uint8_t* elems, uint8_t* scales, const In* x, int64_t M, int64_t K, MxScaleRule rule,
                      ScaleLayout layout, cudaStream_t stream, uint16_t* operand) {
  if (M < 0 || K <= 0 || K % 32 != 0) return invalid_argument("quantize_mxfp8: K={} must be a positive multiple of 32", K);
  if (rule == MxScaleRule::kTeCeil) return invalid_argument("quantize_mxfp8: the TE ceil rule is an MXFP4 rule");
  if (!aligned16(x) || !aligned16(elems) || !aligned16(operand))
    return invalid_argument("quantize_mxfp8: x, elems and operand must be 16-byte aligned");
  NIB_RETURN_IF_ERROR(check_skipped_parts("quantize_mxfp8", elems, scales, operand, layout));
  const int64_t kb = K / 32, nblocks = M * kb;
  const bool swz = layout == ScaleLayout::kSwizzled;
  if (swz) NIB_CUDA_CHECK(cudaMemsetAsync(scales, 0, fm::swizzled_scale_bytes(M, kb), stream));
  if (nblocks == 0) return Status::ok();
  const int grid = ceil_div_int(nblocks, kThreads);
  if (rule == MxScaleRule::kFloor)
    mxfp8_quantize_kernel<In, MxScaleRule::kFloor><<<grid, kThreads, 0, stream>>>(elems, scales, operand, x, nblocks, kb,
                                                                                  swz);
  else
    mxfp8_quantize_kernel<In, MxScaleRule::kRceil><<<grid, kThreads, 0, stream>>>(elems, scales, operand, x, nblocks, kb,
                                                                                  swz);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

// y (nblocks*32) <- MX blocks; thread per 1x32 block. kFp8: E4M3 elements (32 bytes per block),
// else packed E2M1 codes (16 bytes).
template <typename Out, bool kFp8>
__global__ void __launch_bounds__(kThreads) mx_dequantize_kernel(Out* y, const uint8_t* elems, const uint8_t* scales,
                                                                int64_t nblocks) {
  constexpr int kBytes = kFp8 ? 32 : 16;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nblocks) return;
  Vec<uint8_t, kBytes> c;
#pragma unroll
  for (int i = 0; i < kBytes / 16; ++i) c.w[i] = *reinterpret_cast<const uint4*>(elems + b * kBytes + 16 * i);
  const uint32_t byte = scales[b];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (kFp8) {
      store_mxfp8_values16(y + b * 32 + 16 * h, c.e + 16 * h, byte);
    } else {  // mxfp4_decode = e2m1_decode(code) * e8m0_decode(byte): the table decode
      float f[16];
      decode16_mul(f, h ? make_uint2(c.w[0].z, c.w[0].w) : make_uint2(c.w[0].x, c.w[0].y), fm::e8m0_decode(byte));
      store_values(y + b * 32 + 16 * h, f);
    }
  }
}

template <typename Out, bool kFp8>
Status dequantize_mx(Out* y, const uint8_t* elems, const uint8_t* scales, int64_t M, int64_t K, cudaStream_t stream) {
  if (M < 0 || K <= 0 || K % 32 != 0)
    return invalid_argument("dequantize_{}: K={} must be a positive multiple of 32", kFp8 ? "mxfp8" : "mxfp4", K);
  const int64_t nblocks = M * K / 32;
  if (nblocks == 0) return Status::ok();
  mx_dequantize_kernel<Out, kFp8><<<ceil_div_int(nblocks, kThreads), kThreads, 0, stream>>>(y, elems, scales, nblocks);
  NIB_CUDA_CHECK_LAUNCH();
  return Status::ok();
}

template <typename Out>
Status dequantize_mxfp4(Out* y, const uint8_t* codes, const uint8_t* scales, int64_t M, int64_t K, cudaStream_t stream) {
  return dequantize_mx<Out, false>(y, codes, scales, M, K, stream);
}

template <typename Out>
Status dequantize_mxfp8(Out* y, const uint8_t* elems, const uint8_t* scales, int64_t M, int64_t K, cudaStream_t stream) {
  return dequantize_mx<Out, true>(y, elems, scales, M, K, stream);
}

// ---- explicit instantiations ------------------------------------------------------------------

#define NIB_INSTANTIATE_IN(In)                                                                                   \
  template Status absmax<In>(float*, const In*, int64_t, cudaStream_t);                                          \
  template Status quantize_nvfp4_te<In>(uint8_t*, uint8_t*, float*, const In*, int64_t, int64_t, const SrKey*,   \
                                        AmaxMode, ScaleLayout, cudaStream_t, uint16_t*);                         \
  template Status quantize_nvfp4_te_2d<In>(uint8_t*, uint8_t*, uint8_t*, uint8_t*, float*, const In*, int64_t,    \
                                           int64_t, AmaxMode, ScaleLayout, cudaStream_t, uint16_t*);             \
  template Status quantize_nvfp4_2level<In>(uint8_t*, uint8_t*, float*, const In*, int64_t, int64_t,             \
                                            const SrKey*, ScaleLayout, cudaStream_t, uint16_t*);                 \
  template Status quantize_mxfp4<In>(uint8_t*, uint8_t*, const In*, int64_t, int64_t, MxScaleRule, const SrKey*, \
                                     ScaleLayout, cudaStream_t);                                                 \
  template Status quantize_mxfp8<In>(uint8_t*, uint8_t*, const In*, int64_t, int64_t, MxScaleRule, ScaleLayout,  \
                                     cudaStream_t, uint16_t*);
NIB_INSTANTIATE_IN(float)
NIB_INSTANTIATE_IN(uint16_t)

#define NIB_INSTANTIATE_OUT(Out)                                                                                       \
  template Status dequantize_nvfp4_te<Out>(Out*, const uint8_t*, const uint8_t*, const float*, int64_t, int64_t,      \
                                           cudaStream_t);                                                             \
  template Status dequantize_nvfp4_2level<Out>(Out*, const uint8_t*, const uint8_t*, const float*, int64_t, int64_t,  \
                                               cudaStream_t);                                                         \
  template Status dequantize_mxfp4<Out>(Out*, const uint8_t*, const uint8_t*, int64_t, int64_t, cudaStream_t);        \
  template Status dequantize_mxfp8<Out>(Out*, const uint8_t*, const uint8_t*, int64_t, int64_t, cudaStream_t);
NIB_INSTANTIATE_OUT(float)
NIB_INSTANTIATE_OUT(uint16_t)

}  // namespace nibble::cuda
