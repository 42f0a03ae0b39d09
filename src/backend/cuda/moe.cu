// CUDA MoE routing ops (moe.h), the semantics of backend/cpu/moe.cpp:
//  - router: one warp per token; softmax numerators by glibc_expf (glibc's expf bit for bit), the
//    float sum in the CPU's order (i ascending) and IEEE division, so probs, top-k ids and gate
//    weights equal the CPU's bits; lse uses CUDA's logf (within 2 ulp); top-k by k warp arg-max
//    rounds over (prob desc, id asc), or the CPU's own scan when a row has a NaN;
//  - router backward: one warp per token; dL/dp in the CPU's order, the softmax dot by a fixed
//    per-lane order and butterfly;
//  - dispatch plan: a stable counting sort: per-chunk histograms, a per-expert scan over chunks in
//    order, then each chunk's slots ranked in order by one warp (__match_any_sync);
//  - gather / combine and their backward: one owner per output element, j ascending (bit-exact);
//  - load sums in double by a fixed tree. No float atomics anywhere.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/moe.h"
#include "backend/glibc_expf.h"
#include "core/check.h"

namespace nibble::cuda {

namespace {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int64_t kMaxExperts = 4096;            // shared-memory rows of the router kernels
constexpr int kRouterWarpsPerBlock = 4;
constexpr size_t kSharedLimit = 48 * 1024;       // default dynamic shared memory per block

// The first token with an invalid forced set in the current forced router call (ULLONG_MAX: none).
__device__ unsigned long long g_moe_forced_error_token;
std::mutex g_moe_forced_mutex;  // one forced call at a time reads and resets that word

void check_router_shape(int64_t N, int64_t E, int64_t k) {
  NIB_CHECK_MSG(N >= 0 && E >= 1 && E <= kMaxExperts && k >= 1 && k <= E,
                "MoE router: N {} E {} k {} (need N >= 0, 1 <= k <= E <= {})", N, E, k, kMaxExperts);
  NIB_CHECK_MSG(N * k <= INT32_MAX && N * E <= (int64_t(1) << 40), "MoE router: N {} too large for E {} k {}", N, E, k);
}

// Warps per block for a kernel that keeps `floats_per_warp` floats of shared memory per warp.
int router_warps(int64_t floats_per_warp) {
  int w = kRouterWarpsPerBlock;
  while (w > 1 && static_cast<size_t>(w) * floats_per_warp * sizeof(float) > kSharedLimit) w /= 2;
  NIB_CHECK(static_cast<size_t>(w) * floats_per_warp * sizeof(float) <= kSharedLimit);
  return w;
}

// hist[topk_idx[s]] += 1 for slots s in [s0, s1) with an id in [0,E), the block's warps taking 32
// consecutive slots at a time; lanes with the same expert add once (__match_any_sync), so a
// popular expert costs one shared atomic per warp instead of 32. Integer counts: order-free.
__device__ __forceinline__ void histogram_slots(int* hist, const int32_t* topk_idx, int64_t s0, int64_t s1, int E) {
  const int lane = threadIdx.x & 31;
  const int64_t stride = static_cast<int64_t>(blockDim.x);
  for (int64_t base = s0 + (threadIdx.x & ~31); base < s1; base += stride) {
    const int64_t s = base + lane;
    int e = s < s1 ? topk_idx[s] : -1;
    if (e < 0 || e >= E) e = -1;
    const unsigned same = __match_any_sync(kFullMask, e);
    if (e >= 0 && lane == __ffs(same) - 1) atomicAdd(&hist[e], __popc(same));
  }
}

__device__ __forceinline__ float warp_sum_butterfly(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;  // the same bits in every lane (each step adds the same two values in every lane)
}

// ---- router forward --------------------------------------------------------------------------

// probs (N,E), lse (N), topk_idx (N,k), topk_w (N,k); logits (N,E); forced_idx (N,k) or null.
// One warp per token. Shared memory per warp: p (E) f32, selp (k) f32, sel (k) i32.
__global__ void moe_router_forward_kernel(float* probs, float* lse, int32_t* topk_idx, float* topk_w,
                                          const float* logits, const int32_t* forced_idx, int64_t N, int E, int k,
                                          bool renorm) {
  extern __shared__ float router_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (n >= N) return;  // whole warps leave together; no block-wide barrier follows
  float* p = router_smem + static_cast<size_t>(warp) * (E + 2 * k);
  float* selp = p + E;
  int* sel = reinterpret_cast<int*>(selp + k);
  const float* l = logits + n * E;

  // max over non-NaN logits (the CPU's `l > mx ? l : mx` skips NaN); lane 0's value for all
  float mx = -INFINITY;
  for (int i = lane; i < E; i += 32) {
    const float v = l[i];
    mx = v > mx ? v : mx;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(kFullMask, mx, o);
    mx = v > mx ? v : mx;
  }
  mx = __shfl_sync(kFullMask, mx, 0);

  for (int i = lane; i < E; i += 32) p[i] = backend::glibc_expf(l[i] - mx);
  __syncwarp();
  float sum = 0.0f;
  if (lane == 0)
    for (int i = 0; i < E; ++i) sum += p[i];  // the CPU's order
  sum = __shfl_sync(kFullMask, sum, 0);
  bool nan_seen = false;
  for (int i = lane; i < E; i += 32) {
    const float q = p[i] / sum;
    p[i] = q;
    probs[n * E + i] = q;
    nan_seen |= isnan(q);
  }
  if (lane == 0) lse[n] = mx + logf(sum);
  __syncwarp();

  if (forced_idx != nullptr) {
    for (int j = lane; j < k; j += 32) {
      const int32_t id = forced_idx[n * k + j];
      bool ok = id >= 0 && id < E;
      for (int j2 = 0; j2 < j; ++j2) ok &= forced_idx[n * k + j2] != id;
      if (!ok) atomicMin(&g_moe_forced_error_token, static_cast<unsigned long long>(n));
      sel[j] = ok ? id : -1;
      selp[j] = ok ? p[id] : 0.0f;
    }
  } else if (__any_sync(kFullMask, nan_seen)) {
    // the CPU's selection scan as written (its outcome with NaNs depends on the scan order)
    if (lane == 0) {
      for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int i = 0; i < E; ++i) {
          bool taken = false;
          for (int j2 = 0; j2 < j; ++j2) taken |= sel[j2] == i;
          if (taken) continue;
          if (best < 0 || p[i] > p[best]) best = i;
        }
        sel[j] = best;
        selp[j] = p[best];
      }
    }
  } else {
    // NaN-free probs are >= 0: a taken expert is set to -1 and never wins again (k <= E). The
    // lane scan (i ascending, strict >) and the butterfly's (value desc, id asc) order select the
    // first expert of the largest prob, as the CPU's scan does.
    for (int j = 0; j < k; ++j) {
      float bv = -2.0f;
      int bi = INT_MAX;
      for (int i = lane; i < E; i += 32) {
        const float v = p[i];
        if (v > bv) bv = v, bi = i;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFullMask, bv, o);
        const int oi = __shfl_xor_sync(kFullMask, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
      }
      if (lane == 0) sel[j] = bi, selp[j] = bv;
      if (lane == (bi & 31)) p[bi] = -1.0f;
      __syncwarp();
    }
  }
  __syncwarp();
  float s = 0.0f;  // every lane, the CPU's order
  for (int j = 0; j < k; ++j) s += selp[j];
  for (int j = lane; j < k; j += 32) {
    topk_idx[n * k + j] = sel[j];
    topk_w[n * k + j] = renorm ? selp[j] / s : selp[j];
  }
}

