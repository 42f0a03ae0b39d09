// The backend seam (../shared/spec/06-backends.md): every op the training step, the recipes and
// the optimizer run goes through one Backend object per model instance, so one model definition
// and one copy of each recipe's policy run on the CPU (backend/cpu, the oracle) and on CUDA
// (backend/cuda). Ops are destination-first over raw pointers in the backend's memory (host
// memory for the CPU backend, device memory for CUDA), stream-ordered; shapes are written at
// every pointer. Scalar readable references for each op live in backend/reference.h; the op-test
// suite (src/backend/ops_test) runs every op on every available backend against them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/status.h"
#include "core/tensor.h"
#include "formats/guided.h"
#include "formats/mx.h"
#include "formats/nvfp4.h"

namespace nibble::backend {

// ---- quantized operands: one value type --------------------------------------------------------
// A quantized matrix (rows, cols) with blocks along cols, as a view of memory owned elsewhere
// (on the backend's device). Used by recipes, checkpoints, export and weight sync alike.
enum class QuantFormat : uint8_t {
  kNvfp4Te,       // TE 1x16: codes (rows, cols/2) e2m1x2, scales (rows, cols/16) e4m3, amax (1) f32
  kNvfp4Te2d,     // TE 16x16 tiles, scales replicated per row as kNvfp4Te; amax (1) f32
  kNvfp4TwoLevel, // TetraJet-v2 double-block: codes, inner scales (rows, cols/16) e4m3,
                  //   outer (rows, ceil(cols/128)) f32
  kMxfp8,         // elems (rows, cols) e4m3, scales (rows, cols/32) e8m0 (rule kRceil unless said)
};
const char* quant_format_name(QuantFormat f);

struct QuantizedTensor {
  QuantFormat format = QuantFormat::kNvfp4TwoLevel;
  int64_t rows = 0, cols = 0;
  uint8_t* codes = nullptr;   // packed e2m1 (rows, cols/2) or e4m3 elements (rows, cols)
  uint8_t* scales = nullptr;  // block scales, row-major linear layout
  float* outer = nullptr;     // 2-level outer scales (rows, ceil(cols/128)) or TE amax (1)
  // Bytes of each part for this format and shape.
  static int64_t code_bytes(QuantFormat f, int64_t rows, int64_t cols);
  static int64_t scale_bytes(QuantFormat f, int64_t rows, int64_t cols);
  static int64_t outer_count(QuantFormat f, int64_t rows, int64_t cols);
};

// Ops a backend may lack; supports() says so, require() fails loudly naming the op and backend.
enum class Op : uint16_t {
  kGemm, kEmbedding, kRmsNorm, kRope, kSwiglu, kAttention, kCrossEntropy, kElementwise, kMoeRouting,
  kAdamW, kQuantizeNvfp4Te, kQuantizeNvfp4TwoLevel, kQuantizeMxfp8, kRht16, kBackwardOperandTwoLevel,
  kPagedKvCache,  // kv_cache_write + paged_attention (the rollout engine's decode attention)
  kNvfp4WeightGemm,  // matmul_nt_nvfp4_weight, grouped_matmul_nt_nvfp4_weight (decode GEMV on packed weights)
  kGroupedGemm,   // grouped_matmul_bf16_* + moe_dispatch_plan_device (MoE experts in one launch)
  kTraceGuidedRows,  // guided_overwrite_rows (the RL trainer's TRACE guided rounding), guidance_payload_rows
  kGreedyRows,    // greedy_rows (the rollout engine's greedy decoding where the logits are)
  kCount
};
const char* op_name(Op op);

// Element format of a paged KV cache's pages (rollout engine). kBf16: BF16 bits (the default);
// kF32: binary32 (the exact reference the tests compare with); kFp8: E4M3 codes with an FP32
// scale per (position, kv head); kNvfp4: the two-level NVFP4 of each (position, kv head) row
// (E2M1 codes, E4M3 1x16 scales, FP32 1x128 scales; D % 16 == 0). Layouts: backend/kv_page_codec.h.
enum class KvPageFormat : uint8_t { kBf16, kF32, kFp8, kNvfp4 };
// Bytes of one slot (one position of one layer: Hkv heads of D elements, with its scales).
int64_t kv_token_bytes(KvPageFormat f, int64_t Hkv, int64_t D);
const char* kv_page_format_name(KvPageFormat f);  // "bf16" | "f32" | "fp8" | "nvfp4"

struct CrossEntropySums {
  double ce_sum = 0;   // sum over valid rows of ce
  double z_sum = 0;    // sum over valid rows of lse^2
  int64_t n_valid = 0;
};

// What AdamW needs for one flat parameter range (see train/optimizer.h for the exact order).
struct AdamWStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;       // 1-based step count after this update (bias corrections)
  float grad_scale = 1;   // gradients are multiplied by this first
};
// One parameter of a multi-tensor AdamW call: w, m, v (n) updated from g (n), in backend memory;
// the step's weight decay applies where weight_decay is set.
struct AdamWRange {
  float* w = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const float* g = nullptr;
  int64_t n = 0;
  bool weight_decay = true;
};

