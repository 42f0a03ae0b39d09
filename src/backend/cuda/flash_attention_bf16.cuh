// BF16 tensor-core flash attention kernels (issue #13), dependency-free (CUDA headers only) so that
// the backend (attention_bf16.cu) and its sandbox (dev/cuda/flash_attention_bf16.cu) compile the
// very same code: causal GQA, scale 1/sqrt(D), FlashAttention-2 structure on mma.m16n8k16 (bf16 in,
// f32 accumulate), ldmatrix, cp.async double buffering; forward + deterministic backward (dK/dV
// kernel per KV tile, dQ kernel per query tile, delta pre-pass, no atomics). The includer defines
// NIB_FA_CHECK(expr) (how a failed CUDA call is reported) and includes this from ONE translation
// unit of a program (its kernels have internal linkage). Entry points: fa::workspace_bytes,
// fa::run_forward, fa::run_backward; all pointers are device memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "ptx_mma.cuh"

#ifndef NIB_FA_CHECK
#error "define NIB_FA_CHECK(expr) before including flash_attention_bf16.cuh"
#endif

namespace nibble::cuda::fa {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kTileN = 64;  // keys per K/V tile (forward, dq); keys per block (dk/dv)
constexpr int kTileQ = 64;  // queries per Q/dO tile (dk/dv); queries per block (dq)

// PTX wrappers (smem_addr, ldsm_x4[_trans], mma_bf16_16816, cp_async*, pack_bf16): ptx_mma.cuh.
using namespace nibble::cuda::ptx;

// Shared tiles are (rows, Dp) bf16 with a row stride of Dp + 8 elements: 8 consecutive rows read by
// one ldmatrix then start in 8 different 16-byte bank groups (no conflicts), rows stay 16-byte
// aligned for cp.async.
template <int Dp>
__host__ __device__ constexpr int ld_smem() {
  return Dp + 8;
}

// dst (kRows, Dp) <- rows row0 .. row0+kRows-1 of src (Tn rows of Dp bf16), rows >= Tn zero-filled.
// Issued by all kThreads threads of the block; the caller commits the group.
template <int kRows, int Dp, int kThreads>
__device__ __forceinline__ void load_tile_async(__nv_bfloat16* dst, const __nv_bfloat16* src, int row0, int Tn) {
  constexpr int kChunksPerRow = Dp / 8;
  for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, cc = c % kChunksPerRow;
    const int row = row0 + r;
    const bool ok = row < Tn;
    cp_async16(dst + r * ld_smem<Dp>() + cc * 8, src + static_cast<int64_t>(ok ? row : 0) * Dp + cc * 8, ok ? 16 : 0);
  }
}

// Address of this lane's ldmatrix row for an A operand (16 rows x 16 k, row-major in shared):
// matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
template <int Dp>
__device__ __forceinline__ const __nv_bfloat16* a_addr(const __nv_bfloat16* tile, int row0, int k0, int lane) {
  return tile + (row0 + (lane & 15)) * ld_smem<Dp>() + k0 + (lane >> 4) * 8;
}
// B operand of x @ tile^T (tile rows = n, columns = k), two n-blocks of 8: matrices (n 0-7, k 0-7),
// (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) -> regs {0,1} = n-block 0, {2,3} = n-block 1.
template <int Dp>
__device__ __forceinline__ const __nv_bfloat16* bt_addr(const __nv_bfloat16* tile, int n0, int k0, int lane) {
  return tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld_smem<Dp>() + k0 + ((lane >> 3) & 1) * 8;
}
// B operand of x @ tile (tile rows = k, columns = n) with .trans, two n-blocks of 8: matrices
// (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) -> regs {0,1}, {2,3}.
template <int Dp>
__device__ __forceinline__ const __nv_bfloat16* b_addr_trans(const __nv_bfloat16* tile, int k0, int n0, int lane) {
  return tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld_smem<Dp>() + n0 + (lane >> 4) * 8;
}

// row[c], row[c + 1] <- x, y for the columns below D (row: f32, D columns; c even). One 8-byte
// store when D is even (then c + 1 < D whenever c < D and the address is 8-byte aligned).
__device__ __forceinline__ void store_pair(float* row, int c, int D, float x, float y) {
  if ((D & 1) == 0) {
    if (c < D) *reinterpret_cast<float2*>(row + c) = make_float2(x, y);
  } else {
    if (c < D) row[c] = x;
    if (c + 1 < D) row[c + 1] = y;
  }
}

