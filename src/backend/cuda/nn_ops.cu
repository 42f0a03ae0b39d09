// CUDA per-token layers (nn_ops.h): embedding, RMSNorm, RoPE, SwiGLU, softmax cross-entropy
// with z-loss and the elementwise helpers, each with the formula and operation order of
// backend/cpu/nn_ops.cpp (rounding differs only where a reduction's order or expf's last bit
// does; the op tests bound both). Reductions: one block per row with block_reduce's fixed tree;
// RMSNorm's dw from per-chunk partials summed in chunk order; the embedding gradient from a
// stable radix sort of (token, n) pairs, each vocab row summed by one block in token order n.
#include "backend/cuda/nn_ops.h"

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cmath>

#include "backend/cuda/block_reduce.cuh"

namespace nibble::cuda {

namespace {

#define NIB_RETURN_IF_CUDA_ERROR(expr)       \
  do {                                       \
    cudaError_t e_ = (expr);                 \
    if (e_ != cudaSuccess) return e_;        \
  } while (0)

constexpr int kThreads = 256;

unsigned grid_for(int64_t n, int threads = kThreads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, int64_t{1} << 20)));
}

#define NIB_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

// ---- embedding ---------------------------------------------------------------------------------
// One block per token row n: out[n, :] = wte[tokens[n], :].
__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte, int64_t V, int64_t C,
                                         uint32_t* error_flags) {
  const int64_t n = blockIdx.x;
  const int32_t tok = tokens[n];
  const bool ok = tok >= 0 && tok < V;
  if (!ok && threadIdx.x == 0) atomicOr(error_flags, kErrorTokenId);
  float* o = out + n * C;
  const float* row = wte + (ok ? int64_t(tok) : 0) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = ok ? row[c] : __int_as_float(0x7FC00000);
}

// keys (N) <- tokens, out-of-range ids replaced by V (sorted last, skipped); rows (N) <- n.
__global__ void embedding_sort_input_kernel(int32_t* keys, int32_t* rows, const int32_t* tokens, int64_t N, int64_t V,
                                            uint32_t* error_flags) {
  NIB_GRID_STRIDE(n, N) {
    const int32_t tok = tokens[n];
    const bool ok = tok >= 0 && tok < V;
    if (!ok) atomicOr(error_flags, kErrorTokenId);
    keys[n] = ok ? tok : static_cast<int32_t>(V);
    rows[n] = static_cast<int32_t>(n);
  }
}

// One block per sorted position i; the block at the start of a run of equal keys owns that
// vocab row and adds the run's dout rows in sorted (= token) order, as the CPU does.
// keys, rows: (N) sorted by key, stably (rows ascending within a key).
__global__ void embedding_backward_runs_kernel(float* dwte, const float* dout, const int32_t* keys,
                                               const int32_t* rows, int64_t N, int64_t V, int64_t C) {
  const int64_t i = blockIdx.x;
  const int32_t tok = keys[i];
  if (tok >= V || (i > 0 && keys[i - 1] == tok)) return;
  int64_t end = i + 1;
  while (end < N && keys[end] == tok) ++end;
  float* d = dwte + int64_t(tok) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = d[c];
    for (int64_t p = i; p < end; ++p) acc += dout[int64_t(rows[p]) * C + c];
    d[c] = acc;
  }
}

int key_bits(int64_t V) {  // bits that hold 0..V (V is the sentinel)
  int b = 1;
  while (b < 31 && (int64_t{1} << b) <= V) ++b;
  return b;
}

size_t cub_sort_bytes(int64_t N) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<int>(N), 0, 31);
  return bytes;
}

// ---- RMSNorm ---------------------------------------------------------------------------------
// One block per row r.
__global__ void rmsnorm_forward_kernel(float* out, float* rstd, const float* x, const float* w, int64_t C, float eps) {
  __shared__ float shared[33];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * C;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += xr[c] * xr[c];
  ss = block_reduce(ss, SumOp{}, 0.0f, shared);
  const float s = 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[r] = s;
  float* o = out + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = w[c] * (xr[c] * s);
}

// dx row r = s (dout w) - s^3 x (sum_j dout_j w_j x_j) / C. One block per row.
__global__ void rmsnorm_backward_dx_kernel(float* dx, const float* dout, const float* x, const float* w,
                                           const float* rstd, int64_t C) {
  __shared__ float shared[33];
  const int64_t r = blockIdx.x;
  const float* xr = x + r * C;
  const float* dr = dout + r * C;
  const float s = rstd[r];
  float dot = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += dr[c] * w[c] * xr[c];
  dot = block_reduce(dot, SumOp{}, 0.0f, shared);
  const float k = s * s * s * dot / static_cast<float>(C);
  float* o = dx + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = s * (dr[c] * w[c]) - k * xr[c];
}