// Precision of the attention ops (issue #13). kFp32: FP32 throughout. kBf16: q, k, v (backward:
// dout, out) rounded to BF16, products with FP32 accumulation, the probabilities P (backward: dS)
// rounded to BF16 before the second product as FlashAttention-2 does; lse FP32, outputs FP32.
enum class AttentionPrecision : uint8_t { kFp32, kBf16 };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"
  virtual bool supports(Op op) const = 0;
  // Fails with a CheckError naming the op and the backend when !supports(op).
  void require(Op op) const;

  // ---- memory (not for hot paths: callers keep grow-only buffers) -----------------------------
  // Zero-filled on the CPU, unspecified on CUDA. Errors name `what`, the size and what is free.
  virtual Result<void*> allocate(size_t bytes, const std::string& what) = 0;
  virtual void deallocate(void* p) = 0;
  virtual void copy_to_device(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;  // synchronises
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;              // device to device
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Batch-invariant GEMMs, for inference: while on, matmul_nt and the NT products built on it
  // (matmul_bf16_nt, grouped_matmul_bf16_nt, matmul_nt_nvfp4_weight and its grouped form) compute
  // each output row from that row's operands alone by one fixed sequence of operations, so a row
  // gets the same bits whatever M and the other rows are: the rollout engine's promise that a seed
  // gives the same tokens whatever else is in the batch. Returns whether this backend honours it;
  // the default does not and changes nothing (CUDA today: its decode GEMV for M <= 8 is
  // row-invariant by construction, cuBLASLt above it is not promised to be).
  virtual bool set_batch_invariant(bool on) {
    (void)on;
    return false;
  }
  // Bytes held through allocate() now and at most since the last reset_peak_memory() (-1 where a
  // backend does not track them).
  struct MemoryStats {
    int64_t in_use_bytes = -1;
    int64_t peak_bytes = -1;
  };
  virtual MemoryStats memory_stats() { return {}; }
  virtual void reset_peak_memory() {}

  // ---- GEMMs, FP32 semantics: C (M,N) [+]= products with FP32 accumulation ----------------------
  // operands_bf16: the caller promises every operand value is exactly a BF16 number (bf16-rounded
  // activations, dequantized E2M1 x E4M3 blocks), so a backend may multiply on BF16 tensor cores
  // with the same products; the sum order is the backend's.
  // y: (M,N) = x: (M,K) . w: (N,K)^T
  virtual void matmul_nt(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                         bool accumulate = false, bool operands_bf16 = false) = 0;
  // y: (M,N) = a: (M,K) . b: (K,N)
  virtual void matmul_nn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K,
                         bool accumulate = false, bool operands_bf16 = false) = 0;
  // y: (M,N) = a: (K,M)^T . b: (K,N)
  virtual void matmul_tn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K,
                         bool accumulate = false, bool operands_bf16 = false) = 0;

  // ---- BF16-operand GEMMs and their operands (issue #13; 06-backends.md "Hopper facts") ---------
  // y (M,N) f32 = alpha · Σ_k a·b, or y + alpha · Σ_k a·b when accumulating: a, b are BF16 bits
  // (products exact in FP32), FP32 accumulation in the backend's order. alpha: (1) f32 in backend
  // memory (a per-tensor scale computed there, so nothing waits for the host), null = 1; the CPU
  // applies it as fl(alpha · sum) or fma(alpha, sum, y).
  // y: (M,N) = a: (M,K) . b: (N,K)^T
  virtual void matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                              const float* alpha = nullptr, bool accumulate = false) = 0;
  // y: (M,N) = a: (M,K) . b: (K,N)
  virtual void matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                              const float* alpha = nullptr, bool accumulate = false) = 0;
  // y: (M,N) = a: (K,M)^T . b: (K,N)
  virtual void matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                              const float* alpha = nullptr, bool accumulate = false) = 0;
  // y (q.rows, q.cols) bf16 bits <- q as a BF16 GEMM operand (bit-exact across backends):
  //   kNvfp4Te / kNvfp4Te2d: E2M1 code × E4M3 block scale WITHOUT the per-tensor factor, exact
  //     (<= 6 significant bits, in range); the factor goes into the GEMM's alpha (nvfp4_te_alpha);
  //   kNvfp4TwoLevel: the FP32 dequantization (code × fl(inner × outer)) rounded to nearest even,
  //     relative error <= 2^-8 (BF16's unit roundoff): the outer scale varies along K, so it
  //     cannot be an alpha (docs/architecture.md, "accepted rounding");
  //   kMxfp8: the FP32 dequantization (E4M3 × 2^k) rounded to nearest even, exact when normal.
  virtual void dequantize_bf16(uint16_t* y, const QuantizedTensor& q) = 0;
  // alpha (1) <- fl(fl(amax_a · fl(1/2688)) · fl(amax_b · fl(1/2688))): the product of the
  // per-tensor factors of two TE operands (amax_a, amax_b: their `outer`, (1) f32 each).
  virtual void nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b) = 0;

  // ---- per-token layers (conventions of backend/cpu/nn_ops.h: backward overwrites input
  // gradients and accumulates parameter gradients) ------------------------------------------------
  // out: (N,C) = wte: (V,C)[tokens: (N) i32]
  virtual void embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V,
                                 int64_t C) = 0;
  // dwte: (V,C) += scatter of dout (N,C); deterministic (fixed order per row of dwte).
  virtual void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V,
                                  int64_t C) = 0;
  // out: (R,C), rstd: (R); x: (R,C), w: (C)
  virtual void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                               double eps) = 0;
  // dx: (R,C) overwritten, dw: (C) +=
  virtual void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                                const float* rstd, int64_t R, int64_t C) = 0;
  // out/x: (B,T,H,D), may alias; cos/sin: (P, D/2) tables in backend memory; positions: (B,T) i32 or null.
  virtual void rope_forward(float* out, const float* x, const float* cos, const float* sin, const int32_t* positions,
                            int64_t B, int64_t Tn, int64_t H, int64_t D) = 0;
  virtual void rope_backward(float* dx, const float* dout, const float* cos, const float* sin,
                             const int32_t* positions, int64_t B, int64_t Tn, int64_t H, int64_t D) = 0;
  // out: (N,I) = silu(gate) * up; gu: (N,2I) rows [gate | up]
  virtual void swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) = 0;
  virtual void swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I) = 0;
  // Causal GQA attention, scale 1/sqrt(D), flash-style contract: out: (B,T,H,D), lse: (B,H,T)
  // log-sum-exp of each query row's scaled scores (saved for backward, probabilities are not);
  // q: (B,T,H,D), k, v: (B,T,Hkv,D).
  virtual void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                                 int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                                 AttentionPrecision precision = AttentionPrecision::kFp32) = 0;
  // dq: (B,T,H,D), dk, dv: (B,T,Hkv,D) overwritten; recomputes the probabilities from lse.
  virtual void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                                  const float* lse, const float* q, const float* k, const float* v, int64_t B,
                                  int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                                  AttentionPrecision precision = AttentionPrecision::kFp32) = 0;
  // Softmax cross-entropy with z-loss (nn_ops.h semantics). lse: (N); token_ce: (N) or null;
  // logits: (N,V); targets: (N) i32 in backend memory (< 0 ignored). Sums come back to the host.
  virtual CrossEntropySums cross_entropy_forward(float* lse, float* token_ce, const float* logits,
                                                 const int32_t* targets, int64_t N, int64_t V) = 0;
  // dlogits (N,V) may alias logits; token_ce required.
  virtual CrossEntropySums cross_entropy_forward_backward(float* dlogits, float* lse, float* token_ce,
                                                          const float* logits, const int32_t* targets, int64_t N,
                                                          int64_t V, double ce_scale, double z_scale) = 0;

  // ---- small utilities ----------------------------------------------------------------------
  virtual void add_inplace(float* y, const float* x, int64_t n) = 0;         // y += x
  virtual void add(float* y, const float* a, const float* b, int64_t n) = 0; // y = a + b
  // dst (rows, cols) ld dst_ld <- src (rows, cols) ld src_ld (QKV split / merge).
  virtual void copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) = 0;

  // ---- MoE (backend/cpu/moe.h semantics) -----------------------------------------------------
  virtual void moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, const float* logits,
                                  const int32_t* forced_idx, int64_t N, int64_t E, int64_t k,
                                  bool norm_topk_prob) = 0;
  virtual void moe_router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                                   const int32_t* topk_idx, const float* topk_w, const float* dprobs_extra,
                                   double z_scale, int64_t N, int64_t E, int64_t k, bool renormalized) = 0;
  // expert_offsets_host: (E+1) host array (the model walks experts on the host); row_of_slot,
  // token_of_row: (N*k) in backend memory.
  virtual void moe_dispatch_plan(int64_t* expert_offsets_host, int32_t* row_of_slot, int32_t* token_of_row,
                                 const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) = 0;
  virtual void moe_gather(float* xe, const float* x, const int32_t* token_of_row, int64_t rows, int64_t C) = 0;
  virtual void moe_gather_backward(float* dx, const float* dxe, const int32_t* row_of_slot, int64_t N, int64_t k,
                                   int64_t C) = 0;
  virtual void moe_combine(float* out, const float* ye, const float* topk_w, const int32_t* row_of_slot, int64_t N,
                           int64_t k, int64_t C) = 0;
  virtual void moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye,
                                    const float* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k,
                                    int64_t C) = 0;
  // Host double sums: count (E) += rows routed to e; prob_sum (E) += sum_n probs[n,e];
  // returns sum_n lse[n]^2 (router z-loss numerator).
  virtual double moe_accumulate_load(double* count_host, double* prob_sum_host, const float* probs,
                                     const float* lse, const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) = 0;

  // ---- grouped BF16 GEMMs over MoE experts (issue #13; Op::kGroupedGemm) ---------------------------
  // One call for all G groups (experts) of a layer; the groups come from `offsets`: (G+1) i64 in
  // backend memory, non-decreasing, offsets[0] = 0, offsets[G] <= extent (the host never reads
  // them). Operands are BF16 bits, products exact, FP32 accumulation in the backend's order, as
  // matmul_bf16_*; alpha: (G) f32 in backend memory (group g's scale) or null = 1. The defaults
  // fail through require().
  // Rows grouped: for each g, rows [o_g, o_{g+1}) of a and y; extent = rows of a and y (rows past
  // o_G are left as they are).
  //   y: (extent, N) rows o_g.. = a: (extent, K) rows o_g.. . b_g: (N,K)^T, b_g = b + g * b_stride
  virtual void grouped_matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                      int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                      const float* alpha = nullptr, bool accumulate = false);
  //   y: (extent, N) rows o_g.. = a: (extent, K) rows o_g.. . b_g: (K,N), b_g = b + g * b_stride
  virtual void grouped_matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                      int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                      const float* alpha = nullptr, bool accumulate = false);
  // Reduction grouped: y_g: (M,N) = a: (extent, M) rows o_g..^T . b: (extent, N) rows o_g..,
  // y_g = y + g * y_stride; an empty group's y_g is zero-filled (accumulate: left as it is).
  virtual void grouped_matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                      int64_t G, int64_t extent, int64_t M, int64_t N, int64_t y_stride,
                                      const float* alpha = nullptr, bool accumulate = false);
  // Block-reduction grouped (the FP4 recipes' expert wgrads, each expert's along-token operands
  // quantized by the expert itself and stored back to back): group g reduces over its own
  // K_g = o_g+1 - o_g columns; a_g: (a_rows, K_g) at a + a_rows · o_g and b_g: (b_rows, K_g) at
  // b + b_rows · o_g, row-major with leading dimension K_g (their first M / N rows are used);
  //   y_g: (M,N) at y + g * y_stride = a_g[:M] . b_g[:N]^T
  // An empty group's y_g is zero-filled (accumulate: left as it is).
  virtual void grouped_matmul_bf16_nt_blocks(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                             int64_t G, int64_t extent, int64_t M, int64_t N, int64_t a_rows,
                                             int64_t b_rows, int64_t y_stride, const float* alpha = nullptr,
                                             bool accumulate = false);
  // moe_dispatch_plan with expert_offsets: (E+1) i64 in backend memory (no host round trip). The
  // ids must be in [0, E) (moe_router_forward's are; forced sets are checked there).
  virtual void moe_dispatch_plan_device(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row,
                                        const int32_t* topk_idx, int64_t N, int64_t E, int64_t k);

  // ---- optimizer -------------------------------------------------------------------------------
  // Sum of squares of g (n) * grad_scale^2 in double, in a fixed order (deterministic).
  virtual double sum_squares(const float* g, int64_t n, float grad_scale) = 0;
  // partials_host (ceil(n / chunk)) <- sum_squares of each consecutive `chunk`-element piece of
  // g (n), the last one shorter; one round trip for all pieces (the global-norm clip sums them
  // on the host in order). Default: one sum_squares call per piece.
  virtual void sum_squares_chunks(double* partials_host, const float* g, int64_t n, int64_t chunk, float grad_scale) {
    for (int64_t c = 0, b = 0; b < n; ++c, b += chunk)
      partials_host[c] = sum_squares(g + b, std::min(chunk, n - b), grad_scale);
  }
  // AdamW on one flat range: w, m, v (n) updated in place from g (n) (train/optimizer.h order).
  virtual void adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const AdamWStep& s) = 0;
  // The optimizer's whole parameter list at once (a MoE model has thousands of tensors: one
  // launch and one round trip instead of one each). sum_squares_chunks_multi: partials_host holds
  // the sum_squares_chunks pieces of g[0] (n[0]), then of g[1], ... (sum_r ceil(n_r / chunk)), the
  // same values as one call per range. adamw_update_multi: adamw_update of every range with
  // s.weight_decay where the range has weight_decay (0 elsewhere), the same bits. Defaults: one
  // call per range.
  virtual void sum_squares_chunks_multi(double* partials_host, const float* const* g, const int64_t* n, int64_t count,
                                        int64_t chunk, float grad_scale);
  virtual void adamw_update_multi(const AdamWRange* ranges, int64_t count, const AdamWStep& s);
  virtual void scale(float* x, int64_t n, float s) = 0;  // x *= s

  // ---- format ops the recipes use (bit-exact across backends) --------------------------------------
  // dst (n) <- round_to_bf16(src (n)) (may alias)
  virtual void round_to_bf16(float* dst, const float* src, int64_t n) = 0;
  // dst (n) bf16 bits <- src (n) f32 rounded to nearest even
  virtual void to_bf16_bits(uint16_t* dst, const float* src, int64_t n) = 0;
  // dst (n) f32 <- src (n) bf16 bits widened (exact: the inverse of to_bf16_bits on BF16 values)
  virtual void from_bf16_bits(float* dst, const uint16_t* src, int64_t n) = 0;
  // dst (rows_p, cols_p) <- bf16(src[r, idx[j]]) for r < rows, j < n_idx (idx null: j), else 0.
  // src: (rows, src_cols) f32; idx: (n_idx) i64 in backend memory.
  virtual void gather_columns_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t src_cols,
                                   const int64_t* idx, int64_t n_idx, int64_t cols_p) = 0;
  // dw[n, idx[j]] += t[n, j] for n < N, j < n_idx; t: (N, ld), dw: (N, K).
  virtual void scatter_add_columns(float* dw, const float* t, int64_t N, int64_t K, const int64_t* idx,
                                   int64_t n_idx, int64_t ld) = 0;
  // dst[n, idx[j]] = t[n, j] (the inverse gather, no rounding); dst: (N, K), t: (N, ld).
  virtual void scatter_columns(float* dst, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                               int64_t ld) = 0;
  // dst (cols, rows) <- src (rows, cols)^T (4-byte or 2-byte elements)
  virtual void transpose(float* dst, const float* src, int64_t rows, int64_t cols) = 0;
  virtual void transpose(uint16_t* dst, const uint16_t* src, int64_t rows, int64_t cols) = 0;
  // TetraJet-v2 RHT: y (rows, cols) f32, each 16-group along a row <- rht16_f32(group, sign_mask); y may be x.
  virtual void rht16_rows(float* y, const float* x, int64_t rows, int64_t cols, uint32_t sign_mask) = 0;
  // sums (K) += column sums of squares of x (M,K), in double (outlier calibration).
  virtual void column_sumsq_accumulate(double* sums, const float* x, int64_t M, int64_t K) = 0;

  // out (format, shape, buffers set) <- quantize x (out.rows, out.cols) f32 (or BF16 bits for the
  // uint16_t overload) with sr (null: RTN). kNvfp4Te / kNvfp4Te2d compute the amax into out.outer.
  virtual void quantize(QuantizedTensor& out, const float* x, const formats::SrKey* sr = nullptr) = 0;
  virtual void quantize(QuantizedTensor& out, const uint16_t* x_bf16, const formats::SrKey* sr = nullptr) = 0;
  // y (q.rows, q.cols) f32 <- exact dequantization of q.
  virtual void dequantize(float* y, const QuantizedTensor& q) = 0;
  // TE wgrad operand: out (K, M) kNvfp4Te <- quantize(RHT_TE(x^T)) with y_t scratch (K, M) bf16;
  // x (M, K) bf16, M % 16 == 0 (formats::nvfp4_te_quantize_rht_t_cpu).
  virtual void quantize_te_rht_transpose(QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M,
                                         int64_t K, const formats::SrKey* sr = nullptr) = 0;
  // TetraJet-v2 fused backward operand: out (K, M) 2-level <- quantize(RHT16_along_M(deq(in)^T), sr);
  // in (M, K) 2-level, M % 128 == 0 (formats::nvfp4_2level_backward_operand_cpu).
  virtual void backward_operand_two_level(QuantizedTensor& out, const QuantizedTensor& in, uint32_t sign_mask,
                                          const formats::SrKey& sr) = 0;

  // ---- fused quantize + BF16 GEMM operand (issue #13) -------------------------------------------
  // Each quantizer above and dequantize_bf16 of its result in one pass: y (out.rows, out.cols) bf16
  // bits <- the BF16 GEMM operand of the quantization, bit for bit what dequantize_bf16(y, out)
  // gives after the unfused op (SR included: the same key gives the same bits), and `out` as the
  // unfused op writes it. out.codes == out.scales == nullptr skips them (nothing keeps the
  // quantization); the TE formats still need out.outer (the amax: the GEMM's alpha), kNvfp4TwoLevel
  // writes its outer scales only where out.outer is set. The defaults compose the unfused ops (the
  // CPU reference, with scratch parts where they are skipped); CUDA runs fused kernels. y and x:
  // 16-byte aligned.
  virtual void quantize_operand(QuantizedTensor& out, uint16_t* y, const float* x, const formats::SrKey* sr = nullptr);
  virtual void quantize_operand(QuantizedTensor& out, uint16_t* y, const uint16_t* x_bf16,
                                const formats::SrKey* sr = nullptr);
  // quantize_te_rht_transpose + dequantize_bf16: y (K, M) bf16 operand; y_t (K, M) bf16 scratch.
  virtual void quantize_te_rht_transpose_operand(QuantizedTensor& out, uint16_t* y, uint16_t* y_t, const uint16_t* x,
                                                 int64_t M, int64_t K, const formats::SrKey* sr = nullptr);
  // backward_operand_two_level + dequantize_bf16: y (in.cols, in.rows) bf16 operand.
  virtual void backward_operand_two_level_bf16(QuantizedTensor& out, uint16_t* y, const QuantizedTensor& in,
                                               uint32_t sign_mask, const formats::SrKey& sr);
  // q with the parts the fused ops may skip set to null (codes, scales; kNvfp4TwoLevel's outer):
  // the view to pass for an operand nothing keeps.
  static QuantizedTensor operand_only(QuantizedTensor q) {
    q.codes = nullptr, q.scales = nullptr;
    if (q.format == QuantFormat::kNvfp4TwoLevel) q.outer = nullptr;
    return q;
  }

 protected:
  // Where the composed defaults above keep skipped parts: plain host memory when true (a backend
  // whose memory is the host's: nothing goes through allocate()), else allocate().
  virtual bool host_memory_scratch() const { return false; }

 public:

  // ---- cross-entropy sums kept in backend memory (issue #13) -------------------------------------
  // cross_entropy_forward / cross_entropy_forward_backward with the sums written to `sums` (4) f64
  // in backend memory as {ce_sum, z_sum, n_valid, 0} instead of returned: nothing waits for the
  // host, so a chunked loss keeps one slot per chunk and reads them all with one copy_to_host
  // (adding them on the host in chunk order: deterministic). A target id >= V is reported at that
  // synchronisation. The defaults run the host-returning op and copy its sums in.
  virtual void cross_entropy_forward_sums(double* sums, float* lse, float* token_ce, const float* logits,
                                          const int32_t* targets, int64_t N, int64_t V);
  virtual void cross_entropy_forward_backward_sums(double* sums, float* dlogits, float* lse, float* token_ce,
                                                   const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                                   double ce_scale, double z_scale);

  // ---- paged KV cache (rollout engine, ../shared/spec/06-backends.md §8; Op::kPagedKvCache) ------
  // Pages of one layer: k_pages, v_pages (num_pages * page_size) slots of kv_token_bytes(format,
  // Hkv, D) bytes; a slot is page * page_size + offset. The defaults fail through require(): a
  // backend without the op says so by name instead of computing anything.
  // k_pages/v_pages[slots[n]] <- k, v: (N, Hkv*D) f32 rounded (RNE) or quantized to `format`
  // (kv_page_codec.h; the same bytes on every backend); slots: (N) i32. nvfp4 needs D % 16 == 0.
  virtual void kv_cache_write(void* k_pages, void* v_pages, KvPageFormat format, const float* k, const float* v,
                              const int32_t* slots, int64_t N, int64_t Hkv, int64_t D);
  // out: (N,H,D) f32 <- for each row n and head h (kv head h / (H/Hkv)), softmax(scale q.k_j) . v_j
  // over the row's positions j < context_len[n], scale 1/sqrt(D); position j lives in page
  // block_table[n * max_blocks + j / page_size] at offset j % page_size. q: (N,H,D) f32;
  // block_table: (N, max_blocks) i32; context_len: (N) i32, each in [1, max_blocks * page_size].
  // Each row is computed on its own (no reduction across rows): batch-invariant. precision as
  // attention_forward's: kBf16 rounds q, k, v to BF16 and P = exp(s - lse) to BF16 before P v.
  virtual void paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                               KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                               const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                               int64_t page_size, AttentionPrecision precision = AttentionPrecision::kFp32);

  // ---- packed-NVFP4 weight GEMM (rollout decode, issue #15 §4; Op::kNvfp4WeightGemm) ------------
  // y (M, N) f32 <- x (M, K) f32 . dequantize(w)^T for a two-level NVFP4 weight w (N, K), K % 32
  // == 0: the weight is read packed. For decode batches (small M). CUDA: M <= 8 the GEMV
  // (backend/cuda/fp4_gemv.cuh) dequantizes in registers to the values dequantize() gives, so y
  // equals dequantize + matmul_nt within FP32 summation order; M > 8 BF16 tensor cores
  // (fp4_weight_mma.cuh) on e2m1 * e4m3 with the outer scale applied per 128-chunk, within the
  // bound derived in ops_test/packed_weight_gemm_test.cpp. The default fails through require().
  virtual void matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w, int64_t M);
  // All G experts of a MoE layer part at once (the rollout engine's fused MoE decode; no host
  // offsets): for each g < G, rows [offsets[g], offsets[g+1]) of y (rows, N) <- the same rows of x
  // (rows, K) . dequantize(W_g)^T, where W_g is the (N, K) two-level tensor whose parts start g
  // tensors after w's (packed back to back: w.codes + g * code_bytes(N, K), w.scales + g *
  // scale_bytes(N, K), w.outer + g * outer_count(N, K)). offsets (G+1) i64 in backend memory,
  // non-decreasing, offsets[G] <= rows; rows past offsets[G] are left alone, an empty group reads
  // nothing of its weight. Each row's arithmetic is that of matmul_nt_nvfp4_weight's GEMV (CUDA:
  // the same bits as matmul_nt_nvfp4_weight with M <= 8; the CPU runs it per group).
  virtual void grouped_matmul_nt_nvfp4_weight(float* y, const float* x, const QuantizedTensor& w,
                                              const int64_t* offsets, int64_t G, int64_t rows);

  // ---- TRACE guided rounding of gathered rows (03-rl-and-trace.md §2; Op::kTraceGuidedRows) -----
  // q (rows, cols) kNvfp4TwoLevel, as quantize(q, x) left it (RTN, the trainer's own scales). For
  // each i < R, row m = rows[i] of q is re-rounded under the rollout's scales: its codes <- the
  // guided codes of x row m (formats::nvfp4_2level_encode_guided with inner scales row i, outer
  // row i and guide row i of `kind`), its inner scales <- scales row i, its outer <- outer row i;
  // dequantize(q) then gives the rollout-scaled values on those rows and RTN elsewhere. Before a
  // row is overwritten its RTN codes are compared with the guided and the rollout's codes
  // (formats::guided_element_stats): stats (3) i64 += {rtn_mismatch, one_step, reproduced} over
  // the R rows. All in backend memory: x (q.rows, q.cols) f32; rows (R) i32, distinct, in
  // [0, q.rows); scales (R, cols/16) e4m3; outer (R, ceil(cols/128)) f32; guide (R, cols/2) packed
  // codes (kFull) or (R, cols/8) mantissa bits (kMantissaBit; bit j of byte i = element 8i + j).
  // The same bits on every backend (integer sums). The default fails through require().
  virtual void guided_overwrite_rows(QuantizedTensor& q, int64_t* stats, const float* x, const int32_t* rows,
                                     int64_t R, const uint8_t* scales, const float* outer, const uint8_t* guide,
                                     formats::GuidanceKind kind);
  // The rollout side's TRACE records of every row of q (rows, cols) kNvfp4TwoLevel, without their
  // headers (rollout/guidance_store.h, record version 1): out (q.rows, P) bytes, row r = q's inner
  // scales row r (cols/16) | its outer row r (ceil(cols/128) f32, host byte order) | its codes row
  // r (cols/2; kFull) or their mantissa bits (cols/8, bit j of byte i = element 8i + j;
  // kMantissaBit); P = cols/16 + 4 ceil(cols/128) + that. Backend memory; the same bytes on every
  // backend. The default fails through require().
  virtual void guidance_payload_rows(uint8_t* out, const QuantizedTensor& q, formats::GuidanceKind kind);

  // ---- greedy decoding where the logits are (rollout engine; Op::kGreedyRows) --------------------
  // For each row r of logits (rows, V) f32: token[r] = the first index of the row's largest logit
  // (a NaN is never larger; a NaN at index 0 gives 0: the host sampler's sequential scan), and
  // stats (rows, 3) f64 = (logits[token], mx, z): mx the row's largest logit, z the sum of
  // exp_f64(logit - mx) in core/softmax_f64.h's lane order (softmax_exp_sum at t = 1). Then
  // stats0 - mx - log(z) is rollout::sample_with_logprob's greedy log-prob to the bit. All in
  // backend memory.
  virtual void greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V);
};