// ---- pre-passes -----------------------------------------------------------------------------------
// dst: (B,Hx,T,Dp) bf16 <- src: (B,T,Hx,D) f32 rounded to nearest even, columns D..Dp-1 zero
// (Dp = D rounded up to a kernel head dim, a multiple of 8); one thread per 8 columns of dst.
__global__ void to_bf16_heads_kernel(__nv_bfloat16* dst, const float* src, int64_t B, int64_t Tn, int64_t Hx, int D,
                                     int Dp) {
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= B * Tn * Hx * (Dp / 8)) return;
  const int d0 = static_cast<int>(chunk % (Dp / 8)) * 8;
  const int64_t row = chunk / (Dp / 8);  // b*T*Hx + t*Hx + h: a row of src
  const int64_t h = row % Hx, t = (row / Hx) % Tn, b = row / (Hx * Tn);
  const float* x = src + row * D;
  float f[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = d0 + i < D ? x[d0 + i] : 0.f;
  const uint4 o =
      make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
  *reinterpret_cast<uint4*>(dst + ((b * Hx + h) * Tn + t) * Dp + d0) = o;
}

// delta: (B,H,T) = rowsum(bf16(dout) * bf16(out)) in f32, d ascending; dout_bf: (B,H,T,Dp) bf16 of
// dout: (B,T,H,D), zero-padded; out: (B,T,H,D). One thread per row (b, t, h).
__global__ void delta_kernel(float* delta, __nv_bfloat16* dout_bf, const float* dout, const float* out, int64_t B,
                             int64_t Tn, int64_t H, int D, int Dp) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // b*T*H + t*H + h
  if (row >= B * Tn * H) return;
  const int64_t h = row % H, t = (row / H) % Tn, b = row / (H * Tn);
  const float* dr = dout + row * D;
  const float* orow = out + row * D;
  __nv_bfloat16* dst = dout_bf + ((b * H + h) * Tn + t) * Dp;
  float acc = 0.f;
  for (int d0 = 0; d0 < Dp; d0 += 8) {
    uint32_t packed[4];
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int d = d0 + i;
      const __nv_bfloat162 ab = __floats2bfloat162_rn(d < D ? dr[d] : 0.f, d + 1 < D ? dr[d + 1] : 0.f);
      const float o0 = d < D ? __bfloat162float(__float2bfloat16_rn(orow[d])) : 0.f;
      const float o1 = d + 1 < D ? __bfloat162float(__float2bfloat16_rn(orow[d + 1])) : 0.f;
      packed[i / 2] = *reinterpret_cast<const uint32_t*>(&ab);
      acc = __fmaf_rn(__low2float(ab), o0, acc);
      acc = __fmaf_rn(__high2float(ab), o1, acc);
    }
    *reinterpret_cast<uint4*>(dst + d0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  delta[(b * H + h) * Tn + t] = acc;
}

