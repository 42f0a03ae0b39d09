// Sandbox (spec 06 principle 7) for nibble's BF16 tensor-core flash attention, issue #13: causal
// GQA attention, scale 1/sqrt(D), FlashAttention-2 structure on mma.m16n8k16 (bf16 in, f32
// accumulate), ldmatrix, cp.async double buffering. Forward + deterministic backward (dK/dV kernel
// per KV tile, dQ kernel per query tile, delta pre-pass), checked against a double CPU reference
// with the same BF16 roundings and timed at the OLMo-2 shapes. No dependency beyond CUDA:
//   nvcc -O3 -std=c++17 -arch=sm_90a dev/cuda/flash_attention_bf16.cu -o fa && ./fa
// Exits non-zero when a check fails. The kernels graduate into src/backend/cuda/attention_bf16.cu.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(expr)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (expr);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

// ================================ kernels (graduated verbatim) ================================
namespace fa {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kTileN = 64;  // keys per K/V tile (forward, dq); keys per block (dk/dv)
constexpr int kTileQ = 64;  // queries per Q/dO tile (dk/dv); queries per block (dq)

// ---- PTX wrappers -------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i; register i of a lane
// holds row lane/4, columns 2*(lane%4), +1 of matrix i (.trans: row 2*(lane%4), +1, column lane/4).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// c (16x8 f32) += a (16x16 bf16, row) * b (16x8 bf16, col). Fragments (g = lane/4, t = lane%4):
// a: {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b: {(k 2t..2t+1, n g), (k 2t+8.., n g)};
// c: {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}. Lower column / k index in the low 16 bits.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 16 bytes global -> shared, asynchronously; src_bytes = 0 writes zeros (rows past T).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&v);
}

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
          mma_bf16(s[mt][2 * np], qf[mt][kk], bf[0], bf[1]);
          mma_bf16(s[mt][2 * np + 1], qf[mt][kk], bf[2], bf[3]);
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
          mma_bf16(o[mt][2 * dp], pf[mt][kk], bf[0], bf[1]);
          mma_bf16(o[mt][2 * dp + 1], pf[mt][kk], bf[2], bf[3]);
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
        mma_bf16(s[2 * np], kf, bq[0], bq[1]);
        mma_bf16(s[2 * np + 1], kf, bq[2], bq[3]);
        mma_bf16(dp[2 * np], vf, bd[0], bd[1]);
        mma_bf16(dp[2 * np + 1], vf, bd[2], bd[3]);
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
        mma_bf16(dv_acc[2 * dpair], pa, bd[0], bd[1]);
        mma_bf16(dv_acc[2 * dpair + 1], pa, bd[2], bd[3]);
        mma_bf16(dk_acc[2 * dpair], da, bq[0], bq[1]);
        mma_bf16(dk_acc[2 * dpair + 1], da, bq[2], bq[3]);
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
        mma_bf16(s[2 * np], qf[kk], bk[0], bk[1]);
        mma_bf16(s[2 * np + 1], qf[kk], bk[2], bk[3]);
        mma_bf16(dp[2 * np], df[kk], bv[0], bv[1]);
        mma_bf16(dp[2 * np + 1], df[kk], bv[2], bv[3]);
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
        mma_bf16(dq_acc[2 * dpair], da, bk[0], bk[1]);
        mma_bf16(dq_acc[2 * dpair + 1], da, bk[2], bk[3]);
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
  CK(cudaGetLastError());
}

template <int Dp>
void forward_kernels(float* out, float* lse, const Workspace& w, int64_t B, int64_t Tn, int64_t H, int64_t Hkv,
                     int64_t D, cudaStream_t st) {
  using S = FwdShape<Dp>;
  auto kernel = fwd_kernel<Dp, S::kWarps, S::kMT>;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(S::kSmem)));
  const dim3 grid(static_cast<unsigned>((Tn + S::kBlockM - 1) / S::kBlockM), static_cast<unsigned>(H),
                  static_cast<unsigned>(B));
  const float scale_log2 = static_cast<float>(kLog2e / std::sqrt(static_cast<double>(D)));
  kernel<<<grid, S::kWarps * 32, S::kSmem, st>>>(out, lse, w.q, w.k, w.v, static_cast<int>(Tn), static_cast<int>(H),
                                                 static_cast<int>(Hkv), static_cast<int>(D), scale_log2);
  CK(cudaGetLastError());
}

