// The CUDA backend (backend.h's Backend on one GPU): a device, one non-blocking stream that
// orders every op, a cuBLASLt engine (gemm.h), stream-ordered memory from the device's pool
// (cudaMallocAsync) and a grow-only scratch arena, so the steady state allocates nothing. Ops
// launch the kernels of nn_ops / optimizer_ops / format_ops / quantize / attention / moe.
// Every CUDA or cuBLASLt error names the op, its shapes and the device; running out of memory
// names what was being allocated, the size, what is free and the config keys to lower.
// register_cuda_backend() adds the "cuda" / "cuda:N" factory to backend.h's registry. As
// backend::GraphCapture it records its stream's ops into CUDA graphs (stream capture) and replays them.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/optimizer_ops.h"
#include "backend/graph_capture.h"

namespace nibble::cuda {

class GemmEngine;

// Registers the factory "cuda" with backend::register_backend (idempotent, thread-safe).
void register_cuda_backend();

class CudaBackend final : public backend::Backend, public backend::GraphCapture {
 public:
  // Selects `device_index` and creates the stream, the cuBLASLt handle and small buffers; throws
  // CheckError naming the device when that fails (use create() for a Status instead).
  explicit CudaBackend(int device_index);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;
  // A backend on `device_index`, or a Status saying why there is none (no GPU, no driver).
  static Result<std::unique_ptr<backend::Backend>> create(int device_index);

  Device device() const override { return Device::kCUDA; }
  std::string name() const override { return name_; }
  bool supports(backend::Op op) const override;
  cudaStream_t stream() const { return stream_; }
  int device_index() const { return device_; }
  // Device allocations made so far (allocate() calls, workspaces included) and the GEMM plans
  // cached: a repeated step leaves both unchanged (tests of the steady state).
  int64_t allocation_count() const { return allocation_count_; }
  size_t gemm_plan_count() const;

  // ---- graph capture (backend/graph_capture.h): stream capture of stream() ---------------------
  void begin_capture() override;
  std::unique_ptr<backend::CapturedGraph> end_capture() override;
  void abort_capture() override;
  bool capturing() const override { return capturing_; }
  int64_t memory_epoch() const override { return deallocation_count_; }

  // ---- memory ------------------------------------------------------------------------------
  Result<void*> allocate(size_t bytes, const std::string& what) override;
  // From the device pool's used-memory counters (cudaMemPoolAttrUsedMemCurrent / High).
  MemoryStats memory_stats() override;
  void reset_peak_memory() override;
  void deallocate(void* p) override;
  void copy_to_device(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override;

  // ---- GEMMs ---------------------------------------------------------------------------------
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
  void sum_squares_chunks_multi(double* partials_host, const float* const* g, const int64_t* n, int64_t count,
                                int64_t chunk, float grad_scale) override;
  void adamw_update_multi(const backend::AdamWRange* ranges, int64_t count, const backend::AdamWStep& s) override;
  void moe_dispatch_plan_device(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row,
                                const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) override;
  void dequantize_bf16(uint16_t* y, const backend::QuantizedTensor& q) override;
  void nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b) override;

