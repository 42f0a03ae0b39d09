// CpuBackend (cpu_backend.h): each op forwards to today's CPU function, so results are the ones
// the CPU engine always produced; the small utilities the recipes used to hand-roll (BF16
// gathers, tiled transpose, column scatters) are here, unchanged. Also the backend registry
// (make_backend), which lives beside the CPU backend so that linking it always links "cpu".
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include <unistd.h>

#include "backend/cpu/attention.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/moe.h"
#include "backend/cpu/nn_ops.h"
#include "backend/cpu/paged_attention.h"
#include "core/bits.h"
#include "core/parallel.h"
#include "core/softmax_f64.h"
#include "formats/quantize_cpu.h"

namespace nibble::backend {

namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per task and per partial sum (train/optimizer.cpp)
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

template <typename T>
void transpose_tiled(T* dst, const T* src, int64_t rows, int64_t cols) {
  // 32 x 32 tiles: the 32 source rows of a tile stay in L1 while its 32 destination rows are written.
  constexpr int64_t kTile = 32;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  parallel_for(col_tiles, std::max<int64_t>(1, grain(rows) / kTile), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = t * kTile, c1 = std::min(cols, c0 + kTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        const int64_t r1 = std::min(rows, r0 + kTile);
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
      }
    }
  });
}

formats::MxScaleRule mxfp8_rule() { return formats::MxScaleRule::kRceil; }

template <typename In>
void quantize_any(QuantizedTensor& q, const In* x, const formats::SrKey* sr) {
  switch (q.format) {
    case QuantFormat::kNvfp4Te:
      *q.outer = formats::nvfp4_te_quantize_cpu(q.codes, q.scales, x, q.rows, q.cols, sr);
      return;
    case QuantFormat::kNvfp4Te2d:
      NIB_CHECK_MSG(sr == nullptr, "nvfp4-te-2d quantization is RTN only");
      if constexpr (std::is_same_v<In, float>) {
        *q.outer = formats::nvfp4_te_quantize_2d_cpu(q.codes, q.scales, nullptr, nullptr, x, q.rows, q.cols);
      } else {
        std::vector<float> xf(static_cast<size_t>(q.rows * q.cols));
        for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_bits_to_f32(x[i]);
        *q.outer = formats::nvfp4_te_quantize_2d_cpu(q.codes, q.scales, nullptr, nullptr, xf.data(), q.rows, q.cols);
      }
      return;
    case QuantFormat::kNvfp4TwoLevel:
      formats::nvfp4_2level_quantize_cpu(q.codes, q.scales, q.outer, x, q.rows, q.cols, sr);
      return;
    case QuantFormat::kMxfp8:
      NIB_CHECK_MSG(sr == nullptr, "mxfp8 quantization is RTN only");
      formats::mxfp8_quantize_cpu(q.codes, q.scales, x, q.rows, q.cols, mxfp8_rule());
      return;
  }
}

}  // namespace

// ---- memory ---------------------------------------------------------------------------------------
Result<void*> CpuBackend::allocate(size_t bytes, const std::string& what) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  // Zero-filled memory is touched at once, so more than the machine's RAM can never succeed:
  // refuse it up front (also keeps sanitizer allocators from aborting on absurd sizes).
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const bool beyond_ram = pages > 0 && page > 0 && rounded / static_cast<size_t>(page) > static_cast<size_t>(pages);
  void* p = beyond_ram ? nullptr : std::aligned_alloc(64, rounded);
  if (p == nullptr)
    return Status(StatusCode::kInternal,
                  fmt::format("out of host memory on cpu allocating {}: {} bytes requested; lower batch_size or "
                              "seq_len in the run config (raise grad_accum to keep the tokens per step), or choose a "
                              "smaller model",
                              what, bytes));
  std::memset(p, 0, rounded);
  std::lock_guard<std::mutex> lock(memory_mutex_);
  sizes_[p] = rounded;
  in_use_ += static_cast<int64_t>(rounded);
  peak_ = std::max(peak_, in_use_);
  return p;
}
void CpuBackend::deallocate(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    auto it = sizes_.find(p);
    if (it != sizes_.end()) {
      in_use_ -= static_cast<int64_t>(it->second);
      sizes_.erase(it);
    }
  }
  std::free(p);
}
Backend::MemoryStats CpuBackend::memory_stats() {
  std::lock_guard<std::mutex> lock(memory_mutex_);
  return {in_use_, peak_};
}
void CpuBackend::reset_peak_memory() {
  std::lock_guard<std::mutex> lock(memory_mutex_);
  peak_ = in_use_;
}
void CpuBackend::copy_to_device(void* dst, const void* host_src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host_src, bytes);
}
void CpuBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(host_dst, src, bytes);
}
void CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
}
void CpuBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes > 0) std::memset(dst, 0, bytes);
}

