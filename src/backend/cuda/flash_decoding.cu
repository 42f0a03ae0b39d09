// Flash-decoding paged attention kernels (see flash_decoding.h). Lane layout of all three
// kernels: a position's D elements are D/8 runs of 8; a group of lp lanes (the power of two
// >= D/8) holds one position, lane `sub` its run d0 = 8 sub (lanes past D/8 hold none); the
// 128 threads are 128/lp position groups, and each lane loads kBatch positions before using any,
// so a chunk's K or V is in flight at once. Sums over the lanes of a position are xor-shuffle
// trees, over position groups a loop in group order: every sum has a fixed order.
#include "backend/cuda/flash_decoding.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/block_reduce.cuh"
#include "backend/kv_page_codec.h"
#include "core/bits.h"
#include "formats/e2m1.h"
#include "formats/e4m3.h"
#include "formats/nvfp4.h"

namespace nibble::cuda {

namespace {

using backend::KvPageFormat;
using backend::kv::TokenLayout;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = static_cast<int>(kFlashDecodingChunk);
constexpr int kBatch = 8;    // positions a lane loads before it uses any
constexpr int kMaxTile = 8;  // query heads per P v pass (registers: kTile x 8 accumulators)
constexpr int kCombineThreads = 256;

// Eight consecutive elements d0 .. d0+7 of kv head hk of one slot record: load() reads them
// (one 16-byte word for BF16, two for F32; FP8 codes and scale; NVFP4 codes and the run's block
// scale), decode() gives the values kv::decode_element gives, element by element.
template <KvPageFormat F>
struct Run8;

template <>
struct Run8<KvPageFormat::kBf16> {
  uint4 w;
  __device__ __forceinline__ void load(const uint8_t* rec, const TokenLayout&, int D, int hk, int d0) {
    w = __ldg(reinterpret_cast<const uint4*>(rec + 2 * (static_cast<int64_t>(hk) * D + d0)));
  }
  __device__ __forceinline__ void decode(float* x) const {
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // little endian: the lower address is the low half
      x[2 * i] = bf16_bits_to_f32(static_cast<uint16_t>(u[i] & 0xFFFFu));
      x[2 * i + 1] = bf16_bits_to_f32(static_cast<uint16_t>(u[i] >> 16));
    }
  }
};

template <>
struct Run8<KvPageFormat::kF32> {
  float4 a, b;
  __device__ __forceinline__ void load(const uint8_t* rec, const TokenLayout&, int D, int hk, int d0) {
    const float4* p = reinterpret_cast<const float4*>(rec + 4 * (static_cast<int64_t>(hk) * D + d0));
    a = __ldg(p);
    b = __ldg(p + 1);
  }
  __device__ __forceinline__ void decode(float* x) const {
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  }
};

template <>
struct Run8<KvPageFormat::kFp8> {
  uint32_t c[2];  // 8 E4M3 codes (4-byte aligned: the record, the code offset 4 Hkv, hk D + d0)
  float s;        // the (slot, head) scale
  __device__ __forceinline__ void load(const uint8_t* rec, const TokenLayout& L, int D, int hk, int d0) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(rec + L.codes + static_cast<int64_t>(hk) * D + d0);
    c[0] = __ldg(p);
    c[1] = __ldg(p + 1);
    s = __ldg(reinterpret_cast<const float*>(rec + L.scales) + hk);
  }
  __device__ __forceinline__ void decode(float* x) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = formats::e4m3_decode((c[i / 4] >> (8 * (i % 4))) & 0xFFu) * s;
  }
};

template <>
struct Run8<KvPageFormat::kNvfp4> {
  uint8_t b[4];  // 8 packed E2M1 codes (byte loads: the code offset need not be 4-byte aligned)
  float sp;      // the 16-block's scale e4m3(inner) * outer
  __device__ __forceinline__ void load(const uint8_t* rec, const TokenLayout& L, int D, int hk, int d0) {
    const float so = __ldg(reinterpret_cast<const float*>(rec + L.scales) + hk * L.outer_per_head + d0 / 128);
    sp = formats::nvfp4_2level_block_scale(__ldg(rec + L.inner + static_cast<int64_t>(hk) * (D / 16) + d0 / 16), so);
    const uint8_t* codes = rec + L.codes + static_cast<int64_t>(hk) * (D / 2) + d0 / 2;
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = __ldg(codes + i);
  }
  __device__ __forceinline__ void decode(float* x) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = formats::nvfp4_2level_decode(formats::e2m1_unpack(b, i), sp);
  }
};