  // ---- per-token layers ------------------------------------------------------------------------
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
                         int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                         backend::AttentionPrecision precision) override;
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                          const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                          int64_t Hkv, int64_t D, backend::AttentionPrecision precision) override;
  backend::CrossEntropySums cross_entropy_forward(float* lse, float* token_ce, const float* logits,
                                                  const int32_t* targets, int64_t N, int64_t V) override;
  backend::CrossEntropySums cross_entropy_forward_backward(float* dlogits, float* lse, float* token_ce,
                                                           const float* logits, const int32_t* targets, int64_t N,
                                                           int64_t V, double ce_scale, double z_scale) override;

  // ---- small utilities -------------------------------------------------------------------------
  void add_inplace(float* y, const float* x, int64_t n) override;
  void add(float* y, const float* a, const float* b, int64_t n) override;
  void copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) override;

  // ---- MoE -------------------------------------------------------------------------------------
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

  // ---- optimizer -------------------------------------------------------------------------------
  double sum_squares(const float* g, int64_t n, float grad_scale) override;
  void sum_squares_chunks(double* partials_host, const float* g, int64_t n, int64_t chunk, float grad_scale) override;
  void adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const backend::AdamWStep& s) override;
  void scale(float* x, int64_t n, float s) override;

  // ---- format ops ------------------------------------------------------------------------------
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
  void quantize(backend::QuantizedTensor& out, const float* x, const formats::SrKey* sr) override;
  void quantize(backend::QuantizedTensor& out, const uint16_t* x_bf16, const formats::SrKey* sr) override;
  void dequantize(float* y, const backend::QuantizedTensor& q) override;
  void quantize_te_rht_transpose(backend::QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K,
                                 const formats::SrKey* sr) override;
  void backward_operand_two_level(backend::QuantizedTensor& out, const backend::QuantizedTensor& in,
                                  uint32_t sign_mask, const formats::SrKey& sr) override;
  // cross-entropy with the sums left in device memory (no synchronisation)
  void cross_entropy_forward_sums(double* sums, float* lse, float* token_ce, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V) override;
  void cross_entropy_forward_backward_sums(double* sums, float* dlogits, float* lse, float* token_ce,
                                           const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                           double ce_scale, double z_scale) override;
  // fused quantize + BF16 operand: the quantize kernels with their operand output (quantize.h)
  void quantize_operand(backend::QuantizedTensor& out, uint16_t* y, const float* x, const formats::SrKey* sr) override;
  void quantize_operand(backend::QuantizedTensor& out, uint16_t* y, const uint16_t* x_bf16,
                        const formats::SrKey* sr) override;
  void quantize_te_rht_transpose_operand(backend::QuantizedTensor& out, uint16_t* y, uint16_t* y_t, const uint16_t* x,
                                         int64_t M, int64_t K, const formats::SrKey* sr) override;
  void backward_operand_two_level_bf16(backend::QuantizedTensor& out, uint16_t* y, const backend::QuantizedTensor& in,
                                       uint32_t sign_mask, const formats::SrKey& sr) override;

  // packed-NVFP4 weight GEMM (backend/cuda/fp4_gemv.cuh for M <= 8, fp4_weight_mma.cuh beyond)
  void matmul_nt_nvfp4_weight(float* y, const float* x, const backend::QuantizedTensor& w, int64_t M) override;
  void grouped_matmul_nt_nvfp4_weight(float* y, const float* x, const backend::QuantizedTensor& w,
                                      const int64_t* offsets, int64_t G, int64_t rows) override;
  // TRACE guided rows (backend/cuda/guided.cu: nvfp4_2level_guided_rows)
  void guided_overwrite_rows(backend::QuantizedTensor& q, int64_t* stats, const float* x, const int32_t* rows,
                             int64_t R, const uint8_t* scales, const float* outer, const uint8_t* guide,
                             formats::GuidanceKind kind) override;
  void greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V) override;
  void guidance_payload_rows(uint8_t* out, const backend::QuantizedTensor& q, formats::GuidanceKind kind) override;
  // paged KV cache (backend/cuda/paged_attention.h)
  void kv_cache_write(void* k_pages, void* v_pages, backend::KvPageFormat format, const float* k, const float* v,
                      const int32_t* slots, int64_t N, int64_t Hkv, int64_t D) override;
  void paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                       backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                       const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                       int64_t page_size, backend::AttentionPrecision precision) override;

 private:
  struct HostResults;  // pinned host copies of small device results
  void activate() const;  // makes this backend's device current on the calling thread
  // The scratch arena: at least `bytes` of device memory, valid until the next call (grow-only).
  void* scratch(size_t bytes, const char* op);
  // Stream sync, then throws if a kernel flagged an id out of range since the last check.
  void sync_and_check_flags(const char* op);
  // A CheckError naming `op` when a capture is under way (the calls a graph cannot hold).
  void refuse_while_capturing(const char* op) const;
  // Frees what deallocate() was given during a capture (after it ended).
  void free_deferred();
  // grouped_matmul_bf16_nt (nn false) / _nn (true): the checks and the launch
  void grouped_rows_bf16(bool nn, float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets, int64_t G,
                         int64_t extent, int64_t N, int64_t K, int64_t b_stride, const float* alpha, bool accumulate);
  [[noreturn]] void op_failed(const char* op, const std::string& shapes, const std::string& error, const char* expr,
                              const char* file, int line) const;
  // quantize / quantize_operand: operand (out.rows, out.cols) bf16 or null.
  template <typename In>
  void quantize_impl(backend::QuantizedTensor& out, const In* x, const formats::SrKey* sr, uint16_t* operand);
  void te_rht_transpose_impl(backend::QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K,
                             const formats::SrKey* sr, uint16_t* operand, const char* op);
  void backward_operand_impl(backend::QuantizedTensor& out, const backend::QuantizedTensor& in, uint32_t sign_mask,
                             const formats::SrKey& sr, uint16_t* operand, const char* op);

  int device_ = 0;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
  std::unique_ptr<GemmEngine> gemm_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  double* small_dev_ = nullptr;     // (8) f64 device results (sums)
  uint32_t* flags_dev_ = nullptr;   // (1) u32 error flags (nn_ops.h)
  HostResults* host_ = nullptr;     // pinned
  int64_t allocation_count_ = 0;
  int64_t deallocation_count_ = 0;  // memory_epoch()
  bool capturing_ = false;
  std::vector<void*> deferred_frees_;  // deallocate() during a capture
  std::vector<cuda::SumSquaresRange> sum_ranges_;   // sum_squares_chunks_multi's descriptors (grow-only)
  std::vector<cuda::AdamWMultiRange> adamw_ranges_;  // adamw_update_multi's descriptors (grow-only)
  std::vector<double> moe_load_host_;  // (2E+1) moe_accumulate_load's sums on the host (grow-only)
};

}  // namespace nibble::cuda
