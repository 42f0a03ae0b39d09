// Small-batch GEMM on packed two-level NVFP4 weights with BF16 tensor cores (issue #15 §4, the
// w4a16 decode linears at M > 8): y (M, N) f32 = x (M, K) f32 . W^T, W (N, K) held as E2M1 codes
// (N, K/2), E4M3 1x16 inner scales (N, K/16) and FP32 1x128 outer scales (N, ceil(K/128)), as
// fp4_gemv.cuh reads them. A block (8 warps) owns 128 weight rows and up to 64 rows of x; each
// weight tile is read from global memory once per block and decoded to e2m1 * e4m3(inner) in BF16
// shared memory (exact: <= 6 significant bits, exponents 2^-10 .. 2^12). x is split into three
// BF16 parts x = hi + mid + lo (exact for 2^-100 <= |x| < 2^127; the mid/lo MMAs run only for a
// stage where some element of the block's x tile is not a BF16 number, so a BF16 activation, the
// w4a16 case, costs one pass). mma.sync m16n8k16 (A = 16 weight rows, B = 8 rows of x) sums each
// 128-wide K chunk c in FP32: P_c = sum_{k in c} (e2m1 * e4m3)_k x_k, then total = fma(outer_c,
// P_c, total) chunk by chunk. Large grids come from splitting K into S chunk ranges (S from N, K
// and the SM count only); S > 1 writes S partial sums to a workspace and a second kernel adds
// them in the order s = 0..S-1. No atomics: the same bits every call, and the same bits for a row
// at any M > 8 (the per-element arithmetic does not depend on M or on the other rows' values).
// The GEMV's weights w = e2m1 * fl(e4m3 * outer) differ from these exact products by the
// rounding of fl(e4m3 * outer); the tolerance is derived in
// src/backend/ops_test/packed_weight_gemm_test.cpp. nvfp4_weight_gemm() picks the GEMV for M <= 8.
// Dependency-free (CUDA only): the sandbox dev/cuda/fp4_weight_gemm.cu and src/backend/cuda
// include it. docs/benchmarks.md has the predicted times.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fp4_gemv.cuh"
#include "ptx_mma.cuh"

