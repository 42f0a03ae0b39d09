// Grouped BF16-operand GEMM with FP32 accumulation (issue #13, MoE experts): one launch computes
// C_g = alpha_g · A_g · B_g^T for every group g of an offsets array in device memory (E+1 i64),
// on mma.sync m16n8k16 BF16 tensor cores. Dependency-free (CUDA runtime only): included verbatim
// by the sandbox dev/cuda/grouped_gemm_bf16.cu and by the backend (grouped_gemm.cu). Tiles of
// 128x128x32, 8 warps of 64x32, register-staged double buffering through shared memory. Each
// operand keeps its global layout in shared memory (16-byte chunks both ways); fragments come from
// ldmatrix, with .trans for operands stored transposed (k-major) in global memory.
// Grouping kRows: groups split the rows of A and C (forward, dX); kReduction: groups split the
// reduction dimension, each group owns its own C (dW); kBlocks: as kReduction, but group g's A and
// B are contiguous row-major blocks of K_g columns each (the FP4 recipes' per-expert along-token
// operands). See docs/cuda-kernels.md.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ptx_mma.cuh"

namespace nibble::cuda::grouped_gemm {

constexpr int kTileM = 128, kTileN = 128, kTileK = 32, kThreads = 256;
constexpr int kLds = kTileK + 8;   // plain tile (128 r, 32 k): row stride 80 bytes, conflict-free ldmatrix
constexpr int kLdsT = kTileM + 8;  // transposed tile (32 k, 128 r): row stride 272 bytes, conflict-free
constexpr int kTileElems = kTileM * kLds > kTileK * kLdsT ? kTileM * kLds : kTileK * kLdsT;

// Blocks per SM the register budget is cut for (2: 128 registers a thread).
#ifndef NIB_GG_MIN_BLOCKS
#define NIB_GG_MIN_BLOCKS 2
#endif

enum class Grouping : int { kRows, kReduction, kBlocks };

// Element (r, k) of an operand: transposed = stored (k, r) with leading dimension ld, else (r, k).
struct Operand {
  const uint16_t* p;  // group 0's first element
  int64_t ld;
  bool vec;  // 16-byte loads allowed (p 16-byte aligned, ld % 8 == 0, group strides % 8 == 0)
};

struct Problem {
  float* c;              // kRows: rows by offsets (ldc); kReduction: group g at c + g * c_stride
  int64_t ldc, c_stride;
  Operand a, b;
  int64_t b_stride;      // kRows: group g's B at b.p + g * b_stride
  int64_t a_rows, b_rows;  // kBlocks: rows of group g's A block (at a.p + a_rows * o_g) and B block
  const int64_t* offsets;  // (G+1) device, non-decreasing; clamped into [0, extent] on read
  int G;
  int64_t extent;        // kRows: rows of A and C; kReduction/kBlocks: the reduction extent
  int64_t M, N, K;       // kRows: N, K per group (M unused); kReduction/kBlocks: M, N per group (K unused)
  const float* alpha;    // (G) device or null (= 1)
  bool accumulate;       // C = fma(alpha, sum, C) instead of alpha · sum
};

// PTX wrappers (smem_addr, ldsm_x4[_trans], mma_bf16_16816): ptx_mma.cuh.
using namespace nibble::cuda::ptx;

__device__ __forceinline__ int64_t clamp_offset(const int64_t* offsets, int i, int64_t extent) {
  const int64_t v = offsets[i];
  return v < 0 ? 0 : (v > extent ? extent : v);
}

// A 128 x 32 (rows x k) tile of one operand: 512 chunks of 8 bf16, two per thread, staged in
// registers between the global load and the shared store.
template <bool kTransposed>
struct TileLoader {
  uint4 reg[2];
  // rows: valid rows of this group's operand; kdim: valid k; r0, k0: tile origin.
  __device__ __forceinline__ void load(const Operand& op, const uint16_t* base, int64_t rows, int64_t kdim,
                                       int64_t r0, int64_t k0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      int64_t r, k;  // the chunk's first element; the 8 run along k (plain) or along r (transposed)
      chunk_origin(c, r, k);
      r += r0, k += k0;
      uint16_t e[8];
      const bool full = kTransposed ? (k < kdim && r + 8 <= rows) : (r < rows && k + 8 <= kdim);
      if (op.vec && full) {
        const uint16_t* src = kTransposed ? base + k * op.ld + r : base + r * op.ld + k;
        reg[i] = *reinterpret_cast<const uint4*>(src);
        continue;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t rj = kTransposed ? r + j : r, kj = kTransposed ? k : k + j;
        e[j] = (rj < rows && kj < kdim) ? (kTransposed ? base[kj * op.ld + rj] : base[rj * op.ld + kj]) : 0;
      }
      reg[i].x = e[0] | (static_cast<uint32_t>(e[1]) << 16);
      reg[i].y = e[2] | (static_cast<uint32_t>(e[3]) << 16);
      reg[i].z = e[4] | (static_cast<uint32_t>(e[5]) << 16);
      reg[i].w = e[6] | (static_cast<uint32_t>(e[7]) << 16);
    }
  }
  // Plain: s (128 r, kLds) bf16, element (r, k) at s[r * kLds + k]. Transposed: s (32 k, kLdsT),
  // element (r, k) at s[k * kLdsT + r]. One 16-byte store per chunk either way.
  __device__ __forceinline__ void store(uint16_t* s) const {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      int64_t r, k;
      chunk_origin(c, r, k);
      uint16_t* dst = kTransposed ? s + k * kLdsT + r : s + r * kLds + k;
      *reinterpret_cast<uint4*>(dst) = reg[i];
    }
  }
  // Plain: chunk c = row c/4, k (c%4)*8 (the 8 run along k). Transposed: chunk c = k c/16, r
  // (c%16)*8 (the 8 run along r): a warp reads two 256-byte k rows.
  __device__ __forceinline__ static void chunk_origin(int c, int64_t& r, int64_t& k) {
    if (!kTransposed) {
      r = c / 4, k = (c % 4) * 8;
    } else {
      k = c / 16, r = (c % 16) * 8;
    }
  }
};

