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

// The bf16 A fragment (16 rows x 16 k) of two f32 accumulator tiles of 16 x 8 (columns k 0-7 in
// lo, 8-15 in hi): the mma output layout of a product becomes the A operand of the next one.
__device__ __forceinline__ void a_frag_of(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
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
// f[0..7] <- x[d0 .. d0+7], zeros at and past column D: two 16-byte loads when the 8 columns are
// whole and 16-byte aligned (D a multiple of 4 keeps every row so), else one load per column.
__device__ __forceinline__ void load8_f32(float (&f)[8], const float* x, int d0, int D) {
  if ((D & 3) == 0 && d0 + 8 <= D) {
    const float4 a = *reinterpret_cast<const float4*>(x + d0), c = *reinterpret_cast<const float4*>(x + d0 + 4);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = c.x, f[5] = c.y, f[6] = c.z, f[7] = c.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = d0 + i < D ? x[d0 + i] : 0.f;
  }
}

// dst: (B,Hx,T,Dp) bf16 <- src: (B,T,Hx,D) f32 rounded to nearest even, columns D..Dp-1 zero
// (Dp = D rounded up to a kernel head dim, a multiple of 8); one thread per 8 columns of dst.
__global__ void to_bf16_heads_kernel(__nv_bfloat16* dst, const float* src, int64_t B, int64_t Tn, int64_t Hx, int D,
                                     int Dp) {
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= B * Tn * Hx * (Dp / 8)) return;
  const int d0 = static_cast<int>(chunk % (Dp / 8)) * 8;
  const int64_t row = chunk / (Dp / 8);  // b*T*Hx + t*Hx + h: a row of src
  const int64_t h = row % Hx, t = (row / Hx) % Tn, b = row / (Hx * Tn);
  float f[8];
  load8_f32(f, src + row * D, d0, D);
  const uint4 o =
      make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
  *reinterpret_cast<uint4*>(dst + ((b * Hx + h) * Tn + t) * Dp + d0) = o;
}

// delta: (B,H,T) = rowsum(bf16(dout) * bf16(out)) in f32; dout_bf: (B,H,T,Dp) bf16 of dout:
// (B,T,H,D), zero-padded; out: (B,T,H,D). Dp / 8 adjacent lanes share a row (b, t, h), one 8-column
// chunk each: each sums its 8 products (d ascending), then the lanes' partials are added by a fixed
// butterfly (deterministic; Dp / 8 divides 32, so a row never straddles two warps).
__global__ void delta_kernel(float* delta, __nv_bfloat16* dout_bf, const float* dout, const float* out, int64_t B,
                             int64_t Tn, int64_t H, int D, int Dp) {
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lanes = Dp / 8;
  const bool live = chunk < B * Tn * H * lanes;  // dead lanes still join the shuffles
  const int64_t row = live ? chunk / lanes : 0;  // b*T*H + t*H + h
  const int d0 = static_cast<int>(chunk % lanes) * 8;
  float fd[8], fo[8];
  load8_f32(fd, dout + row * D, d0, D);
  load8_f32(fo, out + row * D, d0, D);
  uint32_t packed[4];
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const __nv_bfloat162 ab = __floats2bfloat162_rn(fd[i], fd[i + 1]);
    packed[i / 2] = *reinterpret_cast<const uint32_t*>(&ab);
    acc = __fmaf_rn(__low2float(ab), __bfloat162float(__float2bfloat16_rn(fo[i])), acc);
    acc = __fmaf_rn(__high2float(ab), __bfloat162float(__float2bfloat16_rn(fo[i + 1])), acc);
  }
  for (int off = 1; off < lanes; off <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (!live) return;
  const int64_t h = row % H, t = (row / H) % Tn, b = row / (H * Tn);
  *reinterpret_cast<uint4*>(dout_bf + ((b * H + h) * Tn + t) * Dp + d0) =
      make_uint4(packed[0], packed[1], packed[2], packed[3]);
  if (d0 == 0) delta[(b * H + h) * Tn + t] = acc;
}