namespace nibble_fp4_gemv {

constexpr int kMmaMinRows = kMaxRowsPerBlock + 1;  // M from which nvfp4_weight_gemm takes the MMA kernel
constexpr int kMmaThreads = 256;                   // 8 warps
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kMmaBlockN = 16 * kMmaWarps;         // 128 weight rows per block (two threads stage a row)
constexpr int kMmaStageK = 64;                     // k per shared-memory stage (two stages per 128-chunk)
constexpr int kMmaLds = kMmaStageK + 8;            // row stride 144 bytes: conflict-free ldmatrix
constexpr int kMmaBlocksPerSm = 1;                 // the split count aims at this many blocks per SM

// Three BF16 parts of x with hi + mid + lo == x exactly for finite |x| >= 2^-100 (hi = RN(x),
// each residual exact in FP32 and of at most 16, then 8 significant bits); non-finite x: hi only.
__device__ __forceinline__ void split_bf16(float x, float& hi, float& mid, float& lo) {
  hi = __bfloat162float(__float2bfloat16_rn(x));
  float r = __fsub_rn(x, hi);
  if (!isfinite(r)) r = 0.0f;
  mid = __bfloat162float(__float2bfloat16_rn(r));
  lo = __bfloat162float(__float2bfloat16_rn(__fsub_rn(r, mid)));
}
__device__ __forceinline__ uint32_t bf16_pair_bits(float lo_k, float hi_k) { return nibble::cuda::ptx::pack_bf16(lo_k, hi_k); }

// AT m16 weight tiles and BP pairs of n8 x tiles per warp; 8 / AT warps along N, AT along M:
// block tile 128 (N) x BM (M), BM = 16 * AT * BP. Grid (ceil(N/128), ceil(M/BM), S).
// part: S == 1 -> y (M, N); else the workspace (S, M, N). Requires K % 32 == 0, 16-byte aligned codes and x.
template <int AT, int BP>
__global__ void __launch_bounds__(kMmaThreads, 2)
    nvfp4_mma_kernel(float* __restrict__ part, const float* __restrict__ x, const uint8_t* __restrict__ codes,
                     const uint8_t* __restrict__ inner, const float* __restrict__ outer, int M, int N, int K,
                     int chunks_per_split) {
  using namespace nibble::cuda::ptx;
  constexpr int WN = kMmaWarps / AT;       // warps along N
  constexpr int BM = 16 * AT * BP;         // rows of x per block
  constexpr int kXLoads = BM * (kMmaStageK / 4) / kMmaThreads;  // float4 of x per thread per stage
  static_assert(kXLoads * kMmaThreads == BM * kMmaStageK / 4, "x stage must split evenly over the threads");
  __shared__ alignas(16) uint16_t sw[kMmaBlockN * kMmaLds];  // decoded weights (128 rows, 64 k) bf16
  __shared__ alignas(16) uint16_t sx[3][BM * kMmaLds];       // x parts hi, mid, lo (BM rows, 64 k) bf16

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n0 = blockIdx.x * kMmaBlockN, m0 = blockIdx.y * BM;
  const int rows_m = M - m0 < BM ? M - m0 : BM;
  const int outer_per_row = (K + 127) / 128;
  const int c_begin = blockIdx.z * chunks_per_split;
  const int c_end = c_begin + chunks_per_split < outer_per_row ? c_begin + chunks_per_split : outer_per_row;
  const int k_begin = c_begin * 128, k_end = c_end * 128 < K ? c_end * 128 : K;
  const int stages = (k_end - k_begin + kMmaStageK - 1) / kMmaStageK;

  // this thread's share of a weight stage: row wr, 32 codes from k offset 32 * wh
  const int wr = tid >> 1, wh = tid & 1;
  const int wn = n0 + wr;
  // warp tile
  const int warp_n = (warp % WN) * 16 * AT, warp_m = (warp / WN) * 16 * BP;
  const int g = lane >> 2, t = lane & 3;

  float acc[AT][2 * BP][4], total[AT][2 * BP][4];
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int j = 0; j < 2 * BP; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[a][j][e] = 0.0f, total[a][j][e] = 0.0f;

  // registers of the next stage (global loads in flight while the current stage multiplies)
  uint4 wq;
  uint32_t ws2;
  float4 xq[kXLoads];
  auto load_stage = [&](int k0) {
    const int kw = k0 + 32 * wh;
    if (wn < N && kw < K) {
      wq = *reinterpret_cast<const uint4*>(codes + static_cast<int64_t>(wn) * (K / 2) + kw / 2);
      const uint8_t* ir = inner + static_cast<int64_t>(wn) * (K / 16) + kw / 16;
      ws2 = static_cast<uint32_t>(ir[0]) | (static_cast<uint32_t>(ir[1]) << 8);
    } else {
      wq = make_uint4(0u, 0u, 0u, 0u), ws2 = 0u;  // codes 0, scales 0: weight 0
    }
#pragma unroll
    for (int j = 0; j < kXLoads; ++j) {
      const int i = tid + j * kMmaThreads, r = i / (kMmaStageK / 4), k = k0 + 4 * (i % (kMmaStageK / 4));
      xq[j] = (r < rows_m && k < K) ? *reinterpret_cast<const float4*>(x + static_cast<int64_t>(m0 + r) * K + k)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  // decode the registers into shared memory; returns whether some x element is not a BF16 number
  auto store_stage = [&]() -> bool {
    const float sp0 = e4m3_to_f32(ws2 & 0xFFu), sp1 = e4m3_to_f32(ws2 >> 8);
    const uint32_t words[4] = {wq.x, wq.y, wq.z, wq.w};
    uint4* dst = reinterpret_cast<uint4*>(sw + wr * kMmaLds + 32 * wh);
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // codes 8q .. 8q+7: word q
      uint32_t pair[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t c0 = (words[q] >> (8 * i)) & 0xFu, c1 = (words[q] >> (8 * i + 4)) & 0xFu;
        const float sp = q < 2 ? sp0 : sp1;  // codes 0..15: the first 16-block
        pair[i] = bf16_pair_bits(decode(c0, sp), decode(c1, sp));  // exact in BF16
      }
      dst[q] = make_uint4(pair[0], pair[1], pair[2], pair[3]);
    }
    bool not_bf16 = false;
#pragma unroll
    for (int j = 0; j < kXLoads; ++j) {
      const int i = tid + j * kMmaThreads, r = i / (kMmaStageK / 4), k = 4 * (i % (kMmaStageK / 4));
      const float v[4] = {xq[j].x, xq[j].y, xq[j].z, xq[j].w};
      float h[4], m[4], l[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        split_bf16(v[e], h[e], m[e], l[e]);
        not_bf16 = not_bf16 || m[e] != 0.0f;
      }
      *reinterpret_cast<uint2*>(sx[0] + r * kMmaLds + k) = make_uint2(bf16_pair_bits(h[0], h[1]), bf16_pair_bits(h[2], h[3]));
      *reinterpret_cast<uint2*>(sx[1] + r * kMmaLds + k) = make_uint2(bf16_pair_bits(m[0], m[1]), bf16_pair_bits(m[2], m[3]));
      *reinterpret_cast<uint2*>(sx[2] + r * kMmaLds + k) = make_uint2(bf16_pair_bits(l[0], l[1]), bf16_pair_bits(l[2], l[3]));
    }
    return not_bf16;
  };

  float so[AT][2];  // outer scales of this thread's accumulator rows for the current chunk
  if (stages > 0) load_stage(k_begin);
  for (int s = 0; s < stages; ++s) {
    const int k0 = k_begin + s * kMmaStageK;
    if (k0 % 128 == 0) {  // a chunk starts: its outer scales
      const int c = k0 / 128;
#pragma unroll
      for (int a = 0; a < AT; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = n0 + warp_n + 16 * a + g + 8 * h;
          so[a][h] = n < N ? outer[static_cast<int64_t>(n) * outer_per_row + c] : 0.0f;
        }
    }
    __syncthreads();  // the previous stage's fragments have been read
    const bool any_split = __syncthreads_or(store_stage()) != 0;
    if (s + 1 < stages) load_stage(k0 + kMmaStageK);
    const int parts = any_split ? 3 : 1;
#pragma unroll
    for (int ks = 0; ks < kMmaStageK / 16; ++ks) {
      uint32_t af[AT][4];
#pragma unroll
      for (int a = 0; a < AT; ++a)
        ldsm_x4(af[a], sw + (warp_n + 16 * a + (lane & 7) + 8 * ((lane >> 3) & 1)) * kMmaLds + 16 * ks + 8 * (lane >> 4));
      for (int p = 0; p < parts; ++p) {  // in order hi, mid, lo
#pragma unroll
        for (int b = 0; b < BP; ++b) {
          uint32_t bf[4];  // n8 tiles 2b (bf[0], bf[1]) and 2b + 1 (bf[2], bf[3])
          ldsm_x4(bf, sx[p] + (warp_m + 16 * b + (lane & 7) + 8 * (lane >> 4)) * kMmaLds + 16 * ks + 8 * ((lane >> 3) & 1));
#pragma unroll
          for (int a = 0; a < AT; ++a) {
            mma_bf16_16816(acc[a][2 * b], af[a], bf[0], bf[1]);
            mma_bf16_16816(acc[a][2 * b + 1], af[a], bf[2], bf[3]);
          }
        }
      }
    }
    const bool chunk_ends = (k0 + kMmaStageK) % 128 == 0 || s + 1 == stages;
    if (chunk_ends) {  // total = fma(outer_c, P_c, total), one rounding
#pragma unroll
      for (int a = 0; a < AT; ++a)
#pragma unroll
        for (int j = 0; j < 2 * BP; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            total[a][j][e] = __fmaf_rn(so[a][e >> 1], acc[a][j][e], total[a][j][e]);
            acc[a][j][e] = 0.0f;
          }
    }
  }
  // c fragment: e -> (weight row g + 8 (e >> 1), x row 2t + (e & 1))
  float* out = part + static_cast<int64_t>(blockIdx.z) * M * N;
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int j = 0; j < 2 * BP; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = n0 + warp_n + 16 * a + g + 8 * (e >> 1);
        const int m = warp_m + 8 * j + 2 * t + (e & 1);
        if (n < N && m < rows_m) out[static_cast<int64_t>(m0 + m) * N + n] = total[a][j][e];
      }
}

// y[i] = part[0][i] + part[1][i] + ... + part[S-1][i], added in that order.
__global__ void nvfp4_split_sum_kernel(float* __restrict__ y, const float* __restrict__ part, int64_t count, int S) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float v = part[i];
  for (int s = 1; s < S; ++s) v = __fadd_rn(v, part[static_cast<int64_t>(s) * count + i]);
  y[i] = v;
}