constexpr int64_t kRmsRowsPerChunk = 64;

// partial: (chunks, C): partial[q, c] = sum over rows r of chunk q, in row order, of dout x s.
// grid (ceil(C / blockDim), chunks).
__global__ void rmsnorm_dw_partial_kernel(float* partial, const float* dout, const float* x, const float* rstd,
                                          int64_t R, int64_t C) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t q = blockIdx.y;
  if (c >= C) return;
  const int64_t r0 = q * kRmsRowsPerChunk, r1 = min(R, r0 + kRmsRowsPerChunk);
  float p = 0;
  for (int64_t r = r0; r < r1; ++r) p += dout[r * C + c] * (x[r * C + c] * rstd[r]);
  partial[q * C + c] = p;
}

// dw (C) += sum over chunks in order of partial (chunks, C).
__global__ void rmsnorm_dw_finish_kernel(float* dw, const float* partial, int64_t chunks, int64_t C) {
  NIB_GRID_STRIDE(c, C) {
    float s = 0;
    for (int64_t q = 0; q < chunks; ++q) s += partial[q * C + c];
    dw[c] += s;
  }
}

// ---- RoPE --------------------------------------------------------------------------------------
// One thread per (row bt*H + h, j < D/2): the pair (j, j + D/2), rotated as the CPU does.
__global__ void rope_kernel(float* out, const float* x, const float* cos, const float* sin, const int32_t* positions,
                            int64_t Tn, int64_t H, int64_t D, float sign, int64_t total) {
  const int64_t half = D / 2;
  NIB_GRID_STRIDE(i, total) {
    const int64_t j = i % half, row = i / half;  // row = bt * H + h
    const int64_t bt = row / H;
    const int64_t pos = positions ? positions[bt] : bt % Tn;
    const float c = cos[pos * half + j], sj = sign * sin[pos * half + j];
    const float x1 = x[row * D + j], x2 = x[row * D + j + half];
    out[row * D + j] = x1 * c - x2 * sj;
    out[row * D + j + half] = x2 * c + x1 * sj;
  }
}

// ---- SwiGLU ------------------------------------------------------------------------------------
__global__ void swiglu_forward_kernel(float* out, const float* gu, int64_t I, int64_t total) {
  NIB_GRID_STRIDE(i, total) {
    const int64_t n = i / I, k = i % I;
    const float g = gu[n * 2 * I + k], u = gu[n * 2 * I + I + k];
    const float sg = 1.0f / (1.0f + expf(-g));
    out[i] = g * sg * u;
  }
}

__global__ void swiglu_backward_kernel(float* dgu, const float* dout, const float* gu, int64_t I, int64_t total) {
  NIB_GRID_STRIDE(i, total) {
    const int64_t n = i / I, k = i % I;
    const float g = gu[n * 2 * I + k], u = gu[n * 2 * I + I + k], d = dout[i];
    const float sg = 1.0f / (1.0f + expf(-g));
    const float silu = g * sg;
    dgu[n * 2 * I + k] = d * u * (sg * (1.0f + g * (1.0f - sg)));
    dgu[n * 2 * I + I + k] = d * silu;
  }
}

// ---- cross-entropy -----------------------------------------------------------------------------
constexpr int kCeThreads = 512;

// One block per row n. kBackward: also dlogits (may alias logits: the target logit is read
// before the barrier that precedes every write; each element is read and written by one thread).
template <bool kBackward>
__global__ void __launch_bounds__(kCeThreads) cross_entropy_row_kernel(float* dlogits, float* lse, float* token_ce,
                                                                       const float* logits, const int32_t* targets,
                                                                       int64_t V, float ce_scale, float z_scale,
                                                                       uint32_t* error_flags) {
  __shared__ float shared_f[33];
  __shared__ double shared_d[33];
  const int64_t n = blockIdx.x;
  const float* l = logits + n * V;
  const int32_t t = targets[n];
  const bool bad = t >= V;
  if (bad && threadIdx.x == 0) atomicOr(error_flags, kErrorTargetId);
  const bool valid = t >= 0 && !bad;
  const float lt = valid ? l[t] : 0.0f;
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = l[v] > mx ? l[v] : mx;
  mx = block_reduce(mx, MaxOp{}, -INFINITY, shared_f);  // ends with a barrier: lt is read everywhere
  double sum = 0;
  float* d = kBackward ? dlogits + n * V : nullptr;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float ev = expf(l[v] - mx);
    if constexpr (kBackward) d[v] = ev;
    sum += static_cast<double>(ev);
  }
  sum = block_reduce(sum, SumOp{}, 0.0, shared_d);
  const float ls = mx + static_cast<float>(log(sum));
  if (threadIdx.x == 0) {
    lse[n] = ls;
    if (token_ce) token_ce[n] = valid ? ls - lt : 0.0f;
  }
  if constexpr (kBackward) {
    if (!valid) {
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) d[v] = 0.0f;
      return;
    }
    const float coef = (ce_scale + 2.0f * z_scale * ls) / static_cast<float>(sum);
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      float dv = d[v] * coef;
      if (v == t) dv -= ce_scale;
      d[v] = dv;
    }
  }
}

