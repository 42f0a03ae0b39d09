// Tests of the R3 routing records (routing_record.h): compact id widths (uint8 up to 256 experts,
// uint16 above), round trip through a spilling store into the (L_moe, B*T, k) array the model
// replays, padding past a sequence's length, errors by key, and a real MoE model whose replayed
// forward (RoutingIO::forced from the store) routes every token to the recorded experts.
#include "rollout/routing_record.h"

#include <unistd.h>

#include <filesystem>

#include <gtest/gtest.h>

#include "core/philox.h"
#include "model/transformer.h"

namespace nibble::rollout {
namespace {

namespace fs = std::filesystem;

class RoutingRecordTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nibble_routing_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    RecordStoreOptions o;
    o.name = "routing store";
    o.memory_budget_bytes = 64;  // spills after a few records
    o.spill_dir = dir_.string();
    auto s = RecordStore::open(o);
    ASSERT_TRUE(s.is_ok()) << s.status().message();
    store_ = std::move(s).value();
  }
  void TearDown() override {
    store_.reset();
    EXPECT_FALSE(fs::exists(dir_));
  }
  fs::path dir_;
  std::unique_ptr<RecordStore> store_;
};

// Distinct random expert sets: (L, N, k) ids in [0, E).
std::vector<int32_t> random_sets(int64_t L, int64_t N, int64_t k, int64_t E, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(L * N * k));
  PhiloxStream rng(seed, 4);
  for (int64_t row = 0; row < L * N; ++row)
    for (int64_t j = 0; j < k; ++j) {
      int32_t e;
      bool dup;
      do {
        e = static_cast<int32_t>(rng.next_below(static_cast<uint64_t>(E)));
        dup = false;
        for (int64_t i = 0; i < j; ++i) dup |= ids[row * k + i] == e;
      } while (dup);
      ids[row * k + j] = e;
    }
  return ids;
}

TEST(RoutingRecord, CompactIdWidths) {
  EXPECT_EQ(routing_id_bytes(256), 1);
  EXPECT_EQ(routing_id_bytes(257), 2);
  EXPECT_EQ(routing_record_bytes(128, 8), 4 + 8);       // Qwen3-30B-A3B: 128 experts, top-8
  EXPECT_EQ(routing_record_bytes(512, 10), 4 + 2 * 10);
  EXPECT_EQ(routing_bytes_per_token(128, 8, 48), 48 * 12);
  for (int64_t E : {int64_t{256}, int64_t{300}}) {
    std::vector<int32_t> ids = {0, static_cast<int32_t>(E - 1), 77};
    auto rec = encode_routing(ids, E);
    ASSERT_TRUE(rec.is_ok());
    EXPECT_EQ(static_cast<int64_t>(rec->size()), routing_record_bytes(E, 3));
    auto back = decode_routing(*rec, E, "t");
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_EQ(*back, ids);
  }
  EXPECT_FALSE(encode_routing(std::vector<int32_t>{3, 8}, 8).is_ok());  // id 8 of 8 experts
  EXPECT_FALSE(encode_routing(std::vector<int32_t>{-1}, 8).is_ok());
  // A record read with another expert count, or cut short, is data loss naming it.
  auto rec = encode_routing(std::vector<int32_t>{1, 2}, 8);
  auto wrong = decode_routing(*rec, 300, "(sequence 1)");
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_NE(wrong.status().message().find("(sequence 1)"), std::string::npos);
  std::vector<uint8_t> cut(rec->begin(), rec->end() - 1);
  EXPECT_EQ(decode_routing(cut, 8, "x").status().code(), StatusCode::kDataLoss);
  ASSERT_TRUE(rec.is_ok());
  std::vector<uint8_t> big = *rec;
  big[kRoutingHeaderBytes + 1] = 9;  // the second id
  EXPECT_EQ(decode_routing(big, 8, "x").status().code(), StatusCode::kDataLoss);
}

