// The split of a step's prompt groups among the rollout ranks of a disaggregated run
// (mpi_rollout.h): contiguous shares in rank order that cover every request once, sizes differing
// by at most one (larger first), none empty while the rollout ranks do not exceed the requests;
// and the one-line error of a world with more rollout ranks than prompts per step (or of one
// process). The device weight transport across 3 CPU processes (this program re-launched under
// `mpirun -np 3`; the packed buffers in host memory, the NCCL path's code): rank 1 receives rank
// 0's packed and host-form versions bit for bit in 1 KiB buckets; a version arriving while its
// only buffer is held is an error, and rank 2's model of another shape gets an error for every
// version; either way the body is received and dropped, so the next message still arrives in step.
// Skipped without MPI. The runs themselves are tested through the binary (rl_cli_test.cpp).
#include <gtest/gtest.h>

#include "dist/mpi_test_util.h"
#include "rl/mpi_rollout.h"
#include "rl/policy_test_util.h"

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

std::unique_ptr<model::Model> dense_model(int64_t intermediate) {
  nlohmann::json j = nlohmann::json::parse(R"({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 64, "max_position_embeddings": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "initializer_range": 0.1})");
  j["intermediate_size"] = intermediate;
  auto mc = model::parse_model_config(j);
  EXPECT_TRUE(mc.is_ok());
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto m = model::Model::create(mc.value(), rc, &backend::cpu_backend());
  EXPECT_TRUE(m.is_ok());
  m.value()->init_weights(3);
  return std::move(m).value();
}

void device_transport_worker() {
  using rollout::PrecisionMode;
  auto g = dist::make_mpi_group();
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  dist::ProcessGroup& group = *g.value();
  ASSERT_EQ(group.world_size(), 3);
  const int rank = group.rank();
  auto m = dense_model(rank == 2 ? 96 : 64);  // rank 2: another model's layout
  auto t = make_device_weight_transport(group, *m, PrecisionMode::kW4A4, "tetrajet-v2", /*versions_held=*/1,
                                        /*bucket_bytes=*/1024);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_GT(policy_layout(*m, PrecisionMode::kW4A4, "tetrajet-v2").total_bytes, 4 * 1024) << "several buckets";
  const PolicyWeights host = snapshot_policy(*m, PrecisionMode::kW4A4, "tetrajet-v2", 1).value();
  if (rank == 0) {
    auto packed = pack_policy(*m, PrecisionMode::kW4A4, "tetrajet-v2");
    ASSERT_TRUE(packed.is_ok());
    PolicyWeights v1;
    v1.version = 1, v1.mode = PrecisionMode::kW4A4, v1.format = host.format, v1.packed = packed.value();
    PolicyWeights v2 = host, v3 = v1;  // v2: a host version (uploaded), v3 packed again
    v2.version = 2, v3.version = 3;
    for (const PolicyWeights* v : {&v1, &v2, &v3}) ASSERT_TRUE(t.value()->send(*v));
  } else {
    Result<PolicyWeights> v1 = t.value()->receive();  // rank 1 keeps it: its only buffer stays held
    Result<PolicyWeights> v2 = t.value()->receive();
    if (rank == 1) {
      ASSERT_TRUE(v1.is_ok()) << v1.status().message();
      ASSERT_TRUE(v1.value().packed != nullptr);
      test::expect_same_policy(unpack_policy(*v1.value().packed, 1), host, "v1");
      EXPECT_EQ(v2.status().code(), StatusCode::kInternal) << v2.status().message();
      v1 = Status(StatusCode::kInternal, "released");
    } else {
      EXPECT_EQ(v1.status().code(), StatusCode::kDataLoss) << v1.status().message();
      EXPECT_EQ(v2.status().code(), StatusCode::kDataLoss) << v2.status().message();
    }
    Result<PolicyWeights> v3 = t.value()->receive();
    if (rank == 1) {
      ASSERT_TRUE(v3.is_ok()) << v3.status().message();
      EXPECT_EQ(v3.value().version, 3);
      PolicyWeights want = host;
      want.version = 3;
      test::expect_same_policy(unpack_policy(*v3.value().packed, 3), want, "v3");
    } else {
      EXPECT_EQ(v3.status().code(), StatusCode::kDataLoss);
    }
  }
  // in step: the next broadcast carries rank 0's value to everyone
  int64_t sentinel = rank == 0 ? 0x5EED : -1;
  ASSERT_TRUE(group.broadcast_host(&sentinel, sizeof sentinel, 0));
  EXPECT_EQ(sentinel, 0x5EED);
}

TEST(WeightTransportMpiTest, DeviceTransportAcrossThreeProcessesStaysInStep) {
  if (dist::test::under_mpirun()) {  // a worker
    device_transport_worker();
    return;
  }
  if (const std::string why = dist::test::why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  dist::test::expect_every_rank_passes(3, "WeightTransportMpiTest.DeviceTransportAcrossThreeProcessesStaysInStep");
}

}  // namespace
}  // namespace nibble::rl
