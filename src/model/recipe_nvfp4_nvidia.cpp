// nvfp4-nvidia LinearRecipe (see recipe_nvfp4_nvidia.h): TransformerEngine's NVFP4 recipe as
// backend ops (quantize / dequantize of QuantizedTensor, the TE RHT-transpose quantizer, FP32
// GEMMs). No GEMM here passes operands_bf16: a dequantized 1x16 value carries the FP32 global
// scale amax / (6 * 448), so it is not exactly a BF16 number in general.
#include "model/recipe_nvfp4_nvidia.h"

#include <algorithm>

#include "core/check.h"

namespace nibble::model {

namespace {

using backend::QuantFormat;

// dst: (rows_p, cols) bf16 bits <- src (rows, cols) f32, rows >= `rows` zero.
void to_bf16_padded(backend::Backend& be, uint16_t* dst, const float* src, int64_t rows, int64_t rows_p,
                    int64_t cols) {
  be.to_bf16_bits(dst, src, rows * cols);
  if (rows_p > rows) be.fill_zero(dst + rows * cols, static_cast<size_t>((rows_p - rows) * cols) * sizeof(uint16_t));
}

}  // namespace

void Nvfp4NvidiaLinearRecipe::forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M,
                                      int64_t N, int64_t K, const LinearCall& call) {
  NIB_CHECK_MSG(N % 16 == 0 && K % 16 == 0, "nvfp4-nvidia: N={} and K={} must be multiples of 16", N, K);
  const int64_t Mp = (M + 15) / 16 * 16;
  M_ = M, N_ = N, K_ = K;
  uint16_t* xb = xb_.ensure(be, Mp * K, "nvfp4-nvidia: bf16 x");
  float* xq = xq_.ensure(be, M * K, "nvfp4-nvidia: saved X^");
  float* wq = wq_.ensure(be, N * K, "nvfp4-nvidia: saved W^");
  float* wb = wb_.ensure(be, N * K, "nvfp4-nvidia: bf16 w");
  // Q(X): 1x16 along K, per-tensor amax, RTN, from the BF16 activation.
  to_bf16_padded(be, xb, x, M, Mp, K);
  backend::QuantizedTensor qx = q_.view(be, QuantFormat::kNvfp4Te, M, K);
  be.quantize(qx, xb);
  be.dequantize(xq, qx);
  // Q(W): 16x16 2-D tiles, per-tensor amax, RTN, from the BF16 weight.
  be.round_to_bf16(wb, w, N * K);
  backend::QuantizedTensor qw = q_.view(be, QuantFormat::kNvfp4Te2d, N, K);
  be.quantize(qw, wb);
  be.dequantize(wq, qw);
  be.matmul_nt(y, xq, wq, M, N, K);
  be.round_to_bf16(y, y, M * N);  // the GEMM writes BF16
}

void Nvfp4NvidiaLinearRecipe::backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M,
                                       int64_t N, int64_t K, const LinearCall& call) {
  NIB_CHECK_MSG(M == M_ && N == N_ && K == K_, "nvfp4-nvidia: backward without a matching forward");
  const int64_t Mp = (M + 15) / 16 * 16;
  uint16_t* dyb = dyb_.ensure(be, Mp * N, "nvfp4-nvidia: bf16 dY");
  float* a = a_.ensure(be, Mp * std::max(N, K), "nvfp4-nvidia: dequantized operand");
  float* b = b_.ensure(be, Mp * K, "nvfp4-nvidia: dequantized operand");
  uint16_t* tb = tb_.ensure(be, Mp * std::max(N, K), "nvfp4-nvidia: RHT-transpose scratch");
  to_bf16_padded(be, dyb, dy, M, Mp, N);

  // dgrad: dX (M,K) = deq(SR 1x16 along N of dY) (M,N) · Ŵ (N,K).
  formats::SrKey kd{call.seed, linear_call_stream(call, kNvidiaStreamDgradDy)};
  backend::QuantizedTensor qd = q_.view(be, QuantFormat::kNvfp4Te, M, N);
  be.quantize(qd, dyb, &kd);
  be.dequantize(a, qd);
  be.matmul_nn(dx, a, wq_.data(), M, K, N);
  be.round_to_bf16(dx, dx, M * K);

  // wgrad: dW (N,K) += deq(SR(RHT(dY^T))) (N,Mp) · deq(RTN(RHT(X^T)))^T (K,Mp), FP32.
  formats::SrKey kw{call.seed, linear_call_stream(call, kNvidiaStreamWgradDy)};
  backend::QuantizedTensor qg = q_.view(be, QuantFormat::kNvfp4Te, N, Mp);
  be.quantize_te_rht_transpose(qg, tb, dyb, Mp, N, &kw);
  be.dequantize(a, qg);
  backend::QuantizedTensor qx = q_.view(be, QuantFormat::kNvfp4Te, K, Mp);
  be.quantize_te_rht_transpose(qx, tb, xb_.data(), Mp, K);
  be.dequantize(b, qx);
  be.matmul_nt(dw, a, b, N, K, Mp, /*accumulate=*/true);
}

Result<std::unique_ptr<LinearRecipe>> make_nvfp4_nvidia_recipe(const RecipeConfig& config, const LinearInfo& info) {
  if (config.bf16_last_blocks > 0 && info.block >= info.num_blocks - config.bf16_last_blocks)
    return std::unique_ptr<LinearRecipe>(new Bf16LinearRecipe());
  if (info.N % 16 != 0 || info.K % 16 != 0)
    return invalid_argument("nvfp4-nvidia: linear '{}' has shape ({}, {}); N and K must be multiples of 16", info.name,
                            info.N, info.K);
  return std::unique_ptr<LinearRecipe>(new Nvfp4NvidiaLinearRecipe());
}

}  // namespace nibble::model
