// The `nvfp4-nvidia` LinearRecipe: NVIDIA's NVFP4 pretraining recipe as TransformerEngine runs it
// (02-pretraining-recipes.md §5, 01-formats.md §2, §6), through backend ops. Each operand is
// quantized, dequantized to BF16 as E2M1 code × E4M3 block scale (exact) and multiplied by a BF16
// GEMM whose alpha is the product of the two per-tensor factors, as native FP4 hardware applies
// them (issue #13); only the accumulation order differs from an FP4 tensor-core GEMM. See
// docs/recipes.md for every choice.
#pragma once

#include <cstdint>
#include "backend/backend.h"
#include "model/linear.h"

namespace nibble::model {

// Stream purposes (linear_call_stream) of the two SR draws of a backward call.
inline constexpr uint32_t kNvidiaStreamDgradDy = 0;  // dY, 1x16 along N, SR (dgrad)
inline constexpr uint32_t kNvidiaStreamWgradDy = 1;  // RHT(dY^T), 1x16 along tokens, SR (wgrad)

// Per call (Y = X W^T, X (M,K), W (N,K); every operand first rounded to BF16, as TE sees it):
//  forward  Y  = BF16( deq(Q_1x16,RTN(X)) · deq(Q_2D16x16,RTN(W))^T )        per-tensor amax each
//  dgrad    dX = BF16( deq(Q_1x16,SR(dY)) · deq(W columnwise 2-D) )          = the forward Ŵ numbers
//  wgrad    dW += deq(Q_1x16,SR(RHT_TE(dY^T))) · deq(Q_1x16,RTN(RHT_TE(X^T)))^T   along tokens, FP32
// where each product deq(A) · deq(B) is alpha · (A_blk · B_blk) with A_blk = code × E4M3 scale in
// BF16 (backend dequantize_bf16), FP32 sums, alpha = nvfp4_te_alpha(amax_A, amax_B), applied as
// fl(alpha · sum) (or fma(alpha, sum, dW) in the wgrad).
// RHT_TE = fixed TE sign vector, result rounded to BF16 (rht16_te_transpose_cpu). The wgrad X
// operand is a fresh quantization of X (no alignment). Tokens are zero-padded to a multiple of
// 16 for the along-token operands (zero rows add nothing). Requires N, K multiples of 16.
// Grouped experts (where the backend has Op::kGroupedGemm): each expert's instance quantizes its
// own operands (own amax, own SR streams) into the layer's grouped buffers, its along-token
// operands padded to 16 rows per expert; one grouped GEMM per product with per-expert alphas.
class Nvfp4NvidiaLinearRecipe final : public LinearRecipe {
 public:
  NIB_LINEAR_RECIPE_HOST_OVERLOADS;
  std::string name() const override { return "nvfp4-nvidia"; }
  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
               const LinearCall& call) override;
  void backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K,
                const LinearCall& call) override;
  void forward_experts(backend::Backend& be, float* y, const float* x, const float* w, int64_t N, int64_t K,
                       const ExpertGroup& group) override;
  void backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t N, int64_t K,
                        const ExpertGroup& group) override;

 private:
  // The GEMM operands of one call, written where the caller says (its own call: the workspace;
  // grouped experts: the layer's buffers); the GEMMs are the caller's.
  // forward: xq (M,K), wq (N,K) BF16 operands, alpha (1), from x (M,K) f32 and wb (N,K) BF16 W.
  void forward_operands(backend::Backend& be, uint16_t* xq, uint16_t* wq, float* alpha, const float* x,
                        const uint16_t* wb, int64_t M, int64_t N, int64_t K, const LinearCall& call);
  // dgrad: a (M,N) dY operand, wq (N,K) Ŵ operand, alpha (1); dyb (Mp,N) <- BF16 dY, rows >= M zero.
  void dgrad_operands(backend::Backend& be, uint16_t* a, uint16_t* wq, float* alpha, uint16_t* dyb, const float* dy,
                      int64_t M, int64_t N, int64_t K, const LinearCall& call);
  // wgrad: a (N,Mp), b (K,Mp) along-token operands, alpha (1), from dyb; tb: (Mp, max(N,K)) scratch.
  void wgrad_operands(backend::Backend& be, uint16_t* a, uint16_t* b, float* alpha, uint16_t* tb,
                      const uint16_t* dyb, int64_t M, int64_t N, int64_t K, const LinearCall& call);

  int64_t M_ = 0, N_ = 0, K_ = 0;
  // Saved for the backward (backend memory, grow-only; Mp = M rounded up to 16); everything
  // else is transient, in the model's LinearWorkspace.
  backend::Buffer<uint16_t> xb_;      // (Mp,K) bf16 bits of x, rows >= M zero (the wgrad X^T source)
  backend::QuantizedBuffer w_saved_;  // Ŵ as 2-D NVFP4 codes (N,K/2) + scales (N,K/16) + amax
  backend::QuantizedTensor qw_;       // the view of w_saved_ (dgrad uses the forward Ŵ numbers)
  ExpertRowPlan expert_plan_;         // grouped experts (expert 0's instance): the rows of the last call
};

// Builds nvfp4-nvidia for one linear, or the bf16 recipe for the last `bf16_last_blocks` blocks.
Result<std::unique_ptr<LinearRecipe>> make_nvfp4_nvidia_recipe(const RecipeConfig& config, const LinearInfo& info);

}  // namespace nibble::model
