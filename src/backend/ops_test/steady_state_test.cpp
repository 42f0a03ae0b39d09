// The CUDA backend's steady state (issue 13: the step allocates nothing in its hot path): after
// one pass over the ops of a training step, a second pass with the same shapes makes no device
// allocation and adds no cuBLASLt plan (workspaces and plans are grow-only caches). Skips on
// "cpu" (the CPU backend's ops take no workspaces of their own).
#include <vector>

#include "backend/ops_test/ops_test_util.h"

#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace nibble::backend::testing {
namespace {

class SteadyStateOpsTest : public OpsTest {};

TEST_P(SteadyStateOpsTest, RepeatedStepAllocatesNothing) {
#ifndef NIBBLE_HAVE_CUDA
  GTEST_SKIP() << "a CUDA backend case (not in this build)";
#else
  auto* cuda_be = dynamic_cast<cuda::CudaBackend*>(&be());
  if (cuda_be == nullptr) GTEST_SKIP() << "a CUDA backend case";
  const int64_t M = 64, N = 48, K = 96, V = 300;
  float* x = upload(normal_vector(M * K, 1));
  float* w = upload(normal_vector(N * K, 2));
  float* dy = upload(normal_vector(M * N, 3));
  float* y = zeros<float>(M * N);
  float* dx = zeros<float>(M * K);
  float* dw = zeros<float>(N * K);
  float* rn = zeros<float>(M * K);
  float* drn = zeros<float>(M * K);
  float* rstd = zeros<float>(M);
  float* gain = upload(normal_vector(K, 4));
  float* dgain = zeros<float>(K);
  float* wte = upload(normal_vector(V * K, 5));
  float* dwte = zeros<float>(V * K);
  std::vector<int32_t> tok(static_cast<size_t>(M));
  for (int64_t i = 0; i < M; ++i) tok[i] = static_cast<int32_t>((i * 37) % V);
  const int32_t* td = upload(tok);
  float* logits = upload(normal_vector(M * V, 6));
  float* lse = zeros<float>(M);
  float* ce = zeros<float>(M);
  float* m = zeros<float>(N * K);
  float* v = zeros<float>(N * K);
  QuantizedBuffer qb, qt;
  QuantizedTensor q = qb.view(be(), QuantFormat::kNvfp4TwoLevel, 128, K);
  QuantizedTensor q_t = qt.view(be(), QuantFormat::kNvfp4TwoLevel, K, 128);
  float* x128 = upload(normal_vector(128 * K, 7));
  uint16_t* operand = zeros<uint16_t>(128 * K);
  double* ce_sums = zeros<double>(4);
  // Values are not checked here (the other op tests do): operands_bf16 = true only exercises
  // the BF16 plans and workspaces.
  auto step = [&] {
    be().embedding_forward(x, td, wte, M, V, K);
    be().rmsnorm_forward(rn, rstd, x, gain, M, K, 1e-6);
    be().matmul_nt(y, rn, w, M, N, K);
    be().matmul_nt(y, rn, w, M, N, K, true, true);
    be().matmul_nn(drn, dy, w, M, K, N);
    be().matmul_tn(dw, dy, rn, N, K, M, true, true);
    be().rmsnorm_backward(dx, dgain, drn, x, gain, rstd, M, K);
    be().embedding_backward(dwte, dx, td, M, V, K);
    be().cross_entropy_forward_backward(logits, lse, ce, logits, td, M, V, 1.0 / M, 1e-4 / M);
    const formats::SrKey sr{1, 2};
    be().quantize(q, x128, &sr);
    be().backward_operand_two_level(q_t, q, 0x5A5Au, sr);
    // the fused quantize + BF16 operand ops, parts skipped, and the CE sums left on the device
    QuantizedTensor q_op = Backend::operand_only(q), q_t_op = Backend::operand_only(q_t);
    be().quantize_operand(q_op, operand, x128, &sr);
    be().backward_operand_two_level_bf16(q_t_op, operand, q, 0x5A5Au, sr);
    be().cross_entropy_forward_backward_sums(ce_sums, logits, lse, ce, logits, td, M, V, 1.0 / M, 1e-4 / M);
    (void)be().sum_squares(dw, N * K, 1.0f);
    AdamWStep s;
    s.lr = 1e-3, s.step = 1;
    be().adamw_update(w, m, v, dw, N * K, s);
    be().synchronize();
  };
  step();
  const int64_t allocations = cuda_be->allocation_count();
  const size_t plans = cuda_be->gemm_plan_count();
  EXPECT_GE(plans, 4u);  // nt fp32 and bf16, nn, tn bf16
  step();
  EXPECT_EQ(cuda_be->allocation_count(), allocations);
  EXPECT_EQ(cuda_be->gemm_plan_count(), plans);
#endif
}

NIB_INSTANTIATE_OPS_TEST(SteadyStateOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