// Thrown when backend memory cannot be had: the message is the backend's one line (what was being
// allocated, how much, what is free, which config keys to lower), without source positions.
class AllocationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---- grow-only buffers in backend memory (allocation happens only when a shape grows) ------------
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  ~Buffer() { reset(); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      be_ = o.be_, p_ = o.p_, n_ = o.n_;
      o.be_ = nullptr, o.p_ = nullptr, o.n_ = 0;
    }
    return *this;
  }
  // Ensures room for n elements (contents are not kept when it grows). Throws AllocationError with
  // the backend's allocation message on failure (out of memory names `what`).
  T* ensure(Backend& be, int64_t n, const char* what) {
    if (p_ != nullptr && be_ == &be && n <= n_) return p_;
    reset();
    Result<void*> r = be.allocate(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T), what);
    if (!r.is_ok()) throw AllocationError(r.status().message());
    be_ = &be, p_ = static_cast<T*>(r.value()), n_ = n;
    return p_;
  }
  void reset() {
    if (p_ != nullptr && be_ != nullptr) be_->deallocate(p_);
    be_ = nullptr, p_ = nullptr, n_ = 0;
  }
  T* data() const { return p_; }
  int64_t size() const { return n_; }

 private:
  Backend* be_ = nullptr;
  T* p_ = nullptr;
  int64_t n_ = 0;
};

// Owns the three parts of a QuantizedTensor in backend memory (grow-only).
struct QuantizedBuffer {
  Buffer<uint8_t> codes, scales;
  Buffer<float> outer;
  // A view of `format` (rows, cols) backed by this buffer (grown as needed).
  QuantizedTensor view(Backend& be, QuantFormat format, int64_t rows, int64_t cols);
};

// ---- backend registry: "cpu" always; "cuda" where the CUDA backend is linked and registered ------
using BackendFactory = Result<std::unique_ptr<Backend>> (*)(int device_index);
void register_backend(const std::string& kind, BackendFactory factory);
// kind: "cpu" | "cuda" | "cuda:N". Unknown or unavailable kinds give a Status naming what exists.
Result<std::unique_ptr<Backend>> make_backend(const std::string& kind);
std::vector<std::string> registered_backends();
// The process-wide CPU backend (stateless; the default of models built without one).
Backend& cpu_backend();

}  // namespace nibble::backend
