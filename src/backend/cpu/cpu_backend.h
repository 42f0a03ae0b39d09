// The CPU backend: backend::Backend over host memory, wrapping the CPU ops of this folder
// (OpenBLAS GEMMs, nn_ops, attention, moe) and the whole-tensor format drivers of
// formats/quantize_cpu.h, so the model on the seam keeps today's CPU results to the bit. It is
// the oracle the CUDA backend is tested against. One instance serves any number of models
// (backend::cpu_backend()); its only state is the allocation count behind memory_stats().
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"

namespace nibble::backend {

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::kCPU; }
  std::string name() const override { return "cpu"; }
  bool supports(Op op) const override { return op < Op::kCount; }

  Result<void*> allocate(size_t bytes, const std::string& what) override;
  void deallocate(void* p) override;
  void copy_to_device(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override {}
  // The NT GEMMs through cpu::matmul_nt_row_invariant while on (OpenBLAS otherwise).
  bool set_batch_invariant(bool on) override {
    batch_invariant_ = on;
    return true;
  }
  MemoryStats memory_stats() override;
  void reset_peak_memory() override;

  void matmul_nt(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K, bool accumulate,
                 bool operands_bf16) override;
  void matmul_nn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool accumulate,
                 bool operands_bf16) override;
  void matmul_tn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool accumulate,
                 bool operands_bf16) override;
  void matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha, bool accumulate) override;
  void matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha, bool accumulate) override;
  void matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha, bool accumulate) override;
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
  void moe_dispatch_plan_device(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row,
                                const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) override;
  void dequantize_bf16(uint16_t* y, const QuantizedTensor& q) override;
  void nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b) override;

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V,
                         int64_t C) override;
  void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V,
                          int64_t C) override;
  void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                       double eps) override;
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                        int64_t R, int64_t C) override;
  void rope_forward(float* out, const float* x, const float* cos, const float* sin, const int32_t* positions,
                    int64_t B, int64_t Tn, int64_t H, int64_t D) override;
  void rope_backward(float* dx, const float* dout, const float* cos, const float* sin, const int32_t* positions,
                     int64_t B, int64_t Tn, int64_t H, int64_t D) override;
  void swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) override;
  void swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I) override;
  void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                         int64_t Tn, int64_t H, int64_t Hkv, int64_t D, AttentionPrecision precision) override;
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                          const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                          int64_t Hkv, int64_t D, AttentionPrecision precision) override;
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

  void quantize(QuantizedTensor& out, const float* x, const formats::SrKey* sr) override;
  void quantize(QuantizedTensor& out, const uint16_t* x_bf16, const formats::SrKey* sr) override;
  void dequantize(float* y, const QuantizedTensor& q) override;
  void quantize_te_rht_transpose(QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K,
                                 const formats::SrKey* sr) override;
  void backward_operand_two_level(QuantizedTensor& out, const QuantizedTensor& in, uint32_t sign_mask,
                                  const formats::SrKey& sr) override;

  // paged KV cache (backend/cpu/paged_attention.h)
  void kv_cache_write(void* k_pages, void* v_pages, KvPageFormat format, const float* k, const float* v,
                      const int32_t* slots, int64_t N, int64_t Hkv, int64_t D) override;
  void paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages, KvPageFormat format,
                       const int32_t* block_table, int64_t max_blocks, const int32_t* context_len, int64_t N,
                       int64_t H, int64_t Hkv, int64_t D, int64_t page_size,
                       AttentionPrecision precision) override;
  // packed-NVFP4 weight GEMM: the reference (dequantize, then matmul_nt)
  void matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w, int64_t M) override;
  void grouped_matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w, const int64_t* offsets,
                                      int64_t G, int64_t rows) override;
  // TRACE guided rows: formats::nvfp4_2level_quantize_guided_cpu row by row
  void guided_overwrite_rows(QuantizedTensor& q, int64_t* stats, const float* x, const int32_t* rows, int64_t R,
                             const uint8_t* scales, const float* outer, const uint8_t* guide,
                             formats::GuidanceKind kind) override;
  void greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V) override;
  void guidance_payload_rows(uint8_t* out, const QuantizedTensor& q, formats::GuidanceKind kind) override;

 protected:
  bool host_memory_scratch() const override { return true; }  // the composed fused ops' skipped parts

 private:
  bool batch_invariant_ = false;
  std::vector<float> nvfp4_weight_scratch_;  // (N, K) the dequantized weight of matmul_nt_nvfp4_weight
  std::mutex memory_mutex_;
  std::unordered_map<void*, size_t> sizes_;  // live allocations (for memory_stats)
  int64_t in_use_ = 0, peak_ = 0;
};

}  // namespace nibble::backend
