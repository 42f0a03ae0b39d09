// Tests of the trainer's fake-quantized linear (fake_quant.h). The rollout quantizes x_roll; the
// trainer sees x_train, x_roll moved by a relative 2^-7 (what a different kernel's rounding does
// to an activation), so its own RTN codes differ at some elements: with trace-full guidance its
// codes are the rollout's at every element, with trace guidance their mantissa bits, and in both
// its output equals the output on the rollout's own input bit for bit; without guidance (qat) the
// mismatches remain. Rows without a record stay RTN. A routed expert's rows are guided by the
// records of the tokens the dispatch plan names (LinearCall::token_of_row) at the expert's own
// site; a row without one stays RTN and is counted. The backward is straight-through. The KV-cache
// sites (TraceKvQuantizer): RTN gives the NVFP4 page codec's values, guidance the rollout's codes
// (trace-full) or mantissa bits (trace) of K and V per (token, kv head) row. The guided rows go
// through Backend::guided_overwrite_rows (overwrite_guided_rows); on the CPU backend its xq and
// counts equal, bit for bit, the host path that ran before it (kept here as the reference).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/kv_page_codec.h"
#include "core/philox.h"
#include "formats/quantize_cpu.h"
#include "model/kv_quantizer.h"
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

// The update's forward after the pi_old forward asks for the same rows: they come from what the
// first forward gathered (TraceGuidance::gathered), not from the store again; a new store
// (set_guidance_store) is read afresh. Shown with an empty store swapped in behind the cache's
// back: a read of it would fail on the first missing record.
TEST(FakeQuant, SameRowsAgainReuseTheGatheredRecordsUntilTheStoreChanges) {
  Operands s;
  auto store = rollout_records(s, rollout::GuidanceMode::kTraceFull);
  TraceGuidance g = guidance_over(store.get(), M);
  const std::vector<float> y = forward(s, s.x_train, &g);
  ASSERT_TRUE(g.status.is_ok()) << g.status.message();
  EXPECT_EQ(g.gathered.size(), 1u);
  auto empty = rollout::RecordStore::open({});
  ASSERT_TRUE(empty.is_ok());
  g.store = empty->get();  // not through set_guidance_store: the cache stays
  EXPECT_EQ(forward(s, s.x_train, &g), y);
  EXPECT_TRUE(g.status.is_ok()) << g.status.message();
  set_guidance_store(g, empty->get());
  EXPECT_TRUE(g.gathered.empty());
  forward(s, s.x_train, &g);
  EXPECT_FALSE(g.status.is_ok());  // read afresh: sequence 5 has no record there
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
// A layer's experts through forward_experts (one host copy of the plan's tokens for the layer)
// with the counts summed on the device (reset_guided_counts / collect_guided_counts): the same
// output and counts as expert 2's own forward with its per-call copies. Experts 0 and 1 get no rows.
TEST(FakeQuant, ExpertGroupWithDeviceCountsEqualsThePerCallPath) {
  const Operands s = expert_operands();
  auto store = rollout_records(s, rollout::GuidanceMode::kTraceFull, rollout::routed_expert_site(2, 1), kRowPositions, 4);
  TraceGuidance g1 = guidance_over(store.get(), kTokenRows, kTokenRows);
  const std::vector<float> y1 = forward(s, s.x_train, &g1, expert_call());
  ASSERT_TRUE(g1.status.is_ok()) << g1.status.message();

  backend::Backend& be = backend::cpu_backend();
  TraceGuidance g2 = guidance_over(store.get(), kTokenRows, kTokenRows);
  reset_guided_counts(be, g2);
  std::vector<std::unique_ptr<FakeQuantLinear>> experts;
  std::vector<model::LinearRecipe*> recipes;
  std::vector<model::LinearCall> calls(3);
  for (int e = 0; e < 3; ++e) {
    model::LinearInfo info = s.info;
    info.expert = e, info.id = e;
    experts.push_back(std::make_unique<FakeQuantLinear>(FakeQuantOptions{true, true, &g2}, info));
    recipes.push_back(experts.back().get());
  }
  const std::vector<int64_t> offsets = {0, 0, 0, M};
  std::vector<float> w3(3 * N * K, 0.5f);  // experts 0 and 1: weights never read
  std::copy(s.w.begin(), s.w.end(), w3.begin() + 2 * N * K);
  model::ExpertGroup group;
  group.recipes = recipes.data(), group.calls = calls.data(), group.offsets_host = offsets.data();
  group.E = 3, group.rows = M, group.w_stride = N * K, group.token_of_row = kTokenOfRow.data();
  std::vector<float> y2(M * N);
  recipes[0]->forward_experts(be, y2.data(), s.x_train.data(), w3.data(), N, K, group);
  ASSERT_TRUE(g2.status.is_ok()) << g2.status.message();
  EXPECT_EQ(g2.stats.rtn_mismatch, 0);  // not collected yet: still on the device
  collect_guided_counts(be, g2);
  EXPECT_EQ(y2, y1);
  EXPECT_EQ(g2.stats.elements, g1.stats.elements);
  EXPECT_EQ(g2.stats.rtn_mismatch, g1.stats.rtn_mismatch);
  EXPECT_EQ(g2.stats.one_step, g1.stats.one_step);
  EXPECT_EQ(g2.stats.reproduced, g1.stats.reproduced);
  EXPECT_EQ(g2.stats.routed_rows, g1.stats.routed_rows);
  EXPECT_EQ(g2.stats.routed_fallback_rows, g1.stats.routed_fallback_rows);
  EXPECT_GT(g1.stats.reproduced, 0);
  EXPECT_GT(g1.stats.rtn_mismatch, 0);
  collect_guided_counts(be, g2);  // collected counts are zeroed on the device: nothing more
  EXPECT_EQ(g2.stats.rtn_mismatch, g1.stats.rtn_mismatch);
}

// Three experts of a layer's down_proj with rows (2, 0, 4) through forward_experts /
// backward_experts (one quantization of all rows, one guided re-rounding for the experts' records,
// each expert's own weight and GEMMs) against each expert's own forward / backward on its rows:
// y, dx and each expert's dw bit for bit, and the same counts. Expert 0's site holds every token,
// expert 2's only tokens 7 and 2 (its rows of tokens 9 and 0 fall back to RTN); the weights differ
// per expert.
TEST(FakeQuant, GroupedExpertsEqualEachExpertsOwnCalls) {
  const Operands s = expert_operands();
  auto store = rollout::RecordStore::open({}).value();
  {
    std::vector<float> xb(s.x_roll.size());
    model::round_to_bf16_array(xb.data(), s.x_roll.data(), M * K);
    std::vector<uint8_t> codes(M * K / 2), scales(M * K / 16);
    std::vector<float> outer(M * (K / 128 + 1));
    formats::nvfp4_2level_quantize_cpu(codes.data(), scales.data(), outer.data(), xb.data(), M, K);
    std::vector<uint64_t> seq(M, 5);
    std::vector<uint32_t> pos(kRowPositions.begin(), kRowPositions.end());
    for (int e : {0, 2}) {
      const int64_t rows = e == 2 ? 2 : M;  // expert 2: only tokens 7 and 2 (rows 0, 1 of x_roll)
      backend::QuantizedTensor q{backend::QuantFormat::kNvfp4TwoLevel, rows, K, codes.data(), scales.data(),
                                 outer.data()};
      ASSERT_TRUE(rollout::append_guidance(*store, q, seq.data(), pos.data(), 0, rollout::routed_expert_site(e, 1),
                                           rollout::GuidanceMode::kTraceFull)
                      .is_ok());
    }
    ASSERT_TRUE(store->flush().is_ok());
  }
  // the plan: rows 0-1 to expert 0 (tokens 7, 2), none to expert 1, rows 2-5 to expert 2 (tokens 7, 2, 9, 0)
  const std::vector<int32_t> tokens = {7, 2, 7, 2, 9, 0};
  const std::vector<int64_t> offsets = {0, 2, 2, M};
  std::vector<float> w3(3 * N * K);
  for (int64_t i = 0; i < 3 * N * K; ++i) w3[i] = s.w[i % (N * K)] * (1.0f + 0.25f * static_cast<float>(i / (N * K)));
  std::vector<float> dy(M * N);
  for (int64_t i = 0; i < M * N; ++i) dy[i] = static_cast<float>((i % 5) - 2) * 0.5f;
  auto make = [&](TraceGuidance* g, std::vector<std::unique_ptr<FakeQuantLinear>>& ex) {
    for (int e = 0; e < 3; ++e) {
      model::LinearInfo info = s.info;
      info.expert = e, info.id = e;
      ex.push_back(std::make_unique<FakeQuantLinear>(FakeQuantOptions{true, true, g}, info));
    }
  };
  // each expert alone
  TraceGuidance g1 = guidance_over(store.get(), kTokenRows, kTokenRows);
  std::vector<std::unique_ptr<FakeQuantLinear>> a;
  make(&g1, a);
  std::vector<float> y1(M * N), dx1(M * K), dw1(3 * N * K, 0.0f);
  for (int e = 0; e < 3; ++e) {
    const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
    if (m == 0) continue;
    model::LinearCall c;
    c.token_of_row = tokens.data() + r0;
    a[e]->forward(y1.data() + r0 * N, s.x_train.data() + r0 * K, w3.data() + e * N * K, m, N, K, c);
    a[e]->backward(dx1.data() + r0 * K, dw1.data() + e * N * K, dy.data() + r0 * N, m, N, K, c);
  }
  ASSERT_TRUE(g1.status.is_ok()) << g1.status.message();
  // grouped
  TraceGuidance g2 = guidance_over(store.get(), kTokenRows, kTokenRows);
  std::vector<std::unique_ptr<FakeQuantLinear>> b;
  make(&g2, b);
  std::vector<model::LinearRecipe*> recipes;
  for (auto& e : b) recipes.push_back(e.get());
  std::vector<model::LinearCall> calls(3);
  model::ExpertGroup group;
  group.recipes = recipes.data(), group.calls = calls.data(), group.offsets_host = offsets.data();
  group.E = 3, group.rows = M, group.w_stride = N * K, group.token_of_row = tokens.data();
  std::vector<float> y2(M * N), dx2(M * K), dw2(3 * N * K, 0.0f);
  backend::Backend& be = backend::cpu_backend();
  recipes[0]->forward_experts(be, y2.data(), s.x_train.data(), w3.data(), N, K, group);
  recipes[0]->backward_experts(be, dx2.data(), dw2.data(), dy.data(), N, K, group);
  ASSERT_TRUE(g2.status.is_ok()) << g2.status.message();
  EXPECT_EQ(y2, y1);
  EXPECT_EQ(dx2, dx1);
  EXPECT_EQ(dw2, dw1);
  EXPECT_EQ(g2.stats.elements, g1.stats.elements);
  EXPECT_EQ(g2.stats.reproduced, g1.stats.reproduced);
  EXPECT_EQ(g2.stats.rtn_mismatch, g1.stats.rtn_mismatch);
  EXPECT_EQ(g2.stats.routed_rows, g1.stats.routed_rows);
  EXPECT_EQ(g2.stats.routed_fallback_rows, g1.stats.routed_fallback_rows);
  EXPECT_EQ(g1.stats.routed_rows, M);
  EXPECT_EQ(g1.stats.routed_fallback_rows, 2);  // tokens 9 and 0 have no record at expert 2
  EXPECT_EQ(g1.stats.elements, 4 * K);
}

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

// ---- the device path against the host path it replaced -----------------------------------------

// The host path fake_quant.cpp ran before Backend::guided_overwrite_rows: the guided rows of the
// BF16 input re-rounded on the host (rollout::guided_quantize_cpu), dequantized with the rollout's
// scales over the RTN dequantization xq, and the counts taken element by element.
void host_overwrite_guided_rows(std::vector<float>& xq, const std::vector<float>& xb, const std::vector<uint8_t>& rtn,
                                int64_t K_, const std::vector<int64_t>& rows, const rollout::GuidanceBatch& gb,
                                GuidedSiteStats& st) {
  const int64_t Rr = gb.rows_per_record, R = static_cast<int64_t>(rows.size()) * Rr;
  auto matrix_row = [&](int64_t i) { return rows[static_cast<size_t>(i / Rr)] * Rr + i % Rr; };
  std::vector<float> xr(static_cast<size_t>(R * K_)), deq(static_cast<size_t>(R * K_));
  std::vector<uint8_t> guided(static_cast<size_t>(R * K_ / 2));
  for (int64_t i = 0; i < R; ++i) std::copy_n(xb.data() + matrix_row(i) * K_, K_, xr.data() + i * K_);
  rollout::guided_quantize_cpu(guided.data(), xr.data(), gb);
  formats::nvfp4_2level_dequantize_cpu(deq.data(), guided.data(), gb.scales.data(), gb.outer.data(), R, K_);
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t k = 0; k < K_; ++k) {
      const uint32_t own = formats::e2m1_unpack(rtn.data() + matrix_row(i) * (K_ / 2), k);
      const uint32_t gc = formats::e2m1_unpack(guided.data() + i * (K_ / 2), k);
      uint32_t roll = gc;
      bool same;
      if (gb.mode == rollout::GuidanceMode::kTraceFull) {
        roll = formats::e2m1_unpack(gb.guide.data() + i * (K_ / 2), k);
        same = gc == roll || ((gc & 7u) == 0 && (roll & 7u) == 0);
      } else {
        same = (gc & 1u) == ((gb.guide[static_cast<size_t>(i * (K_ / 8) + k / 8)] >> (k & 7)) & 1u);
      }
      const bool mism = own != roll && !((own & 7u) == 0 && (roll & 7u) == 0);
      st.rtn_mismatch += mism;
      st.one_step += mism && e2m1_one_step_apart(own, roll);
      st.reproduced += same;
    }
    std::copy_n(deq.data() + i * K_, K_, xq.data() + matrix_row(i) * K_);
  }
  st.elements += R * K_;
}

