// A Backend decorator that times every op of the wrapped backend (`nibble bench train --profile`,
// docs/cli.md): each op is forwarded unchanged; while enabled, the wrapped backend is synchronised
// before and after the op and a steady clock read around it, so the per-op times are wall times of
// device work on any backend. Synchronising removes the overlap of host launches with device work,
// so a profiled step is slower than an unprofiled one; the shares are what the report is for.
// Memory management, synchronize() and queries are forwarded untimed.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace nibble::backend {

// Every timed op of the Backend interface (the two overloads of quantize and of transpose apart).
enum class ProfiledOp : uint8_t {
  kCopyToDevice,
  kCopyToHost,
  kCopy,
  kFillZero,
  kMatmulNt,
  kMatmulNn,
  kMatmulTn,
  kEmbeddingForward,
  kEmbeddingBackward,
  kRmsnormForward,
  kRmsnormBackward,
  kRopeForward,
  kRopeBackward,
  kSwigluForward,
  kSwigluBackward,
  kAttentionForward,
  kAttentionBackward,
  kCrossEntropyForward,
  kCrossEntropyForwardBackward,
  kAddInplace,
  kAdd,
  kCopy2d,
  kMoeRouterForward,
  kMoeRouterBackward,
  kMoeDispatchPlan,
  kMoeGather,
  kMoeGatherBackward,
  kMoeCombine,
  kMoeCombineBackward,
  kMoeAccumulateLoad,
  kSumSquares,
  kSumSquaresChunks,
  kAdamwUpdate,
  kScale,
  kRoundToBf16,
  kToBf16Bits,
  kFromBf16Bits,
  kGatherColumnsBf16,
  kScatterAddColumns,
  kScatterColumns,
  kTransposeF32,
  kTransposeU16,
  kRht16Rows,
  kColumnSumsqAccumulate,
  kQuantizeF32,
  kQuantizeBf16,
  kDequantize,
  kQuantizeTeRhtTranspose,
  kBackwardOperandTwoLevel,
  kMatmulBf16Nt,
  kMatmulBf16Nn,
  kMatmulBf16Tn,
  kDequantizeBf16,
  kNvfp4TeAlpha,
  kKvCacheWrite,
  kPagedAttention,
  kMatmulNtNvfp4Weight,
  kGroupedMatmulNtNvfp4Weight,
  kQuantizeOperandF32,
  kQuantizeOperandBf16,
  kQuantizeTeRhtTransposeOperand,
  kBackwardOperandTwoLevelBf16,
  kCrossEntropyForwardSums,
  kCrossEntropyForwardBackwardSums,
  kGroupedMatmulBf16Nt,
  kGroupedMatmulBf16Nn,
  kGroupedMatmulBf16Tn,
  kGroupedMatmulBf16NtBlocks,
  kSumSquaresChunksMulti,
  kAdamwUpdateMulti,
  kMoeDispatchPlanDevice,
  kGuidedOverwriteRows,
  kGuidancePayloadRows,
  kGreedyRows,
  kCount
};

enum class OpCategory : uint8_t {
  kGemm,
  kAttention,
  kNorm,
  kCrossEntropy,
  kQuantize,
  kOptimizer,
  kElementwise,
  kMoe,
  kCopies,
  kCount
};

const char* profiled_op_name(ProfiledOp op);  // the Backend method name, e.g. "matmul_nt"
OpCategory profiled_op_category(ProfiledOp op);
const char* op_category_name(OpCategory category);  // "GEMM", "attention", ...

struct OpTiming {
  int64_t count = 0;   // calls while enabled
  double seconds = 0;  // their synchronised wall time
};
using OpTimings = std::array<OpTiming, static_cast<size_t>(ProfiledOp::kCount)>;

