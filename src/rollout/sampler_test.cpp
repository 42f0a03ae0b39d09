// Tests of the rollout sampler: greedy and top-k 1 are the argmax; top-k keeps only the k most
// likely ids and draws them in proportion to their renormalized probabilities; a tiny top-p keeps
// only the most likely id; the same Philox position gives the same token; the log-probability is
// log_softmax(logits / t) (t = 1 when greedy), independent of top-k / top-p; the engine's one-pass
// sampler gives the reference's tokens, log-probs and Philox draws bit for bit.
#include <gtest/gtest.h>

#include <bit>
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

// Rows that exercise every path of sample_with_logprob: spread logits (a long nucleus), peaked
// ones (a short one), few distinct values (ties: equal probabilities rank by id) and -inf
// (probability 0, ranked last).
std::vector<float> test_row(int kind, int64_t V, uint64_t seed) {
  PhiloxStream g(seed, 77);
  std::vector<float> row(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) {
    const double n = g.next_normal();
    switch (kind) {
      case 0: row[i] = static_cast<float>(n); break;                                // spread
      case 1: row[i] = static_cast<float>(6 * n); break;                            // peaked
      case 2: row[i] = static_cast<float>(std::floor(2 * n)); break;                // ties
      default: row[i] = i % 3 == 0 ? -INFINITY : static_cast<float>(3 * n); break;  // masked ids
    }
  }
  return row;
}

// sample_with_logprob == sample_token + token_logprob, bit for bit, and both consume the same
// Philox draws: over temperatures (greedy included), top-k (off, 1, small, past a quarter of V),
// top-p (off, near 1, middle, tiny), split rows or not, and vocabularies where the ranking is
// sorted in chunks (nth_element), switches to the radix sort midway, or is sorted whole.
TEST(RolloutSampler, OnePassSamplerEqualsTheReferenceBitForBit) {
  int checked = 0;
  for (const int64_t V : {int64_t{7}, int64_t{300}, int64_t{5000}})
    for (int kind = 0; kind < 4; ++kind) {
      const std::vector<float> row = test_row(kind, V, static_cast<uint64_t>(V + kind));
      for (const double t : {0.0, 0.25, 1.0, 3.0})
        for (const int64_t k : {int64_t{0}, int64_t{1}, int64_t{5}, V / 3})
          for (const double top_p : {1.0, 0.9999, 0.6, 1e-6})
            for (const bool split : {false, true}) {
              const SamplingParams sp{t, k, top_p};
              PhiloxStream a(static_cast<uint64_t>(checked), 5), b(static_cast<uint64_t>(checked), 5);
              const int32_t want = sample_token(row.data(), V, sp, &a);
              const double want_lp = token_logprob(row.data(), V, want, t);
              const SampledToken got = sample_with_logprob(row.data(), V, sp, &b, split);
              ASSERT_EQ(got.token, want) << "V " << V << " kind " << kind << " t " << t << " k " << k << " p " << top_p;
              ASSERT_EQ(std::bit_cast<uint64_t>(got.logprob), std::bit_cast<uint64_t>(want_lp))
                  << "V " << V << " kind " << kind << " t " << t << " k " << k << " p " << top_p;
              ASSERT_EQ(a.next_u32(), b.next_u32());  // the same number of draws taken
              ++checked;
            }
    }
  EXPECT_EQ(checked, 3 * 4 * 4 * 4 * 4 * 2);
}

// The 100k vocabulary of the OLMo-2 1B shape (where the one-pass sampler matters): a few
// temperature-1 draws, nucleus off and on, equal the reference.
TEST(RolloutSampler, OnePassSamplerEqualsTheReferenceOnALargeVocabulary) {
  const int64_t V = 100352;
  const std::vector<float> row = test_row(1, V, 3);
  for (const double top_p : {1.0, 0.95})
    for (uint64_t draw = 0; draw < 3; ++draw) {
      PhiloxStream a(draw, 1), b(draw, 1);
      const SamplingParams sp{1.0, 0, top_p};
      const int32_t want = sample_token(row.data(), V, sp, &a);
      const SampledToken got = sample_with_logprob(row.data(), V, sp, &b, draw % 2 == 1);
      EXPECT_EQ(got.token, want);
      EXPECT_EQ(got.logprob, token_logprob(row.data(), V, want, 1.0));
    }
}

}  // namespace
}  // namespace nibble::rollout
