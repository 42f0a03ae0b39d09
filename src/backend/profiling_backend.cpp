// ProfilingBackend (profiling_backend.h): every op forwarded to the wrapped backend inside a
// Timed scope that, while profiling is enabled, synchronises the wrapped backend, reads the
// steady clock, and adds the op's wall time and one call to its row. The op table below gives
// each op its name and category; the report sorts and formats the rows.
#include "backend/profiling_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>

namespace nibble::backend {

namespace {
struct OpInfo {
  const char* name;
  OpCategory category;
};
constexpr OpInfo kOps[] = {
    {"copy_to_device", OpCategory::kCopies},
    {"copy_to_host", OpCategory::kCopies},
    {"copy", OpCategory::kCopies},
    {"fill_zero", OpCategory::kCopies},
    {"matmul_nt", OpCategory::kGemm},
    {"matmul_nn", OpCategory::kGemm},
    {"matmul_tn", OpCategory::kGemm},
    {"embedding_forward", OpCategory::kElementwise},
    {"embedding_backward", OpCategory::kElementwise},
    {"rmsnorm_forward", OpCategory::kNorm},
    {"rmsnorm_backward", OpCategory::kNorm},
    {"rope_forward", OpCategory::kElementwise},
    {"rope_backward", OpCategory::kElementwise},
    {"swiglu_forward", OpCategory::kElementwise},
    {"swiglu_backward", OpCategory::kElementwise},
    {"attention_forward", OpCategory::kAttention},
    {"attention_backward", OpCategory::kAttention},
    {"cross_entropy_forward", OpCategory::kCrossEntropy},
    {"cross_entropy_forward_backward", OpCategory::kCrossEntropy},
    {"add_inplace", OpCategory::kElementwise},
    {"add", OpCategory::kElementwise},
    {"copy_2d", OpCategory::kCopies},
    {"moe_router_forward", OpCategory::kMoe},
    {"moe_router_backward", OpCategory::kMoe},
    {"moe_dispatch_plan", OpCategory::kMoe},
    {"moe_gather", OpCategory::kMoe},
    {"moe_gather_backward", OpCategory::kMoe},
    {"moe_combine", OpCategory::kMoe},
    {"moe_combine_backward", OpCategory::kMoe},
    {"moe_accumulate_load", OpCategory::kMoe},
    {"sum_squares", OpCategory::kOptimizer},
    {"sum_squares_chunks", OpCategory::kOptimizer},
    {"adamw_update", OpCategory::kOptimizer},
    {"scale", OpCategory::kOptimizer},
    {"round_to_bf16", OpCategory::kQuantize},
    {"to_bf16_bits", OpCategory::kQuantize},
    {"from_bf16_bits", OpCategory::kQuantize},
    {"gather_columns_bf16", OpCategory::kQuantize},
    {"scatter_add_columns", OpCategory::kQuantize},
    {"scatter_columns", OpCategory::kQuantize},
    {"transpose_f32", OpCategory::kCopies},
    {"transpose_u16", OpCategory::kCopies},
    {"rht16_rows", OpCategory::kQuantize},
    {"column_sumsq_accumulate", OpCategory::kQuantize},
    {"quantize_f32", OpCategory::kQuantize},
    {"quantize_bf16", OpCategory::kQuantize},
    {"dequantize", OpCategory::kQuantize},
    {"quantize_te_rht_transpose", OpCategory::kQuantize},
    {"backward_operand_two_level", OpCategory::kQuantize},
    {"matmul_bf16_nt", OpCategory::kGemm},
    {"matmul_bf16_nn", OpCategory::kGemm},
    {"matmul_bf16_tn", OpCategory::kGemm},
    {"dequantize_bf16", OpCategory::kQuantize},
    {"nvfp4_te_alpha", OpCategory::kQuantize},
    {"kv_cache_write", OpCategory::kCopies},
    {"paged_attention", OpCategory::kAttention},
    {"matmul_nt_nvfp4_weight", OpCategory::kGemm},
    {"grouped_matmul_nt_nvfp4_weight", OpCategory::kGemm},
    {"quantize_operand_f32", OpCategory::kQuantize},
    {"quantize_operand_bf16", OpCategory::kQuantize},
    {"quantize_te_rht_transpose_operand", OpCategory::kQuantize},
    {"backward_operand_two_level_bf16", OpCategory::kQuantize},
    {"cross_entropy_forward_sums", OpCategory::kCrossEntropy},
    {"cross_entropy_forward_backward_sums", OpCategory::kCrossEntropy},
    {"grouped_matmul_bf16_nt", OpCategory::kGemm},
    {"grouped_matmul_bf16_nn", OpCategory::kGemm},
    {"grouped_matmul_bf16_tn", OpCategory::kGemm},
    {"grouped_matmul_bf16_nt_blocks", OpCategory::kGemm},
    {"sum_squares_chunks_multi", OpCategory::kOptimizer},
    {"adamw_update_multi", OpCategory::kOptimizer},
    {"moe_dispatch_plan_device", OpCategory::kMoe},
    {"guided_overwrite_rows", OpCategory::kQuantize},
    {"guidance_payload_rows", OpCategory::kCopies},
    {"greedy_rows", OpCategory::kElementwise},
};
static_assert(sizeof(kOps) / sizeof(kOps[0]) == static_cast<size_t>(ProfiledOp::kCount));
using Clock = std::chrono::steady_clock;
}  // namespace

const char* profiled_op_name(ProfiledOp op) {
  const auto i = static_cast<size_t>(op);
  return i < static_cast<size_t>(ProfiledOp::kCount) ? kOps[i].name : "?";
}

OpCategory profiled_op_category(ProfiledOp op) {
  const auto i = static_cast<size_t>(op);
  return i < static_cast<size_t>(ProfiledOp::kCount) ? kOps[i].category : OpCategory::kCount;
}

const char* op_category_name(OpCategory c) {
  switch (c) {
    case OpCategory::kGemm:
      return "GEMM";
    case OpCategory::kAttention:
      return "attention";
    case OpCategory::kNorm:
      return "norm";
    case OpCategory::kCrossEntropy:
      return "cross-entropy";
    case OpCategory::kQuantize:
      return "quantize";
    case OpCategory::kOptimizer:
      return "optimizer";
    case OpCategory::kElementwise:
      return "elementwise";
    case OpCategory::kMoe:
      return "MoE";
    case OpCategory::kCopies:
      return "copies";
    case OpCategory::kCount:
      break;
  }
  return "?";
}

// Synchronises and reads the clock on entry and exit while profiling is enabled. An op that
// throws is not timed (and the exit synchronisation is skipped, so nothing throws from here).
class ProfilingBackend::Timed {
 public:
  Timed(ProfilingBackend& pb, ProfiledOp op)
      : pb_(pb), op_(op), on_(pb.enabled_), exceptions_(std::uncaught_exceptions()) {
    if (on_) {
      pb_.inner_->synchronize();
      t0_ = Clock::now();
    }
  }
  ~Timed() {
    if (!on_ || std::uncaught_exceptions() > exceptions_) return;
    pb_.inner_->synchronize();
    OpTiming& t = pb_.timings_[static_cast<size_t>(op_)];
    t.count += 1;
    t.seconds += std::chrono::duration<double>(Clock::now() - t0_).count();
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  ProfilingBackend& pb_;
  ProfiledOp op_;
  bool on_;
  int exceptions_;
  Clock::time_point t0_{};
};

// ---- forwarding (the untimed methods first, then every op in Backend's order) -----------------
Device ProfilingBackend::device() const {
  return inner_->device();
}
std::string ProfilingBackend::name() const {
  return inner_->name();
}
bool ProfilingBackend::supports(Op op) const {
  return inner_->supports(op);
}
Result<void*> ProfilingBackend::allocate(size_t bytes, const std::string& what) {
  return inner_->allocate(bytes, what);
}
void ProfilingBackend::deallocate(void* p) {
  inner_->deallocate(p);
}
void ProfilingBackend::copy_to_device(void* dst, const void* host_src, size_t bytes) {
  Timed timed(*this, ProfiledOp::kCopyToDevice);
  inner_->copy_to_device(dst, host_src, bytes);
}
void ProfilingBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  Timed timed(*this, ProfiledOp::kCopyToHost);
  inner_->copy_to_host(host_dst, src, bytes);
}
void ProfilingBackend::copy(void* dst, const void* src, size_t bytes) {
  Timed timed(*this, ProfiledOp::kCopy);
  inner_->copy(dst, src, bytes);
}
void ProfilingBackend::fill_zero(void* dst, size_t bytes) {
  Timed timed(*this, ProfiledOp::kFillZero);
  inner_->fill_zero(dst, bytes);
}
void ProfilingBackend::synchronize() {
  inner_->synchronize();
}
bool ProfilingBackend::set_batch_invariant(bool on) {
  return inner_->set_batch_invariant(on);
}
Backend::MemoryStats ProfilingBackend::memory_stats() {
  return inner_->memory_stats();
}
void ProfilingBackend::reset_peak_memory() {
  inner_->reset_peak_memory();
}
void ProfilingBackend::matmul_nt(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                                 bool accumulate, bool operands_bf16) {
  Timed timed(*this, ProfiledOp::kMatmulNt);
  inner_->matmul_nt(y, x, w, M, N, K, accumulate, operands_bf16);
}
void ProfilingBackend::matmul_nn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K,
                                 bool accumulate, bool operands_bf16) {
  Timed timed(*this, ProfiledOp::kMatmulNn);
  inner_->matmul_nn(y, a, b, M, N, K, accumulate, operands_bf16);
}
void ProfilingBackend::matmul_tn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K,
                                 bool accumulate, bool operands_bf16) {
  Timed timed(*this, ProfiledOp::kMatmulTn);
  inner_->matmul_tn(y, a, b, M, N, K, accumulate, operands_bf16);
}
void ProfilingBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V,
                                         int64_t C) {
  Timed timed(*this, ProfiledOp::kEmbeddingForward);
  inner_->embedding_forward(out, tokens, wte, N, V, C);
}
void ProfilingBackend::embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V,
                                          int64_t C) {
  Timed timed(*this, ProfiledOp::kEmbeddingBackward);
  inner_->embedding_backward(dwte, dout, tokens, N, V, C);
}
void ProfilingBackend::rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                                       double eps) {
  Timed timed(*this, ProfiledOp::kRmsnormForward);
  inner_->rmsnorm_forward(out, rstd, x, w, R, C, eps);
}
void ProfilingBackend::rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                                        const float* rstd, int64_t R, int64_t C) {
  Timed timed(*this, ProfiledOp::kRmsnormBackward);
  inner_->rmsnorm_backward(dx, dw, dout, x, w, rstd, R, C);
}
void ProfilingBackend::rope_forward(float* out, const float* x, const float* cos, const float* sin,
                                    const int32_t* positions, int64_t B, int64_t Tn, int64_t H, int64_t D) {
  Timed timed(*this, ProfiledOp::kRopeForward);
  inner_->rope_forward(out, x, cos, sin, positions, B, Tn, H, D);
}
void ProfilingBackend::rope_backward(float* dx, const float* dout, const float* cos, const float* sin,
                                     const int32_t* positions, int64_t B, int64_t Tn, int64_t H, int64_t D) {
  Timed timed(*this, ProfiledOp::kRopeBackward);
  inner_->rope_backward(dx, dout, cos, sin, positions, B, Tn, H, D);
}
void ProfilingBackend::swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) {
  Timed timed(*this, ProfiledOp::kSwigluForward);
  inner_->swiglu_forward(out, gu, N, I);
}
void ProfilingBackend::swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I) {
  Timed timed(*this, ProfiledOp::kSwigluBackward);
  inner_->swiglu_backward(dgu, dout, gu, N, I);
}
void ProfilingBackend::attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                                         int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                                         AttentionPrecision precision) {
  Timed timed(*this, ProfiledOp::kAttentionForward);
  inner_->attention_forward(out, lse, q, k, v, B, Tn, H, Hkv, D, precision);
}
void ProfilingBackend::attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                                          const float* lse, const float* q, const float* k, const float* v, int64_t B,
                                          int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                                          AttentionPrecision precision) {
  Timed timed(*this, ProfiledOp::kAttentionBackward);
  inner_->attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D, precision);
}
CrossEntropySums ProfilingBackend::cross_entropy_forward(float* lse, float* token_ce, const float* logits,
                                                         const int32_t* targets, int64_t N, int64_t V) {
  Timed timed(*this, ProfiledOp::kCrossEntropyForward);
  return inner_->cross_entropy_forward(lse, token_ce, logits, targets, N, V);
}
CrossEntropySums ProfilingBackend::cross_entropy_forward_backward(float* dlogits, float* lse, float* token_ce,
                                                                  const float* logits, const int32_t* targets,
                                                                  int64_t N, int64_t V, double ce_scale,
                                                                  double z_scale) {
  Timed timed(*this, ProfiledOp::kCrossEntropyForwardBackward);
  return inner_->cross_entropy_forward_backward(dlogits, lse, token_ce, logits, targets, N, V, ce_scale, z_scale);
}
void ProfilingBackend::add_inplace(float* y, const float* x, int64_t n) {
  Timed timed(*this, ProfiledOp::kAddInplace);
  inner_->add_inplace(y, x, n);
}
void ProfilingBackend::add(float* y, const float* a, const float* b, int64_t n) {
  Timed timed(*this, ProfiledOp::kAdd);
  inner_->add(y, a, b, n);
}
void ProfilingBackend::copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
                               int64_t cols) {
  Timed timed(*this, ProfiledOp::kCopy2d);
  inner_->copy_2d(dst, dst_ld, src, src_ld, rows, cols);
}
void ProfilingBackend::moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w,
                                          const float* logits, const int32_t* forced_idx, int64_t N, int64_t E,
                                          int64_t k, bool norm_topk_prob) {
  Timed timed(*this, ProfiledOp::kMoeRouterForward);
  inner_->moe_router_forward(probs, lse, topk_idx, topk_w, logits, forced_idx, N, E, k, norm_topk_prob);
}
void ProfilingBackend::moe_router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                                           const int32_t* topk_idx, const float* topk_w, const float* dprobs_extra,
                                           double z_scale, int64_t N, int64_t E, int64_t k, bool renormalized) {
  Timed timed(*this, ProfiledOp::kMoeRouterBackward);
  inner_->moe_router_backward(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, dprobs_extra, z_scale, N, E, k,
                              renormalized);
}
void ProfilingBackend::moe_dispatch_plan(int64_t* expert_offsets_host, int32_t* row_of_slot, int32_t* token_of_row,
                                         const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
  Timed timed(*this, ProfiledOp::kMoeDispatchPlan);
  inner_->moe_dispatch_plan(expert_offsets_host, row_of_slot, token_of_row, topk_idx, N, E, k);
}
void ProfilingBackend::moe_gather(float* xe, const float* x, const int32_t* token_of_row, int64_t rows, int64_t C) {
  Timed timed(*this, ProfiledOp::kMoeGather);
  inner_->moe_gather(xe, x, token_of_row, rows, C);
}
void ProfilingBackend::moe_gather_backward(float* dx, const float* dxe, const int32_t* row_of_slot, int64_t N,
                                           int64_t k, int64_t C) {
  Timed timed(*this, ProfiledOp::kMoeGatherBackward);
  inner_->moe_gather_backward(dx, dxe, row_of_slot, N, k, C);
}
void ProfilingBackend::moe_combine(float* out, const float* ye, const float* topk_w, const int32_t* row_of_slot,
                                   int64_t N, int64_t k, int64_t C) {
  Timed timed(*this, ProfiledOp::kMoeCombine);
  inner_->moe_combine(out, ye, topk_w, row_of_slot, N, k, C);
}
void ProfilingBackend::moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye,
                                            const float* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k,
                                            int64_t C) {
  Timed timed(*this, ProfiledOp::kMoeCombineBackward);
  inner_->moe_combine_backward(dye, dtopk_w, dout, ye, topk_w, row_of_slot, N, k, C);
}
double ProfilingBackend::moe_accumulate_load(double* count_host, double* prob_sum_host, const float* probs,
                                             const float* lse, const int32_t* topk_idx, int64_t N, int64_t E,
                                             int64_t k) {
  Timed timed(*this, ProfiledOp::kMoeAccumulateLoad);
  return inner_->moe_accumulate_load(count_host, prob_sum_host, probs, lse, topk_idx, N, E, k);
}
double ProfilingBackend::sum_squares(const float* g, int64_t n, float grad_scale) {
  Timed timed(*this, ProfiledOp::kSumSquares);
  return inner_->sum_squares(g, n, grad_scale);
}
void ProfilingBackend::sum_squares_chunks(double* partials_host, const float* g, int64_t n, int64_t chunk,
                                          float grad_scale) {
  Timed timed(*this, ProfiledOp::kSumSquaresChunks);
  inner_->sum_squares_chunks(partials_host, g, n, chunk, grad_scale);
}
void ProfilingBackend::adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const AdamWStep& s) {
  Timed timed(*this, ProfiledOp::kAdamwUpdate);
  inner_->adamw_update(w, m, v, g, n, s);
}
void ProfilingBackend::scale(float* x, int64_t n, float s) {
  Timed timed(*this, ProfiledOp::kScale);
  inner_->scale(x, n, s);
}
void ProfilingBackend::round_to_bf16(float* dst, const float* src, int64_t n) {
  Timed timed(*this, ProfiledOp::kRoundToBf16);
  inner_->round_to_bf16(dst, src, n);
}
void ProfilingBackend::to_bf16_bits(uint16_t* dst, const float* src, int64_t n) {
  Timed timed(*this, ProfiledOp::kToBf16Bits);
  inner_->to_bf16_bits(dst, src, n);
}
void ProfilingBackend::from_bf16_bits(float* dst, const uint16_t* src, int64_t n) {
  Timed timed(*this, ProfiledOp::kFromBf16Bits);
  inner_->from_bf16_bits(dst, src, n);
}
void ProfilingBackend::gather_columns_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t src_cols,
                                           const int64_t* idx, int64_t n_idx, int64_t cols_p) {
  Timed timed(*this, ProfiledOp::kGatherColumnsBf16);
  inner_->gather_columns_bf16(dst, src, rows, rows_p, src_cols, idx, n_idx, cols_p);
}
void ProfilingBackend::scatter_add_columns(float* dw, const float* t, int64_t N, int64_t K, const int64_t* idx,
                                           int64_t n_idx, int64_t ld) {
  Timed timed(*this, ProfiledOp::kScatterAddColumns);
  inner_->scatter_add_columns(dw, t, N, K, idx, n_idx, ld);
}
void ProfilingBackend::scatter_columns(float* dst, const float* t, int64_t N, int64_t K, const int64_t* idx,
                                       int64_t n_idx, int64_t ld) {
  Timed timed(*this, ProfiledOp::kScatterColumns);
  inner_->scatter_columns(dst, t, N, K, idx, n_idx, ld);
}
void ProfilingBackend::transpose(float* dst, const float* src, int64_t rows, int64_t cols) {
  Timed timed(*this, ProfiledOp::kTransposeF32);
  inner_->transpose(dst, src, rows, cols);
}
void ProfilingBackend::transpose(uint16_t* dst, const uint16_t* src, int64_t rows, int64_t cols) {
  Timed timed(*this, ProfiledOp::kTransposeU16);
  inner_->transpose(dst, src, rows, cols);
}
void ProfilingBackend::rht16_rows(float* y, const float* x, int64_t rows, int64_t cols, uint32_t sign_mask) {
  Timed timed(*this, ProfiledOp::kRht16Rows);
  inner_->rht16_rows(y, x, rows, cols, sign_mask);
}
void ProfilingBackend::column_sumsq_accumulate(double* sums, const float* x, int64_t M, int64_t K) {
  Timed timed(*this, ProfiledOp::kColumnSumsqAccumulate);
  inner_->column_sumsq_accumulate(sums, x, M, K);
}
void ProfilingBackend::quantize(QuantizedTensor& out, const float* x, const formats::SrKey* sr) {
  Timed timed(*this, ProfiledOp::kQuantizeF32);
  inner_->quantize(out, x, sr);
}
void ProfilingBackend::quantize(QuantizedTensor& out, const uint16_t* x_bf16, const formats::SrKey* sr) {
  Timed timed(*this, ProfiledOp::kQuantizeBf16);
  inner_->quantize(out, x_bf16, sr);
}
void ProfilingBackend::matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                      const float* alpha, bool accumulate) {
  Timed timed(*this, ProfiledOp::kMatmulBf16Nt);
  inner_->matmul_bf16_nt(y, a, b, M, N, K, alpha, accumulate);
}
void ProfilingBackend::matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                      const float* alpha, bool accumulate) {
  Timed timed(*this, ProfiledOp::kMatmulBf16Nn);
  inner_->matmul_bf16_nn(y, a, b, M, N, K, alpha, accumulate);
}
void ProfilingBackend::matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                      const float* alpha, bool accumulate) {
  Timed timed(*this, ProfiledOp::kMatmulBf16Tn);
  inner_->matmul_bf16_tn(y, a, b, M, N, K, alpha, accumulate);
}
void ProfilingBackend::dequantize_bf16(uint16_t* y, const QuantizedTensor& q) {
  Timed timed(*this, ProfiledOp::kDequantizeBf16);
  inner_->dequantize_bf16(y, q);
}
void ProfilingBackend::nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b) {
  Timed timed(*this, ProfiledOp::kNvfp4TeAlpha);
  inner_->nvfp4_te_alpha(alpha, amax_a, amax_b);
}
void ProfilingBackend::kv_cache_write(void* k_pages, void* v_pages, KvPageFormat format, const float* k,
                                      const float* v, const int32_t* slots, int64_t N, int64_t Hkv, int64_t D) {
  Timed timed(*this, ProfiledOp::kKvCacheWrite);
  inner_->kv_cache_write(k_pages, v_pages, format, k, v, slots, N, Hkv, D);
}
void ProfilingBackend::paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                                       KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                                       const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                                       int64_t page_size, AttentionPrecision precision) {
  Timed timed(*this, ProfiledOp::kPagedAttention);
  inner_->paged_attention(out, q, k_pages, v_pages, format, block_table, max_blocks, context_len, N, H, Hkv, D,
                          page_size, precision);
}
void ProfilingBackend::matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w, int64_t M) {
  Timed timed(*this, ProfiledOp::kMatmulNtNvfp4Weight);
  inner_->matmul_nt_nvfp4_weight(y, x, w, M);
}
void ProfilingBackend::grouped_matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w,
                                                      const int64_t* offsets, int64_t G, int64_t rows) {
  Timed timed(*this, ProfiledOp::kGroupedMatmulNtNvfp4Weight);
  inner_->grouped_matmul_nt_nvfp4_weight(y, x, w, offsets, G, rows);
}
void ProfilingBackend::greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V) {
  Timed timed(*this, ProfiledOp::kGreedyRows);
  inner_->greedy_rows(token, stats, logits, rows, V);
}
void ProfilingBackend::guided_overwrite_rows(QuantizedTensor& q, int64_t* stats, const float* x, const int32_t* rows,
                                             int64_t R, const uint8_t* scales, const float* outer,
                                             const uint8_t* guide, formats::GuidanceKind kind) {
  Timed timed(*this, ProfiledOp::kGuidedOverwriteRows);
  inner_->guided_overwrite_rows(q, stats, x, rows, R, scales, outer, guide, kind);
}
void ProfilingBackend::guidance_payload_rows(uint8_t* out, const QuantizedTensor& q, formats::GuidanceKind kind) {
  Timed timed(*this, ProfiledOp::kGuidancePayloadRows);
  inner_->guidance_payload_rows(out, q, kind);
}
void ProfilingBackend::grouped_matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                              int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                              const float* alpha, bool accumulate) {
  Timed timed(*this, ProfiledOp::kGroupedMatmulBf16Nt);
  inner_->grouped_matmul_bf16_nt(y, a, b, offsets, G, extent, N, K, b_stride, alpha, accumulate);
}
void ProfilingBackend::grouped_matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                              int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                              const float* alpha, bool accumulate) {
  Timed timed(*this, ProfiledOp::kGroupedMatmulBf16Nn);
  inner_->grouped_matmul_bf16_nn(y, a, b, offsets, G, extent, N, K, b_stride, alpha, accumulate);
}
void ProfilingBackend::grouped_matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                              int64_t G, int64_t extent, int64_t M, int64_t N, int64_t y_stride,
                                              const float* alpha, bool accumulate) {
  Timed timed(*this, ProfiledOp::kGroupedMatmulBf16Tn);
  inner_->grouped_matmul_bf16_tn(y, a, b, offsets, G, extent, M, N, y_stride, alpha, accumulate);
}
void ProfilingBackend::grouped_matmul_bf16_nt_blocks(float* y, const uint16_t* a, const uint16_t* b,
                                                     const int64_t* offsets, int64_t G, int64_t extent, int64_t M,
                                                     int64_t N, int64_t a_rows, int64_t b_rows, int64_t y_stride,
                                                     const float* alpha, bool accumulate) {
  Timed timed(*this, ProfiledOp::kGroupedMatmulBf16NtBlocks);
  inner_->grouped_matmul_bf16_nt_blocks(y, a, b, offsets, G, extent, M, N, a_rows, b_rows, y_stride, alpha,
                                        accumulate);
}
void ProfilingBackend::sum_squares_chunks_multi(double* partials_host, const float* const* g, const int64_t* n,
                                                int64_t count, int64_t chunk, float grad_scale) {
  Timed timed(*this, ProfiledOp::kSumSquaresChunksMulti);
  inner_->sum_squares_chunks_multi(partials_host, g, n, count, chunk, grad_scale);
}
void ProfilingBackend::adamw_update_multi(const AdamWRange* ranges, int64_t count, const AdamWStep& s) {
  Timed timed(*this, ProfiledOp::kAdamwUpdateMulti);
  inner_->adamw_update_multi(ranges, count, s);
}
void ProfilingBackend::moe_dispatch_plan_device(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row,
                                                const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
  Timed timed(*this, ProfiledOp::kMoeDispatchPlanDevice);
  inner_->moe_dispatch_plan_device(expert_offsets, row_of_slot, token_of_row, topk_idx, N, E, k);
}
void ProfilingBackend::dequantize(float* y, const QuantizedTensor& q) {
  Timed timed(*this, ProfiledOp::kDequantize);
  inner_->dequantize(y, q);
}
void ProfilingBackend::quantize_te_rht_transpose(QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M,
                                                 int64_t K, const formats::SrKey* sr) {
  Timed timed(*this, ProfiledOp::kQuantizeTeRhtTranspose);
  inner_->quantize_te_rht_transpose(out, y_t, x, M, K, sr);
}
void ProfilingBackend::backward_operand_two_level(QuantizedTensor& out, const QuantizedTensor& in, uint32_t sign_mask,
                                                  const formats::SrKey& sr) {
  Timed timed(*this, ProfiledOp::kBackwardOperandTwoLevel);
  inner_->backward_operand_two_level(out, in, sign_mask, sr);
}
void ProfilingBackend::quantize_operand(QuantizedTensor& out, uint16_t* y, const float* x, const formats::SrKey* sr) {
  Timed timed(*this, ProfiledOp::kQuantizeOperandF32);
  inner_->quantize_operand(out, y, x, sr);
}
void ProfilingBackend::quantize_operand(QuantizedTensor& out, uint16_t* y, const uint16_t* x_bf16,
                                        const formats::SrKey* sr) {
  Timed timed(*this, ProfiledOp::kQuantizeOperandBf16);
  inner_->quantize_operand(out, y, x_bf16, sr);
}
void ProfilingBackend::quantize_te_rht_transpose_operand(QuantizedTensor& out, uint16_t* y, uint16_t* y_t,
                                                         const uint16_t* x, int64_t M, int64_t K,
                                                         const formats::SrKey* sr) {
  Timed timed(*this, ProfiledOp::kQuantizeTeRhtTransposeOperand);
  inner_->quantize_te_rht_transpose_operand(out, y, y_t, x, M, K, sr);
}
void ProfilingBackend::backward_operand_two_level_bf16(QuantizedTensor& out, uint16_t* y, const QuantizedTensor& in,
                                                       uint32_t sign_mask, const formats::SrKey& sr) {
  Timed timed(*this, ProfiledOp::kBackwardOperandTwoLevelBf16);
  inner_->backward_operand_two_level_bf16(out, y, in, sign_mask, sr);
}
void ProfilingBackend::cross_entropy_forward_sums(double* sums, float* lse, float* token_ce, const float* logits,
                                                  const int32_t* targets, int64_t N, int64_t V) {
  Timed timed(*this, ProfiledOp::kCrossEntropyForwardSums);
  inner_->cross_entropy_forward_sums(sums, lse, token_ce, logits, targets, N, V);
}
void ProfilingBackend::cross_entropy_forward_backward_sums(double* sums, float* dlogits, float* lse, float* token_ce,
                                                           const float* logits, const int32_t* targets, int64_t N,
                                                           int64_t V, double ce_scale, double z_scale) {
  Timed timed(*this, ProfiledOp::kCrossEntropyForwardBackwardSums);
  inner_->cross_entropy_forward_backward_sums(sums, dlogits, lse, token_ce, logits, targets, N, V, ce_scale, z_scale);
}

