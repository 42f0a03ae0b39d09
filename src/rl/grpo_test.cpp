// Tests of the GRPO math (grpo.h): group-normalised advantages, TIS weights (truncated, masked),
// and the policy loss's logits gradient against central finite differences of the loss itself,
// in token and sequence aggregation, with the ratio inside and outside the clip band and with
// the k3 KL term.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/philox.h"
#include "model/tiny_olmo2_test_util.h"
#include "model/transformer.h"
#include "rl/grpo.h"
#include "train/optimizer.h"

namespace nibble::rl {
namespace {

TEST(Grpo, GroupAdvantagesAreNormalisedPerGroup) {
  const std::vector<double> r = {1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5};
  const auto a = group_advantages(r, 4, 1e-6);
  // group 1: mean 0.5, population std 0.5
  EXPECT_NEAR(a[0], 1.0, 1e-5);
  EXPECT_NEAR(a[1], -1.0, 1e-5);
  // group 2: all equal -> 0 (no signal), not NaN
  for (int i = 4; i < 8; ++i) EXPECT_EQ(a[i], 0.0);
}

TEST(Grpo, TisWeightTruncatesOrMasks) {
  const double lr = std::log(0.1);  // π_old / π_rollout = 10 with logp_old = 0
  EXPECT_NEAR(tis_weight(0.0, lr, TisMode::kTruncate, 5.0), 5.0, 1e-12);
  EXPECT_EQ(tis_weight(0.0, lr, TisMode::kMask, 5.0), 0.0);
  EXPECT_NEAR(tis_weight(0.0, std::log(0.5), TisMode::kMask, 5.0), 2.0, 1e-12);
  EXPECT_EQ(tis_weight(0.0, lr, TisMode::kNone, 5.0), 1.0);
  EXPECT_EQ(tis_weight(std::log(0.1), 0.0, TisMode::kMask, 5.0), 0.0);  // ratio 0.1 < 1/C
}

// A (B=2, T=3) batch over V=5 with 4 response tokens and π_old shifted from the logits so that
// ratios are away from 1 (some clipped).
struct Case {
  PolicyBatch b;
  std::vector<float> logits;
  static constexpr int64_t V = 5;
};

Case make_case(double shift, double temperature = 1.0) {
  Case c;
  c.b.B = 2, c.b.T = 3;
  c.b.targets = {-1, 2, 4, -1, -1, 1};
  c.b.advantage = {0.7, -1.3};
  c.b.response_len = {2, 1};
  PhiloxStream rng(3, 1);
  for (int i = 0; i < 6 * Case::V; ++i) c.logits.push_back(static_cast<float>(2.0 * rng.next_uniform_double() - 1.0));
  c.b.logp_old.assign(6, 0.0), c.b.logp_rollout.assign(6, 0.0), c.b.logp_ref.assign(6, 0.0);
  for (int n = 0; n < 6; ++n) {
    if (c.b.targets[n] < 0) continue;
    const double lp = token_logprob_entropy(c.logits.data() + n * Case::V, Case::V, c.b.targets[n], temperature).logp;
    c.b.logp_old[n] = lp + shift * (n % 2 ? 1 : -1);
    c.b.logp_rollout[n] = lp + 0.3;
    c.b.logp_ref[n] = lp - 0.2;
  }
  return c;
}

void check_gradient(const Case& c, const GrpoConfig& g) {
  std::vector<float> grad = c.logits;
  const double loss = policy_loss_and_grad(grad.data(), c.b, Case::V, g).loss;
  EXPECT_TRUE(std::isfinite(loss));
  auto loss_at = [&](const std::vector<float>& l) {
    std::vector<float> tmp = l;
    return policy_loss_and_grad(tmp.data(), c.b, Case::V, g).loss;
  };
  // central differences in FP32 logits: h = 1e-2 keeps the FP32 rounding of the inputs (2^-24 x 1)
  // well below the O(h^2) truncation error (~1e-4 x third derivative of order 1)
  const float h = 1e-2f;
  for (size_t i = 0; i < c.logits.size(); ++i) {
    std::vector<float> p = c.logits, m = c.logits;
    p[i] += h, m[i] -= h;
    const double fd = (loss_at(p) - loss_at(m)) / (2.0 * h);
    EXPECT_NEAR(grad[i], fd, 2e-3) << "logit " << i;
  }
}

TEST(Grpo, PolicyGradientMatchesFiniteDifferencesTokenAggregation) {
  GrpoConfig g;
  check_gradient(make_case(0.05), g);  // ratios inside the band
}

TEST(Grpo, PolicyGradientMatchesFiniteDifferencesSequenceAggregationWithKl) {
  GrpoConfig g;
  g.aggregation = Aggregation::kSequence;
  g.kl_coef = 0.3;
  g.temperature = 0.7;
  check_gradient(make_case(0.05, g.temperature), g);
}

TEST(Grpo, ClippedTokensGiveNoPolicyGradient) {
  GrpoConfig g;
  g.tis = TisMode::kNone;
  Case c = make_case(1.0);  // ratios e^{±1}: every token outside [0.8, 1.2]
  std::vector<float> grad = c.logits;
  const PolicyLossStats st = policy_loss_and_grad(grad.data(), c.b, Case::V, g);
  EXPECT_EQ(st.tokens, 3);
  // ρ = π/π_old: n=2 (A>0, ρ=e > 1.2) and n=5 (A<0, ρ=1/e < 0.8) take the clipped term: no
  // gradient; n=1 (A>0, ρ=1/e) keeps the unclipped, smaller term
  EXPECT_NEAR(st.clip_fraction, 2.0 / 3.0, 1e-12);
  for (int64_t v = 0; v < Case::V; ++v) EXPECT_EQ(grad[2 * Case::V + v], 0.0f);
  for (int64_t v = 0; v < Case::V; ++v) EXPECT_EQ(grad[5 * Case::V + v], 0.0f);
  double g1 = 0;
  for (int64_t v = 0; v < Case::V; ++v) g1 += std::abs(grad[1 * Case::V + v]);
  EXPECT_GT(g1, 0.0);
  check_gradient(c, g);
}

}  // namespace
}  // namespace nibble::rl

