// Tests of the rollout sampler: greedy and top-k 1 are the argmax; top-k keeps only the k most
// likely ids and draws them in proportion to their renormalized probabilities; a tiny top-p keeps
// only the most likely id; the same Philox position gives the same token; the log-probability is
// log_softmax(logits / t) (t = 1 when greedy), independent of top-k / top-p.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "rollout/sampler.h"

namespace nibble::rollout {
namespace {

const std::vector<float> kLogits{0.5f, 2.0f, -1.0f, 1.5f, 1.9f, 0.0f, -3.0f, 1.0f};  // top-3: ids 1, 4, 3

TEST(RolloutSampler, GreedyAndTopKOneAreTheArgmax) {
  PhiloxStream rng(1, 2);
  EXPECT_EQ(sample_token(kLogits.data(), 8, SamplingParams{0.0, 0, 1.0}, &rng), 1);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_token(kLogits.data(), 8, SamplingParams{2.0, 1, 1.0}, &rng), 1);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_token(kLogits.data(), 8, SamplingParams{1.0, 0, 1e-6}, &rng), 1);
}

TEST(RolloutSampler, TopKDrawsTheKMostLikelyInProportion) {
  const double t = 1.5;
  PhiloxStream rng(7, 0);
  std::map<int32_t, int> counts;
  const int n = 4000;
  for (int i = 0; i < n; ++i) ++counts[sample_token(kLogits.data(), 8, SamplingParams{t, 3, 1.0}, &rng)];
  ASSERT_EQ(counts.size(), 3u);
  double z = 0;
  for (int32_t id : {1, 4, 3}) z += std::exp(kLogits[id] / t);
  for (int32_t id : {1, 4, 3}) {
    const double p = std::exp(kLogits[id] / t) / z;
    // a binomial count: within 5 standard deviations of n p
    EXPECT_NEAR(counts[id], n * p, 5 * std::sqrt(n * p * (1 - p))) << "id " << id;
  }
}

TEST(RolloutSampler, SamePhiloxPositionSameToken) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    PhiloxStream a(seed, 9), b(seed, 9);
    for (int i = 0; i < 10; ++i)
      ASSERT_EQ(sample_token(kLogits.data(), 8, SamplingParams{1.0, 4, 0.9}, &a),
                sample_token(kLogits.data(), 8, SamplingParams{1.0, 4, 0.9}, &b));
  }
}

TEST(RolloutSampler, LogprobIsLogSoftmaxOfLogitsOverTemperature) {
  for (double t : {0.0, 0.7, 1.0, 2.0}) {
    const double tt = t > 0 ? t : 1.0;
    double z = 0;
    for (float l : kLogits) z += std::exp(l / tt);
    for (int32_t id = 0; id < 8; ++id)
      EXPECT_NEAR(token_logprob(kLogits.data(), 8, id, t), kLogits[id] / tt - std::log(z), 1e-12) << t << " " << id;
  }
}

}  // namespace
}  // namespace nibble::rollout