// The lane layout of a head dim D (flash_decoding_supports: D % 8 == 0, D <= 256).
struct Lanes {
  int lp;       // lanes per position: the power of two >= D / 8
  int groups;   // positions in flight per step: kThreads / lp
  int pg, sub;  // this thread's position group and lane in it
  bool has_run; // sub < D / 8
  __device__ __forceinline__ explicit Lanes(int D) {
    lp = 1;
    while (lp < D / 8) lp <<= 1;
    groups = kThreads / lp;
    pg = static_cast<int>(threadIdx.x) / lp;
    sub = static_cast<int>(threadIdx.x) % lp;
    has_run = sub * 8 < D;
  }
  // s summed over the lp lanes of this position (every lane of the warp calls)
  __device__ __forceinline__ float position_sum(float s) const {
    for (int o = lp / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    return s;
  }
};

__device__ __forceinline__ int64_t clamped_length(int32_t len, int64_t cap) {
  return len < 1 ? 1 : (len > cap ? cap : len);
}

// The record of position j of a row (block table `blocks`) in `pages`.
__device__ __forceinline__ const uint8_t* slot_record(const uint8_t* pages, const int32_t* blocks, int64_t j,
                                                      int page_size, const TokenLayout& L) {
  const int64_t slot = static_cast<int64_t>(blocks[j / page_size]) * page_size + j % page_size;
  return pages + slot * L.bytes;
}

// run[b] <- this lane's run of position base + b * groups + pg of `pages`, for the positions < j1
// (where the lane holds a run); the kBatch loads are all issued before any is used.
template <KvPageFormat F>
__device__ __forceinline__ void load_runs(Run8<F> (&run)[kBatch], const uint8_t* pages, const int32_t* blocks,
                                          int64_t base, int64_t j1, const Lanes& ln, int page_size,
                                          const TokenLayout& L, int D, int hk) {
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const int64_t j = base + static_cast<int64_t>(b) * ln.groups + ln.pg;
    if (ln.has_run && j < j1) run[b].load(slot_record(pages, blocks, j, page_size, L), L, D, hk, ln.sub * 8);
  }
}

// Kernel 1, block (chunk c, kv head hk, row n): scores[n, h, j] = scale q_h . k_j for the chunk's
// positions j and the G heads h of the group; then stats[n, h, c] = (m, sum_j exp(s_j - m)) with
// m the chunk's max score. scores: (rows, H, cap) f32; stats: (rows, H, C) f32x2; q: (rows,H,D).
template <KvPageFormat F, bool kBf16>
__global__ void __launch_bounds__(kThreads)
    chunk_scores_kernel(float* scores, float2* stats, const float* q, const uint8_t* k_pages,
                        const int32_t* block_table, int64_t max_blocks, const int32_t* context_len, int H, int G,
                        int D, int page_size, int64_t cap, int C, float scale, TokenLayout L) {
  const int c = static_cast<int>(blockIdx.x), hk = static_cast<int>(blockIdx.y);
  const int64_t n = blockIdx.z;
  const int64_t len = clamped_length(context_len[n], cap), j0 = static_cast<int64_t>(c) * kChunk;
  if (j0 >= len) return;  // the whole block: the row is shorter than this chunk
  const int64_t j1 = j0 + kChunk < len ? j0 + kChunk : len;
  const Lanes ln(D);
  const int d0 = ln.sub * 8;
  const int32_t* blocks = block_table + n * max_blocks;
  for (int64_t base = j0; base < j1; base += static_cast<int64_t>(ln.groups) * kBatch) {
    Run8<F> run[kBatch];
    load_runs(run, k_pages, blocks, base, j1, ln, page_size, L, D, hk);
    for (int g = 0; g < G; ++g) {
      const int64_t h = static_cast<int64_t>(hk) * G + g;
      float qv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (ln.has_run) {
        const float4* qp = reinterpret_cast<const float4*>(q + (n * H + h) * D + d0);
        const float4 a = __ldg(qp), b = __ldg(qp + 1);
        qv[0] = a.x, qv[1] = a.y, qv[2] = a.z, qv[3] = a.w, qv[4] = b.x, qv[5] = b.y, qv[6] = b.z, qv[7] = b.w;
        if (kBf16)
#pragma unroll
          for (int i = 0; i < 8; ++i) qv[i] = round_to_bf16(qv[i]);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t j = base + static_cast<int64_t>(b) * ln.groups + ln.pg;
        if (base + static_cast<int64_t>(b) * ln.groups >= j1) break;  // uniform over the block
        float s = 0;
        if (ln.has_run && j < j1) {
          float x[8];
          run[b].decode(x);
#pragma unroll
          for (int i = 0; i < 8; ++i) s += qv[i] * (kBf16 ? round_to_bf16(x[i]) : x[i]);
        }
        s = ln.position_sum(s);
        if (ln.sub == 0 && j < j1) scores[(n * H + h) * cap + j] = s * scale;
      }
    }
  }
  __syncthreads();  // the block's score stores are visible to the whole block (global memory too)
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  for (int g = warp; g < G; g += kWarps) {
    const float* sr = scores + (n * H + static_cast<int64_t>(hk) * G + g) * cap;
    float m = -INFINITY;
    for (int64_t j = j0 + lane; j < j1; j += 32) m = sr[j] > m ? sr[j] : m;
    m = warp_reduce(m, MaxOp{});
    float l = 0;
    for (int64_t j = j0 + lane; j < j1; j += 32) l += expf(sr[j] - m);
    l = warp_reduce(l, SumOp{});
    if (lane == 0) stats[(n * H + static_cast<int64_t>(hk) * G + g) * C + c] = make_float2(m, l);
  }
}

