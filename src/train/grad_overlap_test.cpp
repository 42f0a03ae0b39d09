// The bucket-readiness logic of the overlapped gradient reduce (train/grad_overlap.h): by hand
// (each bucket exactly once, highest first, only once the offset reaches its start; rising or
// out-of-range offsets are errors), and against the model's real backward (Model's
// grads_final_hook): OLMo-2 and Qwen3-MoE with a shared expert and routing forced onto experts
// {0, 1}, so experts 2 and 3 get no tokens, over several bucket sizes, with and without gradient
// accumulation: when a bucket is reported ready its gradients already hold their final bits
// (a snapshot taken then equals the gradients after backward), and every bucket is reported.
// The model has no tied embeddings (tie_word_embeddings must be false), so none are tested.
// Under `mpirun -np 3` (this program re-launched as its workers; skipped without MPI): the
// overlapped reduce-scatter (ZeRO-1) and all-reduce equal the after-backward ones bit for bit,
// with buckets started during a simulated backward, after it, and both.
#include "train/grad_overlap.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "core/philox.h"
#include "dist/mpi_test_util.h"
#include "train/data_parallel.h"
#include "model/config.h"
#include "model/transformer.h"

namespace nibble::train {
namespace {

TEST(BucketReadinessTest, EachBucketOnceHighestFirstWhenTheOffsetReachesItsStart) {
  // buckets [0,4) [4,8) [8,9)
  BucketReadiness r({{0, 4}, {4, 8}, {8, 9}});
  using V = std::vector<size_t>;
  EXPECT_EQ(*r.advance(9), V{});      // nothing final below the end: no bucket
  EXPECT_EQ(*r.advance(8), V{2});     // [8,9) final
  EXPECT_EQ(*r.advance(8), V{});      // not twice
  EXPECT_EQ(*r.advance(5), V{});      // [4,8) only partly final
  EXPECT_FALSE(r.all_ready());
  EXPECT_EQ(*r.advance(4), V{1});
  EXPECT_EQ(*r.advance(0), V{0});
  EXPECT_TRUE(r.all_ready());
  EXPECT_EQ(*r.advance(0), V{});
  // A new backward: all again; a jump to 0 gives every bucket, highest first.
  r.reset();
  EXPECT_FALSE(r.all_ready());
  EXPECT_EQ(*r.advance(3), (V{2, 1}));
  EXPECT_FALSE(r.advance(4));   // rising offsets: an error
  r.reset();
  EXPECT_FALSE(r.advance(10));  // past the end
  EXPECT_FALSE(r.advance(-1));
  EXPECT_EQ(*r.advance(0), (V{2, 1, 0}));
}

model::ModelConfig config(const std::string& json) {
  auto c = model::parse_model_config(nlohmann::json::parse(json));
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  return c.value();
}

model::ModelConfig olmo2() {
  return config(R"({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 11,
    "max_position_embeddings": 16, "rope_theta": 10000.0})");
}

// Layer 1 dense (mlp_only_layers), layers 0 and 2 MoE with 4 experts, top 2, a shared expert.
model::ModelConfig qwen3_moe() {
  return config(R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16, "intermediate_size": 12,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6, "vocab_size": 11,
    "max_position_embeddings": 16, "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 8, "mlp_only_layers": [1], "shared_expert_intermediate_size": 6,
    "router_aux_loss_coef": 0.1, "router_z_loss_coef": 0.05})");
}

// Runs `micro_batches` forward+backward passes (the hook on the last one only, as the trainer
// does) and checks the readiness reports against the gradients' final bits.
void check_readiness_against_backward(const model::ModelConfig& cfg, int64_t bucket_elems, int micro_batches) {
  model::RecipeConfig rc;
  rc.name = "fp32";
  auto created = model::Model::create(cfg, rc);
  ASSERT_TRUE(created) << created.status().message();
  auto m = std::move(created).value();
  m->init_weights(7);
  const int64_t n = m->num_params(), B = 2, Tn = 5, N = B * Tn;
  std::vector<FlatRange> buckets;
  for (int64_t b = 0; b < n; b += bucket_elems) buckets.push_back({b, std::min(n, b + bucket_elems)});
  BucketReadiness ready(buckets);

  // Experts {0, 1} for every token of every MoE layer: experts 2 and 3 get none.
  std::vector<int32_t> forced(static_cast<size_t>(m->num_moe_layers() * N * cfg.num_experts_per_tok));
  for (size_t s = 0; s < forced.size(); ++s) forced[s] = static_cast<int32_t>(s % 2);
  const model::RoutingIO routing{m->num_moe_layers() > 0 ? forced.data() : nullptr, nullptr};

  std::vector<int64_t> offsets;                    // what the hook reported, in order
  std::vector<size_t> order;                       // buckets in the order they became ready
  std::map<size_t, std::vector<float>> snapshot;   // bucket -> its gradients when it became ready
  std::vector<float> host(static_cast<size_t>(n));
  m->zero_grad();
  PhiloxStream rng(5, 0);
  for (int mb = 0; mb < micro_batches; ++mb) {
    std::vector<int32_t> tokens(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) {
      tokens[static_cast<size_t>(i)] = static_cast<int32_t>(rng.next_u32() % 11);
      targets[static_cast<size_t>(i)] = static_cast<int32_t>(rng.next_u32() % 11);
    }
    const bool last = mb + 1 == micro_batches;
    if (last) {
      ready.reset();
      m->set_grads_final_hook([&](int64_t final_from) {
        offsets.push_back(final_from);
        auto r = ready.advance(final_from);
        ASSERT_TRUE(r) << r.status().message();
        if (r->empty()) return;
        m->download_gradients(host.data());
        for (size_t k : *r) {
          order.push_back(k);
          snapshot[k].assign(host.begin() + buckets[k].begin, host.begin() + buckets[k].end);
        }
      });
    }
    m->forward_backward(tokens.data(), targets.data(), B, Tn, {}, routing);
    m->set_grads_final_hook(nullptr);
  }
  // The hook: once for model.norm + lm_head, once per block, once for the embedding, falling to 0.
  ASSERT_EQ(offsets.size(), static_cast<size_t>(cfg.num_hidden_layers + 2));
  EXPECT_EQ(offsets.back(), 0);
  for (size_t i = 1; i < offsets.size(); ++i) EXPECT_LT(offsets[i], offsets[i - 1]);
  EXPECT_TRUE(ready.all_ready());
  // Every bucket once, highest first.
  ASSERT_EQ(order.size(), buckets.size());
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], buckets.size() - 1 - i);
  // A bucket's gradients had their final bits when it was reported ready.
  m->download_gradients(host.data());
  for (const auto& [k, g] : snapshot) {
    const std::vector<float> final_bits(host.begin() + buckets[k].begin, host.begin() + buckets[k].end);
    EXPECT_EQ(g, final_bits) << "bucket " << k << " [" << buckets[k].begin << ", " << buckets[k].end << ") of " << n
                             << " reported ready before its gradients were final";
  }
  // The experts without tokens have zero gradients (and were covered by their block's report).
  if (m->num_moe_layers() > 0) {
    const auto* idle = m->find_param("model.layers.0.mlp.experts.3.down_proj.weight");
    ASSERT_NE(idle, nullptr);
    for (int64_t i = 0; i < idle->numel; ++i) ASSERT_EQ(idle->grad[i], 0.0f);
  }
}