// ---- router backward -------------------------------------------------------------------------

// dlogits (N,E); dtopk_w, topk_idx, topk_w (N,k); probs (N,E); lse (N); dprobs_extra (E) or null.
// One warp per token; shared memory per warp: g = dL/dp (E) f32.
__global__ void moe_router_backward_kernel(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                                           const int32_t* topk_idx, const float* topk_w, const float* dprobs_extra,
                                           float z_scale, int64_t N, int E, int k, bool renorm) {
  extern __shared__ float router_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (n >= N) return;
  float* g = router_smem + static_cast<size_t>(warp) * E;
  const float* p = probs + n * E;
  for (int i = lane; i < E; i += 32) g[i] = dprobs_extra ? dprobs_extra[i] : 0.0f;
  __syncwarp();
  if (lane == 0) {  // k terms in the CPU's order (ids outside [0,E) are skipped)
    const int32_t* idx = topk_idx + n * k;
    const float* w = topk_w + n * k;
    const float* dw = dtopk_w + n * k;
    if (renorm) {
      // w_j = p_j / S, S = sum_sel p:  dL/dp_i = (dw_i - sum_j dw_j w_j) / S
      float s = 0.0f, dww = 0.0f;
      for (int j = 0; j < k; ++j) {
        if (idx[j] >= 0 && idx[j] < E) s += p[idx[j]];
        dww += dw[j] * w[j];
      }
      for (int j = 0; j < k; ++j)
        if (idx[j] >= 0 && idx[j] < E) g[idx[j]] += (dw[j] - dww) / s;
    } else {
      for (int j = 0; j < k; ++j)
        if (idx[j] >= 0 && idx[j] < E) g[idx[j]] += dw[j];
    }
  }
  __syncwarp();
  float pdp = 0.0f;
  for (int i = lane; i < E; i += 32) pdp += p[i] * g[i];
  pdp = warp_sum_butterfly(pdp);
  const float zc = 2.0f * z_scale * lse[n];  // d(z_scale lse^2)/dl = 2 z_scale lse p
  for (int i = lane; i < E; i += 32) dlogits[n * E + i] = p[i] * (g[i] - pdp) + zc * p[i];
}