// Kernel 2, block (chunk c, kv head hk, row n): for kTile heads h of the group at a time, the
// row's lse from all its chunks' stats (M = max m, l = sum_c l_c exp(m_c - M), a fixed tree),
// P_j = exp(s_j - M) / l (kBf16: rounded to BF16) over the chunk, and partial[n, h, c, :] =
// sum_j P_j v_j over the chunk's positions. partial: (rows, H, C, D) f32.
template <KvPageFormat F, bool kBf16, int kTile>
__global__ void __launch_bounds__(kThreads)
    chunk_pv_kernel(float* partial, const float* scores, const float2* stats, const uint8_t* v_pages,
                    const int32_t* block_table, int64_t max_blocks, const int32_t* context_len, int H, int G, int D,
                    int page_size, int64_t cap, int C, TokenLayout L) {
  __shared__ float p_chunk[kTile][kChunk];           // P of the tile's heads over the chunk
  __shared__ float group_acc[kTile * kThreads * 8];  // (kTile, groups, D): groups * D <= 8 kThreads
  const int c = static_cast<int>(blockIdx.x), hk = static_cast<int>(blockIdx.y);
  const int64_t n = blockIdx.z;
  const int64_t len = clamped_length(context_len[n], cap), j0 = static_cast<int64_t>(c) * kChunk;
  if (j0 >= len) return;
  const int64_t j1 = j0 + kChunk < len ? j0 + kChunk : len;
  const int chunks = static_cast<int>((len + kChunk - 1) / kChunk);
  const Lanes ln(D);
  const int d0 = ln.sub * 8;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int32_t* blocks = block_table + n * max_blocks;
  for (int g0 = 0; g0 < G; g0 += kTile) {
    for (int t = warp; t < kTile && g0 + t < G; t += kWarps) {
      const int64_t nh = n * H + static_cast<int64_t>(hk) * G + g0 + t;
      const float2* st = stats + nh * C;
      float m = -INFINITY;
      for (int i = lane; i < chunks; i += 32) m = st[i].x > m ? st[i].x : m;
      m = warp_reduce(m, MaxOp{});
      float l = 0;
      for (int i = lane; i < chunks; i += 32) l += st[i].y * expf(st[i].x - m);
      l = warp_reduce(l, SumOp{});
      const float inv = 1.0f / l;
      const float* sr = scores + nh * cap;
      for (int64_t j = j0 + lane; j < j1; j += 32) {
        const float p = expf(sr[j] - m) * inv;
        p_chunk[t][j - j0] = kBf16 ? round_to_bf16(p) : p;
      }
    }
    __syncthreads();
    float acc[kTile][8];
#pragma unroll
    for (int t = 0; t < kTile; ++t)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[t][i] = 0.0f;
    for (int64_t base = j0; base < j1; base += static_cast<int64_t>(ln.groups) * kBatch) {
      Run8<F> run[kBatch];
      load_runs(run, v_pages, blocks, base, j1, ln, page_size, L, D, hk);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t j = base + static_cast<int64_t>(b) * ln.groups + ln.pg;
        if (!ln.has_run || j >= j1) continue;
        float x[8];
        run[b].decode(x);
#pragma unroll
        for (int t = 0; t < kTile; ++t) {
          if (g0 + t >= G) break;
          const float p = p_chunk[t][j - j0];
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[t][i] += p * (kBf16 ? round_to_bf16(x[i]) : x[i]);
        }
      }
    }
    if (ln.has_run)
#pragma unroll
      for (int t = 0; t < kTile; ++t)
#pragma unroll
        for (int i = 0; i < 8; ++i) group_acc[(t * ln.groups + ln.pg) * D + d0 + i] = acc[t][i];
    __syncthreads();
    for (int e = static_cast<int>(threadIdx.x); e < kTile * D; e += kThreads) {
      const int t = e / D, d = e % D;
      if (g0 + t >= G) break;  // e grows with t
      float s = 0;
      for (int p = 0; p < ln.groups; ++p) s += group_acc[(t * ln.groups + p) * D + d];
      partial[((n * H + static_cast<int64_t>(hk) * G + g0 + t) * C + c) * D + d] = s;
    }
    __syncthreads();  // p_chunk and group_acc are rewritten by the next tile
  }
}

