// Tests of the training/validation loaders: window layout (targets are tokens shifted by one),
// determinism for a seed, a different order for another seed, exact resume from saved state,
// every window once per epoch, the fixed-order capped validation iterator, and a rank's row range
// of a batch (data parallelism).
#include "train/loader.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>

namespace nibble::train {
namespace {

namespace fs = std::filesystem;

// A shard whose token at position p is p % vocab, so a window's start is readable from it.
std::string make_shard(const std::string& name, int64_t count, int64_t vocab = 60000) {
  std::string path = (fs::temp_directory_path() / ("nibble_loader_test_" + std::to_string(::getpid()) + name)).string();
  std::vector<int32_t> t(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) t[i] = static_cast<int32_t>(i % vocab);
  EXPECT_TRUE(write_token_shard(path, t, vocab).is_ok());
  return path;
}

std::vector<std::vector<int32_t>> draw(TrainLoader& l, int n) {
  std::vector<std::vector<int32_t>> out;
  Batch b;
  for (int i = 0; i < n; ++i) {
    EXPECT_TRUE(l.next(&b).is_ok());
    out.push_back(b.tokens);
    out.push_back(b.targets);
  }
  return out;
}

TEST(TrainLoader, WindowsAndTargets) {
  const int64_t T = 8;
  std::string a = make_shard("a.bin", 8 * 10 + 1), b = make_shard("b.bin", 8 * 3 + 5);  // 10 + 3 windows
  auto l = TrainLoader::open({a, b}, 4, T, 7);
  ASSERT_TRUE(l.is_ok()) << l.status().message();
  EXPECT_EQ(l->windows_per_epoch(), 13);
  Batch batch;
  std::multiset<int32_t> starts;
  for (int step = 0; step < 13; ++step) {  // 13 batches of 4 = 4 epochs of 13 windows
    ASSERT_TRUE(l->next(&batch).is_ok());
    ASSERT_EQ(batch.batch, 4);
    ASSERT_EQ(batch.seq_len, T);
    ASSERT_EQ(batch.tokens.size(), 32u);
    for (int r = 0; r < 4; ++r) {
      const int32_t* tok = batch.tokens.data() + r * T;
      const int32_t* tgt = batch.targets.data() + r * T;
      EXPECT_EQ(tok[0] % T, 0);  // windows start at multiples of T
      for (int t = 0; t < T; ++t) {
        EXPECT_EQ(tok[t], tok[0] + t);      // contiguous tokens
        EXPECT_EQ(tgt[t], tok[t] + 1);      // targets are the next tokens
      }
      starts.insert(tok[0]);
    }
  }
  // 4 epochs: each of shard a's 10 window starts 0..72 and b's 3 (0, 8, 16) appear 4 times;
  // starts 0, 8, 16 exist in both shards, so they appear 8 times.
  EXPECT_EQ(l->state().epoch, 3u);
  EXPECT_EQ(l->state().position, 13);
  for (int32_t s = 0; s < 80; s += 8) EXPECT_EQ(starts.count(s), s < 24 ? 8u : 4u) << s;
  fs::remove(a);
  fs::remove(b);
}

TEST(TrainLoader, DeterministicPerSeedAndResumable) {
  std::string a = make_shard("det.bin", 16 * 50 + 1);
  auto l1 = TrainLoader::open({a}, 3, 16, 42);
  auto l2 = TrainLoader::open({a}, 3, 16, 42);
  auto l3 = TrainLoader::open({a}, 3, 16, 43);
  ASSERT_TRUE(l1.is_ok() && l2.is_ok() && l3.is_ok());
  auto d1 = draw(*l1, 40), d2 = draw(*l2, 40), d3 = draw(*l3, 40);  // 120 windows: crosses 2 epoch ends
  EXPECT_EQ(d1, d2);
  EXPECT_NE(d1, d3);
  // The epoch orders differ from each other too (a fresh permutation per epoch).
  auto e = TrainLoader::open({a}, 50, 16, 42);
  ASSERT_TRUE(e.is_ok());
  auto epochs = draw(*e, 2);
  EXPECT_NE(epochs[0], epochs[2]);

  // Save the state after 17 batches (mid-epoch), keep drawing; a new loader restored from
  // the JSON draws the same batches.
  auto r = TrainLoader::open({a}, 3, 16, 42);
  ASSERT_TRUE(r.is_ok());
  draw(*r, 17);
  nlohmann::json saved = nlohmann::json::parse(r->state_json().dump());
  auto cont = draw(*r, 23);
  auto resumed = TrainLoader::open({a}, 3, 16, 42);
  ASSERT_TRUE(resumed.is_ok());
  ASSERT_TRUE(resumed->restore_json(saved).is_ok());
  EXPECT_EQ(draw(*resumed, 23), cont);
  EXPECT_EQ(cont, std::vector<std::vector<int32_t>>(d1.begin() + 34, d1.end()));

  // State from another seed/seq_len/data is refused.
  EXPECT_FALSE(l3->restore_json(saved).is_ok());
  auto other_t = TrainLoader::open({a}, 3, 8, 42);
  ASSERT_TRUE(other_t.is_ok());
  EXPECT_FALSE(other_t->restore_json(saved).is_ok());
  nlohmann::json bad = saved;
  bad["position"] = 51;
  EXPECT_FALSE(resumed->restore_json(bad).is_ok());
  EXPECT_FALSE(resumed->restore_json(nlohmann::json::array()).is_ok());
  EXPECT_FALSE(resumed->restore_json(nlohmann::json{{"epoch", 1}}).is_ok());
  fs::remove(a);
}

TEST(TrainLoader, Errors) {
  std::string small = make_shard("small.bin", 8);
  auto l = TrainLoader::open({small}, 2, 8, 1);  // needs 9 tokens
  ASSERT_FALSE(l.is_ok());
  EXPECT_NE(l.status().message().find("no window"), std::string::npos) << l.status().message();
  EXPECT_FALSE(TrainLoader::open({}, 2, 4, 1).is_ok());
  EXPECT_FALSE(TrainLoader::open({small}, 0, 4, 1).is_ok());
  EXPECT_FALSE(TrainLoader::open({"/nonexistent.bin"}, 2, 4, 1).is_ok());
  fs::remove(small);
}

TEST(ValLoader, FixedOrderAndCap) {
  std::string a = make_shard("val.bin", 4 * 11 + 1);  // 11 windows of T = 4
  auto v = ValLoader::open({a}, 3, 4, 0);
  ASSERT_TRUE(v.is_ok());
  EXPECT_EQ(v->num_batches(), 3);  // 11 / 3, the partial last batch dropped
  Batch b;
  for (int64_t i = 0; i < v->num_batches(); ++i) {
    ASSERT_TRUE(v->get(i, &b).is_ok());
    for (int r = 0; r < 3; ++r) EXPECT_EQ(b.tokens[r * 4], (i * 3 + r) * 4);
    EXPECT_EQ(b.targets[0], b.tokens[0] + 1);
  }
  Batch again;
  ASSERT_TRUE(v->get(1, &again).is_ok());
  ASSERT_TRUE(v->get(1, &b).is_ok());
  EXPECT_EQ(again.tokens, b.tokens);
  auto capped = ValLoader::open({a}, 3, 4, 2);
  ASSERT_TRUE(capped.is_ok());
  EXPECT_EQ(capped->num_batches(), 2);
  auto tiny = ValLoader::open({a}, 100, 4, 0);  // fewer windows than B: one batch of all 11
  ASSERT_TRUE(tiny.is_ok());
  EXPECT_EQ(tiny->num_batches(), 1);
  ASSERT_TRUE(tiny->get(0, &b).is_ok());
  EXPECT_EQ(b.batch, 11);
  fs::remove(a);
}

// Data parallelism: a row range reads exactly those rows of the batch the whole-batch call draws,
// and advances the state by the whole batch (every rank's loader stays in step).
TEST(TrainLoader, RowRangeIsASliceOfTheWholeBatch) {
  const std::string path = make_shard("rows.bin", 8 * 31 + 1);  // 31 windows of T = 8
  auto whole = TrainLoader::open({path}, 4, 8, 99);
  auto part = TrainLoader::open({path}, 4, 8, 99);
  ASSERT_TRUE(whole.is_ok());
  ASSERT_TRUE(part.is_ok());
  for (int step = 0; step < 40; ++step) {  // crosses epoch ends (31 windows per epoch)
    Batch all, some;
    ASSERT_TRUE(whole->next(&all).is_ok());
    const int64_t b = step % 3, e = b + 1 + step % 2;
    ASSERT_TRUE(part->next(&some, b, e).is_ok());
    ASSERT_EQ(some.batch, e - b);
    EXPECT_EQ(std::vector<int32_t>(all.tokens.begin() + b * 8, all.tokens.begin() + e * 8), some.tokens);
    EXPECT_EQ(std::vector<int32_t>(all.targets.begin() + b * 8, all.targets.begin() + e * 8), some.targets);
    EXPECT_EQ(whole->state().epoch, part->state().epoch);
    EXPECT_EQ(whole->state().position, part->state().position);
  }
  Batch x;
  EXPECT_FALSE(part->next(&x, 2, 2).is_ok());  // empty range
  EXPECT_FALSE(part->next(&x, 3, 5).is_ok());  // past the batch
  EXPECT_FALSE(part->next(&x, -1, 1).is_ok());
  fs::remove(path);
}

// Ready-made rows (nibble sft): every row once per epoch in the shuffled order, targets kept as
// given (-1 included), the state resumes as for shards, and validation reads them in order.
TEST(TrainLoader, ReadyMadeRows) {
  auto rows = std::make_shared<Rows>();
  rows->count = 7;
  rows->seq_len = 3;
  for (int32_t r = 0; r < 7; ++r)
    for (int32_t t = 0; t < 3; ++t) {
      rows->tokens.push_back(100 * r + t);
      rows->targets.push_back(t == 0 ? -1 : 100 * r + t + 1);
    }
  auto l = TrainLoader::from_rows(rows, 2, 5);
  ASSERT_TRUE(l.is_ok()) << l.status().message();
  EXPECT_EQ(l->windows_per_epoch(), 7);
  std::multiset<int32_t> seen;
  Batch b;
  for (int i = 0; i < 7; ++i) {  // 14 rows: two epochs
    ASSERT_TRUE(l->next(&b).is_ok());
    ASSERT_EQ(b.batch, 2);
    for (int r = 0; r < 2; ++r) {
      const int32_t row = b.tokens[r * 3] / 100;
      seen.insert(row);
      EXPECT_EQ(b.targets[r * 3], -1);
      EXPECT_EQ(b.tokens[r * 3 + 2], 100 * row + 2);
      EXPECT_EQ(b.targets[r * 3 + 2], 100 * row + 3);
    }
  }
  for (int32_t r = 0; r < 7; ++r) EXPECT_EQ(seen.count(r), 2u) << r;
  // Resume: restore after 3 batches, draw the same next batches.
  auto a = TrainLoader::from_rows(rows, 2, 5), c = TrainLoader::from_rows(rows, 2, 5);
  ASSERT_TRUE(a.is_ok() && c.is_ok());
  draw(*a, 3);
  ASSERT_TRUE(c->restore_json(a->state_json()).is_ok());
  EXPECT_EQ(draw(*a, 5), draw(*c, 5));
  auto other = TrainLoader::from_rows(rows, 2, 6), same = TrainLoader::from_rows(rows, 2, 5);
  ASSERT_TRUE(other.is_ok() && same.is_ok());
  EXPECT_NE(draw(*other, 3), draw(*same, 3)) << "the seed shuffles";
  // Validation: rows in order, 7 / 3 = 2 full batches.
  auto v = ValLoader::from_rows(rows, 3, 0);
  ASSERT_TRUE(v.is_ok());
  EXPECT_EQ(v->num_batches(), 2);
  ASSERT_TRUE(v->get(1, &b).is_ok());
  EXPECT_EQ(b.tokens[0], 300);
  EXPECT_EQ(b.targets[3 * 2 + 1], 502);
  EXPECT_FALSE(TrainLoader::from_rows(std::make_shared<Rows>(), 2, 5).is_ok());
  EXPECT_FALSE(TrainLoader::from_rows(nullptr, 2, 5).is_ok());
  EXPECT_FALSE(TrainLoader::from_rows(rows, 0, 5).is_ok());
  EXPECT_FALSE(ValLoader::from_rows(rows, 3, -1).is_ok());
}

}  // namespace
}  // namespace nibble::train
