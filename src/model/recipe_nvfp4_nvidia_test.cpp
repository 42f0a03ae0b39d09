// Tests of the nvfp4-nvidia recipe: forward and backward equal the hand-composed TE pipeline
// (formats drivers: 1x16 / 2-D quantize, TE RHT transpose; the BF16 GEMM contract: operands
// code × E4M3 scale, FP32 sum, alpha = product of the per-tensor factors; BF16 output) bit for
// bit; the dgrad W operand (2-D columnwise) is the forward Ŵ transposed; SR only in the
// backward (same seed -> same bits, another seed -> other bits, forward seed-independent);
// bf16_last_blocks; shape errors; and the estimate of dW is unbiased up to derived bounds.
#include "model/recipe_nvfp4_nvidia.h"

#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "backend/cpu/gemm.h"
#include "core/bits.h"
#include "core/philox.h"
#include "formats/quantize_cpu.h"

namespace nibble::model {
namespace {

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  PhiloxStream r(seed, 11);
  std::vector<float> v(n);
  for (auto& x : v) x = scale * static_cast<float>(r.next_normal());
  return v;
}
std::vector<uint16_t> bf16_bits(const std::vector<float>& v, size_t rows_p_times_cols) {
  std::vector<uint16_t> o(rows_p_times_cols, 0);
  for (size_t i = 0; i < v.size(); ++i) o[i] = f32_to_bf16_bits(v[i]);
  return o;
}
bool same_bits(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// The BF16 GEMM operand of a TE-quantized (rows, cols): e2m1(code) × E4M3 block scale, exact
// (at most 6 significant bits), without the per-tensor factor.
std::vector<float> te_operand(const std::vector<uint8_t>& codes, const std::vector<uint8_t>& scales, int64_t rows,
                              int64_t cols) {
  std::vector<float> v(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i)
    v[i] = formats::e2m1_decode(formats::e2m1_unpack(codes.data(), i)) * formats::e4m3_decode(scales[i / 16]);
  return v;
}
// The GEMM's alpha: the two per-tensor factors fl(amax · fl(1/2688)), multiplied.
float te_alpha(float amax_a, float amax_b) {
  return (amax_a * formats::kRecip2688) * (amax_b * formats::kRecip2688);
}
// y (n) = fl(alpha · sum), or fma(alpha, sum, y) when accumulating (the CPU backend's contract).
void apply_alpha(float* y, const std::vector<float>& sum, float alpha, bool accumulate) {
  for (size_t i = 0; i < sum.size(); ++i) y[i] = accumulate ? std::fma(alpha, sum[i], y[i]) : alpha * sum[i];
}

std::unique_ptr<LinearRecipe> make(const RecipeConfig& c, int64_t N, int64_t K, int block = 0, int nblocks = 1) {
  LinearInfo info;
  info.N = N;
  info.K = K;
  info.block = block;
  info.num_blocks = nblocks;
  auto r = make_linear_recipe(c, info);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return std::move(r).value();
}

struct Case {
  int64_t M = 100, N = 64, K = 96;  // M not a multiple of 16: exercises the token padding
  std::vector<float> x, w, dy;
  Case() : x(randn(M * K, 1)), w(randn(N * K, 2, 0.05f)), dy(randn(M * N, 3, 1e-3f)) {}
};

TEST(Nvfp4Nvidia, ForwardAndBackwardEqualTheComposedTePipeline) {
  Case c;
  const int64_t M = c.M, N = c.N, K = c.K, Mp = 112;
  RecipeConfig cfg;
  cfg.name = "nvfp4-nvidia";
  auto r = make(cfg, N, K);
  ASSERT_EQ(r->name(), "nvfp4-nvidia");
  LinearCall call{7, 1234, 3, 5, true};
  std::vector<float> y(M * N), dx(M * K), dw(N * K, 0.5f);
  r->forward(y.data(), c.x.data(), c.w.data(), M, N, K, call);
  r->backward(dx.data(), dw.data(), c.dy.data(), M, N, K, call);

  // reference forward
  std::vector<uint8_t> codes(Mp * 128), scales(Mp * 16), codes_t(Mp * 128), scales_t(Mp * 16);
  auto xb = bf16_bits(c.x, Mp * K);
  std::vector<float> wb(N * K), wdeq(N * K), yr(M * N), sum(M * N);
  float ax = formats::nvfp4_te_quantize_cpu(codes.data(), scales.data(), xb.data(), M, K);
  const std::vector<float> xo = te_operand(codes, scales, M, K);
  for (int64_t i = 0; i < N * K; ++i) wb[i] = round_to_bf16(c.w[i]);
  float aw = formats::nvfp4_te_quantize_2d_cpu(codes.data(), scales.data(), codes_t.data(), scales_t.data(), wb.data(), N, K);
  const std::vector<float> wo = te_operand(codes, scales, N, K);
  formats::nvfp4_te_dequantize_cpu(wdeq.data(), codes.data(), scales.data(), aw, N, K);
  cpu::matmul_nt(sum.data(), xo.data(), wo.data(), M, N, K);
  apply_alpha(yr.data(), sum, te_alpha(ax, aw), false);
  for (auto& v : yr) v = round_to_bf16(v);
  EXPECT_TRUE(same_bits(y.data(), yr.data(), y.size()));

  // dgrad's columnwise W (K,N) from the 2-D quantizer is the forward Ŵ transposed, exactly
  std::vector<float> wt(K * N);
  formats::nvfp4_te_dequantize_cpu(wt.data(), codes_t.data(), scales_t.data(), aw, K, N);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) ASSERT_EQ(wt[k * N + n], wdeq[n * K + k]);

  // reference dgrad: SR 1x16 along N of BF16 dY, stream kNvidiaStreamDgradDy
  auto dyb = bf16_bits(c.dy, Mp * N);
  formats::SrKey kd{call.seed, linear_call_stream(call, kNvidiaStreamDgradDy)};
  std::vector<float> dxr(M * K), dsum(M * K);
  float ad = formats::nvfp4_te_quantize_cpu(codes.data(), scales.data(), dyb.data(), M, N, &kd);
  const std::vector<float> a = te_operand(codes, scales, M, N);
  cpu::matmul_nn(dsum.data(), a.data(), wo.data(), M, K, N);
  apply_alpha(dxr.data(), dsum, te_alpha(ad, aw), false);
  for (auto& v : dxr) v = round_to_bf16(v);
  EXPECT_TRUE(same_bits(dx.data(), dxr.data(), dx.size()));

  // reference wgrad: TE RHT along tokens (zero-padded to 112) + SR for dY^T, RTN for X^T
  formats::SrKey kw{call.seed, linear_call_stream(call, kNvidiaStreamWgradDy)};
  std::vector<uint16_t> tb(Mp * 128);
  std::vector<float> wsum(N * K), dwr(N * K, 0.5f);
  float ag = formats::nvfp4_te_quantize_rht_t_cpu(codes.data(), scales.data(), tb.data(), dyb.data(), Mp, N, &kw);
  const std::vector<float> g = te_operand(codes, scales, N, Mp);
  float axt = formats::nvfp4_te_quantize_rht_t_cpu(codes.data(), scales.data(), tb.data(), xb.data(), Mp, K);
  const std::vector<float> xt = te_operand(codes, scales, K, Mp);
  cpu::matmul_nt(wsum.data(), g.data(), xt.data(), N, K, Mp);
  apply_alpha(dwr.data(), wsum, te_alpha(ag, axt), true);
  EXPECT_TRUE(same_bits(dw.data(), dwr.data(), dw.size()));
}

TEST(Nvfp4Nvidia, SrOnlyInTheBackwardAndSeeded) {
  Case c;
  const int64_t M = c.M, N = c.N, K = c.K;
  RecipeConfig cfg;
  cfg.name = "nvfp4-nvidia";
  auto r = make(cfg, N, K);
  auto run = [&](uint64_t seed, int64_t micro, std::vector<float>& y, std::vector<float>& dx, std::vector<float>& dw) {
    LinearCall call{3, seed, 1, micro, true};
    y.assign(M * N, 0);
    dx.assign(M * K, 0);
    dw.assign(N * K, 0);
    r->forward(y.data(), c.x.data(), c.w.data(), M, N, K, call);
    r->backward(dx.data(), dw.data(), c.dy.data(), M, N, K, call);
  };
  std::vector<float> y1, dx1, dw1, y2, dx2, dw2, y3, dx3, dw3;
  run(1, 0, y1, dx1, dw1);
  run(1, 0, y2, dx2, dw2);
  run(2, 0, y3, dx3, dw3);
  EXPECT_TRUE(same_bits(y1.data(), y2.data(), y1.size()));
  EXPECT_TRUE(same_bits(dx1.data(), dx2.data(), dx1.size()));
  EXPECT_TRUE(same_bits(dw1.data(), dw2.data(), dw1.size()));
  EXPECT_TRUE(same_bits(y1.data(), y3.data(), y1.size()));  // forward is RTN: no seed
  EXPECT_FALSE(same_bits(dx1.data(), dx3.data(), dx1.size()));
  EXPECT_FALSE(same_bits(dw1.data(), dw3.data(), dw1.size()));
  run(1, 1, y3, dx3, dw3);  // another micro-step: fresh noise
  EXPECT_FALSE(same_bits(dw1.data(), dw3.data(), dw1.size()));
}

// E[dW] over seeds = Q(dY)-free target: SR is unbiased, so the mean of dW over S seeds tends to
// deq(RHT dY^T, unquantized)·deq(Q_RTN(RHT X^T))^T, i.e. dY_bf16^T · H H^T X-part. Because the X
// operand is RTN (biased, deterministic), the exact target is Gd^T · Xq where Gd = BF16 RHT(dY^T)
// (the BF16 transform output) and Xq the dequantized RTN operand. Bound per element: 6 sigma/sqrt(S)
// (sample std over seeds; P(false fail) < 1e-8 per element) + saturation allowance: a 1x16 block
// whose max lands above 6 after its E4M3 scale rounds down saturates; that bias is at most
// 2^-4 of the block max (one E4M3 half-ulp), bounded here by 2^-4 * (|Gd| |Xq|^T).
TEST(Nvfp4Nvidia, WgradIsUnbiasedForTheRhtOperands) {
  const int64_t M = 64, N = 32, K = 32;
  auto x = randn(M * K, 5), w = randn(N * K, 6, 0.05f), dy = randn(M * N, 7, 1e-3f);
  RecipeConfig cfg;
  cfg.name = "nvfp4-nvidia";
  auto r = make(cfg, N, K);
  const int S = 300;
  std::vector<double> sum(N * K, 0), sum2(N * K, 0);
  std::vector<float> y(M * N), dx(M * K), dw(N * K);
  for (int s = 0; s < S; ++s) {
    LinearCall call{0, static_cast<uint64_t>(100 + s), 0, 0, true};
    r->forward(y.data(), x.data(), w.data(), M, N, K, call);
    std::fill(dw.begin(), dw.end(), 0.0f);
    r->backward(dx.data(), dw.data(), dy.data(), M, N, K, call);
    for (int64_t i = 0; i < N * K; ++i) sum[i] += dw[i], sum2[i] += double(dw[i]) * dw[i];
  }
  auto dyb = bf16_bits(dy, M * N), xb = bf16_bits(x, M * K);
  std::vector<uint16_t> gt(N * M), xtb(K * M);
  formats::rht16_te_transpose_cpu(gt.data(), dyb.data(), M, N);
  std::vector<uint8_t> codes(K * M / 2), scales(K * M / 16);
  std::vector<uint16_t> scratch(K * M);
  float ax = formats::nvfp4_te_quantize_rht_t_cpu(codes.data(), scales.data(), scratch.data(), xb.data(), M, K);
  std::vector<float> xq(K * M), g(N * M);
  formats::nvfp4_te_dequantize_cpu(xq.data(), codes.data(), scales.data(), ax, K, M);
  for (int64_t i = 0; i < N * M; ++i) g[i] = bf16_bits_to_f32(gt[i]);
  int fails = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double target = 0, absprod = 0;
      for (int64_t m = 0; m < M; ++m) target += double(g[n * M + m]) * xq[k * M + m], absprod += std::fabs(double(g[n * M + m]) * xq[k * M + m]);
      double mean = sum[n * K + k] / S, var = std::max(0.0, sum2[n * K + k] / S - mean * mean) * S / (S - 1);
      double tol = 6 * std::sqrt(var / S) + 0.0625 * absprod + 1e-6 * absprod;
      fails += std::fabs(mean - target) > tol;
    }
  EXPECT_EQ(fails, 0);
}

TEST(Nvfp4Nvidia, LastBlocksInBf16AndShapeErrors) {
  RecipeConfig cfg;
  cfg.name = "nvfp4-nvidia";
  cfg.bf16_last_blocks = 2;
  EXPECT_EQ(make(cfg, 32, 32, 1, 4)->name(), "nvfp4-nvidia");
  EXPECT_EQ(make(cfg, 32, 32, 2, 4)->name(), "bf16");
  EXPECT_EQ(make(cfg, 32, 32, 3, 4)->name(), "bf16");
  LinearInfo bad;
  bad.N = 32;
  bad.K = 40;
  bad.num_blocks = 1;
  cfg.bf16_last_blocks = 0;
  EXPECT_FALSE(make_linear_recipe(cfg, bad).is_ok());
}

}  // namespace
}  // namespace nibble::model
