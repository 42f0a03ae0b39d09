// Decode GEMV / small-batch GEMM on packed two-level NVFP4 weights (issue #15 §4): y (M, N) f32 =
// x (M, K) f32 . W^T with W (N, K) held as E2M1 codes (N, K/2), E4M3 1x16 inner scales (N, K/16)
// and FP32 1x128 outer scales (N, ceil(K/128)), dequantized in registers as formats'
// nvfp4_2level_decode does (w = +-(e2m1 * fl(e4m3(inner) * outer)), the same FP32 values as
// Backend::dequantize) and multiplied with FP32 FMAs. One warp per output column n reads its
// weight row once for up to kMaxRowsPerBlock rows of x; lanes take 32-element chunks k = 32 (lane
// + 32 i), each summed in order, then a fixed xor-shuffle tree: deterministic, no atomics. The
// grouped kernel runs the same per-row arithmetic over the MoE experts of a layer, each row tile
// against its own expert's weight (fused MoE decode: no host offsets, empty experts read nothing).
// Dependency-free (CUDA only): dev/cuda/fp4_gemv.cu (the sandbox) and src/backend/cuda include it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace nibble_fp4_gemv {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxRowsPerBlock = 8;  // rows of x per block (a larger M takes more blocks in y)

__host__ __device__ __forceinline__ float bits_to_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// E4M3 byte -> binary32, the bit manipulation of formats::e4m3_decode_bits (exact; 0x7F/0xFF NaN).
__host__ __device__ __forceinline__ float e4m3_to_f32(uint32_t byte) {
  const uint32_t sign = (byte & 0x80u) << 24;
  const uint32_t e = (byte >> 3) & 0xFu, m = byte & 7u;
  if (e == 15u && m == 7u) return bits_to_f32(sign | 0x7FC00000u);
  const float mag = e == 0u ? static_cast<float>(m) * 0.001953125f : bits_to_f32(((e + 120u) << 23) | (m << 20));
  uint32_t mb;
  std::memcpy(&mb, &mag, sizeof mb);
  return bits_to_f32(mb | sign);
}

// Magnitude of E2M1 index 0..7: {0, 0.5, 1, 1.5, 2, 3, 4, 6}, from bits (formats::e2m1_magnitude).
__host__ __device__ __forceinline__ float e2m1_magnitude(uint32_t idx) {
  const uint32_t e = idx >> 1, m = idx & 1u;
  return bits_to_f32(idx < 2u ? (idx == 0u ? 0u : 0x3F000000u) : (((e + 126u) << 23) | (m << 22)));
}

// The dequantized weight of a 4-bit code with block scale sp: +-(magnitude * sp).
__host__ __device__ __forceinline__ float decode(uint32_t code, float sp) {
  const float v = e2m1_magnitude(code & 7u) * sp;
  return (code & 8u) ? -v : v;
}

// One warp's output column n for `rows` (<= MT) rows of x starting at x_rows (row stride K), into
// y_rows (row stride N): the weight row (crow, irow, orow) read once. The arithmetic of every
// kernel below (so the plain and the grouped GEMV give a row the same bits).
template <int MT>
__device__ __forceinline__ void gemv_column(float* __restrict__ y_rows, const float* __restrict__ x_rows,
                                            const uint8_t* __restrict__ crow, const uint8_t* __restrict__ irow,
                                            const float* __restrict__ orow, int rows, int n, int N, int K, int lane) {
  const int chunks = K / 32;
  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m] = 0.0f;
  for (int c = lane; c < chunks; c += 32) {
    const uint4 packed = *reinterpret_cast<const uint4*>(crow + 16 * c);  // 32 codes
    const uint32_t s2 = static_cast<uint32_t>(irow[2 * c]) | (static_cast<uint32_t>(irow[2 * c + 1]) << 8);
    const float so = orow[(32 * c) / 128];
    const float sp0 = e4m3_to_f32(s2 & 0xFFu) * so, sp1 = e4m3_to_f32(s2 >> 8) * so;
    float w[32];
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int i = 0; i < 32; ++i) w[i] = decode((words[i >> 3] >> ((i & 7) * 4)) & 0xFu, i < 16 ? sp0 : sp1);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < rows) {
        const float4* xr = reinterpret_cast<const float4*>(x_rows + static_cast<int64_t>(m) * K + 32 * c);
        float a = acc[m];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const float4 v = xr[q];
          a = __fmaf_rn(w[4 * q], v.x, a);
          a = __fmaf_rn(w[4 * q + 1], v.y, a);
          a = __fmaf_rn(w[4 * q + 2], v.z, a);
          a = __fmaf_rn(w[4 * q + 3], v.w, a);
        }
        acc[m] = a;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float v = acc[m];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    if (lane == 0 && m < rows) y_rows[static_cast<int64_t>(m) * N + n] = v;
  }
}

