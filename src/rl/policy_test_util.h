// Test helpers of the weight-sync tests (rollout_worker_test.cpp, dist/nccl/
// nccl_weight_transport_test.cpp): two policy versions compared part by part, bit for bit (the
// bytes only: the packed form's BF16 weights come back flat, the host snapshot's as (N, K)); a
// small rollout request set; two rollouts' completions compared token and log-prob exactly.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "rl/rollout_worker.h"

namespace nibble::rl::test {

// The bytes of a tensor list, concatenated.
inline std::vector<uint8_t> raw(const std::vector<Tensor>& ts) {
  std::vector<uint8_t> out;
  for (const Tensor& t : ts) {
    const auto* p = static_cast<const uint8_t*>(t.raw());
    out.insert(out.end(), p, p + t.nbytes());
  }
  return out;
}

inline void expect_same_policy(const PolicyWeights& a, const PolicyWeights& b, const std::string& what) {
  EXPECT_EQ(a.version, b.version) << what;
  EXPECT_EQ(a.codes.size(), b.codes.size()) << what;
  EXPECT_EQ(raw(a.codes), raw(b.codes)) << what;
  EXPECT_EQ(raw(a.scales), raw(b.scales)) << what;
  EXPECT_EQ(raw(a.outer), raw(b.outer)) << what;
  EXPECT_EQ(a.bf16.size(), b.bf16.size()) << what;
  EXPECT_EQ(raw(a.bf16), raw(b.bf16)) << what;
  EXPECT_EQ(raw({a.rest}), raw({b.rest})) << what;
  EXPECT_FALSE(raw({a.rest}).empty()) << what;
}

// Two requests (ids 0 and 1, seed 42) of `samples` samples and `max_new` new tokens each.
inline std::vector<rollout::Request> small_requests(int64_t samples, int64_t max_new) {
  std::vector<rollout::Request> reqs;
  for (int i = 0; i < 2; ++i) {
    rollout::Request r;
    r.prompt = {3 + i, 7, 11 + 5 * i};
    r.id = static_cast<uint64_t>(i);
    r.params.num_samples = samples;
    r.params.max_new_tokens = max_new;
    r.params.seed = 42;
    reqs.push_back(r);
  }
  return reqs;
}

inline void expect_same_completions(const std::vector<rollout::Completion>& got,
                                    const std::vector<rollout::Completion>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << what << " " << i;
    EXPECT_EQ(got[i].logprobs, want[i].logprobs) << what << " " << i;
  }
}

}  // namespace nibble::rl::test
