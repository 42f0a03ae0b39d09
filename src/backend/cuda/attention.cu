// CUDA causal GQA attention in FP32, flash-style (attention.h), after FlashAttention-2's loop
// structure without tensor cores. Forward: a block per (64 or 32 queries, head, batch), K/V tiles
// of 32 keys in shared memory (rows zero-padded to kDMax), online softmax, saves the log-sum-exp.
// Backward: delta = rowsum(dout * out) into the workspace, dk/dv per kv tile (all query heads of
// the group, the queries at or after it), dq per query tile: one writer per output, fixed sum
// orders, no atomics, bitwise deterministic. A row is owned by kLanes consecutive lanes holding
// slices d = lane + kLanes*s; dot products end in an xor-shuffle tree within the lane group.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/attention.h"
#include "backend/cuda/cuda_check.h"

namespace nibble::cuda {

namespace {

constexpr int kThreads = 256;   // per block, every kernel
constexpr int kTileRows = 32;   // keys per staged K/V tile (forward, dq); queries per staged tile (dk/dv)
constexpr int kKeyChunk = 16;  // forward: keys per online-softmax update (scores held in registers)

// Sum of v over the kLanes consecutive lanes of a row group (all 32 lanes must call it).
template <int kLanes>
__device__ __forceinline__ float lane_group_sum(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// dst (kTileRows, kDMax) <- rows r0 .. r0+kTileRows-1 of src (D floats each, rows at stride ld),
// zero-padded: rows >= n_rows and columns >= D are 0 (so the slice loops below need no bounds
// checks). All threads of the block take part.
template <int kDMax>
__device__ __forceinline__ void stage_rows(float* dst, const float* src, int64_t ld, int64_t r0, int64_t n_rows,
                                           int D) {
  for (int e = threadIdx.x; e < kTileRows * kDMax; e += kThreads) {
    const int r = e / kDMax, c = e % kDMax;
    const int64_t row = r0 + r;
    dst[e] = (row < n_rows && c < D) ? src[row * ld + c] : 0.f;
  }
}

// Loads the kSlice interleaved elements d = lane + kLanes*s of this lane from row (D floats);
// zeros where d >= D or !ok.
template <int kLanes, int kSlice>
__device__ __forceinline__ void load_slice(float (&r)[kSlice], const float* row, int lane, int D, bool ok) {
#pragma unroll
  for (int s = 0; s < kSlice; ++s) {
    const int d = lane + kLanes * s;
    r[s] = (ok && d < D) ? row[d] : 0.f;
  }
}

template <int kLanes, int kSlice>
__device__ __forceinline__ void store_slice(float* row, const float (&r)[kSlice], float mul, int lane, int D) {
#pragma unroll
  for (int s = 0; s < kSlice; ++s) {
    const int d = lane + kLanes * s;
    if (d < D) row[d] = r[s] * mul;
  }
}

// This lane's partial dot product of its slice with a zero-padded shared-memory row, in four
// interleaved FMA chains (s mod 4) added pairwise: a fixed order, short dependency chains.
template <int kLanes, int kSlice>
__device__ __forceinline__ float slice_dot(const float (&r)[kSlice], const float* srow, int lane) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s = 0; s < kSlice; ++s) acc[s % 4] = __fmaf_rn(r[s], srow[lane + kLanes * s], acc[s % 4]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// acc += a * srow (this lane's slice of a zero-padded shared-memory row), one FMA per element.
template <int kLanes, int kSlice>
__device__ __forceinline__ void slice_axpy(float (&acc)[kSlice], float a, const float* srow, int lane) {
#pragma unroll
  for (int s = 0; s < kSlice; ++s) acc[s] = __fmaf_rn(a, srow[lane + kLanes * s], acc[s]);
}

// ---- forward -------------------------------------------------------------------------------------
// Grid (ceil(T / kRows), H, B); block kThreads = kRows query rows x kLanes lanes; kDMax = kLanes *
// kSlice >= D. out: (B,T,H,D), lse: (B,H,T); q: (B,T,H,D); k, v: (B,T,Hkv,D). Dynamic shared
// memory: k_s, v_s (kTileRows, kDMax) each. The online softmax updates its running max once per
// chunk of kKeyChunk keys (fewer live scores than one update per staged tile).
template <int kLanes, int kSlice>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(float* out, float* lse, const float* q,
                                                                     const float* k, const float* v, int64_t Tn,
                                                                     int H, int Hkv, int D, float scale) {
  constexpr int kRows = kThreads / kLanes, kDMax = kLanes * kSlice;
  static_assert(kTileRows % kKeyChunk == 0, "whole chunks per tile");
  extern __shared__ float smem[];
  float* k_s = smem;                      // (kTileRows, kDMax)
  float* v_s = smem + kTileRows * kDMax;  // (kTileRows, kDMax)
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
  const int lane = threadIdx.x % kLanes;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t i = q0 + threadIdx.x / kLanes;  // this thread's query row
  const bool row_ok = i < Tn;
  const int64_t ldq = static_cast<int64_t>(H) * D, ldk = static_cast<int64_t>(Hkv) * D;
  const float* kb = k + static_cast<int64_t>(b) * Tn * ldk + static_cast<int64_t>(hk) * D;  // (T,D) ld ldk
  const float* vb = v + static_cast<int64_t>(b) * Tn * ldk + static_cast<int64_t>(hk) * D;
  const int64_t q_off = (static_cast<int64_t>(b) * Tn + (row_ok ? i : 0)) * ldq + static_cast<int64_t>(h) * D;

  float qr[kSlice], o[kSlice];
  load_slice<kLanes, kSlice>(qr, q + q_off, lane, D, row_ok);
#pragma unroll
  for (int s = 0; s < kSlice; ++s) o[s] = 0.f;
  float m = -INFINITY, l = 0.f;  // running max and sum of exp(score - m)

  const int64_t kv_end = Tn < q0 + kRows ? Tn : q0 + kRows;  // keys any row of this tile can see
  for (int64_t j0 = 0; j0 < kv_end; j0 += kTileRows) {
    __syncthreads();  // the previous tile is no longer read
    stage_rows<kDMax>(k_s, kb, ldk, j0, Tn, D);
    stage_rows<kDMax>(v_s, vb, ldk, j0, Tn, D);
    __syncthreads();
    for (int c0 = 0; c0 < kTileRows; c0 += kKeyChunk) {
      float sc[kKeyChunk];
      float chunk_max = -INFINITY;
#pragma unroll
      for (int jj = 0; jj < kKeyChunk; ++jj) {
        const float dot = lane_group_sum<kLanes>(slice_dot<kLanes, kSlice>(qr, k_s + (c0 + jj) * kDMax, lane));
        const int64_t j = j0 + c0 + jj;
        sc[jj] = (j <= i && j < Tn) ? dot * scale : -INFINITY;
        chunk_max = fmaxf(chunk_max, sc[jj]);
      }
      const float m_new = fmaxf(m, chunk_max);
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // no key seen yet: every exp stays 0, no NaN
      const float corr = expf(m - m_ref);
      l *= corr;
#pragma unroll
      for (int s = 0; s < kSlice; ++s) o[s] *= corr;
#pragma unroll
      for (int jj = 0; jj < kKeyChunk; ++jj) {
        const float p = expf(sc[jj] - m_ref);  // 0 for masked keys
        l += p;
        slice_axpy<kLanes, kSlice>(o, p, v_s + (c0 + jj) * kDMax, lane);
      }
      m = m_new;
    }
  }
  if (row_ok) {
    // every valid row has seen key 0, so l >= 1 (the max term contributes exp(0))
    store_slice<kLanes, kSlice>(out + q_off, o, 1.f / l, lane, D);
    if (lane == 0) lse[(static_cast<int64_t>(b) * H + h) * Tn + i] = m + logf(l);
  }
}

// ---- backward ------------------------------------------------------------------------------------
// delta: (B,H,T) = sum_d dout * out per query row; one warp per (b, t, h) row of dout/out (B,T,H,D).
__global__ void __launch_bounds__(kThreads) attention_delta_kernel(float* delta, const float* dout, const float* out,
                                                                   int64_t rows, int64_t Tn, int H, int D) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;  // row of (B*T*H)
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;  // whole warps leave together
  float acc = 0.f;
  for (int d = lane; d < D; d += 32) acc += dout[r * D + d] * out[r * D + d];
  acc = lane_group_sum<32>(acc);
  if (lane == 0) {
    const int64_t h = r % H, t = (r / H) % Tn, b = r / (static_cast<int64_t>(H) * Tn);
    delta[(b * H + h) * Tn + t] = acc;
  }
}

// dk, dv for one tile of kRows keys of kv head hk: sums over the query heads of the group (in head
// order) and the queries i >= j (in order). Grid (ceil(T / kRows), Hkv, B); block kRows keys x
// kLanes lanes. Dynamic shared memory: q_s, do_s (kTileRows, kDMax), lse_s, delta_s (kTileRows).
// dk, dv: (B,T,Hkv,D); dout, q: (B,T,H,D); k, v: (B,T,Hkv,D); lse, delta: (B,H,T).
template <int kLanes, int kSlice>
__global__ void __launch_bounds__(kThreads) attention_backward_dkdv_kernel(float* dk, float* dv, const float* dout,
                                                                           const float* lse, const float* delta,
                                                                           const float* q, const float* k,
                                                                           const float* v, int64_t Tn, int H, int Hkv,
                                                                           int D, float scale) {
  constexpr int kRows = kThreads / kLanes, kDMax = kLanes * kSlice;
  extern __shared__ float smem[];
  float* q_s = smem;                            // (kTileRows, kDMax)
  float* do_s = smem + kTileRows * kDMax;       // (kTileRows, kDMax)
  float* lse_s = smem + 2 * kTileRows * kDMax;  // (kTileRows)
  float* delta_s = lse_s + kTileRows;           // (kTileRows)
  const int b = blockIdx.z, hk = blockIdx.y, group = H / Hkv;
  const int lane = threadIdx.x % kLanes;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t j = k0 + threadIdx.x / kLanes;  // this thread's key row
  const bool row_ok = j < Tn;
  const int64_t ldq = static_cast<int64_t>(H) * D, ldk = static_cast<int64_t>(Hkv) * D;
  const int64_t kv_off = (static_cast<int64_t>(b) * Tn + (row_ok ? j : 0)) * ldk + static_cast<int64_t>(hk) * D;

  float kr[kSlice], vr[kSlice], dk_acc[kSlice], dv_acc[kSlice];
  load_slice<kLanes, kSlice>(kr, k + kv_off, lane, D, row_ok);
  load_slice<kLanes, kSlice>(vr, v + kv_off, lane, D, row_ok);
#pragma unroll
  for (int s = 0; s < kSlice; ++s) dk_acc[s] = dv_acc[s] = 0.f;

  for (int hh = 0; hh < group; ++hh) {
    const int h = hk * group + hh;
    const float* qb = q + static_cast<int64_t>(b) * Tn * ldq + static_cast<int64_t>(h) * D;  // (T,D) ld ldq
    const float* dob = dout + static_cast<int64_t>(b) * Tn * ldq + static_cast<int64_t>(h) * D;
    const float* lse_row = lse + (static_cast<int64_t>(b) * H + h) * Tn;      // (T)
    const float* delta_row = delta + (static_cast<int64_t>(b) * H + h) * Tn;  // (T)
    for (int64_t i0 = k0; i0 < Tn; i0 += kTileRows) {  // queries before k0 see none of these keys
      __syncthreads();
      stage_rows<kDMax>(q_s, qb, ldq, i0, Tn, D);
      stage_rows<kDMax>(do_s, dob, ldq, i0, Tn, D);
      if (threadIdx.x < kTileRows) {
        const int64_t i = i0 + threadIdx.x;
        lse_s[threadIdx.x] = i < Tn ? lse_row[i] : 0.f;
        delta_s[threadIdx.x] = i < Tn ? delta_row[i] : 0.f;
      }
      __syncthreads();
#pragma unroll 4
      for (int ii = 0; ii < kTileRows; ++ii) {
        const int64_t i = i0 + ii;
        const float* qrow = q_s + ii * kDMax;
        const float* dorow = do_s + ii * kDMax;
        const float sdot = lane_group_sum<kLanes>(slice_dot<kLanes, kSlice>(kr, qrow, lane));
        const float pdot = lane_group_sum<kLanes>(slice_dot<kLanes, kSlice>(vr, dorow, lane));
        // j < Tn follows from j <= i < Tn
        const float p = (j <= i && i < Tn) ? expf(sdot * scale - lse_s[ii]) : 0.f;
        const float ds = p * (pdot - delta_s[ii]) * scale;
        slice_axpy<kLanes, kSlice>(dv_acc, p, dorow, lane);
        slice_axpy<kLanes, kSlice>(dk_acc, ds, qrow, lane);
      }
    }
  }
  if (row_ok) {
    store_slice<kLanes, kSlice>(dk + kv_off, dk_acc, 1.f, lane, D);
    store_slice<kLanes, kSlice>(dv + kv_off, dv_acc, 1.f, lane, D);
  }
}

// dq for one tile of kRows queries of head h: sums over keys j <= i in order. Grid
// (ceil(T / kRows), H, B). Dynamic shared memory: k_s, v_s (kTileRows, kDMax).
// dq, dout, q: (B,T,H,D); k, v: (B,T,Hkv,D); lse, delta: (B,H,T).
template <int kLanes, int kSlice>
__global__ void __launch_bounds__(kThreads) attention_backward_dq_kernel(float* dq, const float* dout,
                                                                         const float* lse, const float* delta,
                                                                         const float* q, const float* k,
                                                                         const float* v, int64_t Tn, int H, int Hkv,
                                                                         int D, float scale) {
  constexpr int kRows = kThreads / kLanes, kDMax = kLanes * kSlice;
  extern __shared__ float smem[];
  float* k_s = smem;                      // (kTileRows, kDMax)
  float* v_s = smem + kTileRows * kDMax;  // (kTileRows, kDMax)
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
  const int lane = threadIdx.x % kLanes;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t i = q0 + threadIdx.x / kLanes;  // this thread's query row
  const bool row_ok = i < Tn;
  const int64_t ldq = static_cast<int64_t>(H) * D, ldk = static_cast<int64_t>(Hkv) * D;
  const float* kb = k + static_cast<int64_t>(b) * Tn * ldk + static_cast<int64_t>(hk) * D;  // (T,D) ld ldk
  const float* vb = v + static_cast<int64_t>(b) * Tn * ldk + static_cast<int64_t>(hk) * D;
  const int64_t q_off = (static_cast<int64_t>(b) * Tn + (row_ok ? i : 0)) * ldq + static_cast<int64_t>(h) * D;
  const int64_t stat = (static_cast<int64_t>(b) * H + h) * Tn + (row_ok ? i : 0);
  const float lse_i = row_ok ? lse[stat] : 0.f, delta_i = row_ok ? delta[stat] : 0.f;

  float qr[kSlice], dor[kSlice], dq_acc[kSlice];
  load_slice<kLanes, kSlice>(qr, q + q_off, lane, D, row_ok);
  load_slice<kLanes, kSlice>(dor, dout + q_off, lane, D, row_ok);
#pragma unroll
  for (int s = 0; s < kSlice; ++s) dq_acc[s] = 0.f;

  const int64_t kv_end = Tn < q0 + kRows ? Tn : q0 + kRows;
  for (int64_t j0 = 0; j0 < kv_end; j0 += kTileRows) {
    __syncthreads();
    stage_rows<kDMax>(k_s, kb, ldk, j0, Tn, D);
    stage_rows<kDMax>(v_s, vb, ldk, j0, Tn, D);
    __syncthreads();
#pragma unroll 4
    for (int jj = 0; jj < kTileRows; ++jj) {
      const int64_t j = j0 + jj;
      const float* krow = k_s + jj * kDMax;
      const float sdot = lane_group_sum<kLanes>(slice_dot<kLanes, kSlice>(qr, krow, lane));
      const float pdot = lane_group_sum<kLanes>(slice_dot<kLanes, kSlice>(dor, v_s + jj * kDMax, lane));
      const float p = (j <= i && row_ok) ? expf(sdot * scale - lse_i) : 0.f;
      const float ds = p * (pdot - delta_i) * scale;
      slice_axpy<kLanes, kSlice>(dq_acc, ds, krow, lane);
    }
  }
  if (row_ok) store_slice<kLanes, kSlice>(dq + q_off, dq_acc, 1.f, lane, D);
}

// ---- launchers -----------------------------------------------------------------------------------

struct Shape {
  int64_t B, Tn, H, Hkv, D;
};

void check_shape(const Shape& s) {
  NIB_CHECK_MSG(s.B >= 0 && s.Tn >= 0 && s.H > 0 && s.Hkv > 0 && s.H % s.Hkv == 0,
                "attention: B={} T={} H={} Hkv={} (H must be a multiple of Hkv)", s.B, s.Tn, s.H, s.Hkv);
  NIB_CHECK_MSG(s.D >= 1 && s.D <= 256, "attention: head dim D={} outside 1..256", s.D);
  NIB_CHECK_MSG(s.B <= 65535 && s.H <= 65535, "attention: B={} H={} beyond the grid's y/z limits", s.B, s.H);
}

// Launches kernel<kLanes, kSlice> for the smallest slice layout holding D: D <= 32: 4 lanes x 8,
// D <= 64: 4 x 16, D <= 128: 4 x 32, D <= 256: 8 x 32 (at most 4 x 32 live slice floats per
// thread; 8 lanes x 16 for D = 128 measured no faster on the H200).
template <template <int, int> class Launch, typename... Args>
void dispatch_head_dim(int64_t D, Args&&... args) {
  if (D <= 32) Launch<4, 8>::run(args...);
  else if (D <= 64) Launch<4, 16>::run(args...);
  else if (D <= 128) Launch<4, 32>::run(args...);
  else Launch<8, 32>::run(args...);
}

// Dynamic shared memory above the 48 KB default needs the per-kernel opt-in.
template <typename Kernel>
void allow_shared_bytes(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    NIB_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

unsigned grid_x(int64_t Tn, int rows) { return static_cast<unsigned>((Tn + rows - 1) / rows); }

template <int kLanes, int kSlice>
struct ForwardLaunch {
  static void run(float* out, float* lse, const float* q, const float* k, const float* v, const Shape& s, float scale,
                  cudaStream_t stream) {
    constexpr int kRows = kThreads / kLanes;
    const size_t smem = 2 * kTileRows * static_cast<size_t>(kLanes * kSlice) * sizeof(float);
    auto kernel = attention_forward_kernel<kLanes, kSlice>;
    allow_shared_bytes(kernel, smem);
    const dim3 grid(grid_x(s.Tn, kRows), static_cast<unsigned>(s.H), static_cast<unsigned>(s.B));
    kernel<<<grid, kThreads, smem, stream>>>(out, lse, q, k, v, s.Tn, static_cast<int>(s.H), static_cast<int>(s.Hkv),
                                              static_cast<int>(s.D), scale);
    NIB_CUDA_CHECK_LAUNCH();
  }
};

template <int kLanes, int kSlice>
struct BackwardLaunch {
  static void run(float* dq, float* dk, float* dv, const float* dout, const float* lse, const float* delta,
                  const float* q, const float* k, const float* v, const Shape& s, float scale, cudaStream_t stream) {
    constexpr int kRows = kThreads / kLanes;
    const int H = static_cast<int>(s.H), Hkv = static_cast<int>(s.Hkv), D = static_cast<int>(s.D);
    const size_t smem_dkdv = (2 * kTileRows * static_cast<size_t>(kLanes * kSlice) + 2 * kTileRows) * sizeof(float);
    auto dkdv = attention_backward_dkdv_kernel<kLanes, kSlice>;
    allow_shared_bytes(dkdv, smem_dkdv);
    const dim3 grid_kv(grid_x(s.Tn, kRows), static_cast<unsigned>(s.Hkv), static_cast<unsigned>(s.B));
    dkdv<<<grid_kv, kThreads, smem_dkdv, stream>>>(dk, dv, dout, lse, delta, q, k, v, s.Tn, H, Hkv, D, scale);
    NIB_CUDA_CHECK_LAUNCH();

    const size_t smem_dq = 2 * kTileRows * static_cast<size_t>(kLanes * kSlice) * sizeof(float);
    auto dq_kernel = attention_backward_dq_kernel<kLanes, kSlice>;
    allow_shared_bytes(dq_kernel, smem_dq);
    const dim3 grid_q(grid_x(s.Tn, kRows), static_cast<unsigned>(s.H), static_cast<unsigned>(s.B));
    dq_kernel<<<grid_q, kThreads, smem_dq, stream>>>(dq, dout, lse, delta, q, k, v, s.Tn, H, Hkv, D, scale);
    NIB_CUDA_CHECK_LAUNCH();
  }
};

float softmax_scale(int64_t D) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))); }

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t Tn,
                       int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream) {
  const Shape s{B, Tn, H, Hkv, D};
  check_shape(s);
  if (B == 0 || Tn == 0) return;
  dispatch_head_dim<ForwardLaunch>(D, out, lse, q, k, v, s, softmax_scale(D), stream);
}

size_t attention_backward_workspace_bytes(int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D) {
  return static_cast<size_t>(B * H * Tn) * sizeof(float);  // delta (B,H,T)
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                        int64_t Hkv, int64_t D, void* workspace, cudaStream_t stream) {
  const Shape s{B, Tn, H, Hkv, D};
  check_shape(s);
  if (B == 0 || Tn == 0) return;
  NIB_CHECK_MSG(workspace != nullptr, "attention_backward: workspace of {} bytes needed",
                attention_backward_workspace_bytes(B, Tn, H, Hkv, D));
  float* delta = static_cast<float*>(workspace);  // (B,H,T)
  const int64_t rows = B * Tn * H;
  constexpr int kWarps = kThreads / 32;
  attention_delta_kernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
      delta, dout, out, rows, Tn, static_cast<int>(H), static_cast<int>(D));
  NIB_CUDA_CHECK_LAUNCH();
  dispatch_head_dim<BackwardLaunch>(D, dq, dk, dv, dout, lse, delta, q, k, v, s, softmax_scale(D), stream);
}

}  // namespace nibble::cuda