// The rollout records two sequences token by token in decode order (one row per step, as a
// batched decode step would); the trainer gathers a (B=2, T=6) batch where sequence 0 has 4
// tokens: padding rows get 0..k-1, every other row equals what was recorded.
TEST_F(RoutingRecordTest, RoundTripThroughSpillingStoreWithPadding) {
  for (int64_t E : {int64_t{64}, int64_t{300}}) {
    SCOPED_TRACE(E);
    if (E == 300) SetUp();  // a fresh store (the first one's sequences are taken)
    const int64_t L = 3, k = 4, T = 6;
    const uint64_t seqs[2] = {11, 42};
    const int64_t lengths[2] = {4, 6};
    // Rollout layout: (L, N, k) with N = 2 rows per step, rows (seq 11, seq 42) at position t.
    std::vector<int32_t> all = random_sets(L, 2 * T, k, E, static_cast<uint64_t>(E));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> step(static_cast<size_t>(L * 2 * k));
      std::vector<uint64_t> row_seq;
      std::vector<uint32_t> row_pos;
      int64_t n = 0;
      for (int b = 0; b < 2; ++b) {
        if (t >= lengths[b]) continue;
        for (int64_t m = 0; m < L; ++m)
          for (int64_t j = 0; j < k; ++j) step[(m * 2 + n) * k + j] = all[(m * 2 * T + b * T + t) * k + j];
        row_seq.push_back(seqs[b]);
        row_pos.push_back(static_cast<uint32_t>(t));
        ++n;
      }
      // Rows of this step: (L, n, k) from the (L, 2, k) buffer.
      std::vector<int32_t> packed;
      for (int64_t m = 0; m < L; ++m)
        packed.insert(packed.end(), step.begin() + m * 2 * k, step.begin() + (m * 2 + n) * k);
      ASSERT_TRUE(append_routing(*store_, packed.data(), L, n, k, E, row_seq.data(), row_pos.data()).is_ok());
    }
    Status flushed = store_->flush();
    ASSERT_TRUE(flushed.is_ok()) << flushed.message();
    EXPECT_GT(store_->stats().spilled_records, 0);
    EXPECT_EQ(store_->stats().payload_bytes, (4 + 6) * routing_bytes_per_token(E, k, L));

    std::vector<int32_t> forced(static_cast<size_t>(L * 2 * T * k), -7);
    Status s = gather_routing(forced.data(), *store_, seqs, lengths, 2, T, L, k, E);
    ASSERT_TRUE(s.is_ok()) << s.message();
    for (int64_t m = 0; m < L; ++m)
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < k; ++j) {
            const int64_t i = (m * 2 * T + b * T + t) * k + j;
            ASSERT_EQ(forced[i], t < lengths[b] ? all[i] : static_cast<int32_t>(j)) << m << " " << b << " " << t;
          }
    // Without lengths, sequence 0's positions 4 and 5 are missing: not found, naming the key.
    Status miss = gather_routing(forced.data(), *store_, seqs, nullptr, 2, T, L, k, E);
    EXPECT_EQ(miss.code(), StatusCode::kNotFound);
    EXPECT_NE(miss.message().find("(sequence 11, position 4, layer 0, site 0)"), std::string::npos) << miss.message();
    // A trainer expecting another top_k is told so.
    Status other_k = gather_routing(forced.data(), *store_, seqs, lengths, 2, T, L, k - 1, E);
    EXPECT_FALSE(other_k.is_ok());
    EXPECT_NE(other_k.message().find("top_k"), std::string::npos);
    ASSERT_TRUE(store_->close().is_ok());
  }
}

// A real MoE model: a forward records its routing (RoutingIO::record), the records go through the
// store, and a forward replaying them (RoutingIO::forced from gather_routing) uses exactly those
// expert sets, while the model left to itself under different weights would route differently.
TEST_F(RoutingRecordTest, ModelReplaysRecordedRouting) {
  auto cfg = model::parse_model_config(nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 16, "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 11, "max_position_embeddings": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": true})"));
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  model::RecipeConfig rc;
  rc.name = "fp32";
  auto mr = model::TransformerT<float>::create(*cfg, rc);
  ASSERT_TRUE(mr.is_ok()) << mr.status().message();
  auto model = std::move(mr).value();
  model->init_weights(5);
  const int64_t B = 2, T = 6, k = 2, E = 8, Lm = model->num_moe_layers();
  ASSERT_EQ(Lm, 2);
  std::vector<int32_t> tokens(B * T);
  PhiloxStream rng(3, 3);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.next_below(11));
  std::vector<float> logits(static_cast<size_t>(B * T * 11));
  std::vector<int32_t> recorded(static_cast<size_t>(Lm * B * T * k));
  model->forward_logits(logits.data(), tokens.data(), B, T, {nullptr, recorded.data()});

  const uint64_t seqs[2] = {100, 200};
  std::vector<uint64_t> row_seq;
  std::vector<uint32_t> row_pos;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) row_seq.push_back(seqs[b]), row_pos.push_back(static_cast<uint32_t>(t));
  ASSERT_TRUE(append_routing(*store_, recorded.data(), Lm, B * T, k, E, row_seq.data(), row_pos.data()).is_ok());
  std::vector<int32_t> forced(recorded.size());
  ASSERT_TRUE(gather_routing(forced.data(), *store_, seqs, nullptr, B, T, Lm, k, E).is_ok());
  EXPECT_EQ(forced, recorded);

  // New weights: unforced routing changes, forced routing stays the recorded one.
  model->init_weights(6);
  std::vector<int32_t> free_route(recorded.size()), replay_route(recorded.size());
  model->forward_logits(logits.data(), tokens.data(), B, T, {nullptr, free_route.data()});
  EXPECT_NE(free_route, recorded);
  model->forward_logits(logits.data(), tokens.data(), B, T, {forced.data(), replay_route.data()});
  EXPECT_EQ(replay_route, recorded);
}

}  // namespace
}  // namespace nibble::rollout