// ---- GEMMs (operands_bf16 changes nothing on the CPU: FP32 products of BF16 values are exact) -----
void CpuBackend::matmul_nt(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K, bool accumulate,
                           bool) {
  if (batch_invariant_)
    cpu::matmul_nt_row_invariant(y, x, w, M, N, K, accumulate);
  else
    cpu::matmul_nt(y, x, w, M, N, K, accumulate);
}
void CpuBackend::matmul_nn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool accumulate,
                           bool) {
  cpu::matmul_nn(y, a, b, M, N, K, accumulate);
}
void CpuBackend::matmul_tn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool accumulate,
                           bool) {
  cpu::matmul_tn(y, a, b, M, N, K, accumulate);
}

// ---- BF16-operand GEMMs: exact widening to FP32, today's FP32 GEMM, then alpha ---------------------
namespace {

enum class Bf16Layout { kNT, kNN, kTN };

// dst (n) f32 <- src (n) bf16 bits (exact).
void widen_bf16(std::vector<float>& dst, const uint16_t* src, int64_t n) {
  if (dst.size() < static_cast<size_t>(n)) dst.resize(static_cast<size_t>(n));
  float* d = dst.data();
  parallel_for(n, 1 << 15, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) d[i] = bf16_bits_to_f32(src[i]);
  });
}

// y (M,N) = alpha · (a . b in `layout`) [+ y], the CPU contract of backend.h: without alpha the
// FP32 GEMM accumulates as matmul_* does; with alpha the sum s is formed first, then
// y = fl(alpha · s) or fma(alpha, s, y).
void matmul_bf16_cpu(Bf16Layout layout, float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N,
                     int64_t K, const float* alpha, bool accumulate, bool batch_invariant) {
  // grow-only per thread: the oracle allocates nothing in a steady-state step
  thread_local std::vector<float> af, bf, sum;
  widen_bf16(af, a, M * K);
  widen_bf16(bf, b, N * K);
  float* out = y;
  bool acc = accumulate;
  if (alpha != nullptr) {
    if (sum.size() < static_cast<size_t>(M * N)) sum.resize(static_cast<size_t>(M * N));
    out = sum.data(), acc = false;
  }
  switch (layout) {
    case Bf16Layout::kNT:
      if (batch_invariant)
        cpu::matmul_nt_row_invariant(out, af.data(), bf.data(), M, N, K, acc);
      else
        cpu::matmul_nt(out, af.data(), bf.data(), M, N, K, acc);
      break;
    case Bf16Layout::kNN: cpu::matmul_nn(out, af.data(), bf.data(), M, N, K, acc); break;
    case Bf16Layout::kTN: cpu::matmul_tn(out, af.data(), bf.data(), M, N, K, acc); break;
  }
  if (alpha == nullptr) return;
  const float s = *alpha;
  const float* t = sum.data();  // this thread's buffer (a thread_local named in the lambda would be the worker's)
  parallel_for(M * N, 1 << 15, [&](int64_t b0, int64_t e) {
    if (accumulate)
      for (int64_t i = b0; i < e; ++i) y[i] = std::fma(s, t[i], y[i]);
    else
      for (int64_t i = b0; i < e; ++i) y[i] = s * t[i];
  });
}

}  // namespace

void CpuBackend::matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                const float* alpha, bool accumulate) {
  matmul_bf16_cpu(Bf16Layout::kNT, y, a, b, M, N, K, alpha, accumulate, batch_invariant_);
}
void CpuBackend::matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                const float* alpha, bool accumulate) {
  matmul_bf16_cpu(Bf16Layout::kNN, y, a, b, M, N, K, alpha, accumulate, false);
}
void CpuBackend::matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                const float* alpha, bool accumulate) {
  matmul_bf16_cpu(Bf16Layout::kTN, y, a, b, M, N, K, alpha, accumulate, false);
}