// ---- forward ----------------------------------------------------------------------------------------
// Grid (ceil(T / kBlockM), H, B), kWarps warps, each owning kMT m-tiles of 16 query rows; kBlockM =
// kWarps * kMT * 16. out: (B,T,H,D) f32, lse: (B,H,T) f32 natural log of the scaled scores' sum;
// q: (B,H,T,Dp) bf16; k, v: (B,Hkv,T,Dp) bf16. Shared: Q (kBlockM, Dp), K and V double-buffered
// (kTileN, Dp). Query tiles are visited last-first (the longest causal rows start first).
template <int Dp, int kWarps, int kMT>
__global__ void __launch_bounds__(kWarps * 32)
    fwd_kernel(float* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
               int Tn, int H, int Hkv, int D, float scale_log2) {
  constexpr int kThreads = kWarps * 32, kBlockM = kWarps * kMT * 16, LD = ld_smem<Dp>();
  constexpr int kDT = Dp / 8, kNT = kTileN / 8;  // 8-wide column blocks of O and of S
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (kBlockM, LD)
  __nv_bfloat16* kv_s = q_s + kBlockM * LD;                          // [buf][K|V] (kTileN, LD)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;
  const __nv_bfloat16* qb = q + (static_cast<int64_t>(b) * H + h) * Tn * Dp;
  const __nv_bfloat16* kb = k + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const __nv_bfloat16* vb = v + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const int kv_end = min(Tn, q0 + kBlockM);
  const int n_tiles = (kv_end + kTileN - 1) / kTileN;

  load_tile_async<kBlockM, Dp, kThreads>(q_s, qb, q0, Tn);
  cp_async_commit();
  load_tile_async<kTileN, Dp, kThreads>(kv_s, kb, 0, Tn);
  load_tile_async<kTileN, Dp, kThreads>(kv_s + kTileN * LD, vb, 0, Tn);
  cp_async_commit();
  cp_async_wait<1>();  // Q landed
  __syncthreads();
  uint32_t qf[kMT][Dp / 16][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk) ldsm_x4(qf[mt][kk], a_addr<Dp>(q_s, (warp * kMT + mt) * 16, kk * 16, lane));

  float o[kMT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
  float m_run[kMT][2], l_run[kMT][2];  // per row (g, g+8): running max (log2 units), partial sum
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) m_run[mt][r] = -INFINITY, l_run[mt][r] = 0.f;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      __nv_bfloat16* nxt = kv_s + ((j + 1) & 1) * 2 * kTileN * LD;
      load_tile_async<kTileN, Dp, kThreads>(nxt, kb, (j + 1) * kTileN, Tn);
      load_tile_async<kTileN, Dp, kThreads>(nxt + kTileN * LD, vb, (j + 1) * kTileN, Tn);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* k_s = kv_s + (j & 1) * 2 * kTileN * LD;
    const __nv_bfloat16* v_s = k_s + kTileN * LD;
    const int k0 = j * kTileN;
    const bool need_mask = (k0 + kTileN - 1 > q0) || (k0 + kTileN > Tn);

    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk)
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bf[4];
        ldsm_x4(bf, bt_addr<Dp>(k_s, np * 16, kk * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_bf16_16816(s[mt][2 * np], qf[mt][kk], bf[0], bf[1]);
          mma_bf16_16816(s[mt][2 * np + 1], qf[mt][kk], bf[2], bf[3]);
        }
      }

    uint32_t pf[kMT][kTileN / 16][4];  // P as bf16 A fragments
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int row_base = q0 + (warp * kMT + mt) * 16 + g;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_base + 8 * r;
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float x = s[mt][nt][2 * r + c] * scale_log2;
            if (need_mask) {
              const int key = k0 + nt * 8 + 2 * t4 + c;
              if (key > row || key >= Tn) x = -INFINITY;
            }
            s[mt][nt][2 * r + c] = x;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mt][r], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2f(m_run[mt][r] - m_use);
        m_run[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float p = exp2f(s[mt][nt][2 * r + c] - m_use);
            s[mt][nt][2 * r + c] = p;
            sum += p;
          }
        l_run[mt][r] = l_run[mt][r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) o[mt][dt][2 * r] *= alpha, o[mt][dt][2 * r + 1] *= alpha;
      }