// The number of K splits (1 .. ceil(K/128)): enough blocks for kMmaBlocksPerSm per SM from the
// N blocks alone, so it does not depend on M (a row gets the same bits at every M > 8), then
// evened out so that no split is empty. split_override > 0 forces that many (the sandbox's sweep).
inline int nvfp4_mma_splits(int N, int K, int sm_count, int split_override = 0) {
  const int chunks = (K + 127) / 128;
  const int nb = (N + kMmaBlockN - 1) / kMmaBlockN;
  int s = split_override > 0 ? split_override : (kMmaBlocksPerSm * sm_count + nb - 1) / nb;
  s = s < 1 ? 1 : (s > chunks ? chunks : s);
  const int per = (chunks + s - 1) / s;
  return (chunks + per - 1) / per;
}

inline int current_sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 132;  // the split count only moves speed and summation order, never validity
  return sms;
}

// Workspace bytes nvfp4_mma needs for (M, N, K) on the current device (0: none): S partial (M, N).
inline size_t nvfp4_mma_workspace_bytes(int M, int N, int K, int split_override = 0) {
  if (M <= 0 || N <= 0 || K <= 0) return 0;
  const int S = nvfp4_mma_splits(N, K, current_sm_count(), split_override);
  return S > 1 ? static_cast<size_t>(S) * M * N * sizeof(float) : 0;
}
// The same for nvfp4_weight_gemm (the GEMV of M <= 8 needs none).
inline size_t nvfp4_weight_gemm_workspace_bytes(int M, int N, int K) {
  return M < kMmaMinRows ? 0 : nvfp4_mma_workspace_bytes(M, N, K);
}