// ---- grouped BF16 GEMMs: the reference is one matmul_bf16 per non-empty group ----------------------
namespace {
// Checks the offsets contract of backend.h (host-readable here) and returns group g's rows.
int64_t group_rows(const int64_t* offsets, int64_t g, int64_t G, int64_t extent) {
  NIB_CHECK_MSG(offsets[0] == 0 && offsets[G] <= extent && offsets[g] <= offsets[g + 1],
                "grouped gemm: offsets must be non-decreasing from 0 to at most {} (group {}: [{}, {}))", extent, g,
                offsets[g], offsets[g + 1]);
  return offsets[g + 1] - offsets[g];
}

// Rows grouped (nt, nn): group g's rows of a and y against b + g * b_stride.
void grouped_rows_cpu(Bf16Layout layout, float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                      int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride, const float* alpha,
                      bool accumulate, bool batch_invariant) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = group_rows(offsets, g, G, extent), r0 = offsets[g];
    if (rows > 0)
      matmul_bf16_cpu(layout, y + r0 * N, a + r0 * K, b + g * b_stride, rows, N, K,
                      alpha != nullptr ? alpha + g : nullptr, accumulate, batch_invariant);
  }
}
}  // namespace

void CpuBackend::grouped_matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                        int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                        const float* alpha, bool accumulate) {
  grouped_rows_cpu(Bf16Layout::kNT, y, a, b, offsets, G, extent, N, K, b_stride, alpha, accumulate, batch_invariant_);
}
void CpuBackend::grouped_matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                        int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                        const float* alpha, bool accumulate) {
  grouped_rows_cpu(Bf16Layout::kNN, y, a, b, offsets, G, extent, N, K, b_stride, alpha, accumulate, false);
}
namespace {
// Reduction grouped (tn, nt_blocks): y_g (M,N) at y + g * y_stride from group g's operands, which
// start a_step / b_step elements per reduction row into a / b; an empty group's y_g is zero-filled.
void grouped_reduction_cpu(Bf16Layout layout, float* y, const uint16_t* a, const uint16_t* b,
                           const int64_t* offsets, int64_t G, int64_t extent, int64_t M, int64_t N, int64_t a_step,
                           int64_t b_step, int64_t y_stride, const float* alpha, bool accumulate) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t kg = group_rows(offsets, g, G, extent), k0 = offsets[g];
    float* yg = y + g * y_stride;
    if (kg > 0)
      matmul_bf16_cpu(layout, yg, a + a_step * k0, b + b_step * k0, M, N, kg, alpha != nullptr ? alpha + g : nullptr,
                      accumulate, /*batch_invariant=*/false);  // a training reduction
    else if (!accumulate)
      std::fill(yg, yg + M * N, 0.f);  // an empty sum
  }
}
}  // namespace

void CpuBackend::grouped_matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                        int64_t G, int64_t extent, int64_t M, int64_t N, int64_t y_stride,
                                        const float* alpha, bool accumulate) {
  grouped_reduction_cpu(Bf16Layout::kTN, y, a, b, offsets, G, extent, M, N, M, N, y_stride, alpha, accumulate);
}
void CpuBackend::grouped_matmul_bf16_nt_blocks(float* y, const uint16_t* a, const uint16_t* b,
                                               const int64_t* offsets, int64_t G, int64_t extent, int64_t M,
                                               int64_t N, int64_t a_rows, int64_t b_rows, int64_t y_stride,
                                               const float* alpha, bool accumulate) {
  NIB_CHECK_MSG(a_rows >= M && b_rows >= N,
                "grouped_matmul_bf16_nt_blocks: blocks of {} / {} rows hold fewer than M={} / N={}", a_rows, b_rows, M,
                N);
  // group g's blocks (a_rows, K_g) and (b_rows, K_g) start a_rows / b_rows elements per column before it
  grouped_reduction_cpu(Bf16Layout::kNT, y, a, b, offsets, G, extent, M, N, a_rows, b_rows, y_stride, alpha,
                        accumulate);
}
void CpuBackend::moe_dispatch_plan_device(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row,
                                          const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
  cpu::moe_dispatch_plan(expert_offsets, row_of_slot, token_of_row, topk_idx, N, E, k);  // host memory is ours
}