TEST(FakeQuant, DeviceGuidedRowsEqualTheHostPathBitForBit) {
  // 40 matrix rows of 144 columns (a partial 128-block); the rollout saw x moved by ~4% (odd
  // rows: ~50%), so its codes differ from the trainer's RTN by one step and (odd rows) more, and
  // its scales differ
  constexpr int64_t Mr = 40, Kc = 144, kb = Kc / 16, no = 2;
  PhiloxStream rng(17, 3);
  std::vector<float> x(Mr * Kc), xr(Mr * Kc);
  for (int64_t i = 0; i < Mr * Kc; ++i) {
    x[i] = std::ldexp(static_cast<float>(rng.next_normal()), static_cast<int>((i / Kc) % 7) - 3);
    xr[i] = x[i] * (1.0f + ((i / Kc) % 2 ? 0.5f : 0.04f) * static_cast<float>(rng.next_normal()));
  }
  model::round_to_bf16_array(x.data(), x.data(), Mr * Kc);
  std::vector<uint8_t> roll_codes(Mr * Kc / 2), roll_inner(Mr * kb);
  std::vector<float> roll_outer(Mr * no);
  formats::nvfp4_2level_quantize_cpu(roll_codes.data(), roll_inner.data(), roll_outer.data(), xr.data(), Mr, Kc);
  backend::Backend& be = backend::cpu_backend();
  for (const int64_t Rr : {1, 4})  // version-1 records (linears) and version-2 records of 4 rows (KV)
    for (auto mode : {rollout::GuidanceMode::kTraceFull, rollout::GuidanceMode::kTrace}) {
      SCOPED_TRACE(std::string(rollout::guidance_mode_name(mode)) + " rows per record " + std::to_string(Rr));
      // token rows with a record: unsorted, gaps between them
      std::vector<int64_t> rows;
      for (int64_t t = Mr / Rr - 1; t >= 0; t -= 2) rows.push_back(t);
      rollout::GuidanceBatch gb;
      gb.format = backend::QuantFormat::kNvfp4TwoLevel, gb.mode = mode, gb.cols = Kc, gb.rows_per_record = Rr;
      gb.rows = static_cast<int64_t>(rows.size()) * Rr;
      const int64_t gstride = mode == rollout::GuidanceMode::kTraceFull ? Kc / 2 : Kc / 8;
      gb.guide.resize(static_cast<size_t>(gb.rows * gstride));
      for (int64_t i = 0; i < gb.rows; ++i) {
        const int64_t m = rows[static_cast<size_t>(i / Rr)] * Rr + i % Rr;
        gb.scales.insert(gb.scales.end(), roll_inner.begin() + m * kb, roll_inner.begin() + (m + 1) * kb);
        gb.outer.insert(gb.outer.end(), roll_outer.begin() + m * no, roll_outer.begin() + (m + 1) * no);
        if (mode == rollout::GuidanceMode::kTraceFull)
          std::copy_n(roll_codes.data() + m * Kc / 2, Kc / 2, gb.guide.data() + i * gstride);
        else
          formats::e2m1_mantissa_bits_cpu(gb.guide.data() + i * gstride, roll_codes.data() + m * Kc / 2, 1, Kc);
      }
      // the host path
      std::vector<uint8_t> rtn(Mr * Kc / 2), rtn_inner(Mr * kb);
      std::vector<float> rtn_outer(Mr * no), xq_host(Mr * Kc);
      formats::nvfp4_2level_quantize_cpu(rtn.data(), rtn_inner.data(), rtn_outer.data(), x.data(), Mr, Kc);
      formats::nvfp4_2level_dequantize_cpu(xq_host.data(), rtn.data(), rtn_inner.data(), rtn_outer.data(), Mr, Kc);
      GuidedSiteStats st_host;
      host_overwrite_guided_rows(xq_host, x, rtn, Kc, rows, gb, st_host);
      // the device path on the CPU backend
      backend::QuantizedBuffer qb;
      backend::QuantizedTensor q = qb.view(be, backend::QuantFormat::kNvfp4TwoLevel, Mr, Kc);
      be.quantize(q, x.data());
      GuidedRowsScratch scratch;
      GuidedSiteStats st;
      ASSERT_TRUE(overwrite_guided_rows(be, q, x.data(), rows, gb, scratch, st).is_ok());
      std::vector<float> xq(Mr * Kc);
      be.dequantize(xq.data(), q);
      EXPECT_GT(st_host.one_step, 0);
      if (mode == rollout::GuidanceMode::kTraceFull) {  // some mismatches are more than one step
        EXPECT_GT(st_host.rtn_mismatch, st_host.one_step);
      }
      EXPECT_EQ(st.elements, st_host.elements);
      EXPECT_EQ(st.rtn_mismatch, st_host.rtn_mismatch);
      EXPECT_EQ(st.one_step, st_host.one_step);
      EXPECT_EQ(st.reproduced, st_host.reproduced);
      ASSERT_EQ(xq.size(), xq_host.size());
      EXPECT_EQ(0, std::memcmp(xq.data(), xq_host.data(), sizeof(float) * xq.size()));
    }
}

}  // namespace
}  // namespace nibble::rl

