// Tests of the trainer's fake-quantized linear (fake_quant.h). The rollout quantizes x_roll; the
// trainer sees x_train, x_roll moved by a relative 2^-7 (what a different kernel's rounding does
// to an activation), so its own RTN codes differ at some elements: with trace-full guidance its
// codes are the rollout's at every element, with trace guidance their mantissa bits, and in both
// its output equals the output on the rollout's own input bit for bit; without guidance (qat) the
// mismatches remain. Rows without a record stay RTN. A routed expert's rows are guided by the
// records of the tokens the dispatch plan names (LinearCall::token_of_row) at the expert's own
// site; a row without one stays RTN and is counted. The backward is straight-through.
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

// The rollout's records of the first `rows` rows of x_roll (bf16-rounded first, as the engine's
// w4a4 mode) under `mode` at `site` of layer 0: row i at (sequence 5, position positions[i]; default i).
std::unique_ptr<rollout::RecordStore> rollout_records(const Operands& s, rollout::GuidanceMode mode,
                                                      uint16_t site = rollout::kAttnInput,
                                                      std::vector<uint32_t> positions = {}, int64_t rows = M) {
  auto store = rollout::RecordStore::open({}).value();
  std::vector<float> xb(s.x_roll.size());
  model::round_to_bf16_array(xb.data(), s.x_roll.data(), M * K);
  std::vector<uint8_t> codes(M * K / 2), scales(M * K / 16);
  std::vector<float> outer(M * (K / 128 + 1));
  formats::nvfp4_2level_quantize_cpu(codes.data(), scales.data(), outer.data(), xb.data(), M, K);
  backend::QuantizedTensor q{backend::QuantFormat::kNvfp4TwoLevel, rows, K, codes.data(), scales.data(), outer.data()};
  std::vector<uint64_t> seq(M, 5);
  for (int64_t i = static_cast<int64_t>(positions.size()); i < M; ++i) positions.push_back(static_cast<uint32_t>(i));
  EXPECT_TRUE(rollout::append_guidance(*store, q, seq.data(), positions.data(), 0, site, mode).is_ok());
  EXPECT_TRUE(store->flush().is_ok());
  return store;
}

// Token rows 0..token_rows-1 of sequence 5 at positions 0.., the first recorded_rows recorded.
TraceGuidance guidance_over(rollout::RecordStore* store, int64_t recorded_rows, int64_t token_rows = M) {
  TraceGuidance g;
  g.store = store;
  g.layers = {true};
  for (int64_t i = 0; i < token_rows; ++i) {
    g.row_sequence.push_back(5);
    g.row_position.push_back(static_cast<uint32_t>(i));
    g.row_recorded.push_back(i < recorded_rows);
  }
  return g;
}