// ---- per-token layers ---------------------------------------------------------------------------
void CpuBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V,
                                   int64_t C) {
  cpu::embedding_forward(out, tokens, wte, N, V, C);
}
void CpuBackend::embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V,
                                    int64_t C) {
  cpu::embedding_backward(dwte, dout, tokens, N, V, C);
}
void CpuBackend::rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                                 double eps) {
  cpu::rmsnorm_forward(out, rstd, x, w, R, C, eps);
}
void CpuBackend::rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                                  const float* rstd, int64_t R, int64_t C) {
  cpu::rmsnorm_backward(dx, dw, dout, x, w, rstd, R, C);
}
void CpuBackend::rope_forward(float* out, const float* x, const float* cos, const float* sin, const int32_t* positions,
                              int64_t B, int64_t Tn, int64_t H, int64_t D) {
  cpu::rope_forward(out, x, cos, sin, positions, B, Tn, H, D);
}
void CpuBackend::rope_backward(float* dx, const float* dout, const float* cos, const float* sin,
                               const int32_t* positions, int64_t B, int64_t Tn, int64_t H, int64_t D) {
  cpu::rope_backward(dx, dout, cos, sin, positions, B, Tn, H, D);
}
void CpuBackend::swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) {
  cpu::swiglu_forward(out, gu, N, I);
}
void CpuBackend::swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I) {
  cpu::swiglu_backward(dgu, dout, gu, N, I);
}
void CpuBackend::attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                                   int64_t Tn, int64_t H, int64_t Hkv, int64_t D, AttentionPrecision precision) {
  if (precision == AttentionPrecision::kBf16)
    cpu::attention_forward_bf16(out, lse, q, k, v, B, Tn, H, Hkv, D);
  else
    cpu::attention_forward(out, lse, q, k, v, B, Tn, H, Hkv, D);
}
void CpuBackend::attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                                    const float* lse, const float* q, const float* k, const float* v, int64_t B,
                                    int64_t Tn, int64_t H, int64_t Hkv, int64_t D, AttentionPrecision precision) {
  if (precision == AttentionPrecision::kBf16)
    cpu::attention_backward_bf16(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D);
  else
    cpu::attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D);
}
CrossEntropySums CpuBackend::cross_entropy_forward(float* lse, float* token_ce, const float* logits,
                                                   const int32_t* targets, int64_t N, int64_t V) {
  cpu::CrossEntropySums s = cpu::cross_entropy_forward(lse, token_ce, logits, targets, N, V);
  return {s.ce_sum, s.z_sum, s.n_valid};
}
CrossEntropySums CpuBackend::cross_entropy_forward_backward(float* dlogits, float* lse, float* token_ce,
                                                            const float* logits, const int32_t* targets, int64_t N,
                                                            int64_t V, double ce_scale, double z_scale) {
  cpu::CrossEntropySums s =
      cpu::cross_entropy_forward_backward(dlogits, lse, token_ce, logits, targets, N, V, ce_scale, z_scale);
  return {s.ce_sum, s.z_sum, s.n_valid};
}

// ---- small utilities ------------------------------------------------------------------------------
void CpuBackend::add_inplace(float* y, const float* x, int64_t n) { cpu::add_inplace(y, x, n); }
void CpuBackend::add(float* y, const float* a, const float* b, int64_t n) { cpu::add(y, a, b, n); }
void CpuBackend::copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dst_ld, src + r * src_ld, sizeof(float) * cols);
}

// ---- MoE ------------------------------------------------------------------------------------------
void CpuBackend::moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, const float* logits,
                                    const int32_t* forced_idx, int64_t N, int64_t E, int64_t k, bool norm_topk_prob) {
  cpu::moe_router_forward(probs, lse, topk_idx, topk_w, logits, forced_idx, N, E, k, norm_topk_prob);
}
void CpuBackend::moe_router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                                     const int32_t* topk_idx, const float* topk_w, const float* dprobs_extra,
                                     double z_scale, int64_t N, int64_t E, int64_t k, bool renormalized) {
  cpu::moe_router_backward(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, dprobs_extra, z_scale, N, E, k,
                           renormalized);
}
void CpuBackend::moe_dispatch_plan(int64_t* expert_offsets_host, int32_t* row_of_slot, int32_t* token_of_row,
                                   const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
  cpu::moe_dispatch_plan(expert_offsets_host, row_of_slot, token_of_row, topk_idx, N, E, k);
}
void CpuBackend::moe_gather(float* xe, const float* x, const int32_t* token_of_row, int64_t rows, int64_t C) {
  cpu::moe_gather(xe, x, token_of_row, rows, C);
}
void CpuBackend::moe_gather_backward(float* dx, const float* dxe, const int32_t* row_of_slot, int64_t N, int64_t k,
                                     int64_t C) {
  cpu::moe_gather_backward(dx, dxe, row_of_slot, N, k, C);
}
void CpuBackend::moe_combine(float* out, const float* ye, const float* topk_w, const int32_t* row_of_slot, int64_t N,
                             int64_t k, int64_t C) {
  cpu::moe_combine(out, ye, topk_w, row_of_slot, N, k, C);
}
void CpuBackend::moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye,
                                      const float* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k,
                                      int64_t C) {
  cpu::moe_combine_backward(dye, dtopk_w, dout, ye, topk_w, row_of_slot, N, k, C);
}
double CpuBackend::moe_accumulate_load(double* count_host, double* prob_sum_host, const float* probs,
                                       const float* lse, const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
  cpu::moe_accumulate_load(count_host, prob_sum_host, probs, topk_idx, N, E, k);
  double lse2 = 0;
  for (int64_t n = 0; n < N; ++n) lse2 += static_cast<double>(lse[n]) * lse[n];
  return lse2;
}