// ---- dispatch plan ---------------------------------------------------------------------------

// counts (chunks, E): per-chunk expert histograms of topk_idx (slots); ids outside [0,E) skipped.
__global__ void moe_dispatch_count_kernel(int32_t* counts, const int32_t* topk_idx, int64_t slots, int E,
                                          int slots_per_chunk) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * slots_per_chunk;
  const int64_t s1 = min(s0 + slots_per_chunk, slots);
  histogram_slots(hist, topk_idx, s0, s1, E);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[static_cast<int64_t>(blockIdx.x) * E + e] = hist[e];
}

// Exclusive sum over a block of kScanThreads threads of one value each; total to every thread.
constexpr int kScanThreads = 1024;
__device__ int64_t block_exclusive_sum(int64_t v, int64_t& total, int64_t* warp_sums /* (32) */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t u = __shfl_up_sync(kFullMask, incl, o);
    if (lane >= o) incl += u;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int64_t w = warp_sums[lane], wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t u = __shfl_up_sync(kFullMask, wi, o);
      if (lane >= o) wi += u;
    }
    warp_sums[lane] = wi - w;  // exclusive prefix of warp totals
    if (lane == 31) warp_sums[32] = wi;
  }
  __syncthreads();
  const int64_t excl = warp_sums[warp] + incl - v;
  total = warp_sums[32];
  __syncthreads();  // warp_sums is reused by the next call
  return excl;
}