class ProfilingBackend final : public Backend {
 public:
  // inner must outlive this object. Starts disabled: ops are forwarded without synchronising.
  explicit ProfilingBackend(Backend& inner) : inner_(&inner) {}
  Backend& inner() const { return *inner_; }
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }
  void reset_timings() { timings_ = {}; }
  const OpTiming& timing(ProfiledOp op) const { return timings_[static_cast<size_t>(op)]; }
  const OpTimings& timings() const { return timings_; }

  Device device() const override;
  std::string name() const override;
  bool supports(Op op) const override;
  Result<void*> allocate(size_t bytes, const std::string& what) override;
  void deallocate(void* p) override;
  void copy_to_device(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override;
  bool set_batch_invariant(bool on) override;
  MemoryStats memory_stats() override;
  void reset_peak_memory() override;
  void matmul_nt(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K, bool accumulate = false,
                 bool operands_bf16 = false) override;
  void matmul_nn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool accumulate = false,
                 bool operands_bf16 = false) override;
  void matmul_tn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool accumulate = false,
                 bool operands_bf16 = false) override;
  void matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha = nullptr, bool accumulate = false) override;
  void matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha = nullptr, bool accumulate = false) override;
  void matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha = nullptr, bool accumulate = false) override;
  void dequantize_bf16(uint16_t* y, const QuantizedTensor& q) override;
  void nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b) override;
  void kv_cache_write(void* k_pages, void* v_pages, KvPageFormat format, const float* k, const float* v,
                      const int32_t* slots, int64_t N, int64_t Hkv, int64_t D) override;
  void paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages, KvPageFormat format,
                       const int32_t* block_table, int64_t max_blocks, const int32_t* context_len, int64_t N,
                       int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                       AttentionPrecision precision = AttentionPrecision::kFp32) override;
  void matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w, int64_t M) override;
  void grouped_matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w, const int64_t* offsets,
                                      int64_t G, int64_t rows) override;
  void guided_overwrite_rows(QuantizedTensor& q, int64_t* stats, const float* x, const int32_t* rows, int64_t R,
                             const uint8_t* scales, const float* outer, const uint8_t* guide,
                             formats::GuidanceKind kind) override;
  void greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V) override;
  void guidance_payload_rows(uint8_t* out, const QuantizedTensor& q, formats::GuidanceKind kind) override;
  void grouped_matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets, int64_t G,
                              int64_t extent, int64_t N, int64_t K, int64_t b_stride, const float* alpha,
                              bool accumulate) override;
  void grouped_matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets, int64_t G,
                              int64_t extent, int64_t N, int64_t K, int64_t b_stride, const float* alpha,
                              bool accumulate) override;
  void grouped_matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets, int64_t G,
                              int64_t extent, int64_t M, int64_t N, int64_t y_stride, const float* alpha,
                              bool accumulate) override;
  void grouped_matmul_bf16_nt_blocks(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                     int64_t G, int64_t extent, int64_t M, int64_t N, int64_t a_rows, int64_t b_rows,
                                     int64_t y_stride, const float* alpha, bool accumulate) override;
  void sum_squares_chunks_multi(double* partials_host, const float* const* g, const int64_t* n, int64_t count,
                                int64_t chunk, float grad_scale) override;
  void adamw_update_multi(const AdamWRange* ranges, int64_t count, const AdamWStep& s) override;
  void moe_dispatch_plan_device(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row,
                                const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) override;
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V, int64_t C) override;
  void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V,
                          int64_t C) override;
  void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                       double eps) override;
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                        int64_t R, int64_t C) override;
  void rope_forward(float* out, const float* x, const float* cos, const float* sin, const int32_t* positions, int64_t B,
                    int64_t Tn, int64_t H, int64_t D) override;
  void rope_backward(float* dx, const float* dout, const float* cos, const float* sin, const int32_t* positions,
                     int64_t B, int64_t Tn, int64_t H, int64_t D) override;
  void swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) override;
  void swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I) override;
  void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, int64_t Tn,
                         int64_t H, int64_t Hkv, int64_t D,
                         AttentionPrecision precision = AttentionPrecision::kFp32) override;
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                          const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H, int64_t Hkv,
                          int64_t D, AttentionPrecision precision = AttentionPrecision::kFp32) override;
  CrossEntropySums cross_entropy_forward(float* lse, float* token_ce, const float* logits, const int32_t* targets,
                                         int64_t N, int64_t V) override;
  CrossEntropySums cross_entropy_forward_backward(float* dlogits, float* lse, float* token_ce, const float* logits,
                                                  const int32_t* targets, int64_t N, int64_t V, double ce_scale,
                                                  double z_scale) override;
  void add_inplace(float* y, const float* x, int64_t n) override;
  void add(float* y, const float* a, const float* b, int64_t n) override;
  void copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) override;
  void moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, const float* logits,
                          const int32_t* forced_idx, int64_t N, int64_t E, int64_t k, bool norm_topk_prob) override;
  void moe_router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                           const int32_t* topk_idx, const float* topk_w, const float* dprobs_extra, double z_scale,
                           int64_t N, int64_t E, int64_t k, bool renormalized) override;
  void moe_dispatch_plan(int64_t* expert_offsets_host, int32_t* row_of_slot, int32_t* token_of_row,
                         const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) override;
  void moe_gather(float* xe, const float* x, const int32_t* token_of_row, int64_t rows, int64_t C) override;
  void moe_gather_backward(float* dx, const float* dxe, const int32_t* row_of_slot, int64_t N, int64_t k,
                           int64_t C) override;
  void moe_combine(float* out, const float* ye, const float* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k,
                   int64_t C) override;
  void moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye, const float* topk_w,
                            const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) override;
  double moe_accumulate_load(double* count_host, double* prob_sum_host, const float* probs, const float* lse,
                             const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) override;
  double sum_squares(const float* g, int64_t n, float grad_scale) override;
  void sum_squares_chunks(double* partials_host, const float* g, int64_t n, int64_t chunk, float grad_scale) override;
  void adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const AdamWStep& s) override;
  void scale(float* x, int64_t n, float s) override;
  void round_to_bf16(float* dst, const float* src, int64_t n) override;
  void to_bf16_bits(uint16_t* dst, const float* src, int64_t n) override;
  void from_bf16_bits(float* dst, const uint16_t* src, int64_t n) override;
  void gather_columns_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t src_cols,
                           const int64_t* idx, int64_t n_idx, int64_t cols_p) override;
  void scatter_add_columns(float* dw, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                           int64_t ld) override;
  void scatter_columns(float* dst, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                       int64_t ld) override;
  void transpose(float* dst, const float* src, int64_t rows, int64_t cols) override;
  void transpose(uint16_t* dst, const uint16_t* src, int64_t rows, int64_t cols) override;
  void rht16_rows(float* y, const float* x, int64_t rows, int64_t cols, uint32_t sign_mask) override;
  void column_sumsq_accumulate(double* sums, const float* x, int64_t M, int64_t K) override;
  void quantize(QuantizedTensor& out, const float* x, const formats::SrKey* sr = nullptr) override;
  void quantize(QuantizedTensor& out, const uint16_t* x_bf16, const formats::SrKey* sr = nullptr) override;
  void dequantize(float* y, const QuantizedTensor& q) override;
  void quantize_te_rht_transpose(QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K,
                                 const formats::SrKey* sr = nullptr) override;
  void backward_operand_two_level(QuantizedTensor& out, const QuantizedTensor& in, uint32_t sign_mask,
                                  const formats::SrKey& sr) override;
  void quantize_operand(QuantizedTensor& out, uint16_t* y, const float* x, const formats::SrKey* sr = nullptr) override;
  void quantize_operand(QuantizedTensor& out, uint16_t* y, const uint16_t* x_bf16,
                        const formats::SrKey* sr = nullptr) override;
  void quantize_te_rht_transpose_operand(QuantizedTensor& out, uint16_t* y, uint16_t* y_t, const uint16_t* x, int64_t M,
                                         int64_t K, const formats::SrKey* sr = nullptr) override;
  void backward_operand_two_level_bf16(QuantizedTensor& out, uint16_t* y, const QuantizedTensor& in,
                                       uint32_t sign_mask, const formats::SrKey& sr) override;
  void cross_entropy_forward_sums(double* sums, float* lse, float* token_ce, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V) override;
  void cross_entropy_forward_backward_sums(double* sums, float* dlogits, float* lse, float* token_ce,
                                           const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                           double ce_scale, double z_scale) override;

 private:
  class Timed;
  Backend* inner_;
  bool enabled_ = false;
  OpTimings timings_{};
};