// grid: kRows (m-tile slots, n-tiles); kReduction (m-tiles, n-tiles, G). Block: kThreads.
template <bool kATransposed, bool kBTransposed, Grouping kGrouping>
__global__ void __launch_bounds__(kThreads, NIB_GG_MIN_BLOCKS) grouped_gemm_bf16_kernel(Problem p) {
  __shared__ __align__(16) uint16_t sA[2][kTileElems];
  __shared__ __align__(16) uint16_t sB[2][kTileElems];
  __shared__ int s_warp_sum[kThreads / 32];
  __shared__ int s_group, s_tile;

  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  int g = 0;
  int64_t m_tile = 0;
  if constexpr (kGrouping == Grouping::kRows) {
    // Tile scheduler: blockIdx.x is a linear m-tile index over the groups' ceil(M_g / 128) tiles;
    // a block scan of the per-group counts finds this block's group (slots past the end exit).
    const int t = static_cast<int>(blockIdx.x);
    if (tid == 0) s_group = -1;
    int carry = 0;
    for (int base = 0; base < p.G; base += kThreads) {
      const int j = base + tid;
      int cnt = 0;
      if (j < p.G) {
        const int64_t lo = clamp_offset(p.offsets, j, p.extent);
        int64_t hi = clamp_offset(p.offsets, j + 1, p.extent);
        hi = hi < lo ? lo : hi;
        cnt = static_cast<int>((hi - lo + kTileM - 1) / kTileM);
      }
      int incl = cnt;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
      }
      if (lane == 31) s_warp_sum[warp] = incl;
      __syncthreads();
      int before = 0, total = 0;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) {
        before += w < warp ? s_warp_sum[w] : 0;
        total += s_warp_sum[w];
      }
      const int excl = carry + before + incl - cnt;
      if (cnt > 0 && t >= excl && t < excl + cnt) s_group = j, s_tile = t - excl;
      carry += total;
      __syncthreads();  // s_warp_sum is rewritten by the next chunk
    }
    if (s_group < 0) return;  // uniform: written before the last barrier
    g = s_group;
    m_tile = s_tile;
  } else {
    g = static_cast<int>(blockIdx.z);
    m_tile = blockIdx.x;
  }
  const int64_t lo = clamp_offset(p.offsets, g, p.extent);
  int64_t hi = clamp_offset(p.offsets, g + 1, p.extent);
  hi = hi < lo ? lo : hi;

  // This group's operands and output (rows x cols output, kdim reduction).
  int64_t rows, cols = p.N, kdim;
  const uint16_t *a_base, *b_base;
  float* c_base;
  Operand oa = p.a, ob = p.b;  // kBlocks: this group's leading dimension K_g
  if constexpr (kGrouping == Grouping::kRows) {
    rows = hi - lo, kdim = p.K;
    a_base = p.a.p + lo * p.a.ld;  // plain A: row lo
    b_base = p.b.p + static_cast<int64_t>(g) * p.b_stride;
    c_base = p.c + lo * p.ldc;
  } else {
    rows = p.M, kdim = hi - lo;
    if (kdim == 0 && p.accumulate) return;  // C_g += alpha · 0: nothing to do
    if constexpr (kGrouping == Grouping::kReduction) {
      a_base = p.a.p + lo * p.a.ld;  // transposed A and B: reduction row lo
      b_base = p.b.p + lo * p.b.ld;
    } else {
      a_base = p.a.p + lo * p.a_rows;  // plain blocks (rows, K_g) starting at a_rows · o_g
      b_base = p.b.p + lo * p.b_rows;
      oa.ld = ob.ld = kdim;
      oa.vec = p.a.vec && kdim % 8 == 0 && (lo * p.a_rows) % 8 == 0;
      ob.vec = p.b.vec && kdim % 8 == 0 && (lo * p.b_rows) % 8 == 0;
    }
    c_base = p.c + static_cast<int64_t>(g) * p.c_stride;
  }
  const int64_t m0 = m_tile * kTileM, n0 = static_cast<int64_t>(blockIdx.y) * kTileN;
  if (m0 >= rows || n0 >= cols) return;

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

  TileLoader<kATransposed> la;
  TileLoader<kBTransposed> lb;
  const int64_t k_tiles = (kdim + kTileK - 1) / kTileK;
  const int wm = warp / 4, wn = warp % 4, gid = lane / 4, tig = lane % 4;
  if (k_tiles > 0) {
    la.load(oa, a_base, rows, kdim, m0, 0);
    lb.load(ob, b_base, cols, kdim, n0, 0);
    la.store(sA[0]);
    lb.store(sB[0]);
    __syncthreads();
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int buf = static_cast<int>(kt & 1);
    const bool next = kt + 1 < k_tiles;
    if (next) {  // global loads of the next tile in flight during this tile's MMAs
      la.load(oa, a_base, rows, kdim, m0, (kt + 1) * kTileK);
      lb.load(ob, b_base, cols, kdim, n0, (kt + 1) * kTileK);
    }
    const uint16_t* As = sA[buf];
    const uint16_t* Bs = sB[buf];
#pragma unroll
    for (int ks = 0; ks < kTileK / 16; ++ks) {
      const int k0 = ks * 16;
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {  // A (16 m x 16 k): matrices (m0-7,k0-7) (m8-15,k0-7) (m0-7,k8-15) (m8-15,k8-15)
        const int m0 = wm * 64 + mt * 16;
        if constexpr (!kATransposed)
          ldsm_x4(af[mt], As + (m0 + (lane & 15)) * kLds + k0 + (lane >> 4) * 8);
        else
          ldsm_x4_trans(af[mt], As + (k0 + (lane & 7) + ((lane >> 4) << 3)) * kLdsT + m0 + ((lane >> 3) & 1) * 8);
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {  // B (16 k x 16 n), two n-blocks: regs {0,1} n0-7, {2,3} n8-15
        const int n0 = wn * 32 + np * 16;
        uint32_t r4[4];
        if constexpr (!kBTransposed)
          ldsm_x4(r4, Bs + (n0 + (lane & 7) + ((lane >> 4) << 3)) * kLds + k0 + ((lane >> 3) & 1) * 8);
        else
          ldsm_x4_trans(r4, Bs + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kLdsT + n0 + (lane >> 4) * 8);
        bf[2 * np][0] = r4[0], bf[2 * np][1] = r4[1], bf[2 * np + 1][0] = r4[2], bf[2 * np + 1][1] = r4[3];
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma_bf16_16816(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
    }
    if (next) {
      la.store(sA[buf ^ 1]);
      lb.store(sB[buf ^ 1]);
    }
    __syncthreads();  // the next tile is stored; nobody reads this buffer any more
  }

  const float alpha = p.alpha != nullptr && kdim > 0 ? p.alpha[g] : 1.f;  // an empty group's alpha is not read
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t row = m0 + wm * 64 + mt * 16 + gid + (r / 2) * 8;
        const int64_t col = n0 + wn * 32 + nt * 8 + tig * 2 + r % 2;
        if (row < rows && col < cols) {
          float* dst = c_base + row * p.ldc + col;
          *dst = p.accumulate ? fmaf(alpha, acc[mt][nt][r], *dst) : alpha * acc[mt][nt][r];
        }
      }
}

// The three layouts of backend.h's grouped_matmul_bf16_* (shapes there). Returns the launch
// error (cudaSuccess when nothing was to be done).
enum class Layout { kNT, kNN, kTN };

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// kNT: y (rows by offsets, N) = a (rows, K) . b_g (N, K)^T, b_g = b + g * stride.
// kNN: y (rows by offsets, N) = a (rows, K) . b_g (K, N),   b_g = b + g * stride.
// kTN: y_g (M, N) = a_g (K_g, M)^T . b_g (K_g, N), K_g by offsets over `extent` reduction rows;
//      y_g = y + g * stride.
inline cudaError_t launch(Layout layout, float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                          int64_t G, int64_t extent, int64_t M, int64_t N, int64_t K, int64_t stride,
                          const float* alpha, bool accumulate, cudaStream_t stream) {
  if (G <= 0 || N <= 0 || (layout == Layout::kTN && M <= 0) || (layout != Layout::kTN && extent <= 0))
    return cudaSuccess;
  Problem p{};
  p.c = y, p.offsets = offsets, p.G = static_cast<int>(G), p.extent = extent;
  p.M = M, p.N = N, p.K = K, p.alpha = alpha, p.accumulate = accumulate;
  const dim3 block(kThreads);
  const int64_t n_tiles = (N + kTileN - 1) / kTileN;
  if (n_tiles > 65535 || G > 65535) return cudaErrorInvalidValue;
  switch (layout) {
    case Layout::kNT:
    case Layout::kNN: {
      const bool nn = layout == Layout::kNN;
      p.ldc = N;
      p.a = Operand{a, K, aligned16(a) && K % 8 == 0};
      p.b = Operand{b, nn ? N : K, aligned16(b) && (nn ? N : K) % 8 == 0 && stride % 8 == 0};
      p.b_stride = stride;
      // at most sum_g ceil(M_g / 128) <= extent / 128 + G tiles
      const int64_t slots = (extent + kTileM - 1) / kTileM + G;
      if (slots > INT32_MAX) return cudaErrorInvalidValue;
      const dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(n_tiles));
      if (nn)
        grouped_gemm_bf16_kernel<false, true, Grouping::kRows><<<grid, block, 0, stream>>>(p);
      else
        grouped_gemm_bf16_kernel<false, false, Grouping::kRows><<<grid, block, 0, stream>>>(p);
      break;
    }
    case Layout::kTN: {
      p.ldc = N, p.c_stride = stride;
      p.a = Operand{a, M, aligned16(a) && M % 8 == 0};
      p.b = Operand{b, N, aligned16(b) && N % 8 == 0};
      const int64_t m_tiles = (M + kTileM - 1) / kTileM;
      if (m_tiles > INT32_MAX) return cudaErrorInvalidValue;
      const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles), static_cast<unsigned>(G));
      grouped_gemm_bf16_kernel<true, true, Grouping::kReduction><<<grid, block, 0, stream>>>(p);
      break;
    }
  }
  return cudaGetLastError();
}