std::vector<float> forward(const Operands& s, const std::vector<float>& x, TraceGuidance* g,
                           const model::LinearCall& call = {}) {
  FakeQuantLinear lin(FakeQuantOptions{true, true, g}, s.info);
  std::vector<float> y(M * N);
  lin.forward(y.data(), x.data(), s.w.data(), M, N, K, call);
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

// ---- a routed expert's linear: its M rows are tokens of a batch of 12 token rows ----------------

constexpr int64_t kTokenRows = 12;
const std::vector<int32_t> kTokenOfRow = {7, 2, 9, 0, 4, 11};  // the dispatch plan's tokens of expert 2's rows
const std::vector<uint32_t> kRowPositions = {7, 2, 9, 0, 4, 11};

// expert 2's down_proj: the rollout recorded its rows at (sequence 5, position = token) under
// routed_expert_site(2, 1)
Operands expert_operands() {
  Operands s;
  s.info.kind = model::LinearKind::kExpertDown, s.info.expert = 2, s.info.name = "test.experts.2.down_proj";
  return s;
}
model::LinearCall expert_call() {
  model::LinearCall c;
  c.token_of_row = kTokenOfRow.data();
  return c;
}

TEST(FakeQuant, RoutedExpertRowsReproduceTheRolloutCodesOfTheirTokens) {
  const Operands s = expert_operands();
  for (auto mode : {rollout::GuidanceMode::kTraceFull, rollout::GuidanceMode::kTrace}) {
    SCOPED_TRACE(rollout::guidance_mode_name(mode));
    auto store = rollout_records(s, mode, rollout::routed_expert_site(2, 1), kRowPositions);
    const std::vector<float> y_roll = forward(s, s.x_roll, nullptr);
    TraceGuidance g = guidance_over(store.get(), kTokenRows, kTokenRows);
    const std::vector<float> y = forward(s, s.x_train, &g, expert_call());
    ASSERT_TRUE(g.status.is_ok()) << g.status.message();
    EXPECT_EQ(g.stats.elements, M * K);
    EXPECT_EQ(g.stats.reproduced, M * K);
    EXPECT_GT(g.stats.rtn_mismatch, 0);  // RTN of the moved input would differ
    EXPECT_EQ(g.stats.routed_rows, M);
    EXPECT_EQ(g.stats.routed_fallback_rows, 0);
    EXPECT_EQ(y, y_roll);                               // guided: the rollout's codes, bit for bit
    EXPECT_NE(forward(s, s.x_train, nullptr), y_roll);  // RTN rows would not be
  }
}

// Rows whose token the rollout routed elsewhere (no record at this expert; one is recorded at
// expert 1 instead) stay RTN and are counted; rows of unrecorded tokens (padding) are neither.
TEST(FakeQuant, RoutedExpertRowsWithoutARecordFallBackToRtnAndAreCounted) {
  const Operands s = expert_operands();
  auto store = rollout_records(s, rollout::GuidanceMode::kTraceFull, rollout::routed_expert_site(2, 1), kRowPositions, 4);
  ASSERT_TRUE(store->append(rollout::RecordKey{5, kRowPositions[4], 0, rollout::routed_expert_site(1, 1)},
                            store->read(rollout::RecordKey{5, kRowPositions[0], 0, rollout::routed_expert_site(2, 1)})
                                .value())
                  .is_ok());
  const std::vector<float> y_roll = forward(s, s.x_roll, nullptr);
  const std::vector<float> y_rtn = forward(s, s.x_train, nullptr);
  TraceGuidance g = guidance_over(store.get(), kTokenRows, kTokenRows);
  g.row_recorded[kTokenOfRow[3]] = 0;  // row 3's token is padding
  const std::vector<float> y = forward(s, s.x_train, &g, expert_call());
  ASSERT_TRUE(g.status.is_ok()) << g.status.message();
  EXPECT_EQ(g.stats.routed_rows, M - 1);
  EXPECT_EQ(g.stats.routed_fallback_rows, 2);  // rows 4 and 5
  EXPECT_EQ(g.stats.elements, 3 * K);          // rows 0, 1, 2 guided
  for (int64_t r = 0; r < M; ++r) {
    const bool guided = r < 3;
    const auto* want = (guided ? y_roll : y_rtn).data() + r * N;
    EXPECT_TRUE(std::equal(want, want + N, y.begin() + r * N)) << "row " << r;
  }
}

// A routed expert's call without the plan's tokens, or a token outside the batch, is an error,
// never a silent RTN.
TEST(FakeQuant, RoutedExpertWithoutItsTokensIsAnError) {
  const Operands s = expert_operands();
  auto store = rollout_records(s, rollout::GuidanceMode::kTraceFull, rollout::routed_expert_site(2, 1), kRowPositions);
  TraceGuidance g = guidance_over(store.get(), kTokenRows, kTokenRows);
  forward(s, s.x_train, &g);
  EXPECT_FALSE(g.status.is_ok());
  TraceGuidance h = guidance_over(store.get(), 11, 11);  // token 11 is outside a batch of 11 rows
  forward(s, s.x_train, &h, expert_call());
  EXPECT_FALSE(h.status.is_ok());
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