// The tensor-core kernel alone (any M > 0; the dispatcher sends M > 8 here). workspace: at least
// nvfp4_mma_workspace_bytes(M, N, K, split_override) bytes (may be null when that is 0).
// cudaErrorInvalidValue for K % 32 != 0, misaligned codes or x, a short workspace, bad sizes.
inline cudaError_t nvfp4_mma(float* y, const float* x, const uint8_t* codes, const uint8_t* inner, const float* outer,
                             int M, int N, int K, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                             int split_override = 0) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (M < 0 || N < 0 || K <= 0 || K % 32 != 0 || (reinterpret_cast<uintptr_t>(codes) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(x) & 15u) != 0)
    return cudaErrorInvalidValue;
  const int chunks = (K + 127) / 128;
  const int S = nvfp4_mma_splits(N, K, current_sm_count(), split_override);
  const int per = (chunks + S - 1) / S;
  const size_t need = S > 1 ? static_cast<size_t>(S) * M * N * sizeof(float) : 0;
  if (need > 0 && (workspace == nullptr || workspace_bytes < need)) return cudaErrorInvalidValue;
  float* part = S > 1 ? static_cast<float*>(workspace) : y;
  const dim3 block(kMmaThreads);
  const int nb = (N + kMmaBlockN - 1) / kMmaBlockN;
  if (M <= 16) {
    nvfp4_mma_kernel<1, 1><<<dim3(nb, (M + 15) / 16, S), block, 0, stream>>>(part, x, codes, inner, outer, M, N, K, per);
  } else if (M <= 32) {
    nvfp4_mma_kernel<1, 2><<<dim3(nb, (M + 31) / 32, S), block, 0, stream>>>(part, x, codes, inner, outer, M, N, K, per);
  } else {
    nvfp4_mma_kernel<2, 2><<<dim3(nb, (M + 63) / 64, S), block, 0, stream>>>(part, x, codes, inner, outer, M, N, K, per);
  }
  if (S > 1) {
    const int64_t count = static_cast<int64_t>(M) * N;
    nvfp4_split_sum_kernel<<<static_cast<unsigned>((count + 255) / 256), 256, 0, stream>>>(y, part, count, S);
  }
  return cudaGetLastError();
}

// y (M, N) = x . W^T: the GEMV (fp4_gemv.cuh) for M <= 8, the tensor-core kernel above for M > 8.
inline cudaError_t nvfp4_weight_gemm(float* y, const float* x, const uint8_t* codes, const uint8_t* inner,
                                     const float* outer, int M, int N, int K, void* workspace, size_t workspace_bytes,
                                     cudaStream_t stream) {
  if (M < kMmaMinRows) return nvfp4_gemv(y, x, codes, inner, outer, M, N, K, stream);
  return nvfp4_mma(y, x, codes, inner, outer, M, N, K, workspace, workspace_bytes, stream);
}

}  // namespace nibble_fp4_gemv