// ---- the report -------------------------------------------------------------------------------
StepProfile make_step_profile(const ProfilingBackend& profiler, double step_seconds) {
  return make_step_profile(profiler.timings(), step_seconds);
}

OpTimings per_step_difference(const OpTimings& longer, const OpTimings& shorter, int64_t steps) {
  OpTimings d{};
  const double n = static_cast<double>(std::max<int64_t>(steps, 1));
  for (size_t i = 0; i < d.size(); ++i) {
    d[i].count = std::llround(static_cast<double>(longer[i].count - shorter[i].count) / n);
    d[i].seconds = std::max(0.0, (longer[i].seconds - shorter[i].seconds) / n);
    if (d[i].count <= 0) d[i] = OpTiming{};
  }
  return d;
}

StepProfile make_step_profile(const OpTimings& timings, double step_seconds) {
  StepProfile p;
  p.step_ms = step_seconds * 1e3;
  std::array<ProfileRow, static_cast<size_t>(OpCategory::kCount)> cats{};
  for (size_t i = 0; i < static_cast<size_t>(ProfiledOp::kCount); ++i) {
    const auto op = static_cast<ProfiledOp>(i);
    const OpTiming& t = timings[i];
    if (t.count == 0) continue;
    const OpCategory c = profiled_op_category(op);
    ProfileRow r{profiled_op_name(op), op_category_name(c), t.count, t.seconds * 1e3, 0};
    p.op_ms += r.ms;
    ProfileRow& cr = cats[static_cast<size_t>(c)];
    cr.name = op_category_name(c);
    cr.count += r.count;
    cr.ms += r.ms;
    p.ops.push_back(r);
  }
  for (const ProfileRow& cr : cats)
    if (cr.count > 0) p.categories.push_back(cr);
  auto share_and_sort = [&](std::vector<ProfileRow>& rows) {
    for (ProfileRow& r : rows) r.share = p.step_ms > 0 ? r.ms / p.step_ms : 0;
    std::stable_sort(rows.begin(), rows.end(), [](const ProfileRow& a, const ProfileRow& b) { return a.ms > b.ms; });
  };
  share_and_sort(p.ops);
  share_and_sort(p.categories);
  return p;
}