// Grid (ceil(N / kWarpsPerBlock), ceil(M / MT)), kWarpsPerBlock * 32 threads; MT <= kMaxRowsPerBlock.
// Requires K % 32 == 0 and 16-byte aligned codes rows (K % 32 == 0 with an aligned base).
template <int MT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    nvfp4_gemv_kernel(float* __restrict__ y, const float* __restrict__ x, const uint8_t* __restrict__ codes,
                      const uint8_t* __restrict__ inner, const float* __restrict__ outer, int M, int N, int K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = blockIdx.x * kWarpsPerBlock + warp;
  if (n >= N) return;  // whole warps leave; no block-wide barrier below
  const int m0 = blockIdx.y * MT;
  const int rows = M - m0 < MT ? M - m0 : MT;
  const int outer_per_row = (K + 127) / 128;
  gemv_column<MT>(y + static_cast<int64_t>(m0) * N, x + static_cast<int64_t>(m0) * K,
                  codes + static_cast<int64_t>(n) * (K / 2), inner + static_cast<int64_t>(n) * (K / 16),
                  outer + static_cast<int64_t>(n) * outer_per_row, rows, n, N, K, lane);
}

// M = 1 (batch-1 decode): one warp takes kColsPerWarp output columns, and a lane's x chunk (32
// floats) is read once for all of them; the plain kernel reads the x row once per column, 8 bytes
// of FP32 x per 0.5 byte of weight on chip, which held it to 0.3-0.5 TB/s (docs/benchmarks.md).
// A column's operations are the plain kernel's in the same order (lane chunks in order, FMAs in
// element order, the same xor tree): the same bits. Grid ceil(N / (kWarpsPerBlock kColsPerWarp)).
constexpr int kColsPerWarp = 4;
// Below this N the row kernel has too few blocks to keep the H200's 132 SMs busy (2048 columns:
// 128 blocks) and the per-column kernel is as fast or faster (H200, dev/cuda/fp4_gemv.cu at
// 6404e61: N 2048 K 2048 7.8 vs 7.5 us, N 2048 K 8192 22.9 vs 20.9; N 6144 13.7 vs 21.7, N 16384
// 29.5 vs 38.1). Both give the same bits.
constexpr int kRowKernelMinN = 4096;
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    nvfp4_gemv_row_kernel(float* __restrict__ y, const float* __restrict__ x, const uint8_t* __restrict__ codes,
                          const uint8_t* __restrict__ inner, const float* __restrict__ outer, int N, int K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = (blockIdx.x * kWarpsPerBlock + warp) * kColsPerWarp;
  if (n0 >= N) return;
  const int ncols = N - n0 < kColsPerWarp ? N - n0 : kColsPerWarp;
  const int chunks = K / 32, outer_per_row = (K + 127) / 128;
  float acc[kColsPerWarp];
#pragma unroll
  for (int j = 0; j < kColsPerWarp; ++j) acc[j] = 0.0f;
  for (int c = lane; c < chunks; c += 32) {
    // every column's loads first (independent of the sums), then x, then the FMAs
    uint4 packed[kColsPerWarp];
    uint32_t s2[kColsPerWarp];
    float so[kColsPerWarp];
#pragma unroll
    for (int j = 0; j < kColsPerWarp; ++j) {
      const int64_t n = n0 + (j < ncols ? j : 0);  // a missing column re-reads column n0, unused
      packed[j] = *reinterpret_cast<const uint4*>(codes + n * (K / 2) + 16 * c);
      const uint8_t* irow = inner + n * (K / 16);
      s2[j] = static_cast<uint32_t>(irow[2 * c]) | (static_cast<uint32_t>(irow[2 * c + 1]) << 8);
      so[j] = outer[n * outer_per_row + (32 * c) / 128];
    }
    float xv[32];
    const float4* xr = reinterpret_cast<const float4*>(x + 32 * c);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float4 v = xr[q];
      xv[4 * q] = v.x, xv[4 * q + 1] = v.y, xv[4 * q + 2] = v.z, xv[4 * q + 3] = v.w;
    }
#pragma unroll
    for (int j = 0; j < kColsPerWarp; ++j) {
      const float sp0 = e4m3_to_f32(s2[j] & 0xFFu) * so[j], sp1 = e4m3_to_f32(s2[j] >> 8) * so[j];
      const uint32_t words[4] = {packed[j].x, packed[j].y, packed[j].z, packed[j].w};
      float a = acc[j];
#pragma unroll
      for (int i = 0; i < 32; ++i)
        a = __fmaf_rn(decode((words[i >> 3] >> ((i & 7) * 4)) & 0xFu, i < 16 ? sp0 : sp1), xv[i], a);
      acc[j] = a;
    }
  }