// ---- forward ----------------------------------------------------------------------------------------
// Grid (ceil(T / kBlockM), H, B), kWarps warps, each owning kMT m-tiles of 16 query rows; kBlockM =
// kWarps * kMT * 16. out: (B,T,H,D) f32, lse: (B,H,T) f32 natural log of the scaled scores' sum;
// q: (B,H,T,Dp) bf16; k, v: (B,Hkv,T,Dp) bf16. Shared: Q (kBlockM, Dp), K and V double-buffered
// (kTN, Dp). Query tiles are visited last-first (the longest causal rows start first).
template <int Dp, int kWarps, int kMT, int kTN, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    fwd_kernel(float* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
               int Tn, int H, int Hkv, int D, float scale_log2) {
  constexpr int kThreads = kWarps * 32, kBlockM = kWarps * kMT * 16, LD = ld_smem<Dp>();
  constexpr int kDT = Dp / 8, kNT = kTN / 8;  // 8-wide column blocks of O and of S
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (kBlockM, LD)
  __nv_bfloat16* kv_s = q_s + kBlockM * LD;                          // [buf][K|V] (kTN, LD)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;
  const __nv_bfloat16* qb = q + (static_cast<int64_t>(b) * H + h) * Tn * Dp;
  const __nv_bfloat16* kb = k + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const __nv_bfloat16* vb = v + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const int kv_end = min(Tn, q0 + kBlockM);
  const int n_tiles = (kv_end + kTN - 1) / kTN;

  load_tile_async<kBlockM, Dp, kThreads>(q_s, qb, q0, Tn);
  cp_async_commit();
  load_tile_async<kTN, Dp, kThreads>(kv_s, kb, 0, Tn);
  load_tile_async<kTN, Dp, kThreads>(kv_s + kTN * LD, vb, 0, Tn);
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
      __nv_bfloat16* nxt = kv_s + ((j + 1) & 1) * 2 * kTN * LD;
      load_tile_async<kTN, Dp, kThreads>(nxt, kb, (j + 1) * kTN, Tn);
      load_tile_async<kTN, Dp, kThreads>(nxt + kTN * LD, vb, (j + 1) * kTN, Tn);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* k_s = kv_s + (j & 1) * 2 * kTN * LD;
    const __nv_bfloat16* v_s = k_s + kTN * LD;
    const int k0 = j * kTN;
    const bool need_mask = (k0 + kTN - 1 > q0) || (k0 + kTN > Tn);

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

    uint32_t pf[kMT][kTN / 16][4];  // P as bf16 A fragments
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int row_base = q0 + (warp * kMT + mt) * 16 + g;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_base + 8 * r;
        // The max over raw scores (scale > 0 keeps the order), then p = 2^(s * scale_log2 - m) in
        // one FMA per score.
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            if (need_mask) {
              const int key = k0 + nt * 8 + 2 * t4 + c;
              if (key > row || key >= Tn) s[mt][nt][2 * r + c] = -INFINITY;
            }
            mx = fmaxf(mx, s[mt][nt][2 * r + c]);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mt][r], mx * scale_log2);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = ex2_ftz(m_run[mt][r] - m_use);
        m_run[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float p = ex2_ftz(__fmaf_rn(s[mt][nt][2 * r + c], scale_log2, -m_use));
            s[mt][nt][2 * r + c] = p;
            sum += p;
          }
        l_run[mt][r] = l_run[mt][r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) o[mt][dt][2 * r] *= alpha, o[mt][dt][2 * r + 1] *= alpha;
      }