// Kernel 3: out[n, h, d] = sum over the row's chunks c (in order) of partial[n, h, c, d].
__global__ void combine_chunks_kernel(float* out, const float* partial, const int32_t* context_len, int64_t rows,
                                      int H, int D, int64_t cap, int C) {
  const int64_t total = rows * H * D;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / (static_cast<int64_t>(H) * D), h = i / D % H, d = i % D;
    const int64_t chunks = (clamped_length(context_len[n], cap) + kChunk - 1) / kChunk;
    const float* pp = partial + (n * H + h) * C * D + d;
    float s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += pp[c * D];
    out[i] = s;
  }
}

int64_t chunks_of(int64_t max_context) { return (max_context + kChunk - 1) / kChunk; }

template <KvPageFormat F, bool kBf16, int kTile>
cudaError_t launch_rows(float* out, const float* q, const uint8_t* k_pages, const uint8_t* v_pages,
                        const int32_t* block_table, int64_t max_blocks, const int32_t* context_len, int64_t rows,
                        int64_t H, int64_t Hkv, int64_t D, int64_t page_size, float* scores, float2* stats,
                        float* partial, cudaStream_t stream) {
  const int64_t cap = max_blocks * page_size, C = chunks_of(cap);
  const TokenLayout L = backend::kv::token_layout(F, Hkv, D);
  const dim3 grid(static_cast<unsigned>(C), static_cast<unsigned>(Hkv), static_cast<unsigned>(rows));
  const int G = static_cast<int>(H / Hkv);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  chunk_scores_kernel<F, kBf16><<<grid, kThreads, 0, stream>>>(scores, stats, q, k_pages, block_table, max_blocks,
                                                               context_len, static_cast<int>(H), G, static_cast<int>(D),
                                                               static_cast<int>(page_size), cap, static_cast<int>(C),
                                                               scale, L);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  chunk_pv_kernel<F, kBf16, kTile><<<grid, kThreads, 0, stream>>>(
      partial, scores, stats, v_pages, block_table, max_blocks, context_len, static_cast<int>(H), G,
      static_cast<int>(D), static_cast<int>(page_size), cap, static_cast<int>(C), L);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const int64_t total = rows * H * D;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + kCombineThreads - 1) / kCombineThreads, 65535));
  combine_chunks_kernel<<<blocks, kCombineThreads, 0, stream>>>(out, partial, context_len, rows, static_cast<int>(H),
                                                                static_cast<int>(D), cap, static_cast<int>(C));
  return cudaGetLastError();
}