// One block of kScanThreads. counts (chunks, E) -> when chunks > 1, each chunk's first row per
// expert (offsets[e] + the counts of earlier chunks, in chunk order); expert_offsets (E+1) <- the
// exclusive scan of the per-expert totals. With chunks == 1, counts may alias expert_offsets: every
// count is read before any offset is written. Shared: totals (E) i64 + 33 i64.
__global__ void moe_dispatch_scan_kernel(int64_t* expert_offsets, int32_t* counts, int chunks, int E) {
  extern __shared__ int64_t scan_smem[];
  int64_t* totals = scan_smem;
  int64_t* warp_sums = scan_smem + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t run = 0;
    for (int b = 0; b < chunks; ++b) {
      const int64_t at = static_cast<int64_t>(b) * E + e;
      const int32_t c = counts[at];
      if (chunks > 1) counts[at] = static_cast<int32_t>(run);
      run += c;
    }
    totals[e] = run;
  }
  __syncthreads();
  int64_t carry = 0;
  for (int e0 = 0; e0 < E; e0 += kScanThreads) {
    const int e = e0 + threadIdx.x;
    const int64_t v = e < E ? totals[e] : 0;
    int64_t tile_total = 0;
    const int64_t excl = block_exclusive_sum(v, tile_total, warp_sums);
    if (e < E) totals[e] = carry + excl;  // only this thread reads totals[e] from here on
    carry += tile_total;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) expert_offsets[e] = totals[e];
  if (threadIdx.x == 0) expert_offsets[E] = carry;
  if (chunks > 1)
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      for (int b = 0; b < chunks; ++b) counts[static_cast<int64_t>(b) * E + e] += static_cast<int32_t>(totals[e]);
}

// One warp per chunk: row_of_slot[s] for the chunk's slots in order (stable). first_row (chunks, E)
// i32, or null with one chunk (then expert_offsets gives the first rows). Invalid ids get -1.
__global__ void moe_dispatch_rank_kernel(int32_t* row_of_slot, const int32_t* topk_idx, const int32_t* first_row,
                                         const int64_t* expert_offsets, int64_t slots, int E, int slots_per_chunk) {
  extern __shared__ int cursor[];  // (E)
  const int lane = threadIdx.x;
  for (int e = lane; e < E; e += 32)
    cursor[e] = first_row ? first_row[static_cast<int64_t>(blockIdx.x) * E + e] : static_cast<int>(expert_offsets[e]);
  __syncwarp();
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * slots_per_chunk;
  const int64_t s1 = min(s0 + slots_per_chunk, slots);
  for (int64_t base = s0; base < s1; base += 32) {
    const int64_t s = base + lane;
    int e = s < s1 ? topk_idx[s] : -1;
    if (e < 0 || e >= E) e = -1;
    const unsigned same = __match_any_sync(kFullMask, e);
    if (e >= 0)
      row_of_slot[s] = cursor[e] + __popc(same & lanes_below);
    else if (s < s1)
      row_of_slot[s] = -1;
    __syncwarp();
    if (e >= 0 && lane == 31 - __clz(same)) cursor[e] += __popc(same);  // the group's last lane
    __syncwarp();
  }
}

// token_of_row[row_of_slot[s]] = s / k for every slot with a row.
__global__ void moe_dispatch_tokens_kernel(int32_t* token_of_row, const int32_t* row_of_slot, int64_t slots, int k) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= slots) return;
  const int32_t r = row_of_slot[s];
  if (r >= 0 && r < slots) token_of_row[r] = static_cast<int32_t>(s / k);
}

// ---- gather / combine ------------------------------------------------------------------------

// Launch shape for row-wise kernels: threadIdx.x walks the V-float vectors of a row, threadIdx.y
// picks the row of the block.
struct RowLaunch {
  dim3 grid, block;
};
RowLaunch row_launch(int64_t rows, int64_t vectors_per_row) {
  int bx = 32;
  while (bx < 256 && bx < vectors_per_row) bx *= 2;
  const int by = 256 / bx;
  const int64_t blocks = (rows + by - 1) / by;
  NIB_CHECK_MSG(blocks <= INT32_MAX, "MoE: {} rows too many for one launch", rows);
  return {dim3(static_cast<unsigned>(blocks)), dim3(bx, by)};
}