#pragma unroll
      for (int kk = 0; kk < kTN / 16; ++kk) {
        a_frag_of(pf[mt][kk], s[mt][2 * kk], s[mt][2 * kk + 1]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kTN / 16; ++kk)
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
// Grid (ceil(T / kBN), Hkv, B), 4 warps, each owning kMT m-tiles of 16 keys (kBN = 4 * kMT * 16
// keys a block). Loops over the H/Hkv query heads of the group and, per head, the query tiles of kQT
// rows from the diagonal on (fixed order, one writer per dK/dV row: deterministic). dk, dv:
// (B,T,Hkv,D) f32; q, dout: (B,H,T,Dp) bf16; k, v: (B,Hkv,T,Dp) bf16; lse, delta: (B,H,T) f32.
// Shared: K, V (kBN, Dp), Q and dO double-buffered (kQT, Dp). More keys per warp means fewer shared
// loads of the Q/dO operands per MMA (each B fragment feeds kMT m-tiles). kStageRows: each query
// tile's lse and delta travel beside it into shared (cp.async), keeping global-load latency out of
// the loop (measured 2.65 -> 2.10 ms; off until compute-sanitizer has run on it, docs/benchmarks.md).
template <int Dp, int kMT, int kQT, int kMinBlocks, bool kStageRows>
__global__ void __launch_bounds__(128, kMinBlocks)
    bwd_dkdv_kernel(float* dk, float* dv, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                    const __nv_bfloat16* dout, const float* lse, const float* delta, int Tn, int H, int Hkv,
                    int D, float scale, float scale_log2) {
  constexpr int kThreads = 128, LD = ld_smem<Dp>(), kDT = Dp / 8, kNT = kQT / 8, kBN = 4 * kMT * 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* k_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (kBN, LD)
  __nv_bfloat16* v_s = k_s + kBN * LD;                               // (kBN, LD)
  __nv_bfloat16* qd_s = v_s + kBN * LD;                              // [buf][Q|dO] (kQT, LD)
  float* rows_s = reinterpret_cast<float*>(qd_s + 4 * kQT * LD);     // kStageRows: [buf][lse|delta] (kQT)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int b = blockIdx.z, hk = blockIdx.y, group = H / Hkv;
  const int k0 = (gridDim.x - 1 - blockIdx.x) * kBN;
  const __nv_bfloat16* kb = k + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const __nv_bfloat16* vb = v + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const int qt_first = k0 / kQT;  // earliest query tile holding a query >= k0
  const int n_qt = (Tn + kQT - 1) / kQT - qt_first;
  const int n_iter = group * n_qt;  // (head, query tile) pairs, head-major

  auto issue = [&](int it) {
    const int h = hk * group + it / n_qt, qt0 = (qt_first + it % n_qt) * kQT;
    const int64_t off = (static_cast<int64_t>(b) * H + h) * Tn * Dp;
    __nv_bfloat16* dst = qd_s + (it & 1) * 2 * kQT * LD;
    load_tile_async<kQT, Dp, kThreads>(dst, q + off, qt0, Tn);
    load_tile_async<kQT, Dp, kThreads>(dst + kQT * LD, dout + off, qt0, Tn);
    if constexpr (kStageRows) {  // the tile's lse and delta (zeros past T)
      const int64_t roff = (static_cast<int64_t>(b) * H + h) * Tn;
      float* rdst = rows_s + (it & 1) * 2 * kQT;
      for (int i = threadIdx.x; i < 2 * kQT; i += kThreads) {
        const int qi = qt0 + i % kQT;
        const bool ok = qi < Tn;
        cp_async4(rdst + i, (i < kQT ? lse : delta) + roff + (ok ? qi : 0), ok ? 4 : 0);
      }
    }
  };
  load_tile_async<kBN, Dp, kThreads>(k_s, kb, k0, Tn);
  load_tile_async<kBN, Dp, kThreads>(v_s, vb, k0, Tn);
  issue(0);
  cp_async_commit();

  float dk_acc[kMT][kDT][4], dv_acc[kMT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk_acc[mt][dt][e] = 0.f, dv_acc[mt][dt][e] = 0.f;
  const int key_lo = k0 + warp * kMT * 16 + g;  // m-tile mt's keys: key_lo + 16 mt, + 8

  for (int it = 0; it < n_iter; ++it) {
    if (it + 1 < n_iter) {
      issue(it + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int h = hk * group + it / n_qt, qt0 = (qt_first + it % n_qt) * kQT;
    const __nv_bfloat16* q_s = qd_s + (it & 1) * 2 * kQT * LD;
    const __nv_bfloat16* do_s = q_s + kQT * LD;
    const float* lse_h = lse + (static_cast<int64_t>(b) * H + h) * Tn;
    const float* delta_h = delta + (static_cast<int64_t>(b) * H + h) * Tn;
    const bool need_mask = (qt0 < k0 + kBN) || (qt0 + kQT > Tn);

    // S^T = K Q^T and dP^T = V dO^T: (kMT x 16 keys, kQT queries) per warp.
    float s[kMT][kNT][4], dp[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f, dp[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk) {
      uint32_t kf[kMT][4], vf[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        ldsm_x4(kf[mt], a_addr<Dp>(k_s, (warp * kMT + mt) * 16, kk * 16, lane));
        ldsm_x4(vf[mt], a_addr<Dp>(v_s, (warp * kMT + mt) * 16, kk * 16, lane));
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bq[4], bd[4];
        ldsm_x4(bq, bt_addr<Dp>(q_s, np * 16, kk * 16, lane));
        ldsm_x4(bd, bt_addr<Dp>(do_s, np * 16, kk * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_bf16_16816(s[mt][2 * np], kf[mt], bq[0], bq[1]);
          mma_bf16_16816(s[mt][2 * np + 1], kf[mt], bq[2], bq[3]);
          mma_bf16_16816(dp[mt][2 * np], vf[mt], bd[0], bd[1]);
          mma_bf16_16816(dp[mt][2 * np + 1], vf[mt], bd[2], bd[3]);
        }
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
        float lse2, dlt;
        if constexpr (kStageRows) {
          const float* r_s = rows_s + (it & 1) * 2 * kQT + nt * 8 + 2 * t4 + c;  // zeros past T
          lse2 = r_s[0] * kLog2e, dlt = r_s[kQT];
        } else {
          lse2 = q_ok ? lse_h[qi] * kLog2e : 0.f, dlt = q_ok ? delta_h[qi] : 0.f;
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int key = key_lo + 16 * mt + 8 * r;
            float p = ex2_ftz(__fmaf_rn(s[mt][nt][2 * r + c], scale_log2, -lse2));
            if (need_mask && (!q_ok || key > qi)) p = 0.f;
            s[mt][nt][2 * r + c] = p;
            dp[mt][nt][2 * r + c] = p * (dp[mt][nt][2 * r + c] - dlt);
          }
      }
    // dV += P^T dO, dK += dS^T Q: A from registers (16 keys x 16 queries per step and m-tile).
#pragma unroll
    for (int kk = 0; kk < kQT / 16; ++kk) {
      uint32_t pa[kMT][4], da[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a_frag_of(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
        a_frag_of(da[mt], dp[mt][2 * kk], dp[mt][2 * kk + 1]);
      }
#pragma unroll
      for (int dpair = 0; dpair < Dp / 16; ++dpair) {
        uint32_t bd[4], bq[4];
        ldsm_x4_trans(bd, b_addr_trans<Dp>(do_s, kk * 16, dpair * 16, lane));
        ldsm_x4_trans(bq, b_addr_trans<Dp>(q_s, kk * 16, dpair * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_bf16_16816(dv_acc[mt][2 * dpair], pa[mt], bd[0], bd[1]);
          mma_bf16_16816(dv_acc[mt][2 * dpair + 1], pa[mt], bd[2], bd[3]);
          mma_bf16_16816(dk_acc[mt][2 * dpair], da[mt], bq[0], bq[1]);
          mma_bf16_16816(dk_acc[mt][2 * dpair + 1], da[mt], bq[2], bq[3]);
        }
      }
    }
    __syncthreads();  // this Q/dO buffer is refilled by the prefetch of iteration it + 2
  }

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key_lo + 16 * mt + 8 * r;
      if (key >= Tn) continue;
      const int64_t off = ((static_cast<int64_t>(b) * Tn + key) * Hkv + hk) * D;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        store_pair(dk + off, dt * 8 + 2 * t4, D, dk_acc[mt][dt][2 * r] * scale, dk_acc[mt][dt][2 * r + 1] * scale);
        store_pair(dv + off, dt * 8 + 2 * t4, D, dv_acc[mt][dt][2 * r], dv_acc[mt][dt][2 * r + 1]);
      }
    }
}

// ---- backward: dQ -----------------------------------------------------------------------------------
// Grid (ceil(T / kBM), H, B), 4 warps, each owning kMT m-tiles of 16 queries (kBM = 4 * kMT * 16
// queries a block); loops over the K/V tiles of kKT keys up to the diagonal, recomputing P from lse.
// dq: (B,T,H,D) f32; shapes otherwise as bwd_dkdv_kernel. Shared: Q, dO (kBM, Dp), K and V
// double-buffered (kKT, Dp).
template <int Dp, int kMT, int kKT, int kMinBlocks>
__global__ void __launch_bounds__(128, kMinBlocks)
    bwd_dq_kernel(float* dq, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                  const __nv_bfloat16* dout, const float* lse, const float* delta, int Tn, int H, int Hkv,
                  int D, float scale, float scale_log2) {
  constexpr int kThreads = 128, LD = ld_smem<Dp>(), kDT = Dp / 8, kNT = kKT / 8, kBM = 4 * kMT * 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // (kBM, LD)
  __nv_bfloat16* do_s = q_s + kBM * LD;                              // (kBM, LD)
  __nv_bfloat16* kv_s = do_s + kBM * LD;                             // [buf][K|V] (kKT, LD)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kBM;
  const int64_t qoff = (static_cast<int64_t>(b) * H + h) * Tn * Dp;
  const __nv_bfloat16* kb = k + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const __nv_bfloat16* vb = v + (static_cast<int64_t>(b) * Hkv + hk) * Tn * Dp;
  const int n_tiles = (min(Tn, q0 + kBM) + kKT - 1) / kKT;

  load_tile_async<kBM, Dp, kThreads>(q_s, q + qoff, q0, Tn);
  load_tile_async<kBM, Dp, kThreads>(do_s, dout + qoff, q0, Tn);
  cp_async_commit();
  load_tile_async<kKT, Dp, kThreads>(kv_s, kb, 0, Tn);
  load_tile_async<kKT, Dp, kThreads>(kv_s + kKT * LD, vb, 0, Tn);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  uint32_t qf[kMT][Dp / 16][4], df[kMT][Dp / 16][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk) {
      ldsm_x4(qf[mt][kk], a_addr<Dp>(q_s, (warp * kMT + mt) * 16, kk * 16, lane));
      ldsm_x4(df[mt][kk], a_addr<Dp>(do_s, (warp * kMT + mt) * 16, kk * 16, lane));
    }
  const int row_lo = q0 + warp * kMT * 16 + g;  // m-tile mt's queries: row_lo + 16 mt, + 8
  float lse2[kMT][2], dlt[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_lo + 16 * mt + 8 * r;
      const int64_t i = (static_cast<int64_t>(b) * H + h) * Tn + row;
      lse2[mt][r] = row < Tn ? lse[i] * kLog2e : 0.f;
      dlt[mt][r] = row < Tn ? delta[i] : 0.f;
    }
  float dq_acc[kMT][kDT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq_acc[mt][dt][e] = 0.f;

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      __nv_bfloat16* nxt = kv_s + ((j + 1) & 1) * 2 * kKT * LD;
      load_tile_async<kKT, Dp, kThreads>(nxt, kb, (j + 1) * kKT, Tn);
      load_tile_async<kKT, Dp, kThreads>(nxt + kKT * LD, vb, (j + 1) * kKT, Tn);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* k_s = kv_s + (j & 1) * 2 * kKT * LD;
    const __nv_bfloat16* v_s = k_s + kKT * LD;
    const int k0 = j * kKT;
    const bool need_mask = (k0 + kKT - 1 > q0) || (q0 + kBM > Tn);

    float s[kMT][kNT][4], dp[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f, dp[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk)
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bk[4], bv[4];
        ldsm_x4(bk, bt_addr<Dp>(k_s, np * 16, kk * 16, lane));
        ldsm_x4(bv, bt_addr<Dp>(v_s, np * 16, kk * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_bf16_16816(s[mt][2 * np], qf[mt][kk], bk[0], bk[1]);
          mma_bf16_16816(s[mt][2 * np + 1], qf[mt][kk], bk[2], bk[3]);
          mma_bf16_16816(dp[mt][2 * np], df[mt][kk], bv[0], bv[1]);
          mma_bf16_16816(dp[mt][2 * np + 1], df[mt][kk], bv[2], bv[3]);
        }
      }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int row = row_lo + 16 * mt + 8 * r, key = k0 + nt * 8 + 2 * t4 + c;
            float p = ex2_ftz(__fmaf_rn(s[mt][nt][2 * r + c], scale_log2, -lse2[mt][r]));
            if (need_mask && (row >= Tn || key > row)) p = 0.f;  // key > row also covers key >= T
            dp[mt][nt][2 * r + c] = p * (dp[mt][nt][2 * r + c] - dlt[mt][r]);
          }
    // dQ += dS K: A = dS (16 queries x 16 keys per step and m-tile), B = K rows via .trans.
#pragma unroll
    for (int kk = 0; kk < kKT / 16; ++kk) {
      uint32_t da[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a_frag_of(da[mt], dp[mt][2 * kk], dp[mt][2 * kk + 1]);
      }
#pragma unroll
      for (int dpair = 0; dpair < Dp / 16; ++dpair) {
        uint32_t bk[4];
        ldsm_x4_trans(bk, b_addr_trans<Dp>(k_s, kk * 16, dpair * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_bf16_16816(dq_acc[mt][2 * dpair], da[mt], bk[0], bk[1]);
          mma_bf16_16816(dq_acc[mt][2 * dpair + 1], da[mt], bk[2], bk[3]);
        }
      }
    }
    __syncthreads();  // this K/V buffer is refilled by the prefetch of tile j + 2
  }

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_lo + 16 * mt + 8 * r;
      if (row >= Tn) continue;
      float* qrow = dq + ((static_cast<int64_t>(b) * Tn + row) * H + h) * D;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt)
        store_pair(qrow, dt * 8 + 2 * t4, D, dq_acc[mt][dt][2 * r] * scale, dq_acc[mt][dt][2 * r + 1] * scale);
    }
}

// ---- launchers ------------------------------------------------------------------------------------
// The kernels' head dims: D is padded with zero columns to the next of 16, 32, 64, 128 (zeros
// change no dot product and give zero output columns, which are not stored).
inline int padded_head_dim(int64_t D) { return D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : 128; }

// Tile shapes per padded head dim (the NIB_FA_* macros let the sandbox time other shapes).
// Forward: warps, m-tiles of 16 queries per warp, keys per K/V tile; shared bytes per block.
#ifndef NIB_FA_FWD_WARPS
#define NIB_FA_FWD_WARPS 4
#endif
#ifndef NIB_FA_FWD_MT
#define NIB_FA_FWD_MT 2
#endif
#ifndef NIB_FA_FWD_TN
#define NIB_FA_FWD_TN 64
#endif
#ifndef NIB_FA_FWD_MINB
#define NIB_FA_FWD_MINB 0
#endif
template <int Dp>
struct FwdShape {
  static constexpr int kWarps = Dp <= 64 ? NIB_FA_FWD_WARPS : 8, kMT = Dp <= 64 ? NIB_FA_FWD_MT : 1;
  static constexpr int kBlockM = kWarps * kMT * 16;
  static constexpr int kTN = Dp <= 64 ? NIB_FA_FWD_TN : 64;
  // Resident blocks per SM asked of ptxas (__launch_bounds__' second argument; 0: no request).
  static constexpr int kMinBlocks = Dp <= 64 ? NIB_FA_FWD_MINB : 0;
  static constexpr size_t kSmem = static_cast<size_t>(kBlockM + 4 * kTN) * ld_smem<Dp>() * 2;
};
// Backward: dK/dV kernel m-tiles of 16 keys per warp and queries per Q/dO tile; dQ kernel m-tiles
// of 16 queries per warp and keys per K/V tile (4 warps each). Shared: 2 resident + 2x2
// double-buffered tiles.
#ifndef NIB_FA_BWD_KV_MT
#define NIB_FA_BWD_KV_MT 2
#endif
#ifndef NIB_FA_BWD_QT
#define NIB_FA_BWD_QT 32
#endif
#ifndef NIB_FA_BWD_Q_MT
#define NIB_FA_BWD_Q_MT 1
#endif
#ifndef NIB_FA_BWD_KT
#define NIB_FA_BWD_KT 64
#endif
#ifndef NIB_FA_BWD_STAGE_ROWS
#define NIB_FA_BWD_STAGE_ROWS 0
#endif
#ifndef NIB_FA_BWD_KV_MINB
#define NIB_FA_BWD_KV_MINB 0
#endif
#ifndef NIB_FA_BWD_Q_MINB
#define NIB_FA_BWD_Q_MINB 0
#endif
template <int Dp>
struct BwdShape {
  static constexpr int kKvMT = Dp <= 64 ? NIB_FA_BWD_KV_MT : 1, kQT = Dp <= 64 ? NIB_FA_BWD_QT : 64;
  static constexpr int kQMT = Dp <= 64 ? NIB_FA_BWD_Q_MT : 1, kKT = Dp <= 64 ? NIB_FA_BWD_KT : 64;
  static constexpr int kKvMinBlocks = Dp <= 64 ? NIB_FA_BWD_KV_MINB : 0, kQMinBlocks = Dp <= 64 ? NIB_FA_BWD_Q_MINB : 0;
  static constexpr int kBN = 4 * kKvMT * 16, kBM = 4 * kQMT * 16;  // keys / queries a block owns
  static constexpr bool kStageRows = NIB_FA_BWD_STAGE_ROWS != 0;     // lse/delta tiles in shared (dK/dV)
  static constexpr size_t kSmemKv =
      static_cast<size_t>(2 * kBN + 4 * kQT) * ld_smem<Dp>() * 2 + (kStageRows ? 4 * kQT * 4 : 0);
  static constexpr size_t kSmemQ = static_cast<size_t>(2 * kBM + 4 * kKT) * ld_smem<Dp>() * 2;
};

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
  auto kernel = fwd_kernel<Dp, S::kWarps, S::kMT, S::kTN, S::kMinBlocks>;
  NIB_FA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(S::kSmem)));
  const dim3 grid(static_cast<unsigned>((Tn + S::kBlockM - 1) / S::kBlockM), static_cast<unsigned>(H),
                  static_cast<unsigned>(B));
  const float scale_log2 = static_cast<float>(kLog2e / std::sqrt(static_cast<double>(D)));
  kernel<<<grid, S::kWarps * 32, S::kSmem, st>>>(out, lse, w.q, w.k, w.v, static_cast<int>(Tn), static_cast<int>(H),
                                                 static_cast<int>(Hkv), static_cast<int>(D), scale_log2);
  NIB_FA_CHECK(cudaGetLastError());
}

// The two backward kernels (dK/dV, then dQ), each launchable alone (the sandbox times them apart).
template <int Dp>
void backward_kernel_dkdv(float* dk, float* dv, const float* lse, const Workspace& w, int64_t B, int64_t Tn,
                          int64_t H, int64_t Hkv, int64_t D, cudaStream_t st) {
  using S = BwdShape<Dp>;
  auto kernel = bwd_dkdv_kernel<Dp, S::kKvMT, S::kQT, S::kKvMinBlocks, S::kStageRows>;
  NIB_FA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(S::kSmemKv)));
  const double scale_d = 1.0 / std::sqrt(static_cast<double>(D));
  const dim3 grid(static_cast<unsigned>((Tn + S::kBN - 1) / S::kBN), static_cast<unsigned>(Hkv),
                  static_cast<unsigned>(B));
  kernel<<<grid, 128, S::kSmemKv, st>>>(dk, dv, w.q, w.k, w.v, w.dout, lse, w.delta, static_cast<int>(Tn),
                                        static_cast<int>(H), static_cast<int>(Hkv), static_cast<int>(D),
                                        static_cast<float>(scale_d), static_cast<float>(scale_d * kLog2e));
  NIB_FA_CHECK(cudaGetLastError());
}
template <int Dp>
void backward_kernel_dq(float* dq, const float* lse, const Workspace& w, int64_t B, int64_t Tn, int64_t H,
                        int64_t Hkv, int64_t D, cudaStream_t st) {
  using S = BwdShape<Dp>;
  auto kernel = bwd_dq_kernel<Dp, S::kQMT, S::kKT, S::kQMinBlocks>;
  NIB_FA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(S::kSmemQ)));
  const double scale_d = 1.0 / std::sqrt(static_cast<double>(D));
  const dim3 grid(static_cast<unsigned>((Tn + S::kBM - 1) / S::kBM), static_cast<unsigned>(H),
                  static_cast<unsigned>(B));
  kernel<<<grid, 128, S::kSmemQ, st>>>(dq, w.q, w.k, w.v, w.dout, lse, w.delta, static_cast<int>(Tn),
                                       static_cast<int>(H), static_cast<int>(Hkv), static_cast<int>(D),
                                       static_cast<float>(scale_d), static_cast<float>(scale_d * kLog2e));
  NIB_FA_CHECK(cudaGetLastError());
}
template <int Dp>
void backward_kernels(float* dq, float* dk, float* dv, const float* lse, const Workspace& w, int64_t B, int64_t Tn,
                      int64_t H, int64_t Hkv, int64_t D, cudaStream_t st) {
  backward_kernel_dkdv<Dp>(dk, dv, lse, w, B, Tn, H, Hkv, D, st);
  backward_kernel_dq<Dp>(dq, lse, w, B, Tn, H, Hkv, D, st);
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

// The backward's pre-passes: bf16 q, k, v, dout into the workspace and delta (shapes as run_backward).
void run_backward_prepass(const float* dout, const float* out, const float* q, const float* k, const float* v,
                          int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D, void* workspace, cudaStream_t st) {
  const Workspace w = carve(workspace, B, Tn, H, Hkv, D, true);
  launch_to_bf16(w.q, q, B, Tn, H, D, st);
  launch_to_bf16(w.k, k, B, Tn, Hkv, D, st);
  launch_to_bf16(w.v, v, B, Tn, Hkv, D, st);
  const int64_t chunks = B * Tn * H * (padded_head_dim(D) / 8);
  delta_kernel<<<static_cast<unsigned>((chunks + 255) / 256), 256, 0, st>>>(w.delta, w.dout, dout, out, B, Tn, H,
                                                                           static_cast<int>(D), padded_head_dim(D));
  NIB_FA_CHECK(cudaGetLastError());
}

// dq: (B,T,H,D), dk, dv: (B,T,Hkv,D) overwritten; dout, out: (B,T,H,D); lse: (B,H,T);
// workspace: workspace_bytes(..., true) bytes.
void run_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                  const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H, int64_t Hkv,
                  int64_t D, void* workspace, cudaStream_t st) {
  run_backward_prepass(dout, out, q, k, v, B, Tn, H, Hkv, D, workspace, st);
  const Workspace w = carve(workspace, B, Tn, H, Hkv, D, true);
  switch (padded_head_dim(D)) {
    case 16: backward_kernels<16>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    case 32: backward_kernels<32>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    case 64: backward_kernels<64>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    default: backward_kernels<128>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
  }
}

}  // namespace
}  // namespace nibble::cuda::fa