#pragma unroll
      for (int kk = 0; kk < kTileN / 16; ++kk) {
        pf[mt][kk][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pf[mt][kk][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pf[mt][kk][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pf[mt][kk][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kTileN / 16; ++kk)
#pragma unroll
      for (int dp = 0; dp < Dp / 16; ++dp) {
        uint32_t bf[4];
        ldsm_x4_trans(bf, b_addr_trans<Dp>(v_s, kk * 16, dp * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_bf16_16816(o[mt][2 * dp], pf[mt][kk], bf[0], bf[1]);
          mma_bf16_16816(o[mt][2 * dp + 1], pf[mt][kk], bf[2], bf[3]);
        }
      }
    __syncthreads();  // this buffer is refilled by the prefetch of tile j + 2
  }

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = q0 + (warp * kMT + mt) * 16 + g + 8 * r;
      if (row < Tn) {
        const float inv = 1.f / l;
        float* orow = out + ((static_cast<int64_t>(b) * Tn + row) * H + h) * D;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
          store_pair(orow, dt * 8 + 2 * t4, D, o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
        if (t4 == 0) lse[(static_cast<int64_t>(b) * H + h) * Tn + row] = (m_run[mt][r] + log2f(l)) * kLn2;
      }
    }
}

// ---- backward: dK, dV -------------------------------------------------------------------------------
// Grid (ceil(T / kTileN), Hkv, B), 4 warps, each owning 16 keys of the block's kTileN. Loops over
// the H/Hkv query heads of the group and, per head, the query tiles from the diagonal on (fixed
// order, one writer per dK/dV row: deterministic). dk, dv: (B,T,Hkv,D) f32; q, dout: (B,H,T,Dp)
// bf16; k, v: (B,Hkv,T,Dp) bf16; lse, delta: (B,H,T) f32. Shared: K, V (kTileN, Dp), Q and dO
// double-buffered (kTileQ, Dp).
template <int Dp>
__global__ void __launch_bounds__(128)
    bwd_dkdv_kernel(float* dk, float* dv, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                    const __nv_bfloat16* dout, const float* lse, const float* delta, int Tn, int H, int Hkv,
                    int D, float scale, float scale_log2) {
  constexpr int kThreads = 128, LD = ld_smem<Dp>(), kDT = Dp / 8, kNT = kTileQ / 8;
  static_assert(kTileN == 4 * 16, "one 16-key m-tile per warp");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* k_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (kTileN, LD)
  __nv_bfloat16* v_s = k_s + kTileN * LD;                            // (kTileN, LD)
  __nv_bfloat16* qd_s = v_s + kTileN * LD;                           // [buf][Q|dO] (kTileQ, LD)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int b = blockIdx.z, hk = blockIdx.y, group = H / Hkv;
  const int k0 = (gridDim.x - 1 - blockIdx.x) * kTileN;
  const __nv_bfloat16* kb = k + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const __nv_bfloat16* vb = v + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const int qt_first = k0 / kTileQ;  // earliest query tile holding a query >= k0
  const int n_qt = (Tn + kTileQ - 1) / kTileQ - qt_first;
  const int n_iter = group * n_qt;  // (head, query tile) pairs, head-major

  auto issue = [&](int it) {
    const int h = hk * group + it / n_qt, qt0 = (qt_first + it % n_qt) * kTileQ;
    const int64_t off = (static_cast<int64_t>(b) * H + h) * Tn * Dp;
    __nv_bfloat16* dst = qd_s + (it & 1) * 2 * kTileQ * LD;
    load_tile_async<kTileQ, Dp, kThreads>(dst, q + off, qt0, Tn);
    load_tile_async<kTileQ, Dp, kThreads>(dst + kTileQ * LD, dout + off, qt0, Tn);
  };
  load_tile_async<kTileN, Dp, kThreads>(k_s, kb, k0, Tn);
  load_tile_async<kTileN, Dp, kThreads>(v_s, vb, k0, Tn);
  issue(0);
  cp_async_commit();

  float dk_acc[kDT][4], dv_acc[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[dt][e] = 0.f, dv_acc[dt][e] = 0.f;
  const int key_lo = k0 + warp * 16 + g;  // this lane's keys: key_lo, key_lo + 8

  for (int it = 0; it < n_iter; ++it) {
    if (it + 1 < n_iter) {
      issue(it + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int h = hk * group + it / n_qt, qt0 = (qt_first + it % n_qt) * kTileQ;
    const __nv_bfloat16* q_s = qd_s + (it & 1) * 2 * kTileQ * LD;
    const __nv_bfloat16* do_s = q_s + kTileQ * LD;
    const float* lse_h = lse + (static_cast<int64_t>(b) * H + h) * Tn;
    const float* delta_h = delta + (static_cast<int64_t>(b) * H + h) * Tn;
    const bool need_mask = (qt0 < k0 + kTileN) || (qt0 + kTileQ > Tn);

    // S^T = K Q^T and dP^T = V dO^T: (16 keys, kTileQ queries) per warp.
    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f, dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk) {
      uint32_t kf[4], vf[4];
      ldsm_x4(kf, a_addr<Dp>(k_s, warp * 16, kk * 16, lane));
      ldsm_x4(vf, a_addr<Dp>(v_s, warp * 16, kk * 16, lane));
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bq[4], bd[4];
        ldsm_x4(bq, bt_addr<Dp>(q_s, np * 16, kk * 16, lane));
        ldsm_x4(bd, bt_addr<Dp>(do_s, np * 16, kk * 16, lane));
        mma_bf16_16816(s[2 * np], kf, bq[0], bq[1]);
        mma_bf16_16816(s[2 * np + 1], kf, bq[2], bq[3]);
        mma_bf16_16816(dp[2 * np], vf, bd[0], bd[1]);
        mma_bf16_16816(dp[2 * np + 1], vf, bd[2], bd[3]);
      }
    }
    // P^T = exp2(S^T * scale*log2e - lse*log2e), dS^T = P^T (dP^T - delta); masked: key > query or
    // query >= T (those queries' Q, dO rows are zeros, their lse/delta are not read).
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int qi = qt0 + nt * 8 + 2 * t4 + c;
        const bool q_ok = qi < Tn;
        const float lse2 = q_ok ? lse_h[qi] * kLog2e : 0.f;
        const float dlt = q_ok ? delta_h[qi] : 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int key = key_lo + 8 * r;
          float p = exp2f(s[nt][2 * r + c] * scale_log2 - lse2);
          if (need_mask && (!q_ok || key > qi)) p = 0.f;
          s[nt][2 * r + c] = p;
          dp[nt][2 * r + c] = p * (dp[nt][2 * r + c] - dlt);
        }
      }
    // dV += P^T dO, dK += dS^T Q: A from registers (16 keys x 16 queries per step).
#pragma unroll
    for (int kk = 0; kk < kTileQ / 16; ++kk) {
      uint32_t pa[4], da[4];
      pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      da[0] = pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
      da[1] = pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
      da[2] = pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[3] = pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int dpair = 0; dpair < Dp / 16; ++dpair) {
        uint32_t bd[4], bq[4];
        ldsm_x4_trans(bd, b_addr_trans<Dp>(do_s, kk * 16, dpair * 16, lane));
        ldsm_x4_trans(bq, b_addr_trans<Dp>(q_s, kk * 16, dpair * 16, lane));
        mma_bf16_16816(dv_acc[2 * dpair], pa, bd[0], bd[1]);
        mma_bf16_16816(dv_acc[2 * dpair + 1], pa, bd[2], bd[3]);
        mma_bf16_16816(dk_acc[2 * dpair], da, bq[0], bq[1]);
        mma_bf16_16816(dk_acc[2 * dpair + 1], da, bq[2], bq[3]);
      }
    }
    __syncthreads();  // this Q/dO buffer is refilled by the prefetch of iteration it + 2
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_lo + 8 * r;
    if (key >= Tn) continue;
    const int64_t off = ((static_cast<int64_t>(b) * Tn + key) * Hkv + hk) * D;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      store_pair(dk + off, dt * 8 + 2 * t4, D, dk_acc[dt][2 * r] * scale, dk_acc[dt][2 * r + 1] * scale);
      store_pair(dv + off, dt * 8 + 2 * t4, D, dv_acc[dt][2 * r], dv_acc[dt][2 * r + 1]);
    }
  }
}