TEST(BucketReadinessTest, BucketsReportedReadyHoldTheirFinalGradients) {
  for (const bool moe : {false, true}) {
    const model::ModelConfig cfg = moe ? qwen3_moe() : olmo2();
    for (int64_t bucket : {int64_t{1}, int64_t{97}, int64_t{1000}, int64_t{1} << 30})
      for (int micro : {1, 2}) {
        SCOPED_TRACE(::testing::Message() << (moe ? "qwen3-moe" : "olmo2") << " bucket " << bucket << " micro-batches "
                                          << micro);
        check_readiness_against_backward(cfg, bucket, micro);
      }
  }
}

// ---- against the after-backward reduce across 3 MPI processes ------------------------------

// The worker body (each of 3 ranks): 23 gradients of rank-dependent values whose sums round
// (so a different summation order would change bits), buckets of 4 and 7 (padded: 23 is not a
// multiple of 3 per bucket), "final from" offsets as a backward reports them.
void overlap_worker_checks() {
  auto g_or = dist::make_mpi_group();
  ASSERT_TRUE(g_or) << g_or.status().message();
  dist::ProcessGroup& group = **g_or;
  const int rank = group.rank();
  ASSERT_EQ(group.world_size(), 3);
  const int64_t n = 23;
  const std::vector<int64_t> numels = {5, 1, 3, 10, 4};
  std::vector<float> grads(n);
  PhiloxStream rng(11, static_cast<uint64_t>(rank));
  for (float& x : grads) x = static_cast<float>(rng.next_u32() % 100000) * 1e-3f + 0.1f;
  for (const int64_t bucket : {int64_t{4}, int64_t{7}})
    for (const bool with_zero : {true, false})
      // the offsets a backward reports: all of them, none (all buckets after backward), some
      for (const std::vector<int64_t>& finals : {std::vector<int64_t>{19, 15, 9, 9, 6, 0}, std::vector<int64_t>{},
                                                 std::vector<int64_t>{16, 8}}) {
        SCOPED_TRACE(::testing::Message() << "bucket " << bucket << (with_zero ? " zero" : " all-reduce") << " "
                                          << finals.size() << " offsets");
        auto layout = ZeroLayout::create(numels, bucket, 3, rank);
        ASSERT_TRUE(layout);
        Zero1 zero(group, backend::cpu_backend(), *layout);
        std::vector<float> after = grads, overlapped = grads, stage;
        if (with_zero)
          ASSERT_TRUE(zero.reduce_scatter(after.data()));
        else
          ASSERT_TRUE(all_reduce_gradients(group, backend::cpu_backend(), after.data(), n, &stage, bucket));
        OverlappedGradReduce ovl(group, overlapped.data(), n, with_zero ? &zero : nullptr, bucket);
        for (int pass = 0; pass < 2; ++pass) {  // begin() makes a second backward reduce again
          overlapped = grads;
          ovl.begin();
          for (int64_t f : finals) ovl.on_grads_final(f);
          ASSERT_TRUE(ovl.finish());
          EXPECT_EQ(0, std::memcmp(after.data(), overlapped.data(), n * sizeof(float))) << "pass " << pass;
          // the buckets starting at or above the last offset: all but the first ceil(f/bucket)
          const int64_t buckets = (n + bucket - 1) / bucket;
          const int64_t during = finals.empty() ? 0 : buckets - (finals.back() + bucket - 1) / bucket;
          EXPECT_EQ(ovl.started_during_backward(), during);
        }
      }
  EXPECT_TRUE(group.barrier());
}

TEST(GradOverlapMpiTest, OverlappedReduceIsTheAfterBackwardReduceBitForBit) {
  if (dist::test::under_mpirun()) {  // a worker
    overlap_worker_checks();
    return;
  }
  if (const std::string why = dist::test::why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  dist::test::expect_every_rank_passes(3, "GradOverlapMpiTest.*");
}

}  // namespace
}  // namespace nibble::train