// sums (4) <- {sum ce, sum lse^2, n_valid, 0} over valid rows; one block, fixed order. ce from
// token_ce when given, else lse[n] - logits[n, t] in f32 (the CPU forward's per-token ce).
__global__ void __launch_bounds__(1024) cross_entropy_sums_kernel(double* sums, const float* lse,
                                                                  const float* token_ce, const float* logits,
                                                                  const int32_t* targets, int64_t N, int64_t V) {
  __shared__ double shared[33];
  double ce = 0, z = 0, cnt = 0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    const int32_t t = targets[n];
    if (t < 0 || t >= V) continue;
    const float ls = lse[n];
    ce += static_cast<double>(token_ce ? token_ce[n] : ls - logits[n * V + t]);
    z += static_cast<double>(ls) * static_cast<double>(ls);
    cnt += 1;
  }
  ce = block_reduce(ce, SumOp{}, 0.0, shared);
  z = block_reduce(z, SumOp{}, 0.0, shared);
  cnt = block_reduce(cnt, SumOp{}, 0.0, shared);
  if (threadIdx.x == 0) sums[0] = ce, sums[1] = z, sums[2] = cnt, sums[3] = 0;
}

// ---- elementwise -------------------------------------------------------------------------------
__global__ void add_inplace_kernel(float* y, const float* x, int64_t n) {
  NIB_GRID_STRIDE(i, n) y[i] += x[i];
}
__global__ void add_kernel(float* y, const float* a, const float* b, int64_t n) {
  NIB_GRID_STRIDE(i, n) y[i] = a[i] + b[i];
}
__global__ void scale_kernel(float* x, int64_t n, float s) {
  NIB_GRID_STRIDE(i, n) x[i] *= s;
}
__global__ void copy_2d_kernel(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t cols,
                               int64_t total) {
  NIB_GRID_STRIDE(i, total) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * dst_ld + c] = src[r * src_ld + c];
  }
}

}  // namespace

cudaError_t embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V, int64_t C,
                              uint32_t* error_flags, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  embedding_forward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(out, tokens, wte, V, C, error_flags);
  return cudaGetLastError();
}

size_t embedding_backward_workspace_bytes(int64_t N) {
  const size_t ids = align256(static_cast<size_t>(std::max<int64_t>(N, 1)) * sizeof(int32_t));
  return 4 * ids + align256(cub_sort_bytes(std::max<int64_t>(N, 1)));
}

cudaError_t embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V, int64_t C,
                               void* workspace, uint32_t* error_flags, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return cudaSuccess;
  const size_t ids = align256(static_cast<size_t>(N) * sizeof(int32_t));
  char* ws = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<int32_t*>(ws);
  auto* rows_in = reinterpret_cast<int32_t*>(ws + ids);
  auto* keys = reinterpret_cast<int32_t*>(ws + 2 * ids);
  auto* rows = reinterpret_cast<int32_t*>(ws + 3 * ids);
  void* sort_tmp = ws + 4 * ids;
  size_t sort_bytes = cub_sort_bytes(N);
  embedding_sort_input_kernel<<<grid_for(N), kThreads, 0, stream>>>(keys_in, rows_in, tokens, N, V, error_flags);
  NIB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  NIB_RETURN_IF_CUDA_ERROR(cub::DeviceRadixSort::SortPairs(sort_tmp, sort_bytes, keys_in, keys, rows_in, rows,
                                                           static_cast<int>(N), 0, key_bits(V), stream));
  embedding_backward_runs_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(dwte, dout, keys, rows, N, V, C);
  return cudaGetLastError();
}