template <KvPageFormat F, bool kBf16>
auto pick_tile(int64_t G) {
  using Fn = decltype(&launch_rows<F, kBf16, 1>);
  if (G <= 1) return static_cast<Fn>(launch_rows<F, kBf16, 1>);
  if (G <= 2) return static_cast<Fn>(launch_rows<F, kBf16, 2>);
  if (G <= 4) return static_cast<Fn>(launch_rows<F, kBf16, 4>);
  return static_cast<Fn>(launch_rows<F, kBf16, kMaxTile>);
}

template <KvPageFormat F>
auto pick(bool bf16, int64_t G) {
  return bf16 ? pick_tile<F, true>(G) : pick_tile<F, false>(G);
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

bool flash_decoding_supports(backend::KvPageFormat format, const float* q, const void* k_pages, const void* v_pages,
                             int64_t H, int64_t Hkv, int64_t D) {
  // Run8's loads: 16-byte words of BF16 / F32 pages, 4-byte words (codes, FP32 scales) of the others
  const bool words = format == KvPageFormat::kBf16 || format == KvPageFormat::kF32;
  const uintptr_t page_alignment = words ? 16 : 4;
  return D > 0 && D % 8 == 0 && D <= 256 && (format != KvPageFormat::kNvfp4 || D % 16 == 0) && Hkv > 0 &&
         Hkv <= 65535 && H % Hkv == 0 && aligned(q, 16) && aligned(k_pages, page_alignment) &&
         aligned(v_pages, page_alignment);
}

size_t flash_decoding_workspace_bytes_per_row(int64_t H, int64_t max_context, int64_t D) {
  const int64_t C = chunks_of(max_context);
  // stats (H, C) f32x2, partial (H, C, D) f32, scores (H, max_context) f32
  return static_cast<size_t>(H) * static_cast<size_t>(2 * C + C * D + max_context) * sizeof(float);
}

cudaError_t flash_decoding(float* out, const float* q, const void* k_pages, const void* v_pages,
                           backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                           const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                           int64_t page_size, bool bf16, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  if (N <= 0 || H <= 0) return cudaSuccess;
  if (!flash_decoding_supports(format, q, k_pages, v_pages, H, Hkv, D) || page_size <= 0 || max_blocks <= 0)
    return cudaErrorInvalidValue;
  const int64_t cap = max_blocks * page_size, C = chunks_of(cap);
  const size_t per_row = flash_decoding_workspace_bytes_per_row(H, cap, D);
  const int64_t rows_per_pass = std::min<int64_t>({N, 65535, static_cast<int64_t>(workspace_bytes / per_row)});
  if (rows_per_pass < 1 || C > 0x7FFFFFFF) return cudaErrorInvalidValue;
  using Fn = decltype(&launch_rows<KvPageFormat::kBf16, false, 1>);
  Fn launch = nullptr;
  switch (format) {
    case KvPageFormat::kBf16: launch = pick<KvPageFormat::kBf16>(bf16, H / Hkv); break;
    case KvPageFormat::kF32: launch = pick<KvPageFormat::kF32>(bf16, H / Hkv); break;
    case KvPageFormat::kFp8: launch = pick<KvPageFormat::kFp8>(bf16, H / Hkv); break;
    case KvPageFormat::kNvfp4: launch = pick<KvPageFormat::kNvfp4>(bf16, H / Hkv); break;
  }
  if (launch == nullptr) return cudaErrorInvalidValue;
  // workspace of one pass: stats (rows, H, C) f32x2 | partial (rows, H, C, D) f32 | scores (rows, H, cap) f32
  auto* stats = static_cast<float2*>(workspace);
  auto* partial = reinterpret_cast<float*>(stats + rows_per_pass * H * C);
  float* scores = partial + rows_per_pass * H * C * D;
  for (int64_t r0 = 0; r0 < N; r0 += rows_per_pass) {
    const int64_t rows = std::min<int64_t>(rows_per_pass, N - r0);
    const cudaError_t e = launch(out + r0 * H * D, q + r0 * H * D, static_cast<const uint8_t*>(k_pages),
                                 static_cast<const uint8_t*>(v_pages), block_table + r0 * max_blocks, max_blocks,
                                 context_len + r0, rows, H, Hkv, D, page_size, scores, stats, partial, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace nibble::cuda