// ---- optimizer (the exact arithmetic of train/optimizer.cpp) ----------------------------------------
double CpuBackend::sum_squares(const float* g, int64_t n, float grad_scale) {
  // Per-64K-chunk sums (threaded), added in chunk order: independent of the thread count.
  std::vector<double> partial(static_cast<size_t>((n + kChunk - 1) / kChunk), 0.0);
  sum_squares_chunks(partial.data(), g, n, kChunk, grad_scale);
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

void CpuBackend::sum_squares_chunks(double* partials_host, const float* g, int64_t n, int64_t chunk,
                                    float grad_scale) {
  NIB_CHECK_MSG(chunk > 0, "sum_squares_chunks: chunk {} must be positive", chunk);
  const int64_t count = (n + chunk - 1) / chunk;
  parallel_for(count, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t b = c * chunk, e = std::min(n, b + chunk);
      double s = 0;
      for (int64_t i = b; i < e; ++i) {
        const double x = static_cast<double>(g[i] * grad_scale);
        s += x * x;
      }
      partials_host[c] = s;
    }
  });
}

void CpuBackend::adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const AdamWStep& s) {
  // Scalars as PyTorch computes them (Python doubles), then used in f32 element arithmetic.
  const float decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  const float one_minus_b1 = static_cast<float>(1.0 - s.beta1);
  const float b2 = static_cast<float>(s.beta2);
  const float one_minus_b2 = static_cast<float>(1.0 - s.beta2);
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  const float step_size = static_cast<float>(s.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(s.eps);
  const float grad_scale = s.grad_scale;
  const bool wd = s.weight_decay != 0.0;
  parallel_for(n, kChunk, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float gi = g[i] * grad_scale;
      float wi = w[i];
      if (wd) wi = wi * decay;                        // param.mul_(1 - lr*wd)
      m[i] = m[i] + one_minus_b1 * (gi - m[i]);       // exp_avg.lerp_(grad, 1-beta1)
      v[i] = v[i] * b2 + one_minus_b2 * (gi * gi);    // exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
      const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
      w[i] = wi + (-step_size) * (m[i] / denom);      // param.addcdiv_(m, denom, -step_size)
    }
  });
}

void CpuBackend::scale(float* x, int64_t n, float s) {
  parallel_for(n, kChunk, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) x[i] *= s;
  });
}

// ---- format ops -----------------------------------------------------------------------------------------
void CpuBackend::round_to_bf16(float* dst, const float* src, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = nibble::round_to_bf16(src[i]);
  });
}
void CpuBackend::to_bf16_bits(uint16_t* dst, const float* src, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = f32_to_bf16_bits(src[i]);
  });
}
void CpuBackend::from_bf16_bits(float* dst, const uint16_t* src, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = bf16_bits_to_f32(src[i]);
  });
}
void CpuBackend::gather_columns_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t src_cols,
                                     const int64_t* idx, int64_t n_idx, int64_t cols_p) {
  parallel_for(rows_p, grain(cols_p), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* d = dst + r * cols_p;
      if (r >= rows) {
        std::fill(d, d + cols_p, 0.0f);
        continue;
      }
      const float* s = src + r * src_cols;
      for (int64_t j = 0; j < n_idx; ++j) d[j] = nibble::round_to_bf16(s[idx ? idx[j] : j]);
      std::fill(d + n_idx, d + cols_p, 0.0f);
    }
  });
}
void CpuBackend::scatter_add_columns(float* dw, const float* t, int64_t N, int64_t K, const int64_t* idx,
                                     int64_t n_idx, int64_t ld) {
  parallel_for(N, grain(n_idx), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t j = 0; j < n_idx; ++j) dw[n * K + idx[j]] += t[n * ld + j];
  });
}
void CpuBackend::scatter_columns(float* dst, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                                 int64_t ld) {
  parallel_for(N, grain(n_idx), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t j = 0; j < n_idx; ++j) dst[n * K + idx[j]] = t[n * ld + j];
  });
}
void CpuBackend::transpose(float* dst, const float* src, int64_t rows, int64_t cols) {
  transpose_tiled(dst, src, rows, cols);
}
void CpuBackend::transpose(uint16_t* dst, const uint16_t* src, int64_t rows, int64_t cols) {
  transpose_tiled(dst, src, rows, cols);
}
void CpuBackend::rht16_rows(float* y, const float* x, int64_t rows, int64_t cols, uint32_t sign_mask) {
  formats::rht16_rows_f32_cpu(y, x, rows, cols, sign_mask);
}
void CpuBackend::column_sumsq_accumulate(double* sums, const float* x, int64_t M, int64_t K) {
  parallel_for(K, 16, [&](int64_t k0, int64_t k1) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = k0; k < k1; ++k) {
        const double v = x[m * K + k];
        sums[k] += v * v;
      }
  });
}