template <int Dp>
void backward_kernels(float* dq, float* dk, float* dv, const float* lse, const Workspace& w, int64_t B, int64_t Tn,
                      int64_t H, int64_t Hkv, int64_t D, cudaStream_t st) {
  constexpr size_t smem = bwd_smem_bytes<Dp>();
  CK(cudaFuncSetAttribute(bwd_dkdv_kernel<Dp>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  CK(cudaFuncSetAttribute(bwd_dq_kernel<Dp>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const double scale_d = 1.0 / std::sqrt(static_cast<double>(D));
  const float scale = static_cast<float>(scale_d), scale_log2 = static_cast<float>(scale_d * kLog2e);
  const int Ti = static_cast<int>(Tn), Hi = static_cast<int>(H), Hkvi = static_cast<int>(Hkv), Di = static_cast<int>(D);
  const dim3 grid_kv(static_cast<unsigned>((Tn + kTileN - 1) / kTileN), static_cast<unsigned>(Hkv),
                     static_cast<unsigned>(B));
  bwd_dkdv_kernel<Dp><<<grid_kv, 128, smem, st>>>(dk, dv, w.q, w.k, w.v, w.dout, lse, w.delta, Ti, Hi, Hkvi, Di, scale,
                                                  scale_log2);
  CK(cudaGetLastError());
  const dim3 grid_q(static_cast<unsigned>((Tn + kTileQ - 1) / kTileQ), static_cast<unsigned>(H),
                    static_cast<unsigned>(B));
  bwd_dq_kernel<Dp><<<grid_q, 128, smem, st>>>(dq, w.q, w.k, w.v, w.dout, lse, w.delta, Ti, Hi, Hkvi, Di, scale,
                                               scale_log2);
  CK(cudaGetLastError());
}

// out: (B,T,H,D), lse: (B,H,T); q: (B,T,H,D), k, v: (B,T,Hkv,D), all f32 device memory; D <= 128;
// workspace: workspace_bytes(..., false) bytes.
void attention_forward_bf16(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
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
void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                             const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                             int64_t Hkv, int64_t D, void* workspace, cudaStream_t st) {
  const Workspace w = carve(workspace, B, Tn, H, Hkv, D, true);
  launch_to_bf16(w.q, q, B, Tn, H, D, st);
  launch_to_bf16(w.k, k, B, Tn, Hkv, D, st);
  launch_to_bf16(w.v, v, B, Tn, Hkv, D, st);
  const int64_t rows = B * Tn * H;
  delta_kernel<<<static_cast<unsigned>((rows + 255) / 256), 256, 0, st>>>(w.delta, w.dout, dout, out, B, Tn, H,
                                                                         static_cast<int>(D), padded_head_dim(D));
  CK(cudaGetLastError());
  switch (padded_head_dim(D)) {
    case 16: backward_kernels<16>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    case 32: backward_kernels<32>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    case 64: backward_kernels<64>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
    default: backward_kernels<128>(dq, dk, dv, lse, w, B, Tn, H, Hkv, D, st); break;
  }
}

}  // namespace fa

// ================================ CPU reference (double) ======================================
// Same contract: q, k, v, dout, out rounded to bf16; P = bf16(exp(s - lse)) enters P.V and dV;
// dS = bf16(P (dP - delta)) enters dQ and dK; everything else exact (double). Alongside each
// result, its magnitude: the same sum with every term replaced by its absolute value, which
// bounds the effect of one rounding disagreement per term (see check()).
static float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

struct Shape {
  int B, T, H, Hkv, D;
};

struct Ref {
  std::vector<double> out, out_mag, lse, lse_mag, dq, dq_mag, dk, dk_mag, dv, dv_mag;
};

static Ref reference(const Shape& s, const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& v, const std::vector<float>& dout, const std::vector<float>& out_in) {
  const int B = s.B, T = s.T, H = s.H, Hkv = s.Hkv, D = s.D, G = H / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto qi = [&](int b, int t, int h, int d) { return ((static_cast<size_t>(b) * T + t) * H + h) * D + d; };
  auto ki = [&](int b, int t, int h, int d) { return ((static_cast<size_t>(b) * T + t) * Hkv + h) * D + d; };
  Ref r;
  r.out.assign(q.size(), 0), r.out_mag.assign(q.size(), 0), r.dq.assign(q.size(), 0), r.dq_mag.assign(q.size(), 0);
  r.dk.assign(k.size(), 0), r.dk_mag.assign(k.size(), 0), r.dv.assign(k.size(), 0), r.dv_mag.assign(k.size(), 0);
  r.lse.assign(static_cast<size_t>(B) * H * T, 0), r.lse_mag.assign(r.lse.size(), 0);
  std::vector<double> sc(T), p(T), ds(T), dsabs(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int hk = h / G;
      for (int i = 0; i < T; ++i) {
        double mx = -1e300, qkabs = 0;
        for (int j = 0; j <= i; ++j) {
          double acc = 0, accabs = 0;
          for (int d = 0; d < D; ++d) {
            const double x = static_cast<double>(bf16r(q[qi(b, i, h, d)])) * bf16r(k[ki(b, j, hk, d)]);
            acc += x, accabs += std::fabs(x);
          }
          sc[j] = acc * scale, mx = std::max(mx, sc[j]), qkabs = std::max(qkabs, accabs * scale);
        }
        double l = 0;
        for (int j = 0; j <= i; ++j) l += std::exp(sc[j] - mx);
        const double lse = mx + std::log(l);
        r.lse[(static_cast<size_t>(b) * H + h) * T + i] = lse;
        r.lse_mag[(static_cast<size_t>(b) * H + h) * T + i] = std::fabs(lse) + qkabs + 1;
        double delta = 0;
        for (int d = 0; d < D; ++d)
          delta += static_cast<double>(bf16r(dout[qi(b, i, h, d)])) * bf16r(out_in[qi(b, i, h, d)]);
        for (int j = 0; j <= i; ++j) p[j] = std::exp(sc[j] - lse);
        for (int j = 0; j <= i; ++j) {
          double dp = 0, dpabs = 0;
          for (int d = 0; d < D; ++d) {
            const double x = static_cast<double>(bf16r(dout[qi(b, i, h, d)])) * bf16r(v[ki(b, j, hk, d)]);
            dp += x, dpabs += std::fabs(x);
          }
          ds[j] = bf16r(static_cast<float>(p[j] * (dp - delta)));
          // 0.25 ~ 2^-11 / kRel: P and dP - delta carry f32 error <= 2^-11 of p (dpabs + |delta|)
          // before the rounding; check() multiplies mag by kRel.
          dsabs[j] = std::fabs(ds[j]) + 0.25 * p[j] * (dpabs + std::fabs(delta));
        }
        for (int d = 0; d < D; ++d) {
          double o = 0, omag = 0, g = 0, gmag = 0;
          for (int j = 0; j <= i; ++j) {
            const double pb = bf16r(static_cast<float>(p[j]));
            const double vv = bf16r(v[ki(b, j, hk, d)]), kk = bf16r(k[ki(b, j, hk, d)]);
            o += pb * vv, omag += p[j] * std::fabs(vv);
            g += ds[j] * kk, gmag += dsabs[j] * std::fabs(kk);
          }
          r.out[qi(b, i, h, d)] = o, r.out_mag[qi(b, i, h, d)] = omag;
          r.dq[qi(b, i, h, d)] = g * scale, r.dq_mag[qi(b, i, h, d)] = gmag * scale;
        }
        for (int j = 0; j <= i; ++j) {
          const double pb = bf16r(static_cast<float>(p[j]));
          for (int d = 0; d < D; ++d) {
            const double doo = bf16r(dout[qi(b, i, h, d)]), qq = bf16r(q[qi(b, i, h, d)]);
            r.dv[ki(b, j, hk, d)] += pb * doo, r.dv_mag[ki(b, j, hk, d)] += p[j] * std::fabs(doo);
            r.dk[ki(b, j, hk, d)] += ds[j] * qq * scale, r.dk_mag[ki(b, j, hk, d)] += dsabs[j] * std::fabs(qq) * scale;
          }
        }
      }
    }
  return r;
}

// Tolerance, elementwise: |gpu - ref| <= kRel * mag + kAbs, where mag is the reference's sum with
// absolute values. Derivation: the GPU rounds the same bf16 inputs (bitwise equal) and forms
// products exactly (bf16 x bf16 fits in f32); its P (online softmax, f32 exp2) and dS differ from
// the reference's before rounding only by f32 error (relative <= (T + D + 8) 2^-24 < 2^-11 for
// T <= 4096 incl. the exp2/log2 approximations), so each of their bf16 roundings lands within
// one bf16 ulp (2^-7 relative) of the reference's. A sum of such terms is then within
// 2^-7 * sum|term| = 2^-7 * mag; the f32 accumulation adds at most 2^-11 * mag. kRel = 2^-7 + 2^-10
// covers both. In forward, the GPU rounds exp(s - m_run) before dividing by l: still one rounding
// (2^-8) each side, so the same bound. For lse: f32 error only, kRel = 2^-11 against
// mag = |lse| + scale * max_j sum_d |q_d k_jd| + 1. kAbs = 1e-6 absorbs f32 underflow to 0 of
// probabilities below 2^-126.
static bool check(const char* what, const std::vector<float>& got, const std::vector<double>& ref,
                  const std::vector<double>& mag, double rel) {
  const double kAbs = 1e-6;
  double max_err = 0, max_ratio = 0;
  size_t bad = 0, worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double tol = rel * mag[i] + kAbs;
    if (!(err <= tol)) ++bad;  // NaN counts as bad
    if (!(err <= max_err)) max_err = err, worst = i;
    max_ratio = std::max(max_ratio, err / tol);
  }
  std::printf("  %-4s max|err| %.3e  max err/tol %.3f  (at %zu: got %.6f ref %.6f)  %s\n", what, max_err, max_ratio,
              worst, got[worst], ref[worst], bad ? "FAIL" : "ok");
  return bad == 0;
}

static bool run_check(const Shape& s, uint64_t seed) {
  std::printf("check B=%d T=%d H=%d Hkv=%d D=%d\n", s.B, s.T, s.H, s.Hkv, s.D);
  const size_t nq = static_cast<size_t>(s.B) * s.T * s.H * s.D, nk = static_cast<size_t>(s.B) * s.T * s.Hkv * s.D;
  const size_t nl = static_cast<size_t>(s.B) * s.H * s.T;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(nq), k(nk), v(nk), dout(nq);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (auto& x : dout) x = nd(rng);
  // Backward consumes an `out`: take the reference's, so both sides see the same input.
  std::vector<float> out_in(nq, 0.f);
  {
    const Ref r0 = reference(s, q, k, v, dout, out_in);
    for (size_t i = 0; i < nq; ++i) out_in[i] = static_cast<float>(r0.out[i]);
  }
  const Ref r = reference(s, q, k, v, dout, out_in);

  float *dq_, *dk_, *dv_, *dout_, *out_, *lse_, *q_, *k_, *v_, *outg_;
  void* ws;
  CK(cudaMalloc(&q_, nq * 4)); CK(cudaMalloc(&k_, nk * 4)); CK(cudaMalloc(&v_, nk * 4));
  CK(cudaMalloc(&dout_, nq * 4)); CK(cudaMalloc(&out_, nq * 4)); CK(cudaMalloc(&outg_, nq * 4));
  CK(cudaMalloc(&lse_, nl * 4)); CK(cudaMalloc(&dq_, nq * 4));
  CK(cudaMalloc(&dk_, nk * 4)); CK(cudaMalloc(&dv_, nk * 4));
  CK(cudaMalloc(&ws, fa::workspace_bytes(s.B, s.T, s.H, s.Hkv, s.D, true)));
  CK(cudaMemcpy(q_, q.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k_, k.data(), nk * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v_, v.data(), nk * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dout_, dout.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(out_, out_in.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(outg_, 0xff, nq * 4));  // NaN: catches unwritten outputs
  CK(cudaMemset(dq_, 0xff, nq * 4)); CK(cudaMemset(dk_, 0xff, nk * 4)); CK(cudaMemset(dv_, 0xff, nk * 4));
  fa::attention_forward_bf16(outg_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0);
  // backward reads the lse computed by the GPU forward (as the model does)
  fa::attention_backward_bf16(dq_, dk_, dv_, dout_, out_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0);
  CK(cudaDeviceSynchronize());
  std::vector<float> out_g(nq), lse_g(nl), dq_g(nq), dk_g(nk), dv_g(nk);
  CK(cudaMemcpy(out_g.data(), outg_, nq * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse_g.data(), lse_, nl * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dq_g.data(), dq_, nq * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dk_g.data(), dk_, nk * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dv_g.data(), dv_, nk * 4, cudaMemcpyDeviceToHost));
  const double kRel = 1.0 / 128 + 1.0 / 1024, kRelLse = 1.0 / 2048;
  bool ok = true;
  ok &= check("out", out_g, r.out, r.out_mag, kRel);
  ok &= check("lse", lse_g, r.lse, r.lse_mag, kRelLse);
  ok &= check("dq", dq_g, r.dq, r.dq_mag, kRel);
  ok &= check("dk", dk_g, r.dk, r.dk_mag, kRel);
  ok &= check("dv", dv_g, r.dv, r.dv_mag, kRel);
  // Determinism: a second backward is bitwise equal.
  fa::attention_backward_bf16(dq_, dk_, dv_, dout_, out_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0);
  std::vector<float> dq2(nq), dk2(nk), dv2(nk);
  CK(cudaMemcpy(dq2.data(), dq_, nq * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dk2.data(), dk_, nk * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dv2.data(), dv_, nk * 4, cudaMemcpyDeviceToHost));
  const bool det = std::memcmp(dq2.data(), dq_g.data(), nq * 4) == 0 &&
                   std::memcmp(dk2.data(), dk_g.data(), nk * 4) == 0 &&
                   std::memcmp(dv2.data(), dv_g.data(), nk * 4) == 0;
  std::printf("  backward bitwise repeatable: %s\n", det ? "ok" : "FAIL");
  ok &= det;
  cudaFree(q_), cudaFree(k_), cudaFree(v_), cudaFree(dout_), cudaFree(out_), cudaFree(outg_), cudaFree(lse_);
  cudaFree(dq_), cudaFree(dk_), cudaFree(dv_), cudaFree(ws);
  return ok;
}

static void run_timing(const Shape& s) {
  const size_t nq = static_cast<size_t>(s.B) * s.T * s.H * s.D, nk = static_cast<size_t>(s.B) * s.T * s.Hkv * s.D;
  const size_t nl = static_cast<size_t>(s.B) * s.H * s.T;
  float *q_, *k_, *v_, *out_, *lse_, *dout_, *dq_, *dk_, *dv_;
  void* ws;
  CK(cudaMalloc(&q_, nq * 4)); CK(cudaMalloc(&k_, nk * 4)); CK(cudaMalloc(&v_, nk * 4)); CK(cudaMalloc(&out_, nq * 4));
  CK(cudaMalloc(&dout_, nq * 4)); CK(cudaMalloc(&lse_, nl * 4)); CK(cudaMalloc(&dq_, nq * 4));
  CK(cudaMalloc(&dk_, nk * 4)); CK(cudaMalloc(&dv_, nk * 4));
  CK(cudaMalloc(&ws, fa::workspace_bytes(s.B, s.T, s.H, s.Hkv, s.D, true)));
  std::vector<float> h(nq);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) x = nd(rng);
  CK(cudaMemcpy(q_, h.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dout_, h.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k_, h.data(), nk * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v_, h.data() + (nq - nk), nk * 4, cudaMemcpyHostToDevice));
  const fa::Workspace w = fa::carve(ws, s.B, s.T, s.H, s.Hkv, s.D, true);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto median_ms = [&](auto&& fn) {
    fn();  // warm-up
    std::vector<float> ms;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0));
      fn();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float x;
      CK(cudaEventElapsedTime(&x, e0, e1));
      ms.push_back(x);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double fwd_flop = 2.0 * s.B * s.H * static_cast<double>(s.T) * s.T * s.D, bwd_flop = 2.5 * fwd_flop;
  auto fwd_op = [&] { fa::attention_forward_bf16(out_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0); };
  auto bwd_op = [&] {
    fa::attention_backward_bf16(dq_, dk_, dv_, dout_, out_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0);
  };
  auto fwd_k = [&] { fa::forward_kernels<64>(out_, lse_, w, s.B, s.T, s.H, s.Hkv, s.D, 0); };
  auto bwd_k = [&] { fa::backward_kernels<64>(dq_, dk_, dv_, lse_, w, s.B, s.T, s.H, s.Hkv, s.D, 0); };
  const float t_fo = median_ms(fwd_op), t_bo = median_ms(bwd_op);  // bwd_op leaves w filled for bwd_k
  const float t_fk = median_ms(fwd_k), t_bk = median_ms(bwd_k);
  std::printf("time B=%d T=%d H=%d D=%d (median of 7)\n", s.B, s.T, s.H, s.D);
  std::printf("  fwd kernel %8.3f ms %6.1f TFLOP/s | op incl. bf16 pre-pass %8.3f ms %6.1f TFLOP/s\n", t_fk,
              fwd_flop / t_fk * 1e-9, t_fo, fwd_flop / t_fo * 1e-9);
  std::printf("  bwd kernels %7.3f ms %6.1f TFLOP/s | op incl. pre-pass      %8.3f ms %6.1f TFLOP/s\n", t_bk,
              bwd_flop / t_bk * 1e-9, t_bo, bwd_flop / t_bo * 1e-9);
  cudaFree(q_), cudaFree(k_), cudaFree(v_), cudaFree(out_), cudaFree(dout_), cudaFree(lse_), cudaFree(dq_);
  cudaFree(dk_), cudaFree(dv_), cudaFree(ws);
}

int main(int argc, char** argv) {
  const bool check_only = argc > 1 && std::strcmp(argv[1], "--check") == 0;
  const Shape checks[] = {
      {1, 64, 1, 1, 64},     // one tile
      {2, 77, 4, 2, 32},     // T not a multiple of the tile, GQA, D = 32
      {2, 200, 4, 1, 64},    // several tiles, odd T, GQA group 4, D = 64
      {1, 300, 6, 2, 64},    // query block of 128 over several K/V tiles, 44-row tail
      {1, 131, 2, 2, 128},   // D = 128
      {2, 70, 4, 2, 24},     // D = 24: padded to 32 with zero columns
      {1, 33, 3, 1, 6},      // D = 6 (odd tiles, padded to 16), one GQA group of 3
  };
  bool ok = true;
  uint64_t seed = 1;
  for (const Shape& s : checks) ok &= run_check(s, seed++);
  std::printf("%s\n", ok ? "ALL CHECKS PASSED" : "CHECKS FAILED");
  if (!ok) return 1;
  if (!check_only) {
    run_timing({16, 4096, 8, 8, 64});
    run_timing({8, 4096, 16, 16, 64});
  }
  return 0;
}
