// The `nvfp4-nvidia` LinearRecipe: NVIDIA's NVFP4 pretraining recipe as TransformerEngine runs it
// (02-pretraining-recipes.md §5, 01-formats.md §2, §6), emulated through backend ops. Operands
// are fake-quantized (backend quantize, dequantize to FP32 exactly) and multiplied with FP32
// GEMMs; FP4 block values are exact in FP32, so only the accumulation order differs from an FP4
// tensor-core GEMM. See docs/recipes.md for every choice.
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
// RHT_TE = fixed TE sign vector, result rounded to BF16 (rht16_te_transpose_cpu). The wgrad X
// operand is a fresh quantization of X (no alignment). Tokens are zero-padded to a multiple of
// 16 for the along-token operands (zero rows add nothing). Requires N, K multiples of 16.
class Nvfp4NvidiaLinearRecipe final : public LinearRecipe {
 public:
  NIB_LINEAR_RECIPE_HOST_OVERLOADS;
  std::string name() const override { return "nvfp4-nvidia"; }
  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
               const LinearCall& call) override;
  void backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K,
                const LinearCall& call) override;

 private:
  int64_t M_ = 0, N_ = 0, K_ = 0;
  // All in backend memory, grow-only. Mp = M rounded up to 16.
  backend::Buffer<uint16_t> xb_;      // (Mp,K) bf16 bits of x, rows >= M zero
  backend::Buffer<float> xq_;         // (M,K) dequantized forward X̂
  backend::Buffer<float> wq_;         // (N,K) dequantized forward Ŵ (= the columnwise W of dgrad)
  backend::Buffer<float> wb_;         // (N,K) bf16-rounded w
  backend::QuantizedBuffer q_;        // scratch quantized operand
  backend::Buffer<uint16_t> dyb_, tb_;  // (Mp,N) bf16 dY; (max(N,K), Mp) bf16 RHT-transpose scratch
  backend::Buffer<float> a_, b_;        // scratch dequantized operands
};

// Builds nvfp4-nvidia for one linear, or the bf16 recipe for the last `bf16_last_blocks` blocks.
Result<std::unique_ptr<LinearRecipe>> make_nvfp4_nvidia_recipe(const RecipeConfig& config, const LinearInfo& info);

}  // namespace nibble::model