void CpuBackend::quantize(QuantizedTensor& out, const float* x, const formats::SrKey* sr) { quantize_any(out, x, sr); }
void CpuBackend::quantize(QuantizedTensor& out, const uint16_t* x_bf16, const formats::SrKey* sr) {
  quantize_any(out, x_bf16, sr);
}
void CpuBackend::dequantize(float* y, const QuantizedTensor& q) {
  switch (q.format) {
    case QuantFormat::kNvfp4Te:
    case QuantFormat::kNvfp4Te2d:
      formats::nvfp4_te_dequantize_cpu(y, q.codes, q.scales, *q.outer, q.rows, q.cols);
      return;
    case QuantFormat::kNvfp4TwoLevel:
      formats::nvfp4_2level_dequantize_cpu(y, q.codes, q.scales, q.outer, q.rows, q.cols);
      return;
    case QuantFormat::kMxfp8:
      formats::mxfp8_dequantize_cpu(y, q.codes, q.scales, q.rows, q.cols);
      return;
  }
}
void CpuBackend::dequantize_bf16(uint16_t* y, const QuantizedTensor& q) {
  const int64_t rows = q.rows, cols = q.cols;
  switch (q.format) {
    case QuantFormat::kNvfp4Te:
    case QuantFormat::kNvfp4Te2d:
      NIB_CHECK_MSG(cols % 16 == 0, "dequantize_bf16: {} cols={} must be a multiple of 16", quant_format_name(q.format), cols);
      // code × E4M3 block scale: exact in FP32 and in BF16; the per-tensor factor is the GEMM's alpha
      parallel_for(rows * cols / 16, 1024, [&](int64_t b0, int64_t b1) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          const uint32_t s = q.scales[blk];
          for (int i = 0; i < 16; ++i)
            y[blk * 16 + i] = f32_to_bf16_bits(formats::nvfp4_te_bf16_operand(formats::e2m1_unpack(q.codes + blk * 8, i), s));
        }
      });
      return;
    case QuantFormat::kNvfp4TwoLevel:
    case QuantFormat::kMxfp8: {
      // the FP32 dequantization (grow-only per thread), rounded to nearest even
      thread_local std::vector<float> deq;
      if (deq.size() < static_cast<size_t>(rows * cols)) deq.resize(static_cast<size_t>(rows * cols));
      dequantize(deq.data(), q);
      to_bf16_bits(y, deq.data(), rows * cols);
      return;
    }
  }
}

void CpuBackend::nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b) {
  *alpha = formats::nvfp4_te_gemm_alpha(*amax_a, *amax_b);
}

void CpuBackend::quantize_te_rht_transpose(QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M,
                                           int64_t K, const formats::SrKey* sr) {
  NIB_CHECK(out.format == QuantFormat::kNvfp4Te && out.rows == K && out.cols == M);
  *out.outer = formats::nvfp4_te_quantize_rht_t_cpu(out.codes, out.scales, y_t, x, M, K, sr);
}
void CpuBackend::backward_operand_two_level(QuantizedTensor& out, const QuantizedTensor& in, uint32_t sign_mask,
                                            const formats::SrKey& sr) {
  NIB_CHECK(in.format == QuantFormat::kNvfp4TwoLevel && out.format == QuantFormat::kNvfp4TwoLevel);
  NIB_CHECK(out.rows == in.cols && out.cols == in.rows);
  formats::nvfp4_2level_backward_operand_cpu(out.codes, out.scales, out.outer, in.codes, in.scales, in.outer, in.rows,
                                             in.cols, sign_mask, sr);
}