// ---- backward: dQ -----------------------------------------------------------------------------------
// Grid (ceil(T / kTileQ), H, B), 4 warps, each owning 16 queries of the block's kTileQ; loops over
// the K/V tiles up to the diagonal, recomputing P from lse. dq: (B,T,H,D) f32; shapes otherwise as
// bwd_dkdv_kernel. Shared: Q, dO (kTileQ, Dp), K and V double-buffered (kTileN, Dp).
template <int Dp>
__global__ void __launch_bounds__(128)
    bwd_dq_kernel(float* dq, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                  const __nv_bfloat16* dout, const float* lse, const float* delta, int Tn, int H, int Hkv,
                  int D, float scale, float scale_log2) {
  constexpr int kThreads = 128, LD = ld_smem<Dp>(), kDT = Dp / 8, kNT = kTileN / 8;
  static_assert(kTileQ == 4 * 16, "one 16-query m-tile per warp");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (kTileQ, LD)
  __nv_bfloat16* do_s = q_s + kTileQ * LD;                           // (kTileQ, LD)
  __nv_bfloat16* kv_s = do_s + kTileQ * LD;                          // [buf][K|V] (kTileN, LD)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kTileQ;
  const int64_t qoff = (static_cast<int64_t>(b) * H + h) * Tn * Dp;
  const __nv_bfloat16* kb = k + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const __nv_bfloat16* vb = v + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const int n_tiles = (min(Tn, q0 + kTileQ) + kTileN - 1) / kTileN;

  load_tile_async<kTileQ, Dp, kThreads>(q_s, q + qoff, q0, Tn);
  load_tile_async<kTileQ, Dp, kThreads>(do_s, dout + qoff, q0, Tn);
  cp_async_commit();
  load_tile_async<kTileN, Dp, kThreads>(kv_s, kb, 0, Tn);
  load_tile_async<kTileN, Dp, kThreads>(kv_s + kTileN * LD, vb, 0, Tn);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  uint32_t qf[Dp / 16][4], df[Dp / 16][4];
#pragma unroll
  for (int kk = 0; kk < Dp / 16; ++kk) {
    ldsm_x4(qf[kk], a_addr<Dp>(q_s, warp * 16, kk * 16, lane));
    ldsm_x4(df[kk], a_addr<Dp>(do_s, warp * 16, kk * 16, lane));
  }
  float lse2[2], dlt[2];
  const int row_lo = q0 + warp * 16 + g;  // this lane's queries: row_lo, row_lo + 8
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    const int64_t i = (static_cast<int64_t>(b) * H + h) * Tn + row;
    lse2[r] = row < Tn ? lse[i] * kLog2e : 0.f;
    dlt[r] = row < Tn ? delta[i] : 0.f;
  }
  float dq_acc[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq_acc[dt][e] = 0.f;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      __nv_bfloat16* nxt = kv_s + ((j + 1) & 1) * 2 * kTileN * LD;
      load_tile_async<kTileN, Dp, kThreads>(nxt, kb, (j + 1) * kTileN, Tn);
      load_tile_async<kTileN, Dp, kThreads>(nxt + kTileN * LD, vb, (j + 1) * kTileN, Tn);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* k_s = kv_s + (j & 1) * 2 * kTileN * LD;
    const __nv_bfloat16* v_s = k_s + kTileN * LD;
    const int k0 = j * kTileN;
    const bool need_mask = (k0 + kTileN - 1 > q0) || (q0 + kTileQ > Tn);

    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f, dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk)
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bk[4], bv[4];
        ldsm_x4(bk, bt_addr<Dp>(k_s, np * 16, kk * 16, lane));
        ldsm_x4(bv, bt_addr<Dp>(v_s, np * 16, kk * 16, lane));
        mma_bf16_16816(s[2 * np], qf[kk], bk[0], bk[1]);
        mma_bf16_16816(s[2 * np + 1], qf[kk], bk[2], bk[3]);
        mma_bf16_16816(dp[2 * np], df[kk], bv[0], bv[1]);
        mma_bf16_16816(dp[2 * np + 1], df[kk], bv[2], bv[3]);
      }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int row = row_lo + 8 * r, key = k0 + nt * 8 + 2 * t4 + c;
          float p = exp2f(s[nt][2 * r + c] * scale_log2 - lse2[r]);
          if (need_mask && (row >= Tn || key > row)) p = 0.f;  // key > row also covers key >= T
          dp[nt][2 * r + c] = p * (dp[nt][2 * r + c] - dlt[r]);
        }
    // dQ += dS K: A = dS (16 queries x 16 keys per step), B = K rows via .trans.