// kBlocks: y_g (M, N) = a_g[:M] (K_g) . b_g[:N] (K_g)^T, a_g = a + a_rows · o_g, b_g = b + b_rows · o_g
// (row-major, leading dimension K_g), y_g = y + g * y_stride.
inline cudaError_t launch_blocks(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets, int64_t G,
                                 int64_t extent, int64_t M, int64_t N, int64_t a_rows, int64_t b_rows,
                                 int64_t y_stride, const float* alpha, bool accumulate, cudaStream_t stream) {
  if (G <= 0 || N <= 0 || M <= 0) return cudaSuccess;
  Problem p{};
  p.c = y, p.ldc = N, p.c_stride = y_stride, p.offsets = offsets, p.G = static_cast<int>(G), p.extent = extent;
  p.M = M, p.N = N, p.alpha = alpha, p.accumulate = accumulate;
  p.a = Operand{a, 0, aligned16(a)}, p.b = Operand{b, 0, aligned16(b)};  // ld = K_g per group
  p.a_rows = a_rows, p.b_rows = b_rows;
  const int64_t m_tiles = (M + kTileM - 1) / kTileM, n_tiles = (N + kTileN - 1) / kTileN;
  if (m_tiles > INT32_MAX || n_tiles > 65535 || G > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles), static_cast<unsigned>(G));
  grouped_gemm_bf16_kernel<false, false, Grouping::kBlocks><<<grid, dim3(kThreads), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace nibble::cuda::grouped_gemm