#pragma unroll
  for (int j = 0; j < kColsPerWarp; ++j) {
    float v = acc[j];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    if (lane == 0 && j < ncols) y[n0 + j] = v;
  }
}

// Grouped (MoE experts): grid (ceil(N / kWarpsPerBlock), tiles), tiles >= sum_g ceil(M_g /
// kMaxRowsPerBlock) (ceil(rows / 8) + G always is). Block y takes the y-th row tile in expert
// order: the block's threads count each expert's tiles from `offsets` (G+1, device memory) and scan
// them in chunks of the block's 128 threads; a block past the last tile leaves. Expert g's weight
// parts start g * (N K / 2), g * (N K / 16), g * N ceil(K/128) elements after expert 0's.
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    nvfp4_grouped_gemv_kernel(float* __restrict__ y, const float* __restrict__ x, const uint8_t* __restrict__ codes,
                              const uint8_t* __restrict__ inner, const float* __restrict__ outer,
                              const int64_t* __restrict__ offsets, int G, int N, int K) {
  constexpr int MT = kMaxRowsPerBlock, kThreads = kWarpsPerBlock * 32;
  __shared__ int warp_sums[kWarpsPerBlock];
  __shared__ int found_g, found_m0, found_rows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = blockIdx.y;
  if (tid == 0) found_g = -1;
  int before = 0;  // tiles of the experts before this chunk
  for (int base = 0; base < G; base += kThreads) {
    const int g = base + tid;
    int64_t r0 = 0, cnt = 0;
    if (g < G) r0 = offsets[g], cnt = offsets[g + 1] - r0;
    const int t = static_cast<int>((cnt + MT - 1) / MT);
    int incl = t;  // inclusive scan over the block: warps, then the warp totals
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xFFFFFFFFu, incl, off);
      if (lane >= off) incl += v;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int prior = before;
    for (int w = 0; w < warp; ++w) prior += warp_sums[w];
    const int first = prior + incl - t;  // this expert's first tile
    if (t > 0 && tile >= first && tile < first + t) {
      const int64_t m0 = r0 + static_cast<int64_t>(tile - first) * MT;
      found_g = g, found_m0 = static_cast<int>(m0);
      found_rows = static_cast<int>(cnt - (m0 - r0) < MT ? cnt - (m0 - r0) : MT);
    }
    int total = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) total += warp_sums[w];
    before += total;
    __syncthreads();  // warp_sums reused; found_* visible
  }
  const int g = found_g;
  if (g < 0) return;  // past the last tile (the whole block)
  const int n = blockIdx.x * kWarpsPerBlock + warp;
  if (n >= N) return;
  const int outer_per_row = (K + 127) / 128;
  const int64_t ge = g;
  const uint8_t* crow = codes + ge * N * (K / 2) + static_cast<int64_t>(n) * (K / 2);
  const uint8_t* irow = inner + ge * N * (K / 16) + static_cast<int64_t>(n) * (K / 16);
  const float* orow = outer + ge * N * outer_per_row + static_cast<int64_t>(n) * outer_per_row;
  gemv_column<MT>(y + static_cast<int64_t>(found_m0) * N, x + static_cast<int64_t>(found_m0) * K, crow, irow, orow,
                  found_rows, n, N, K, lane);
}

