// nvfp4-nvidia LinearRecipe (see recipe_nvfp4_nvidia.h): TransformerEngine's NVFP4 recipe as
// backend ops (the fused quantize + BF16 operand ops, plain and RHT-transpose, dequantize_bf16 of
// the saved Ŵ, BF16 GEMMs); only Ŵ's codes and scales are written (kept for the dgrad), the other
// operands' parts are skipped (Backend::operand_only) but for their amax. The per-tensor factor fl(amax · fl(1/2688)) of each operand is not a BF16 number, so
// it stays out of the operands and both go into the GEMM's alpha (nvfp4_te_alpha, on the device).
// Workspace slots: forward 0 bf16 W, 1 X̂ operand, 2 Ŵ operand, 3 alpha; backward 0 bf16 dY,
// 1 dY operand, 2 X operand, 3 alphas, 4 RHT-transpose scratch, 5 Ŵ operand.
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

void Nvfp4NvidiaLinearRecipe::forward_operands(backend::Backend& be, uint16_t* xq, uint16_t* wq, float* alpha,
                                               const float* x, const uint16_t* wb, int64_t M, int64_t N, int64_t K,
                                               const LinearCall& call) {
  NIB_CHECK_MSG(N % 16 == 0 && K % 16 == 0, "nvfp4-nvidia: N={} and K={} must be multiples of 16", N, K);
  const int64_t Mp = (M + 15) / 16 * 16;
  M_ = M, N_ = N, K_ = K;
  LinearWorkspace& ws = workspace(call);
  uint16_t* xb = xb_.ensure(be, Mp * K, "nvfp4-nvidia: saved bf16 x");
  // Q(X): 1x16 along K, per-tensor amax, RTN, from the BF16 activation.
  to_bf16_padded(be, xb, x, M, Mp, K);
  backend::QuantizedTensor qx = backend::Backend::operand_only(ws.quantized(be, 0, QuantFormat::kNvfp4Te, M, K));
  be.quantize_operand(qx, xq, xb);
  // Q(W): 16x16 2-D tiles, per-tensor amax, RTN, from the BF16 weight; kept for the dgrad.
  qw_ = w_saved_.view(be, QuantFormat::kNvfp4Te2d, N, K);
  be.quantize_operand(qw_, wq, wb);
  be.nvfp4_te_alpha(alpha, qx.outer, qw_.outer);
}

void Nvfp4NvidiaLinearRecipe::forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M,
                                      int64_t N, int64_t K, const LinearCall& call) {
  LinearWorkspace& ws = workspace(call);
  uint16_t* wb = ws.get<uint16_t>(be, 0, N * K, "nvfp4-nvidia: bf16 w");
  uint16_t* xq = ws.get<uint16_t>(be, 1, M * K, "nvfp4-nvidia: X^ operand");
  uint16_t* wq = ws.get<uint16_t>(be, 2, N * K, "nvfp4-nvidia: W^ operand");
  float* alpha = ws.get<float>(be, 3, 1, "nvfp4-nvidia: GEMM alpha");
  be.to_bf16_bits(wb, w, N * K);
  forward_operands(be, xq, wq, alpha, x, wb, M, N, K, call);
  be.matmul_bf16_nt(y, xq, wq, M, N, K, alpha);
  be.round_to_bf16(y, y, M * N);  // the GEMM writes BF16
}

void Nvfp4NvidiaLinearRecipe::dgrad_operands(backend::Backend& be, uint16_t* a, uint16_t* wq, float* alpha,
                                             uint16_t* dyb, const float* dy, int64_t M, int64_t N, int64_t K,
                                             const LinearCall& call) {
  NIB_CHECK_MSG(M == M_ && N == N_ && K == K_ && qw_.codes != nullptr,
                "nvfp4-nvidia: backward without a matching forward");
  const int64_t Mp = (M + 15) / 16 * 16;
  to_bf16_padded(be, dyb, dy, M, Mp, N);
  // dX (M,K) = deq(SR 1x16 along N of dY) (M,N) · Ŵ (N,K).
  formats::SrKey kd{call.seed, linear_call_stream(call, kNvidiaStreamDgradDy)};
  backend::QuantizedTensor qd =
      backend::Backend::operand_only(workspace(call).quantized(be, 0, QuantFormat::kNvfp4Te, M, N));
  be.quantize_operand(qd, a, dyb, &kd);
  be.dequantize_bf16(wq, qw_);
  be.nvfp4_te_alpha(alpha, qd.outer, qw_.outer);
}

