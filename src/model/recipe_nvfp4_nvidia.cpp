// nvfp4-nvidia LinearRecipe (see recipe_nvfp4_nvidia.h): TransformerEngine's NVFP4 recipe on
// the CPU through the formats drivers (quantize_cpu.h) and OpenBLAS FP32 GEMMs.
#include "model/recipe_nvfp4_nvidia.h"

#include <algorithm>

#include "backend/cpu/gemm.h"
#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"
#include "formats/quantize_cpu.h"

namespace nibble::model {

namespace {

template <typename V>
void ensure(V& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
}

// dst: (rows_p, cols) bf16 bits <- src (rows, cols) f32, rows >= `rows` zero.
void to_bf16_padded(uint16_t* dst, const float* src, int64_t rows, int64_t rows_p, int64_t cols) {
  parallel_for(rows_p, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = r < rows ? f32_to_bf16_bits(src[r * cols + c]) : 0;
  });
}

void round_rows_bf16(float* y, int64_t n) { round_to_bf16_array(y, y, n); }

}  // namespace

void Nvfp4NvidiaLinearRecipe::forward(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                                      const LinearCall& call) {
  NIB_CHECK_MSG(N % 16 == 0 && K % 16 == 0, "nvfp4-nvidia: N={} and K={} must be multiples of 16", N, K);
  const int64_t Mp = (M + 15) / 16 * 16;
  M_ = M, N_ = N, K_ = K;
  ensure(xb_, Mp * K);
  ensure(xq_, M * K);
  ensure(wq_, N * K);
  ensure(wb_, N * K);
  ensure(codes_, std::max(M, N) * K / 2);
  ensure(scales_, std::max(M, N) * K / 16);
  // Q(X): 1x16 along K, per-tensor amax, RTN, from the BF16 activation.
  to_bf16_padded(xb_.data(), x, M, Mp, K);
  float amax_x = formats::nvfp4_te_quantize_cpu(codes_.data(), scales_.data(), xb_.data(), M, K);
  formats::nvfp4_te_dequantize_cpu(xq_.data(), codes_.data(), scales_.data(), amax_x, M, K);
  // Q(W): 16x16 2-D tiles, per-tensor amax, RTN, from the BF16 weight.
  round_to_bf16_array(wb_.data(), w, N * K);
  float amax_w = formats::nvfp4_te_quantize_2d_cpu(codes_.data(), scales_.data(), nullptr, nullptr, wb_.data(), N, K);
  formats::nvfp4_te_dequantize_cpu(wq_.data(), codes_.data(), scales_.data(), amax_w, N, K);
  cpu::matmul_nt(y, xq_.data(), wq_.data(), M, N, K);
  round_rows_bf16(y, M * N);  // the GEMM writes BF16
}

void Nvfp4NvidiaLinearRecipe::backward(float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K,
                                       const LinearCall& call) {
  NIB_CHECK_MSG(M == M_ && N == N_ && K == K_, "nvfp4-nvidia: backward without a matching forward");
  const int64_t Mp = (M + 15) / 16 * 16;
  ensure(dyb_, Mp * N);
  ensure(codes_, std::max(Mp * N, Mp * K) / 2);
  ensure(scales_, std::max(Mp * N, Mp * K) / 16);
  ensure(a_, Mp * std::max(N, K));
  ensure(b_, Mp * K);
  ensure(tb_, Mp * std::max(N, K));
  to_bf16_padded(dyb_.data(), dy, M, Mp, N);

  // dgrad: dX (M,K) = deq(SR 1x16 along N of dY) (M,N) · Ŵ (N,K).
  formats::SrKey kd{call.seed, linear_call_stream(call, kNvidiaStreamDgradDy)};
  float amax_d = formats::nvfp4_te_quantize_cpu(codes_.data(), scales_.data(), dyb_.data(), M, N, &kd);
  formats::nvfp4_te_dequantize_cpu(a_.data(), codes_.data(), scales_.data(), amax_d, M, N);
  cpu::matmul_nn(dx, a_.data(), wq_.data(), M, K, N);
  round_rows_bf16(dx, M * K);

  // wgrad: dW (N,K) += deq(SR(RHT(dY^T))) (N,Mp) · deq(RTN(RHT(X^T)))^T (K,Mp), FP32.
  formats::SrKey kw{call.seed, linear_call_stream(call, kNvidiaStreamWgradDy)};
  float amax_g = formats::nvfp4_te_quantize_rht_t_cpu(codes_.data(), scales_.data(), tb_.data(), dyb_.data(), Mp, N, &kw);
  formats::nvfp4_te_dequantize_cpu(a_.data(), codes_.data(), scales_.data(), amax_g, N, Mp);
  float amax_x = formats::nvfp4_te_quantize_rht_t_cpu(codes_.data(), scales_.data(), tb_.data(), xb_.data(), Mp, K);
  formats::nvfp4_te_dequantize_cpu(b_.data(), codes_.data(), scales_.data(), amax_x, K, Mp);
  cpu::matmul_nt(dw, a_.data(), b_.data(), N, K, Mp, /*accumulate=*/true);
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