#pragma unroll
    for (int kk = 0; kk < kTileN / 16; ++kk) {
      uint32_t da[4];
      da[0] = pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
      da[1] = pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
      da[2] = pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[3] = pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int dpair = 0; dpair < Dp / 16; ++dpair) {
        uint32_t bk[4];
        ldsm_x4_trans(bk, b_addr_trans<Dp>(k_s, kk * 16, dpair * 16, lane));
        mma_bf16_16816(dq_acc[2 * dpair], da, bk[0], bk[1]);
        mma_bf16_16816(dq_acc[2 * dpair + 1], da, bk[2], bk[3]);
      }
    }
    __syncthreads();  // this K/V buffer is refilled by the prefetch of tile j + 2
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    if (row >= Tn) continue;
    float* qrow = dq + ((static_cast<int64_t>(b) * Tn + row) * H + h) * D;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
      store_pair(qrow, dt * 8 + 2 * t4, D, dq_acc[dt][2 * r] * scale, dq_acc[dt][2 * r + 1] * scale);
  }
}

// ---- launchers ------------------------------------------------------------------------------------
// The kernels' head dims: D is padded with zero columns to the next of 16, 32, 64, 128 (zeros
// change no dot product and give zero output columns, which are not stored).
inline int padded_head_dim(int64_t D) { return D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : 128; }