void Nvfp4NvidiaLinearRecipe::wgrad_operands(backend::Backend& be, uint16_t* a, uint16_t* b, float* alpha,
                                             uint16_t* tb, const uint16_t* dyb, int64_t M, int64_t N, int64_t K,
                                             const LinearCall& call) {
  const int64_t Mp = (M + 15) / 16 * 16;
  LinearWorkspace& ws = workspace(call);
  // dW (N,K) += deq(SR(RHT(dY^T))) (N,Mp) · deq(RTN(RHT(X^T)))^T (K,Mp), FP32.
  formats::SrKey kw{call.seed, linear_call_stream(call, kNvidiaStreamWgradDy)};
  backend::QuantizedTensor qg = backend::Backend::operand_only(ws.quantized(be, 0, QuantFormat::kNvfp4Te, N, Mp));
  be.quantize_te_rht_transpose_operand(qg, a, tb, dyb, Mp, N, &kw);
  backend::QuantizedTensor qx = backend::Backend::operand_only(ws.quantized(be, 1, QuantFormat::kNvfp4Te, K, Mp));
  be.quantize_te_rht_transpose_operand(qx, b, tb, xb_.data(), Mp, K);
  be.nvfp4_te_alpha(alpha, qg.outer, qx.outer);
}

void Nvfp4NvidiaLinearRecipe::backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M,
                                       int64_t N, int64_t K, const LinearCall& call) {
  const int64_t Mp = (M + 15) / 16 * 16;
  LinearWorkspace& ws = workspace(call);
  uint16_t* dyb = ws.get<uint16_t>(be, 0, Mp * N, "nvfp4-nvidia: bf16 dY");
  uint16_t* a = ws.get<uint16_t>(be, 1, Mp * N, "nvfp4-nvidia: dY operand");
  uint16_t* b = ws.get<uint16_t>(be, 2, K * Mp, "nvfp4-nvidia: X operand");
  float* alpha = ws.get<float>(be, 3, 2, "nvfp4-nvidia: GEMM alphas");
  uint16_t* tb = ws.get<uint16_t>(be, 4, Mp * std::max(N, K), "nvfp4-nvidia: RHT-transpose scratch");
  uint16_t* wq = ws.get<uint16_t>(be, 5, N * K, "nvfp4-nvidia: W^ operand");
  dgrad_operands(be, a, wq, alpha, dyb, dy, M, N, K, call);
  be.matmul_bf16_nn(dx, a, wq, M, K, N, alpha);
  be.round_to_bf16(dx, dx, M * K);
  wgrad_operands(be, a, b, alpha + 1, tb, dyb, M, N, K, call);  // a is free again: the dgrad GEMM is queued
  be.matmul_bf16_nt(dw, a, b, N, K, Mp, alpha + 1, /*accumulate=*/true);
}