// ---- the report -------------------------------------------------------------------------------
struct ProfileRow {
  std::string name;      // op or category name
  std::string category;  // the op's category (empty on category rows)
  int64_t count = 0;
  double ms = 0;
  double share = 0;  // ms / the profiled step's ms
};

struct StepProfile {
  double step_ms = 0;                  // wall time of the profiled step (with the per-op syncs)
  double op_ms = 0;                    // sum over ops; step_ms - op_ms is host time between ops
  std::vector<ProfileRow> ops;         // ops with count > 0, most time first (ties: enum order)
  std::vector<ProfileRow> categories;  // categories with count > 0, most time first
};

// The timings of `profiler` against a step of step_seconds.
StepProfile make_step_profile(const ProfilingBackend& profiler, double step_seconds);
StepProfile make_step_profile(const OpTimings& timings, double step_seconds);
// Per-step timings of the steps a run `longer` made beyond a run `shorter` (a prefix of the same
// work): (longer - shorter) / steps per op, counts rounded to the nearest call, times clamped at 0
// (two runs' timing noise can make a difference slightly negative).
OpTimings per_step_difference(const OpTimings& longer, const OpTimings& shorter, int64_t steps);
// The table `bench train --profile` prints: a header naming `title` and the synchronisation
// caveat, the per-category rows, then the per-op rows.
std::string format_step_profile(const StepProfile& profile, const std::string& title);

}  // namespace nibble::backend