template <int V>
struct VecF;
template <>
struct VecF<1> {
  using T = float;
  __device__ static T zero() { return 0.0f; }
  __device__ static void add(T& a, T b) { a = a + b; }
  __device__ static void add_scaled(T& a, float w, T b) { a = a + w * b; }
};
template <>
struct VecF<4> {
  using T = float4;
  __device__ static T zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
  __device__ static void add(T& a, T b) { a.x = a.x + b.x, a.y = a.y + b.y, a.z = a.z + b.z, a.w = a.w + b.w; }
  __device__ static void add_scaled(T& a, float w, T b) {
    a.x = a.x + w * b.x, a.y = a.y + w * b.y, a.z = a.z + w * b.z, a.w = a.w + w * b.w;
  }
};

// xe (rows, C) = x[token_of_row[r]] (x: (tokens, C)); cv = C / V vectors per row.
template <int V>
__global__ void moe_gather_kernel(float* xe, const float* x, const int32_t* token_of_row, int64_t rows, int64_t cv) {
  using T = typename VecF<V>::T;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (r >= rows) return;
  const T* src = reinterpret_cast<const T*>(x) + static_cast<int64_t>(token_of_row[r]) * cv;
  T* dst = reinterpret_cast<T*>(xe) + r * cv;
  for (int64_t c = threadIdx.x; c < cv; c += blockDim.x) dst[c] = src[c];
}

// dx (N, C) = sum_j dxe[row_of_slot[n*k+j]], j ascending from 0 (the CPU's order).
template <int V>
__global__ void moe_gather_backward_kernel(float* dx, const float* dxe, const int32_t* row_of_slot, int64_t N, int k,
                                           int64_t cv) {
  using T = typename VecF<V>::T;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (n >= N) return;
  const T* src = reinterpret_cast<const T*>(dxe);
  for (int64_t c = threadIdx.x; c < cv; c += blockDim.x) {
    T acc = VecF<V>::zero();
    for (int j = 0; j < k; ++j) VecF<V>::add(acc, src[static_cast<int64_t>(row_of_slot[n * k + j]) * cv + c]);
    reinterpret_cast<T*>(dx)[n * cv + c] = acc;
  }
}

// out (N, C) = sum_j topk_w[n,j] * ye[row_of_slot[n*k+j]], j ascending, each product rounded
// then added (the CPU's arithmetic: contraction is off on both sides).
template <int V>
__global__ void moe_combine_kernel(float* out, const float* ye, const float* topk_w, const int32_t* row_of_slot,
                                   int64_t N, int k, int64_t cv) {
  using T = typename VecF<V>::T;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (n >= N) return;
  const T* y = reinterpret_cast<const T*>(ye);
  for (int64_t c = threadIdx.x; c < cv; c += blockDim.x) {
    T acc = VecF<V>::zero();
    for (int j = 0; j < k; ++j)
      VecF<V>::add_scaled(acc, topk_w[n * k + j], y[static_cast<int64_t>(row_of_slot[n * k + j]) * cv + c]);
    reinterpret_cast<T*>(out)[n * cv + c] = acc;
  }
}

// One warp per slot (n, j): dye[r] = w * dout[n] (bit-exact), dtopk_w[n,j] = dout[n] . ye[r]
// (per-lane partial sums over c = lane mod 32, then a butterfly: a fixed order).
__global__ void moe_combine_backward_kernel(float* dye, float* dtopk_w, const float* dout, const float* ye,
                                            const float* topk_w, const int32_t* row_of_slot, int64_t N, int k,
                                            int64_t C) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (slot >= N * k) return;
  const int64_t n = slot / k, r = row_of_slot[slot];
  if (r < 0 || r >= N * k) return;  // only an invalid plan has such rows
  const float w = topk_w[slot];
  const float* d = dout + n * C;
  const float* y = ye + r * C;
  float* dy = dye + r * C;
  float dot = 0.0f;
  for (int64_t c = lane; c < C; c += 32) {
    const float dc = d[c];
    dot += dc * y[c];
    dy[c] = w * dc;
  }
  dot = warp_sum_butterfly(dot);
  if (lane == 0) dtopk_w[slot] = dot;
}