cudaError_t rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C, double eps,
                            cudaStream_t stream) {
  if (R <= 0) return cudaSuccess;
  rmsnorm_forward_kernel<<<static_cast<unsigned>(R), kThreads, 0, stream>>>(out, rstd, x, w, C, static_cast<float>(eps));
  return cudaGetLastError();
}

size_t rmsnorm_backward_workspace_bytes(int64_t R, int64_t C) {
  const int64_t chunks = std::max<int64_t>(1, (R + kRmsRowsPerChunk - 1) / kRmsRowsPerChunk);
  return static_cast<size_t>(chunks * std::max<int64_t>(C, 1)) * sizeof(float);
}

cudaError_t rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                             const float* rstd, int64_t R, int64_t C, void* workspace, cudaStream_t stream) {
  if (R <= 0 || C <= 0) return cudaSuccess;
  rmsnorm_backward_dx_kernel<<<static_cast<unsigned>(R), kThreads, 0, stream>>>(dx, dout, x, w, rstd, C);
  NIB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  const int64_t chunks = (R + kRmsRowsPerChunk - 1) / kRmsRowsPerChunk;
  auto* partial = static_cast<float*>(workspace);
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
  rmsnorm_dw_partial_kernel<<<grid, kThreads, 0, stream>>>(partial, dout, x, rstd, R, C);
  NIB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  rmsnorm_dw_finish_kernel<<<grid_for(C), kThreads, 0, stream>>>(dw, partial, chunks, C);
  return cudaGetLastError();
}

cudaError_t rope_apply(float* out, const float* x, const float* cos, const float* sin, const int32_t* positions,
                       int64_t B, int64_t Tn, int64_t H, int64_t D, float sign, cudaStream_t stream) {
  const int64_t total = B * Tn * H * (D / 2);
  if (total <= 0) return cudaSuccess;
  rope_kernel<<<grid_for(total), kThreads, 0, stream>>>(out, x, cos, sin, positions, Tn, H, D, sign, total);
  return cudaGetLastError();
}

cudaError_t swiglu_forward(float* out, const float* gu, int64_t N, int64_t I, cudaStream_t stream) {
  if (N * I <= 0) return cudaSuccess;
  swiglu_forward_kernel<<<grid_for(N * I), kThreads, 0, stream>>>(out, gu, I, N * I);
  return cudaGetLastError();
}

cudaError_t swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I, cudaStream_t stream) {
  if (N * I <= 0) return cudaSuccess;
  swiglu_backward_kernel<<<grid_for(N * I), kThreads, 0, stream>>>(dgu, dout, gu, I, N * I);
  return cudaGetLastError();
}

cudaError_t cross_entropy_forward(double* sums, float* lse, float* token_ce, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V, uint32_t* error_flags,
                                  cudaStream_t stream) {
  if (N > 0) {
    cross_entropy_row_kernel<false><<<static_cast<unsigned>(N), kCeThreads, 0, stream>>>(
        nullptr, lse, token_ce, logits, targets, V, 0.0f, 0.0f, error_flags);
    NIB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  }
  cross_entropy_sums_kernel<<<1, 1024, 0, stream>>>(sums, lse, token_ce, logits, targets, N, V);
  return cudaGetLastError();
}

cudaError_t cross_entropy_forward_backward(double* sums, float* dlogits, float* lse, float* token_ce,
                                           const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                           double ce_scale, double z_scale, uint32_t* error_flags,
                                           cudaStream_t stream) {
  if (N > 0) {
    cross_entropy_row_kernel<true><<<static_cast<unsigned>(N), kCeThreads, 0, stream>>>(
        dlogits, lse, token_ce, logits, targets, V, static_cast<float>(ce_scale), static_cast<float>(z_scale),
        error_flags);
    NIB_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  }
  cross_entropy_sums_kernel<<<1, 1024, 0, stream>>>(sums, lse, token_ce, nullptr, targets, N, V);
  return cudaGetLastError();
}

cudaError_t add_inplace(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_inplace_kernel<<<grid_for(n), kThreads, 0, stream>>>(y, x, n);
  return cudaGetLastError();
}

cudaError_t add(float* y, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(y, a, b, n);
  return cudaGetLastError();
}

cudaError_t scale(float* x, int64_t n, float s, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  scale_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, s);
  return cudaGetLastError();
}

cudaError_t copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols,
                    cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  copy_2d_kernel<<<grid_for(rows * cols), kThreads, 0, stream>>>(dst, dst_ld, src, src_ld, cols, rows * cols);
  return cudaGetLastError();
}

}  // namespace nibble::cuda