// ---- grouped experts: each expert's operands into the layer's buffers, one grouped GEMM each ----
// Workspace slots from kGroupedSlot (g0): forward g0 bf16 W span, g0+1 X̂ operands (rows,K), g0+2
// Ŵ operands (E,N,K), g0+3 alphas (E); backward g0 bf16 dY padded (padded rows,N), g0+1 dY
// operands (rows,N) then the wgrad dY^T blocks, g0+2 Ŵ operands then the X^T blocks, g0+3 alphas
// (2E), g0+4 RHT-transpose scratch.
void Nvfp4NvidiaLinearRecipe::forward_experts(backend::Backend& be, float* y, const float* x, const float* w,
                                              int64_t N, int64_t K, const ExpertGroup& group) {
  LinearWorkspace& ws = workspace(group.calls[0]);
  ExpertRowPlan& plan = expert_plan_;  // kept: its host arrays are reused, not reallocated
  if (!plan.build(be, group, 16, ws)) return LinearRecipe::forward_experts(be, y, x, w, N, K, group);
  const int64_t E = group.E, rows = plan.rows(), span = (E - 1) * group.w_stride + N * K;
  constexpr int g0 = LinearWorkspace::kGroupedSlot;
  uint16_t* wb = ws.get<uint16_t>(be, g0, span, "nvfp4-nvidia experts: bf16 W");
  uint16_t* xq = ws.get<uint16_t>(be, g0 + 1, rows * K, "nvfp4-nvidia experts: X^ operands");
  uint16_t* wq = ws.get<uint16_t>(be, g0 + 2, E * N * K, "nvfp4-nvidia experts: W^ operands");
  float* alpha = ws.get<float>(be, g0 + 3, E, "nvfp4-nvidia experts: GEMM alphas");
  be.to_bf16_bits(wb, w, span);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = plan.off[e], m = plan.off[e + 1] - r0;
    if (m == 0) continue;  // never called: its alpha is not read
    group_expert<Nvfp4NvidiaLinearRecipe>(group, e)->forward_operands(
        be, xq + r0 * K, wq + e * N * K, alpha + e, x + r0 * K, wb + e * group.w_stride, m, N, K, group.calls[e]);
  }
  be.grouped_matmul_bf16_nt(y, xq, wq, plan.off_dev, E, rows, N, K, N * K, alpha);
  be.round_to_bf16(y, y, rows * N);  // the GEMM writes BF16
}

void Nvfp4NvidiaLinearRecipe::backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy,
                                               int64_t N, int64_t K, const ExpertGroup& group) {
  LinearWorkspace& ws = workspace(group.calls[0]);
  ExpertRowPlan& plan = expert_plan_;  // kept: its host arrays are reused, not reallocated
  if (!plan.build(be, group, 16, ws)) return LinearRecipe::backward_experts(be, dx, dw, dy, N, K, group);
  const int64_t E = group.E, rows = plan.rows(), padded = plan.padded_rows();
  constexpr int g0 = LinearWorkspace::kGroupedSlot;
  uint16_t* dyb = ws.get<uint16_t>(be, g0, padded * N, "nvfp4-nvidia experts: bf16 dY");
  uint16_t* a = ws.get<uint16_t>(be, g0 + 1, std::max(rows, padded) * N, "nvfp4-nvidia experts: dY operands");
  uint16_t* b = ws.get<uint16_t>(be, g0 + 2, std::max(E * N * K, padded * K), "nvfp4-nvidia experts: W^/X operands");
  float* alpha = ws.get<float>(be, g0 + 3, 2 * E, "nvfp4-nvidia experts: GEMM alphas");
  uint16_t* tb = ws.get<uint16_t>(be, g0 + 4, plan.max_padded * std::max(N, K), "nvfp4-nvidia experts: RHT scratch");
  auto expert = [&](int64_t e) { return group_expert<Nvfp4NvidiaLinearRecipe>(group, e); };
  // dgrad: dX_e = deq(dY_e) · Ŵ_e for every expert in one grouped GEMM (b holds the Ŵ operands)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = plan.off[e], m = plan.off[e + 1] - r0;
    if (m == 0) continue;
    expert(e)->dgrad_operands(be, a + r0 * N, b + e * N * K, alpha + e, dyb + plan.pad[e] * N, dy + r0 * N, m, N, K,
                              group.calls[e]);
  }
  be.grouped_matmul_bf16_nn(dx, a, b, plan.off_dev, E, rows, K, N, N * K, alpha);
  be.round_to_bf16(dx, dx, rows * K);
  // wgrad: dW_e += deq(dY_e^T) · deq(X_e^T)^T over expert e's padded rows (a, b: its blocks)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t p0 = plan.pad[e], m = plan.off[e + 1] - plan.off[e];
    if (m == 0) continue;
    expert(e)->wgrad_operands(be, a + N * p0, b + K * p0, alpha + E + e, tb, dyb + p0 * N, m, N, K, group.calls[e]);
  }
  be.grouped_matmul_bf16_nt_blocks(dw, a, b, plan.pad_dev, E, padded, N, K, N, K, group.w_stride, alpha + E,
                                   /*accumulate=*/true);
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