// ---- the KV-cache sites: TraceKvQuantizer ------------------------------------------------------

namespace nibble::rl {
namespace {

// K (or V) of 5 tokens x 2 kv heads x head dim 144 (a short second 128-block): the rollout's values
// and the trainer's, moved by a relative 2^-7 as above.
constexpr int64_t kKvTokens = 5, kHkv = 2, kD = 144, kKvElems = kKvTokens * kHkv * kD;

struct KvOperands {
  std::vector<float> roll[2], train[2];  // [0] K, [1] V: (tokens, Hkv*D)
  KvOperands() {
    PhiloxStream rng(17, 4);
    for (int i = 0; i < 2; ++i)
      for (int64_t e = 0; e < kKvElems; ++e) {
        // heads of different magnitudes, so their scales differ
        const float v = static_cast<float>(std::ldexp(rng.next_normal(), static_cast<int>((e / kD) % 3) - 1));
        roll[i].push_back(v);
        train[i].push_back(v * (1.0f + (rng.next_uniform() < 0.5f ? 1.0f : -1.0f) * 0.0078125f));
      }
  }
};

// The NVFP4 page slot records of x (tokens, Hkv*D), as Backend::kv_cache_write's codec writes them.
std::vector<uint8_t> kv_slots(const std::vector<float>& x) {
  const auto L = backend::kv::token_layout(backend::KvPageFormat::kNvfp4, kHkv, kD);
  std::vector<uint8_t> slots(static_cast<size_t>(kKvTokens * L.bytes));
  for (int64_t t = 0; t < kKvTokens; ++t)
    for (int64_t h = 0; h < kHkv; ++h)
      backend::kv::encode_head(slots.data() + t * L.bytes, L, backend::KvPageFormat::kNvfp4, kD, h,
                               x.data() + (t * kHkv + h) * kD);
  return slots;
}

// What the rollout's paged attention reads from those slots.
std::vector<float> kv_page_values(const std::vector<float>& x) {
  const auto L = backend::kv::token_layout(backend::KvPageFormat::kNvfp4, kHkv, kD);
  const std::vector<uint8_t> slots = kv_slots(x);
  std::vector<float> out;
  for (int64_t t = 0; t < kKvTokens; ++t)
    for (int64_t h = 0; h < kHkv; ++h)
      for (int64_t d = 0; d < kD; ++d)
        out.push_back(backend::kv::decode_element(slots.data() + t * L.bytes, L, backend::KvPageFormat::kNvfp4, kD, h, d));
  return out;
}

// The rollout's kKeyCache / kValueCache records of layer 0, token t at (sequence 5, position t).
std::unique_ptr<rollout::RecordStore> kv_records(const KvOperands& s, rollout::GuidanceMode mode) {
  auto store = rollout::RecordStore::open({}).value();
  const int64_t tb = backend::kv_token_bytes(backend::KvPageFormat::kNvfp4, kHkv, kD);
  for (int i = 0; i < 2; ++i) {
    const std::vector<uint8_t> slots = kv_slots(s.roll[i]);
    for (int64_t t = 0; t < kKvTokens; ++t) {
      auto rec = rollout::kv_guidance_record(slots.data() + t * tb, kHkv, kD, mode);
      EXPECT_TRUE(rec.is_ok()) << rec.status().message();
      EXPECT_TRUE(store
                      ->append(rollout::RecordKey{5, static_cast<uint32_t>(t), 0,
                                                  i == 0 ? rollout::kKeyCache : rollout::kValueCache},
                               std::move(rec).value())
                      .is_ok());
    }
  }
  EXPECT_TRUE(store->flush().is_ok());
  return store;
}

// k, v after the trainer's K/V step (in place on copies).
std::pair<std::vector<float>, std::vector<float>> kv_step(const std::vector<float>* x, TraceGuidance* g) {
  std::vector<float> k = x[0], v = x[1];
  TraceKvQuantizer q;
  q.set_guidance(g);
  q.quantize(backend::cpu_backend(), 0, k.data(), v.data(), kKvTokens, kHkv, kD);
  return {k, v};
}

// RTN: each (token, head) row becomes exactly what the NVFP4 page holds.
TEST(FakeQuantKv, RtnGivesThePageCodecsValues) {
  KvOperands s;
  auto [k, v] = kv_step(s.roll, nullptr);
  EXPECT_EQ(k, kv_page_values(s.roll[0]));
  EXPECT_EQ(v, kv_page_values(s.roll[1]));
  auto [kt, vt] = kv_step(s.train, nullptr);
  EXPECT_NE(kt, k);  // the perturbation moves some codes
  // the model's RTN quantizer is the same step
  std::vector<float> k2 = s.roll[0], v2 = s.roll[1];
  model::Nvfp4KvQuantizer rtn;
  rtn.quantize(backend::cpu_backend(), 3, k2.data(), v2.data(), kKvTokens, kHkv, kD);
  EXPECT_EQ(k2, k);
  EXPECT_EQ(v2, v);
}

TEST(FakeQuantKv, TraceFullGuidanceReproducesTheRolloutsKvCodes) {
  KvOperands s;
  auto store = kv_records(s, rollout::GuidanceMode::kTraceFull);
  TraceGuidance g = guidance_over(store.get(), kKvTokens, kKvTokens);
  auto [k, v] = kv_step(s.train, &g);
  ASSERT_TRUE(g.status.is_ok()) << g.status.message();
  EXPECT_EQ(g.stats.elements, 2 * kKvElems);
  EXPECT_GT(g.stats.rtn_mismatch, 0);
  EXPECT_EQ(g.stats.one_step, g.stats.rtn_mismatch);
  EXPECT_EQ(g.stats.reproduced, 2 * kKvElems);
  EXPECT_EQ(k, kv_page_values(s.roll[0]));  // the rollout's page values, bit for bit
  EXPECT_EQ(v, kv_page_values(s.roll[1]));
}

TEST(FakeQuantKv, TraceGuidanceReproducesTheMantissaBit) {
  KvOperands s;
  auto store = kv_records(s, rollout::GuidanceMode::kTrace);
  TraceGuidance g = guidance_over(store.get(), kKvTokens, kKvTokens);
  auto [k, v] = kv_step(s.train, &g);
  ASSERT_TRUE(g.status.is_ok()) << g.status.message();
  EXPECT_EQ(g.stats.reproduced, 2 * kKvElems);
  EXPECT_GT(g.stats.rtn_mismatch, 0);
  // the rollout's codes are grid neighbours of the trainer's scaled values: the bit picks them
  EXPECT_EQ(k, kv_page_values(s.roll[0]));
  EXPECT_EQ(v, kv_page_values(s.roll[1]));
}

// Tokens without a record and layers outside the guided set stay RTN; a missing record is an error.
TEST(FakeQuantKv, UnrecordedRowsAndLayersStayRtnAndAMissingRecordIsAnError) {
  KvOperands s;
  auto store = kv_records(s, rollout::GuidanceMode::kTraceFull);
  const auto [k_rtn, v_rtn] = kv_step(s.train, nullptr);
  TraceGuidance g = guidance_over(store.get(), 2, kKvTokens);
  auto [k, v] = kv_step(s.train, &g);
  ASSERT_TRUE(g.status.is_ok()) << g.status.message();
  EXPECT_EQ(g.stats.elements, 2 * 2 * kHkv * kD);
  EXPECT_TRUE(std::equal(k.begin() + 2 * kHkv * kD, k.end(), k_rtn.begin() + 2 * kHkv * kD));
  EXPECT_TRUE(std::equal(v.begin() + 2 * kHkv * kD, v.end(), v_rtn.begin() + 2 * kHkv * kD));
  EXPECT_FALSE(std::equal(k.begin(), k.begin() + 2 * kHkv * kD, k_rtn.begin()));
  TraceGuidance off = guidance_over(store.get(), kKvTokens, kKvTokens);
  off.layers = {false};
  auto [k_off, v_off] = kv_step(s.train, &off);
  EXPECT_EQ(k_off, k_rtn);
  EXPECT_EQ(off.stats.elements, 0);
  TraceGuidance bad = guidance_over(store.get(), kKvTokens, kKvTokens);
  bad.row_position[4] = 40;
  kv_step(s.train, &bad);
  ASSERT_FALSE(bad.status.is_ok());
  EXPECT_NE(bad.status.message().find("position 40"), std::string::npos) << bad.status.message();
}

}  // namespace
}  // namespace nibble::rl