// ---- load statistics -------------------------------------------------------------------------

constexpr int kLoadThreads = 1024;

// One block: count (E) += rows routed to e (integer histogram, then one double add each);
// lse2 (1) += sum_n lse[n]^2 in double: thread t sums n = t, t + 1024, ... in order, then a fixed tree.
__global__ void moe_load_count_kernel(double* count, double* lse2, const float* lse, const int32_t* topk_idx,
                                      int64_t N, int E, int k) {
  extern __shared__ int load_hist[];  // (E)
  __shared__ double red[kLoadThreads];
  for (int e = threadIdx.x; e < E; e += blockDim.x) load_hist[e] = 0;
  __syncthreads();
  histogram_slots(load_hist, topk_idx, 0, N * k, E);
  double acc = 0.0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    const double v = static_cast<double>(lse[n]);
    acc += v * v;
  }
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = kLoadThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) red[threadIdx.x] += red[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) lse2[0] += red[0];
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] += static_cast<double>(load_hist[e]);
}

// prob_sum (E) += sum_n probs[n,e] in double. Block (32, 32) covers 32 experts: thread (x, y) sums
// rows n = y, y + 32, ... in order, then a fixed tree over y.
__global__ void moe_load_prob_kernel(double* prob_sum, const float* probs, int64_t N, int E) {
  __shared__ double red[32][33];
  const int e = blockIdx.x * 32 + threadIdx.x;
  double acc = 0.0;
  if (e < E)
    for (int64_t n = threadIdx.y; n < N; n += 32) acc += static_cast<double>(probs[n * E + e]);
  red[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  for (int stride = 16; stride > 0; stride >>= 1) {
    if (threadIdx.y < stride) red[threadIdx.y][threadIdx.x] += red[threadIdx.y + stride][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.y == 0 && e < E) prob_sum[e] += red[0][threadIdx.x];
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

// ---- launchers -----------------------------------------------------------------------------------

void moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, const float* logits,
                        const int32_t* forced_idx, int64_t N, int64_t E, int64_t k, bool norm_topk_prob,
                        cudaStream_t stream) {
  check_router_shape(N, E, k);
  if (N == 0) return;
  const int64_t floats_per_warp = E + 2 * k;
  const int warps = router_warps(floats_per_warp);
  const size_t smem = static_cast<size_t>(warps) * floats_per_warp * sizeof(float);
  const int64_t blocks = (N + warps - 1) / warps;
  NIB_CHECK(blocks <= INT32_MAX);
  const bool renorm = norm_topk_prob;  // a forced (R3) set takes the model's own gate formula
  auto launch = [&] {
    moe_router_forward_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream>>>(
        probs, lse, topk_idx, topk_w, logits, forced_idx, N, static_cast<int>(E), static_cast<int>(k), renorm);
    NIB_CUDA_CHECK_LAUNCH();
  };
  if (forced_idx == nullptr) {
    launch();
    return;
  }
  // Forced (R3) sets are checked as the CPU checks them: the first bad token is found on the device,
  // then this call waits for it and throws the CPU's message (the forced path synchronises once).
  std::lock_guard<std::mutex> lock(g_moe_forced_mutex);
  void* flag = nullptr;
  NIB_CUDA_CHECK(cudaGetSymbolAddress(&flag, g_moe_forced_error_token));
  NIB_CUDA_CHECK(cudaMemsetAsync(flag, 0xFF, sizeof(unsigned long long), stream));
  launch();
  unsigned long long bad = 0;
  NIB_CUDA_CHECK(cudaMemcpyAsync(&bad, flag, sizeof bad, cudaMemcpyDeviceToHost, stream));
  NIB_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad == ~0ull) return;
  const int64_t n = static_cast<int64_t>(bad);
  std::vector<int32_t> ids(static_cast<size_t>(k));
  NIB_CUDA_CHECK(cudaMemcpyAsync(ids.data(), forced_idx + n * k, k * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  NIB_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int64_t j = 0; j < k; ++j) {
    const int32_t id = ids[j];
    NIB_CHECK_MSG(id >= 0 && id < E, "forced expert id {} (token {}) outside [0, {})", id, n, E);
    for (int64_t j2 = 0; j2 < j; ++j2)
      NIB_CHECK_MSG(ids[j2] != id, "forced expert id {} repeated for token {}", id, n);
  }
  NIB_CHECK_MSG(false, "MoE router: the device flagged forced set of token {} but it reads valid", n);
}

void moe_router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                         const int32_t* topk_idx, const float* topk_w, const float* dprobs_extra, double z_scale,
                         int64_t N, int64_t E, int64_t k, bool renormalized, cudaStream_t stream) {
  check_router_shape(N, E, k);
  if (N == 0) return;
  const int warps = router_warps(E);
  const size_t smem = static_cast<size_t>(warps) * E * sizeof(float);
  const int64_t blocks = (N + warps - 1) / warps;
  NIB_CHECK(blocks <= INT32_MAX);
  moe_router_backward_kernel<<<static_cast<unsigned>(blocks), warps * 32, smem, stream>>>(
      dlogits, dtopk_w, probs, lse, topk_idx, topk_w, dprobs_extra, static_cast<float>(z_scale), N,
      static_cast<int>(E), static_cast<int>(k), renormalized);
  NIB_CUDA_CHECK_LAUNCH();
}

void moe_dispatch_plan(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row, const int32_t* topk_idx,
                       int64_t N, int64_t E, int64_t k, cudaStream_t stream) {
  check_router_shape(N, E, k);
  const int64_t slots = N * k;
  if (slots == 0) {
    NIB_CUDA_CHECK(cudaMemsetAsync(expert_offsets, 0, static_cast<size_t>(E + 1) * sizeof(int64_t), stream));
    return;
  }
  // Chunks of at least 2E slots: with several chunks their (chunks, E) counts fit in token_of_row
  // (chunks * E < slots), which is scratch until the last kernel fills it.
  const int slots_per_chunk = static_cast<int>(std::max<int64_t>(2048, (2 * E + 31) / 32 * 32));
  const int64_t chunks = (slots + slots_per_chunk - 1) / slots_per_chunk;
  int32_t* counts = chunks > 1 ? token_of_row : reinterpret_cast<int32_t*>(expert_offsets);
  NIB_CHECK(chunks == 1 || chunks * E <= slots);
  const int Ei = static_cast<int>(E);
  moe_dispatch_count_kernel<<<static_cast<unsigned>(chunks), 256, E * sizeof(int), stream>>>(counts, topk_idx, slots,
                                                                                               Ei, slots_per_chunk);
  NIB_CUDA_CHECK_LAUNCH();
  moe_dispatch_scan_kernel<<<1, kScanThreads, (E + 33) * sizeof(int64_t), stream>>>(expert_offsets, counts,
                                                                                   static_cast<int>(chunks), Ei);
  NIB_CUDA_CHECK_LAUNCH();
  moe_dispatch_rank_kernel<<<static_cast<unsigned>(chunks), 32, E * sizeof(int), stream>>>(
      row_of_slot, topk_idx, chunks > 1 ? counts : nullptr, expert_offsets, slots, Ei, slots_per_chunk);
  NIB_CUDA_CHECK_LAUNCH();
  moe_dispatch_tokens_kernel<<<ceil_div_int(slots, 256), 256, 0, stream>>>(token_of_row, row_of_slot, slots,
                                                                          static_cast<int>(k));
  NIB_CUDA_CHECK_LAUNCH();
}

void moe_gather(float* xe, const float* x, const int32_t* token_of_row, int64_t rows, int64_t C, cudaStream_t stream) {
  NIB_CHECK(rows >= 0 && C >= 0);
  if (rows == 0 || C == 0) return;
  if (C % 4 == 0 && aligned16(xe) && aligned16(x)) {
    const RowLaunch L = row_launch(rows, C / 4);
    moe_gather_kernel<4><<<L.grid, L.block, 0, stream>>>(xe, x, token_of_row, rows, C / 4);
  } else {
    const RowLaunch L = row_launch(rows, C);
    moe_gather_kernel<1><<<L.grid, L.block, 0, stream>>>(xe, x, token_of_row, rows, C);
  }
  NIB_CUDA_CHECK_LAUNCH();
}

void moe_gather_backward(float* dx, const float* dxe, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C,
                         cudaStream_t stream) {
  NIB_CHECK(N >= 0 && k >= 1 && C >= 0 && N * k <= INT32_MAX);
  if (N == 0 || C == 0) return;
  if (C % 4 == 0 && aligned16(dx) && aligned16(dxe)) {
    const RowLaunch L = row_launch(N, C / 4);
    moe_gather_backward_kernel<4><<<L.grid, L.block, 0, stream>>>(dx, dxe, row_of_slot, N, static_cast<int>(k), C / 4);
  } else {
    const RowLaunch L = row_launch(N, C);
    moe_gather_backward_kernel<1><<<L.grid, L.block, 0, stream>>>(dx, dxe, row_of_slot, N, static_cast<int>(k), C);
  }
  NIB_CUDA_CHECK_LAUNCH();
}

void moe_combine(float* out, const float* ye, const float* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k,
                 int64_t C, cudaStream_t stream) {
  NIB_CHECK(N >= 0 && k >= 1 && C >= 0 && N * k <= INT32_MAX);
  if (N == 0 || C == 0) return;
  if (C % 4 == 0 && aligned16(out) && aligned16(ye)) {
    const RowLaunch L = row_launch(N, C / 4);
    moe_combine_kernel<4><<<L.grid, L.block, 0, stream>>>(out, ye, topk_w, row_of_slot, N, static_cast<int>(k), C / 4);
  } else {
    const RowLaunch L = row_launch(N, C);
    moe_combine_kernel<1><<<L.grid, L.block, 0, stream>>>(out, ye, topk_w, row_of_slot, N, static_cast<int>(k), C);
  }
  NIB_CUDA_CHECK_LAUNCH();
}

void moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye, const float* topk_w,
                          const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C, cudaStream_t stream) {
  NIB_CHECK(N >= 0 && k >= 1 && C >= 0 && N * k <= INT32_MAX);
  if (N == 0) return;
  constexpr int kWarps = 8;
  const int64_t slots = N * k;
  moe_combine_backward_kernel<<<ceil_div_int(slots, kWarps), kWarps * 32, 0, stream>>>(
      dye, dtopk_w, dout, ye, topk_w, row_of_slot, N, static_cast<int>(k), C);
  NIB_CUDA_CHECK_LAUNCH();
}

void moe_accumulate_load(double* count, double* prob_sum, double* lse2, const float* probs, const float* lse,
                         const int32_t* topk_idx, int64_t N, int64_t E, int64_t k, cudaStream_t stream) {
  check_router_shape(N, E, k);
  moe_load_count_kernel<<<1, kLoadThreads, E * sizeof(int), stream>>>(count, lse2, lse, topk_idx, N,
                                                                      static_cast<int>(E), static_cast<int>(k));
  NIB_CUDA_CHECK_LAUNCH();
  moe_load_prob_kernel<<<ceil_div_int(E, 32), dim3(32, 32), 0, stream>>>(prob_sum, probs, N, static_cast<int>(E));
  NIB_CUDA_CHECK_LAUNCH();
}

}  // namespace nibble::cuda