std::string format_step_profile(const StepProfile& p, const std::string& title) {
  std::string s = fmt::format(
      "profile of one step, {}: {:.3f} ms with every op synchronised before and after (this removes the overlap "
      "of host launches with device work, so the step is slower than the timed median; shares are of this step)\n",
      title, p.step_ms);
  auto line = [&](const std::string& a, const std::string& b, const std::string& count, double ms, double share) {
    s += fmt::format("  {:<32} {:<14} {:>8} {:>12.3f} {:>7.1f}%\n", a, b, count, ms, share * 100);
  };
  s += fmt::format("  {:<32} {:<14} {:>8} {:>12} {:>8}\n", "category", "", "count", "total ms", "share");
  for (const ProfileRow& r : p.categories) line(r.name, "", std::to_string(r.count), r.ms, r.share);
  const double host_ms = p.step_ms - p.op_ms;
  line("(between ops: host work, syncs)", "", "-", host_ms, p.step_ms > 0 ? host_ms / p.step_ms : 0.0);
  s += fmt::format("  {:<32} {:<14} {:>8} {:>12} {:>8}\n", "op", "category", "count", "total ms", "share");
  for (const ProfileRow& r : p.ops) line(r.name, r.category, std::to_string(r.count), r.ms, r.share);
  return s;
}

}  // namespace nibble::backend