// Tile shapes per padded head dim: forward (warps, m-tiles per warp); shared bytes per block.
template <int Dp>
struct FwdShape {
  static constexpr int kWarps = Dp <= 64 ? 4 : 8, kMT = Dp <= 64 ? 2 : 1, kBlockM = kWarps * kMT * 16;
  static constexpr size_t kSmem = static_cast<size_t>(kBlockM + 4 * kTileN) * ld_smem<Dp>() * 2;
};
template <int Dp>
constexpr size_t bwd_smem_bytes() {
  return static_cast<size_t>(6 * 64) * ld_smem<Dp>() * 2;  // 2 resident + 2x2 double-buffered tiles
}

// Workspace: bf16 q (B,H,T,Dp), k, v (B,Hkv,T,Dp); for backward also bf16 dout (B,H,T,Dp) and f32
// delta (B,H,T). Each region 256-byte aligned.
struct Workspace {
  __nv_bfloat16 *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;
  float* delta = nullptr;
};
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }
inline size_t workspace_bytes(int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D, bool backward) {
  const int64_t Dp = padded_head_dim(D);
  const size_t qb = align256(static_cast<size_t>(B * Tn * H * Dp) * 2);
  const size_t kb = align256(static_cast<size_t>(B * Tn * Hkv * Dp) * 2);
  return qb + 2 * kb + (backward ? qb + align256(static_cast<size_t>(B * H * Tn) * 4) : 0);
}
inline Workspace carve(void* base, int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D, bool backward) {
  const int64_t Dp = padded_head_dim(D);
  const size_t qb = align256(static_cast<size_t>(B * Tn * H * Dp) * 2);
  const size_t kb = align256(static_cast<size_t>(B * Tn * Hkv * Dp) * 2);
  char* p = static_cast<char*>(base);
  Workspace w;
  w.q = reinterpret_cast<__nv_bfloat16*>(p);
  w.k = reinterpret_cast<__nv_bfloat16*>(p + qb);
  w.v = reinterpret_cast<__nv_bfloat16*>(p + qb + kb);
  if (backward) {
    w.dout = reinterpret_cast<__nv_bfloat16*>(p + qb + 2 * kb);
    w.delta = reinterpret_cast<float*>(p + 2 * qb + 2 * kb);
  }
  return w;
}

// dst: (B,Hx,T,Dp) bf16 <- src: (B,T,Hx,D) f32.
inline void launch_to_bf16(__nv_bfloat16* dst, const float* src, int64_t B, int64_t Tn, int64_t Hx, int64_t D,
                           cudaStream_t st) {
  const int Dp = padded_head_dim(D);
  const int64_t n = B * Tn * Hx * (Dp / 8);
  to_bf16_heads_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, st>>>(dst, src, B, Tn, Hx,
                                                                              static_cast<int>(D), Dp);
  NIB_FA_CHECK(cudaGetLastError());
}

template <int Dp>
void forward_kernels(float* out, float* lse, const Workspace& w, int64_t B, int64_t Tn, int64_t H, int64_t Hkv,
                     int64_t D, cudaStream_t st) {
  using S = FwdShape<Dp>;
  auto kernel = fwd_kernel<Dp, S::kWarps, S::kMT>;
  NIB_FA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(S::kSmem)));
  const dim3 grid(static_cast<unsigned>((Tn + S::kBlockM - 1) / S::kBlockM), static_cast<unsigned>(H),
                  static_cast<unsigned>(B));
  const float scale_log2 = static_cast<float>(kLog2e / std::sqrt(static_cast<double>(D)));
  kernel<<<grid, S::kWarps * 32, S::kSmem, st>>>(out, lse, w.q, w.k, w.v, static_cast<int>(Tn), static_cast<int>(H),
                                                 static_cast<int>(Hkv), static_cast<int>(D), scale_log2);
  NIB_FA_CHECK(cudaGetLastError());
}