// ---- paged KV cache ---------------------------------------------------------------------------------
void CpuBackend::kv_cache_write(void* k_pages, void* v_pages, KvPageFormat format, const float* k, const float* v,
                                const int32_t* slots, int64_t N, int64_t Hkv, int64_t D) {
  cpu::kv_cache_write(k_pages, v_pages, format, k, v, slots, N, Hkv, D);
}
void CpuBackend::paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                                 KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                                 const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                                 int64_t page_size, AttentionPrecision precision) {
  cpu::paged_attention(out, q, k_pages, v_pages, format, block_table, max_blocks, context_len, N, H, Hkv, D,
                       page_size, precision);
}

void CpuBackend::matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w, int64_t M) {
  NIB_CHECK_MSG(w.format == QuantFormat::kNvfp4TwoLevel && w.cols % 32 == 0,
                "matmul_nt_nvfp4_weight: a two-level NVFP4 weight with K % 32 == 0 (got {} ({}, {}))",
                quant_format_name(w.format), w.rows, w.cols);
  nvfp4_weight_scratch_.resize(static_cast<size_t>(w.rows * w.cols));
  dequantize(nvfp4_weight_scratch_.data(), w);
  matmul_nt(y, x, nvfp4_weight_scratch_.data(), M, w.rows, w.cols, /*accumulate=*/false, /*operands_bf16=*/false);
}

void CpuBackend::grouped_matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w,
                                                const int64_t* offsets, int64_t G, int64_t rows) {
  NIB_CHECK_MSG(G >= 0 && rows >= 0 && (G == 0 || offsets != nullptr),
                "grouped_matmul_nt_nvfp4_weight: G={} rows={} offsets {}", G, rows, offsets ? "set" : "null");
  const int64_t N = w.rows, K = w.cols;
  const int64_t cb = QuantizedTensor::code_bytes(w.format, N, K), sb = QuantizedTensor::scale_bytes(w.format, N, K);
  const int64_t ob = QuantizedTensor::outer_count(w.format, N, K);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], r1 = offsets[g + 1];
    NIB_CHECK_MSG(0 <= r0 && r0 <= r1 && r1 <= rows,
                  "grouped_matmul_nt_nvfp4_weight: group {} rows [{}, {}) outside [0, {}]", g, r0, r1, rows);
    if (r1 == r0) continue;
    QuantizedTensor wg = w;
    wg.codes = w.codes + g * cb, wg.scales = w.scales + g * sb, wg.outer = w.outer + g * ob;
    matmul_nt_nvfp4_weight(y + r0 * N, x + r0 * K, wg, r1 - r0);
  }
}

void CpuBackend::greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V) {
  NIB_CHECK_MSG(rows >= 0 && V > 0, "greedy_rows: rows={} V={}", rows, V);
  parallel_for(rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* l = logits + r * V;
      const int64_t best = softmax_first_argmax(l, V);  // every sampler's greedy scan
      const double mx = softmax_scaled_max(l, V, 1.0);
      token[r] = static_cast<int32_t>(best);
      stats[3 * r] = static_cast<double>(l[best]);
      stats[3 * r + 1] = mx;
      stats[3 * r + 2] = softmax_exp_sum(l, V, 1.0, mx);
    }
  });
}