// Launches the kernel on `stream`. cudaErrorInvalidValue for K % 32 != 0, misaligned codes or x,
// or non-positive sizes with M > 0.
inline cudaError_t nvfp4_gemv(float* y, const float* x, const uint8_t* codes, const uint8_t* inner, const float* outer,
                              int M, int N, int K, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (M < 0 || N < 0 || K <= 0 || K % 32 != 0 || (reinterpret_cast<uintptr_t>(codes) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(x) & 15u) != 0)
    return cudaErrorInvalidValue;
  if (M == 1 && N >= kRowKernelMinN) {
    const int per_block = kWarpsPerBlock * kColsPerWarp;
    nvfp4_gemv_row_kernel<<<(N + per_block - 1) / per_block, kWarpsPerBlock * 32, 0, stream>>>(y, x, codes, inner,
                                                                                              outer, N, K);
    return cudaGetLastError();
  }
  const int mt = M >= kMaxRowsPerBlock ? kMaxRowsPerBlock : M;
  const dim3 grid((N + kWarpsPerBlock - 1) / kWarpsPerBlock, (M + mt - 1) / mt);
  const dim3 block(kWarpsPerBlock * 32);
  switch (mt) {
    case 1: nvfp4_gemv_kernel<1><<<grid, block, 0, stream>>>(y, x, codes, inner, outer, M, N, K); break;
    case 2: nvfp4_gemv_kernel<2><<<grid, block, 0, stream>>>(y, x, codes, inner, outer, M, N, K); break;
    case 3:
    case 4: nvfp4_gemv_kernel<4><<<grid, block, 0, stream>>>(y, x, codes, inner, outer, M, N, K); break;
    default: nvfp4_gemv_kernel<8><<<grid, block, 0, stream>>>(y, x, codes, inner, outer, M, N, K); break;
  }
  return cudaGetLastError();
}

// The grouped GEMV on `stream` (see nvfp4_grouped_gemv_kernel): rows = the rows of x and y.
inline cudaError_t nvfp4_grouped_gemv(float* y, const float* x, const uint8_t* codes, const uint8_t* inner,
                                      const float* outer, const int64_t* offsets, int G, int rows, int N, int K,
                                      cudaStream_t stream) {
  if (G == 0 || rows == 0 || N == 0) return cudaSuccess;
  if (G < 0 || rows < 0 || N < 0 || K <= 0 || K % 32 != 0 || (reinterpret_cast<uintptr_t>(codes) & 15u) != 0 ||
      (reinterpret_cast<uintptr_t>(x) & 15u) != 0 || offsets == nullptr)
    return cudaErrorInvalidValue;
  const int64_t tiles = (static_cast<int64_t>(rows) + kMaxRowsPerBlock - 1) / kMaxRowsPerBlock + G;
  if (tiles > 65535) return cudaErrorInvalidValue;  // grid y limit
  const dim3 grid((N + kWarpsPerBlock - 1) / kWarpsPerBlock, static_cast<unsigned>(tiles));
  nvfp4_grouped_gemv_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(y, x, codes, inner, outer, offsets, G, N, K);
  return cudaGetLastError();
}

}  // namespace nibble_fp4_gemv