template <int Dp>
void backward_kernels(float* dq, float* dk, float* dv, const float* lse, const Workspace& w, int64_t B, int64_t Tn,
                      int64_t H, int64_t Hkv, int64_t D, cudaStream_t st) {
  constexpr size_t smem = bwd_smem_bytes<Dp>();
  NIB_FA_CHECK(cudaFuncSetAttribute(bwd_dkdv_kernel<Dp>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  NIB_FA_CHECK(cudaFuncSetAttribute(bwd_dq_kernel<Dp>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const double scale_d = 1.0 / std::sqrt(static_cast<double>(D));
  const float scale = static_cast<float>(scale_d), scale_log2 = static_cast<float>(scale_d * kLog2e);
  const int Ti = static_cast<int>(Tn), Hi = static_cast<int>(H), Hkvi = static_cast<int>(Hkv), Di = static_cast<int>(D);
  const dim3 grid_kv(static_cast<unsigned>((Tn + kTileN - 1) / kTileN), static_cast<unsigned>(Hkv),
                     static_cast<unsigned>(B));
  bwd_dkdv_kernel<Dp><<<grid_kv, 128, smem, st>>>(dk, dv, w.q, w.k, w.v, w.dout, lse, w.delta, Ti, Hi, Hkvi, Di, scale,
                                                  scale_log2);
  NIB_FA_CHECK(cudaGetLastError());
  const dim3 grid_q(static_cast<unsigned>((Tn + kTileQ - 1) / kTileQ), static_cast<unsigned>(H),
                    static_cast<unsigned>(B));
  bwd_dq_kernel<Dp><<<grid_q, 128, smem, st>>>(dq, w.q, w.k, w.v, w.dout, lse, w.delta, Ti, Hi, Hkvi, Di, scale,
                                               scale_log2);
  NIB_FA_CHECK(cudaGetLastError());
}

// out: (B,T,H,D), lse: (B,H,T); q: (B,T,H,D), k, v: (B,T,Hkv,D), all f32 device memory; D <= 128;
// workspace: workspace_bytes(..., false) bytes.
void run_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                            int64_t Tn, int64_t H, int64_t Hkv, int64_t D, void* workspace, cudaStream_t st) {
  const Workspace w = carve(workspace, B, Tn, H, Hkv, D, false);
  launch_to_bf16(w.q, q, B, Tn, H, D, st);
  launch_to_bf16(w.k, k, B, Tn, Hkv, D, st);
  launch_to_bf16(w.v, v, B, Tn, Hkv, D, st);
  switch (padded_head_dim(D)) {
    case 16: forward_kernels<16>(out, lse, w, B, Tn, H, Hkv, D, st); break;
    case 32: forward_kernels<32>(out, lse, w, B, Tn, H, Hkv, D, st); break;
    case 64: forward_kernels<64>(out, lse, w, B, Tn, H, Hkv, D, st); break;
    default: forward_kernels<128>(out, lse, w, B, Tn, H, Hkv, D, st); break;
  }
}

// dq: (B,T,H,D), dk, dv: (B,T,Hkv,D) overwritten; dout, out: (B,T,H,D); lse: (B,H,T);
// workspace: workspace_bytes(..., true) bytes.
void run_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                             const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                             int64_t Hkv, int64_t D, void* workspace, cudaStream_t st) {
  const Workspace w = carve(workspace, B, Tn, H, Hkv, D, true);
  launch_to_bf16(w.q, q, B, Tn, H, D, st);
  launch_to_bf16(w.k, k, B, Tn, Hkv, D, st);
  launch_to_bf16(w.v, v, B, Tn, Hkv, D, st);
  const int64_t rows = B * Tn * H;
  delta_kernel<<<static_cast<unsigned>((rows + 255) / 256), 256, 0, st>>>(w.delta, w.dout, dout, out, B, Tn, H,
                                                                         static_cast<int>(D), padded_head_dim(D));
  NIB_FA_CHECK(cudaGetLastError());
  switch (padded_head_dim(D)) {
    case 16: backward_kernels<16>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    case 32: backward_kernels<32>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    case 64: backward_kernels<64>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    default: backward_kernels<128>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
  }
}


}  // namespace
}  // namespace nibble::cuda::fa
