// Tests of the trainer's fake-quantized linear (fake_quant.h). The rollout quantizes x_roll; the
// trainer sees x_train, x_roll moved by a relative 2^-7 (what a different kernel's rounding does
// to an activation), so its own RTN codes differ at some elements: with trace-full guidance its
// codes are the rollout's at every element, with trace guidance their mantissa bits, and in both
// its output equals the output on the rollout's own input bit for bit; without guidance (qat) the
// mismatches remain. Rows without a record stay RTN. The backward is straight-through.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/philox.h"
#include "formats/quantize_cpu.h"
#include "rl/fake_quant.h"

namespace nibble::rl {
namespace {

constexpr int64_t M = 6, N = 8, K = 64;

struct Operands {
  std::vector<float> x_roll, x_train, w;
  model::LinearInfo info;
  Operands() {
    PhiloxStream rng(9, 2);
    for (int64_t i = 0; i < M * K; ++i) {
      const float v = static_cast<float>(rng.next_normal());
      x_roll.push_back(v);
      x_train.push_back(v * (1.0f + (rng.next_uniform() < 0.5f ? 1.0f : -1.0f) * 0.0078125f));
    }
    for (int64_t i = 0; i < N * K; ++i) w.push_back(static_cast<float>(0.1 * rng.next_normal()));
    info.id = 0, info.kind = model::LinearKind::kQkv, info.block = 0, info.num_blocks = 1, info.N = N, info.K = K;
    info.name = "test.qkv";
  }
};

// The rollout's records of x_roll (bf16-rounded first, as the engine's w4a4 mode) under `mode`.
std::unique_ptr<rollout::RecordStore> rollout_records(const Operands& s, rollout::GuidanceMode mode) {
  auto store = rollout::RecordStore::open({}).value();
  std::vector<float> xb(s.x_roll.size());
  model::round_to_bf16_array(xb.data(), s.x_roll.data(), M * K);
  std::vector<uint8_t> codes(M * K / 2), scales(M * K / 16);
  std::vector<float> outer(M * (K / 128 + 1));
  formats::nvfp4_2level_quantize_cpu(codes.data(), scales.data(), outer.data(), xb.data(), M, K);
  backend::QuantizedTensor q{backend::QuantFormat::kNvfp4TwoLevel, M, K, codes.data(), scales.data(), outer.data()};
  std::vector<uint64_t> seq(M, 5);
  std::vector<uint32_t> pos;
  for (int64_t i = 0; i < M; ++i) pos.push_back(static_cast<uint32_t>(i));
  EXPECT_TRUE(rollout::append_guidance(*store, q, seq.data(), pos.data(), 0, rollout::kAttnInput, mode).is_ok());
  EXPECT_TRUE(store->flush().is_ok());
  return store;
}

TraceGuidance guidance_over(rollout::RecordStore* store, int64_t recorded_rows) {
  TraceGuidance g;
  g.store = store;
  g.layers = {true};
  for (int64_t i = 0; i < M; ++i) {
    g.row_sequence.push_back(5);
    g.row_position.push_back(static_cast<uint32_t>(i));
    g.row_recorded.push_back(i < recorded_rows);
  }
  return g;
}

std::vector<float> forward(const Operands& s, const std::vector<float>& x, TraceGuidance* g) {
  FakeQuantLinear lin(FakeQuantOptions{true, true, g}, s.info);
  std::vector<float> y(M * N);
  lin.forward(y.data(), x.data(), s.w.data(), M, N, K, model::LinearCall{});
  return y;
}

TEST(FakeQuant, TraceFullGuidanceReproducesTheRolloutCodesAndOutput) {
  Operands s;
  auto store = rollout_records(s, rollout::GuidanceMode::kTraceFull);
  const std::vector<float> y_roll = forward(s, s.x_roll, nullptr);  // RTN on the rollout's input = its codes
  TraceGuidance g = guidance_over(store.get(), M);
  const std::vector<float> y = forward(s, s.x_train, &g);
  ASSERT_TRUE(g.status.is_ok()) << g.status.message();
  EXPECT_EQ(g.stats.elements, M * K);
  EXPECT_GT(g.stats.rtn_mismatch, 0);  // the perturbation moves some RTN codes
  EXPECT_EQ(g.stats.one_step, g.stats.rtn_mismatch);
  EXPECT_EQ(g.stats.reproduced, M * K);
  EXPECT_EQ(y, y_roll);
  // without guidance the trainer's output differs
  EXPECT_NE(forward(s, s.x_train, nullptr), y_roll);
}

TEST(FakeQuant, TraceGuidanceReproducesTheMantissaBit) {
  Operands s;
  auto store = rollout_records(s, rollout::GuidanceMode::kTrace);
  const std::vector<float> y_roll = forward(s, s.x_roll, nullptr);
  TraceGuidance g = guidance_over(store.get(), M);
  const std::vector<float> y = forward(s, s.x_train, &g);
  ASSERT_TRUE(g.status.is_ok()) << g.status.message();
  EXPECT_EQ(g.stats.reproduced, M * K);
  EXPECT_GT(g.stats.rtn_mismatch, 0);
  // every rollout code is a grid neighbour of the trainer's scaled value here, so the mantissa bit
  // picks exactly the rollout's code
  EXPECT_EQ(y, y_roll);
}

TEST(FakeQuant, RowsWithoutARecordStayRtn) {
  Operands s;
  auto store = rollout_records(s, rollout::GuidanceMode::kTraceFull);
  TraceGuidance g = guidance_over(store.get(), 2);
  const std::vector<float> y = forward(s, s.x_train, &g);
  const std::vector<float> y_rtn = forward(s, s.x_train, nullptr);
  EXPECT_EQ(g.stats.elements, 2 * K);
  EXPECT_TRUE(std::equal(y.begin() + 2 * N, y.end(), y_rtn.begin() + 2 * N));
}

TEST(FakeQuant, AMissingRecordIsAnError) {
  Operands s;
  auto store = rollout_records(s, rollout::GuidanceMode::kTraceFull);
  TraceGuidance g = guidance_over(store.get(), M);
  g.row_sequence[3] = 99;
  forward(s, s.x_train, &g);
  EXPECT_FALSE(g.status.is_ok());
}

TEST(FakeQuant, BackwardIsStraightThrough) {
  Operands s;
  FakeQuantLinear lin(FakeQuantOptions{true, true, nullptr}, s.info);
  std::vector<float> y(M * N), dy(M * N), dx(M * K), dw(N * K, 0.0f);
  lin.forward(y.data(), s.x_train.data(), s.w.data(), M, N, K, model::LinearCall{});
  for (int64_t i = 0; i < M * N; ++i) dy[i] = static_cast<float>((i % 7) - 3) * 0.25f;
  lin.backward(dx.data(), dw.data(), dy.data(), M, N, K, model::LinearCall{});
  // ŵ, x̂: the same quantizers on the host
  auto fq = [](const std::vector<float>& v, int64_t rows) {
    std::vector<float> b(v.size()), out(v.size());
    model::round_to_bf16_array(b.data(), v.data(), static_cast<int64_t>(v.size()));
    std::vector<uint8_t> c(v.size() / 2), sc(v.size() / 16);
    std::vector<float> o(rows * (K / 128 + 1));
    formats::nvfp4_2level_quantize_cpu(c.data(), sc.data(), o.data(), b.data(), rows, K);
    formats::nvfp4_2level_dequantize_cpu(out.data(), c.data(), sc.data(), o.data(), rows, K);
    return out;
  };
  const std::vector<float> wq = fq(s.w, N), xq = fq(s.x_train, M);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      double ref = 0;
      for (int64_t n = 0; n < N; ++n) ref += static_cast<double>(dy[m * N + n]) * wq[n * K + k];
      // FP32 sums of N = 8 products of magnitude <= 0.75 x 0.6: error <= 8 x 2^-24 x 8 x 0.45
      EXPECT_NEAR(dx[m * K + k], ref, 1e-5);
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double ref = 0;
      for (int64_t m = 0; m < M; ++m) ref += static_cast<double>(dy[m * N + n]) * xq[m * K + k];
      // M = 6 products of magnitude <= 0.75 x 6 (|x̂| <= 6 x scale, scale ~ amax/6 ~ 1)
      EXPECT_NEAR(dw[n * K + k], ref, 1e-4);
    }
}

}  // namespace
}  // namespace nibble::rl