void CpuBackend::guided_overwrite_rows(QuantizedTensor& q, int64_t* stats, const float* x, const int32_t* rows,
                                       int64_t R, const uint8_t* scales, const float* outer, const uint8_t* guide,
                                       formats::GuidanceKind kind) {
  const int64_t M = q.rows, K = q.cols;
  NIB_CHECK_MSG(q.format == QuantFormat::kNvfp4TwoLevel && K > 0 && K % 16 == 0 && R >= 0,
                "guided_overwrite_rows: a two-level NVFP4 tensor with cols % 16 == 0 (got {} ({}, {}), {} rows)",
                quant_format_name(q.format), M, K, R);
  const int64_t kb = K / 16, no = (K + 127) / 128;
  const int64_t gstride = kind == formats::GuidanceKind::kFull ? K / 2 : K / 8;
  std::vector<bool> seen(static_cast<size_t>(M), false);
  for (int64_t i = 0; i < R; ++i) {
    const int32_t m = rows[i];
    NIB_CHECK_MSG(m >= 0 && m < M && !seen[static_cast<size_t>(m)],
                  "guided_overwrite_rows: row index {} (entry {}) is out of [0, {}) or repeated", m, i, M);
    seen[static_cast<size_t>(m)] = true;
  }
  std::vector<int64_t> row_stats(static_cast<size_t>(3 * R), 0);  // per row, summed in row order after
  parallel_for(R, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint8_t> gc(static_cast<size_t>(K / 2));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = rows[i];
      const uint8_t* g = guide + i * gstride;
      formats::nvfp4_2level_quantize_guided_cpu(gc.data(), x + m * K, 1, K, scales + i * kb, outer + i * no, g, kind);
      uint8_t* own = q.codes + m * (K / 2);
      int64_t* st = row_stats.data() + 3 * i;
      for (int64_t c = 0; c < K; ++c) {
        const uint32_t gd = kind == formats::GuidanceKind::kFull ? formats::e2m1_unpack(g, c) : (g[c >> 3] >> (c & 7)) & 1u;
        const uint32_t f = formats::guided_element_stats(formats::e2m1_unpack(own, c), formats::e2m1_unpack(gc.data(), c),
                                                         gd, kind);
        st[0] += (f & formats::kGuidedRtnMismatch) != 0, st[1] += (f & formats::kGuidedOneStep) != 0;
        st[2] += (f & formats::kGuidedReproduced) != 0;
      }
      std::memcpy(own, gc.data(), gc.size());
      std::memcpy(q.scales + m * kb, scales + i * kb, static_cast<size_t>(kb));
      std::memcpy(q.outer + m * no, outer + i * no, sizeof(float) * static_cast<size_t>(no));
    }
  });
  for (int64_t i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) stats[j] += row_stats[static_cast<size_t>(3 * i + j)];
}

void CpuBackend::guidance_payload_rows(uint8_t* out, const QuantizedTensor& q, formats::GuidanceKind kind) {
  const int64_t M = q.rows, K = q.cols;
  NIB_CHECK_MSG(q.format == QuantFormat::kNvfp4TwoLevel && K > 0 && K % 16 == 0,
                "guidance_payload_rows: a two-level NVFP4 tensor with cols % 16 == 0 (got {} ({}, {}))",
                quant_format_name(q.format), M, K);
  const int64_t kb = K / 16, no = (K + 127) / 128;
  const int64_t gb = kind == formats::GuidanceKind::kFull ? K / 2 : K / 8, P = kb + 4 * no + gb;
  parallel_for(M, std::max<int64_t>(1, (int64_t{1} << 15) / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint8_t* p = out + r * P;
      std::memcpy(p, q.scales + r * kb, static_cast<size_t>(kb));
      std::memcpy(p + kb, q.outer + r * no, sizeof(float) * static_cast<size_t>(no));
      if (kind == formats::GuidanceKind::kFull)
        std::memcpy(p + kb + 4 * no, q.codes + r * (K / 2), static_cast<size_t>(K / 2));
      else
        formats::e2m1_mantissa_bits_cpu(p + kb + 4 * no, q.codes + r * (K / 2), 1, K);
    }
  });
}

// ---- registry -----------------------------------------------------------------------------------------
namespace {
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, BackendFactory>& registry() {
  static std::map<std::string, BackendFactory> r;
  return r;
}
Result<std::unique_ptr<Backend>> make_cpu(int) { return std::unique_ptr<Backend>(new CpuBackend()); }
}  // namespace

void register_backend(const std::string& kind, BackendFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[kind] = factory;
}

std::vector<std::string> registered_backends() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names{"cpu"};
  for (const auto& [k, f] : registry())
    if (k != "cpu") names.push_back(k);
  return names;
}

Result<std::unique_ptr<Backend>> make_backend(const std::string& kind) {
  if (kind == "cpu") return make_cpu(0);
  std::string base = kind;
  int index = 0;
  if (auto colon = kind.find(':'); colon != std::string::npos) {
    base = kind.substr(0, colon);
    const std::string digits = kind.substr(colon + 1);
    if (digits.empty() || digits.size() > 3 || digits.find_first_not_of("0123456789") != std::string::npos)
      return invalid_argument("device '{}': expected 'cpu', 'cuda' or 'cuda:N'", kind);
    index = std::stoi(digits);
  }
  BackendFactory factory = nullptr;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(base);
    if (it != registry().end()) factory = it->second;
  }
  if (factory == nullptr) {
    std::string names;
    for (const std::string& n : registered_backends()) names += (names.empty() ? "" : ", ") + n;
    return invalid_argument("device '{}' is not available in this build (available: {})", kind, names);
  }
  return factory(index);
}

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace nibble::backend
