// ZeRO-1 (train/zero.h): the ownership arithmetic (a hand-worked world of 3 with uneven
// parameters, padded buckets and parameters smaller than a bucket; a sweep checking that the
// ranks' owned elements partition the buffer into each bucket's contiguous slices), the sliced
// AdamW against the unsharded one (bit-identical weights and moments on every element, state
// imported into slices), and the collectives under `mpirun -np 3` (this program re-launched as
// its workers; skipped where mpirun or MPI is absent): reduce-scatter sums, all-gather, the
// gathered checkpoint state equal to one process's unsharded AdamW, and the grad norm.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/philox.h"
#include "dist/mpi_test_util.h"
#include "train/zero.h"

namespace nibble::train {
namespace {

const std::vector<int64_t> kNumels = {5, 1, 3, 10, 2};  // 21 elements; params smaller than a bucket

std::vector<std::vector<FlatRange>> owned_ranges(const ZeroLayout& l) {
  std::vector<std::vector<FlatRange>> out;
  for (size_t i = 0; i < l.num_params(); ++i) out.push_back(l.owned_of_param(i));
  return out;
}

TEST(ZeroLayoutTest, WorldOfThreeByHand) {
  // params {5, 1, 3} = 9 elements at offsets 0, 5, 6; buckets of 4: [0,4) [4,8) [8,9), shards 2, 2, 1.
  // rank 0 owns [0,2) [4,6) [8,9); rank 1 [2,4) [6,8); rank 2 nothing ((2*2, 3*2) is past each bucket's end).
  const std::vector<int64_t> numels = {5, 1, 3};
  auto l0 = ZeroLayout::create(numels, 4, 3, 0), l1 = ZeroLayout::create(numels, 4, 3, 1),
       l2 = ZeroLayout::create(numels, 4, 3, 2);
  ASSERT_TRUE(l0 && l1 && l2);
  ASSERT_EQ(l0->buckets().size(), 3u);
  EXPECT_EQ(l0->buckets()[0].shard, 2);
  EXPECT_EQ(l0->buckets()[2].shard, 1);
  EXPECT_EQ(l0->max_padded_elems(), 6);  // world * shard of [0,4) and [4,8)
  using R = std::vector<std::vector<FlatRange>>;
  EXPECT_EQ(owned_ranges(*l0), (R{{{0, 2}, {4, 5}}, {{0, 1}}, {{2, 3}}}));
  EXPECT_EQ(owned_ranges(*l1), (R{{{2, 4}}, {}, {{0, 2}}}));
  EXPECT_EQ(owned_ranges(*l2), (R{{}, {}, {}}));
  EXPECT_EQ(l0->owned_elems(), 5);
  EXPECT_EQ(l1->owned_elems(), 4);
  EXPECT_EQ(l2->owned_elems(), 0);
  // Buckets of 6: [0,6) and [6,9), shards 2 and 1, no padding; every rank owns something.
  auto m2 = ZeroLayout::create(numels, 6, 3, 2);
  ASSERT_TRUE(m2);
  EXPECT_EQ(m2->max_padded_elems(), 0);
  EXPECT_EQ(owned_ranges(*m2), (R{{{4, 5}}, {{0, 1}}, {{2, 3}}}));
  // A one-rank world owns each parameter whole, as one range, across bucket boundaries.
  auto one = ZeroLayout::create(numels, 4, 1, 0);
  ASSERT_TRUE(one);
  EXPECT_EQ(owned_ranges(*one), (R{{{0, 5}}, {{0, 1}}, {{0, 3}}}));
  EXPECT_FALSE(ZeroLayout::create(numels, 4, 3, 3));
  EXPECT_FALSE(ZeroLayout::create(numels, 0, 1, 0));
  EXPECT_FALSE(ZeroLayout::create({4, -1}, 4, 1, 0));
}

TEST(ZeroLayoutTest, RanksPartitionTheBufferIntoEachBucketsSlices) {
  for (int world : {1, 2, 3, 4, 7})
    for (int64_t bucket : {1, 2, 4, 7, 21, 100}) {
      std::vector<int> owner(21, -1);
      for (int r = 0; r < world; ++r) {
        auto l = ZeroLayout::create(kNumels, bucket, world, r);
        ASSERT_TRUE(l);
        int64_t count = 0;
        for (size_t i = 0; i < kNumels.size(); ++i)
          for (const FlatRange& g : l->owned_of_param(i)) {
            ASSERT_TRUE(g.begin >= 0 && g.begin < g.end && g.end <= kNumels[i]);
            for (int64_t e = l->param_offset(i) + g.begin; e < l->param_offset(i) + g.end; ++e) {
              EXPECT_EQ(owner[e], -1) << "element " << e << " owned twice";
              owner[e] = r;
              ++count;
            }
          }
        EXPECT_EQ(count, l->owned_elems());
      }
      // Element e of bucket k belongs to rank (e - k.begin) / k.shard, shard = ceil(size / world).
      for (int64_t e = 0; e < 21; ++e) {
        const int64_t b = e / bucket * bucket, size = std::min<int64_t>(bucket, 21 - b);
        const int64_t shard = (size + world - 1) / world;
        EXPECT_EQ(owner[e], (e - b) / shard) << "world " << world << " bucket " << bucket << " element " << e;
      }
    }
}

// params: (21) values and grads of the kNumels parameters as views; weight decay off for param 1.
std::vector<ParamView> make_views(std::vector<float>& w, std::vector<float>& g) {
  std::vector<ParamView> v;
  int64_t at = 0;
  for (size_t i = 0; i < kNumels.size(); ++i) {
    v.push_back({"p" + std::to_string(i), w.data() + at, g.data() + at, kNumels[i], i != 1});
    at += kNumels[i];
  }
  return v;
}

std::vector<float> random_vector(uint64_t seed, float scale) {
  std::vector<float> x(21);
  PhiloxStream rng(seed, 0);
  for (float& e : x) e = scale * (2.0f * rng.next_uniform() - 1.0f);
  return x;
}

TEST(ZeroAdamWTest, SlicedUpdateIsBitIdenticalToUnsharded) {
  for (int world : {1, 2, 3})
    for (int64_t bucket : {4, 7}) {
      std::vector<float> w = random_vector(1, 0.5f), g(21);
      auto full_views = make_views(w, g);
      AdamW full;
      // Each rank: its own copy of weights and gradients, an AdamW over its owned slices.
      std::vector<std::vector<float>> rw(world, w), rg(world, g);
      std::vector<AdamW> ranks(world);
      std::vector<ZeroLayout> layouts;
      std::vector<std::vector<ParamView>> owned;
      for (int r = 0; r < world; ++r) {
        layouts.push_back(*ZeroLayout::create(kNumels, bucket, world, r));
        owned.push_back(owned_views(make_views(rw[r], rg[r]), layouts[r]));
      }
      for (int step = 0; step < 3; ++step) {
        const std::vector<float> fresh = random_vector(10 + step, 2.0f);
        std::copy(fresh.begin(), fresh.end(), g.begin());  // in place: the views point into g
        ASSERT_TRUE(full.step(full_views, 1e-2, 0.5f));
        std::vector<float> gathered(21);
        for (int r = 0; r < world; ++r) {
          rg[r] = g;
          ASSERT_TRUE(ranks[r].step(owned[r], 1e-2, 0.5f));
          for (size_t i = 0; i < kNumels.size(); ++i)  // the all-gather: each rank's owned elements
            for (const FlatRange& e : layouts[r].owned_of_param(i))
              for (int64_t k = e.begin; k < e.end; ++k)
                gathered[layouts[r].param_offset(i) + k] = rw[r][layouts[r].param_offset(i) + k];
        }
        for (int r = 0; r < world; ++r) rw[r] = gathered;
        ASSERT_EQ(0, std::memcmp(gathered.data(), w.data(), 21 * sizeof(float)))
            << "world " << world << " bucket " << bucket << " step " << step;
      }
      // Moments: each slice equals the unsharded moments' elements, bit for bit; a one-rank world
      // holds each parameter whole.
      const auto state = full.export_state();
      int64_t held = 0;
      for (int r = 0; r < world; ++r) {
        held += ranks[r].moment_elems();
        AdamW restored;
        ASSERT_TRUE(restored.import_state(state, owned[r]));
        for (const ParamView& v : owned[r]) {
          if (v.numel == 0) continue;
          const std::vector<float> m = *full.exp_avg(v.name), s = *ranks[r].exp_avg(v.name, v.offset);
          ASSERT_EQ(s.size(), static_cast<size_t>(v.numel));
          EXPECT_EQ(0, std::memcmp(s.data(), m.data() + v.offset, s.size() * sizeof(float))) << v.name;
          EXPECT_EQ(*restored.exp_avg_sq(v.name, v.offset), *ranks[r].exp_avg_sq(v.name, v.offset)) << v.name;
          if (world == 1) EXPECT_EQ(v.numel, v.full_numel);
        }
      }
      EXPECT_EQ(held, 21);
    }
}

TEST(ZeroAdamWTest, OwnedSumsOfSquaresAddUpToTheGlobalNorm) {
  std::vector<float> w(21), g = random_vector(3, 3.0f);
  const auto full = make_views(w, g);
  const double total = grad_sum_squares(full, 0.25f, backend::cpu_backend());
  for (int world : {1, 2, 3}) {
    double sum = 0;
    for (int r = 0; r < world; ++r)
      sum += grad_sum_squares(owned_views(full, *ZeroLayout::create(kNumels, 4, world, r)), 0.25f, backend::cpu_backend());
    // Each square (g*s)^2 of FP32 values is summed in double: 21 terms reordered differ by at
    // most 2*21*2^-53 relative (Higham 3.1); a one-rank world sums in the same order: equal bits.
    if (world == 1) EXPECT_EQ(sum, total);
    else EXPECT_NEAR(sum, total, 2 * 21 * std::ldexp(1.0, -53) * total);
  }
}

// ---- the collectives across 3 MPI processes ----------------------------------------------------

using dist::test::under_mpirun;

// The worker body (each of 3 ranks): buckets of 4 over 21 elements (shards 2, the last bucket
// of 1 owned by rank 0 alone: padded buckets everywhere). ASSERTs: a failing rank exits non-zero.
void zero_worker_checks() {
  auto g_or = dist::make_mpi_group();
  ASSERT_TRUE(g_or) << g_or.status().message();
  dist::ProcessGroup& group = **g_or;
  const int rank = group.rank();
  ASSERT_EQ(group.world_size(), 3);
  auto layout = ZeroLayout::create(kNumels, 4, 3, rank);
  ASSERT_TRUE(layout);
  Zero1 zero(group, backend::cpu_backend(), *layout);
  std::vector<bool> mine(21, false);
  for (size_t i = 0; i < kNumels.size(); ++i)
    for (const FlatRange& e : layout->owned_of_param(i))
      for (int64_t k = e.begin; k < e.end; ++k) mine[layout->param_offset(i) + k] = true;

  // reduce_scatter: rank r's gradient (r+1)*(i+1): owned elements get 6*(i+1) (exact), the rest keep theirs.
  std::vector<float> g(21);
  for (int i = 0; i < 21; ++i) g[i] = static_cast<float>((rank + 1) * (i + 1));
  ASSERT_TRUE(zero.reduce_scatter(g.data()));
  for (int i = 0; i < 21; ++i) EXPECT_EQ(g[i], static_cast<float>((mine[i] ? 6 : rank + 1) * (i + 1))) << i;
  // all_gather: the owned elements' values reach every rank.
  std::vector<float> v(21, -1.0f);
  for (int i = 0; i < 21; ++i)
    if (mine[i]) v[i] = 1000.0f + static_cast<float>(i);
  ASSERT_TRUE(zero.all_gather(v.data()));
  for (int i = 0; i < 21; ++i) EXPECT_EQ(v[i], 1000.0f + static_cast<float>(i)) << i;

  // Three ZeRO-1 steps against one process's unsharded AdamW on the summed gradients.
  std::vector<float> w = random_vector(1, 0.5f), wf = w, grads(21), gf(21);
  auto views = make_views(w, grads), full_views = make_views(wf, gf);
  const auto owned = owned_views(views, *layout);
  AdamW sharded, full;
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> base = random_vector(20 + step, 1.0f);
    for (int i = 0; i < 21; ++i) {  // rank r's gradient; the unsharded one gets the rank-order sum
      grads[i] = base[i] * static_cast<float>(rank + 1);
      gf[i] = (base[i] * 1.0f + base[i] * 2.0f) + base[i] * 3.0f;
    }
    ASSERT_TRUE(zero.reduce_scatter(grads.data()));
    auto ss = zero.grad_sum_squares(owned, 0.5f);
    ASSERT_TRUE(ss);
    const double total = grad_sum_squares(full_views, 0.5f, backend::cpu_backend());
    EXPECT_NEAR(*ss, total, 2 * 21 * std::ldexp(1.0, -53) * total);  // reordered double sums (see above)
    ASSERT_TRUE(sharded.step(owned, 1e-2, 0.5f));
    ASSERT_TRUE(full.step(full_views, 1e-2, 0.5f));
    ASSERT_TRUE(zero.all_gather(w.data()));
    ASSERT_EQ(0, std::memcmp(w.data(), wf.data(), 21 * sizeof(float))) << "step " << step;
  }
  auto state = zero.gather_state(sharded, views, rank != 1);
  ASSERT_TRUE(state);
  if (rank == 1) {
    EXPECT_TRUE(state->empty());
  } else {
    const auto expect = full.export_state();
    ASSERT_EQ(state->size(), expect.size());
    for (size_t i = 0; i < expect.size(); ++i) {
      EXPECT_EQ((*state)[i].name, expect[i].name);
      ASSERT_EQ((*state)[i].tensor.nbytes(), expect[i].tensor.nbytes());
      EXPECT_EQ(0, std::memcmp((*state)[i].tensor.raw(), expect[i].tensor.raw(), expect[i].tensor.nbytes()))
          << expect[i].name;
    }
  }
  EXPECT_TRUE(group.barrier());
}

TEST(ZeroMpiTest, CollectivesAcrossThreeProcessesMatchOneProcess) {
  if (under_mpirun()) {  // a worker
    zero_worker_checks();
    return;
  }
  if (const std::string why = dist::test::why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  dist::test::expect_every_rank_passes(3, "ZeroMpiTest.*");
}

}  // namespace
}  // namespace nibble::train