namespace nibble::rl {
namespace {

// One AdamW step on the GRPO loss through the model raises the log-prob of the sequence with a
// positive advantage and lowers the other's (the objective's sign, end to end through
// Model::forward_backward_custom).
TEST(Grpo, OneUpdateMovesLogprobsWithTheAdvantage) {
  auto cfg = model::parse_model_config(model::test::tiny_olmo2_model_json(40));
  ASSERT_TRUE(cfg.is_ok());
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto m = std::move(model::Model::create(cfg.value(), rc)).value();
  m->init_weights(4);
  const int64_t B = 2, T = 6, V = 40;
  const std::vector<int32_t> tokens = {1, 5, 9, 3, 7, 2, 1, 5, 9, 11, 13, 17};
  PolicyBatch pb;
  pb.B = B, pb.T = T;
  pb.targets.assign(B * T, -1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 2; t < T - 1; ++t) pb.targets[b * T + t] = tokens[b * T + t + 1];
  pb.advantage = {1.0, -1.0};
  pb.response_len = {3, 3};
  auto logps = [&] {
    std::vector<float> logits(B * T * V);
    m->forward_logits(logits.data(), tokens.data(), B, T);
    std::vector<double> lp(B * T, 0.0), seq(B, 0.0);
    for (int64_t n = 0; n < B * T; ++n)
      if (pb.targets[n] >= 0) {
        lp[n] = token_logprob_entropy(logits.data() + n * V, V, pb.targets[n], 1.0).logp;
        seq[n / T] += lp[n];
      }
    return std::make_pair(lp, seq);
  };
  auto [lp0, seq0] = logps();
  pb.logp_old = lp0, pb.logp_rollout = lp0;
  m->zero_grad();
  m->forward_backward_custom(tokens.data(), B, T, [&](float* lg, int64_t N, int64_t Vv) {
    return policy_loss_and_grad(lg, pb, Vv, GrpoConfig{}).loss;
  });
  std::vector<train::ParamView> views;
  for (auto& p : m->param_refs()) views.push_back({p.name, p.value, p.grad, p.numel, p.weight_decay});
  train::AdamW opt(train::AdamWConfig{0.9, 0.95, 1e-8, 0.0});
  ASSERT_TRUE(opt.step(views, 1e-3).is_ok());
  auto [lp1, seq1] = logps();
  EXPECT_GT(seq1[0], seq0[0]);
  EXPECT_LT(seq1[1], seq0[1]);
}

}  // namespace
}  // namespace nibble::rl
