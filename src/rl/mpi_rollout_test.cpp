// The split of a step's prompt groups among the rollout ranks of a disaggregated run
// (mpi_rollout.h): contiguous shares in rank order that cover every request once, sizes differing
// by at most one (larger first), none empty while the rollout ranks do not exceed the requests;
// and the one-line error of a world with more rollout ranks than prompts per step (or of one
// process). The runs themselves are tested through the binary under mpirun (rl_cli_test.cpp).
#include <gtest/gtest.h>

#include "rl/mpi_rollout.h"

namespace nibble::rl {
namespace {

TEST(RolloutShare, ContiguousBalancedSharesCoverEveryRequestOnce) {
  for (int64_t requests = 1; requests <= 9; ++requests)
    for (int ranks = 1; ranks <= requests; ++ranks) {
      int64_t next = 0;
      for (int k = 0; k < ranks; ++k) {
        const RequestShare s = rollout_share(requests, ranks, k);
        EXPECT_EQ(s.begin, next) << requests << " over " << ranks << ", rank index " << k;
        const int64_t size = s.end - s.begin;
        // requests / ranks each, the first requests % ranks one more
        EXPECT_EQ(size, requests / ranks + (k < requests % ranks ? 1 : 0)) << requests << " over " << ranks;
        EXPECT_GE(size, 1);
        next = s.end;
      }
      EXPECT_EQ(next, requests) << requests << " over " << ranks;
    }
  const RequestShare last = rollout_share(3, 2, 1);  // 3 groups over 2 ranks: 2 + 1
  EXPECT_EQ(last.begin, 2);
  EXPECT_EQ(last.end, 3);
}

TEST(RolloutShare, MoreRolloutRanksThanPromptsIsAnError) {
  EXPECT_TRUE(check_rollout_world(2, 1).is_ok());
  EXPECT_TRUE(check_rollout_world(3, 2).is_ok());
  EXPECT_TRUE(check_rollout_world(9, 8).is_ok());
  const Status too_many = check_rollout_world(4, 2);
  EXPECT_EQ(too_many.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.message().find("3 rollout ranks but 2 prompts per step"), std::string::npos) << too_many.message();
  EXPECT_NE(too_many.message().find("at most 3 processes"), std::string::npos) << too_many.message();
  EXPECT_EQ(check_rollout_world(1, 4).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nibble::rl
