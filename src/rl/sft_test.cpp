// Tests of the SFT warm start (sft.h): rows mask everything but the answer tokens (solution +
// eos) and pad the rest; the splits are disjoint and cycle the levels; a tiny MoE learns on the
// pretraining trainer (the loss falls, held-out greedy accuracy is logged at each validation and
// at the end, the checkpoint loads like a pretraining one); an interrupted and resumed run equals
// the uninterrupted one bit for bit; misuse (no task, an unknown task, a task in pretraining, a
// level the task lacks, a too-short seq_len) is one clear error.
#include "rl/sft.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "train/checkpoint.h"
#include "train/metrics.h"

namespace nibble::rl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const Task& arithmetic() {
  static const auto task = std::move(make_task("arithmetic")).value();
  return *task;
}

const train::Tokenizer& arithmetic_tokenizer() {
  static const train::Tokenizer tok = [] {
    train::TokenizerTrainOptions o;
    o.vocab_size = 320;
    o.hard_vocab_limit = false;
    return std::move(train::Tokenizer::train(task_tokenizer_texts(arithmetic(), 1), o)).value();
  }();
  return tok;
}

TEST(SftRows, OnlyAnswerTokensHaveTargets) {
  const train::Tokenizer& tok = arithmetic_tokenizer();
  std::vector<TaskInstance> insts;
  for (int64_t i = 0; i < 20; ++i) insts.push_back(arithmetic().make(3, 1, i));
  auto rows = sft_rows(tok, insts, 24);
  ASSERT_TRUE(rows.is_ok()) << rows.status().message();
  ASSERT_EQ(rows->count, 20);
  for (int64_t r = 0; r < 20; ++r) {
    auto prompt = tok.encode(insts[r].prompt);
    auto answer = tok.encode(insts[r].solution);
    ASSERT_TRUE(prompt.is_ok() && answer.is_ok());
    const int64_t P = static_cast<int64_t>(prompt->size()), A = static_cast<int64_t>(answer->size());
    const int32_t* tokens = rows->tokens.data() + r * 24;
    const int32_t* targets = rows->targets.data() + r * 24;
    std::vector<int32_t> answer_targets;
    for (int64_t t = 0; t < 24; ++t) {
      if (t < P) EXPECT_EQ(tokens[t], (*prompt)[t]);
      else if (t < P + A) EXPECT_EQ(tokens[t], (*answer)[t - P]);
      else EXPECT_EQ(tokens[t], tok.pad_id()) << "padding (the final eos is only a target)";
      if (t < P - 1 || t >= P + A) EXPECT_EQ(targets[t], -1) << "row " << r << " position " << t;
      else answer_targets.push_back(targets[t]);
    }
    std::vector<int32_t> want = *answer;
    want.push_back(tok.eos_id());
    EXPECT_EQ(answer_targets, want) << insts[r].prompt << insts[r].solution;
  }
  auto decoded = tok.decode(std::vector<int32_t>(rows->tokens.begin(), rows->tokens.begin() + 24));
  ASSERT_TRUE(decoded.is_ok());
  EXPECT_TRUE(decoded->starts_with(insts[0].prompt + insts[0].solution));

  auto too_short = sft_rows(tok, insts, 8);
  ASSERT_FALSE(too_short.is_ok());
  EXPECT_EQ(too_short.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_short.status().message().find("'seq_len'"), std::string::npos) << too_short.status().message();
}

TEST(SftInstances, SplitsAreDisjointAndCycleTheLevels) {
  train::TaskDataConfig c;
  c.levels = {0, 2};
  c.seed = 5;
  c.train_examples = 9;
  c.val_examples = 5;
  c.accuracy_examples = 4;
  std::set<std::pair<int, int64_t>> seen;
  for (SftSplit split : {SftSplit::kTrain, SftSplit::kValidation, SftSplit::kAccuracy}) {
    auto insts = sft_instances(arithmetic(), c, split);
    ASSERT_TRUE(insts.is_ok());
    const size_t want = split == SftSplit::kTrain ? 9 : split == SftSplit::kValidation ? 5 : 4;
    ASSERT_EQ(insts->size(), want);
    for (size_t k = 0; k < insts->size(); ++k) {
      const TaskInstance& inst = (*insts)[k];
      EXPECT_EQ(inst.level, k % 2 == 0 ? 0 : 2);
      EXPECT_EQ(inst.seed, 5u);
      EXPECT_TRUE(seen.insert({inst.level, inst.index}).second) << "instance used twice: " << inst.index;
    }
  }
  c.levels = {0, 99};
  auto bad = sft_instances(arithmetic(), c, SftSplit::kTrain);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message(), "task.levels: arithmetic has levels 0..5, not 99");
}

class SftRun : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = (fs::temp_directory_path() / ("nibble_sft_test_" + std::to_string(::getpid()))).string();
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  // configs/tiny-moe.json made smaller (2 layers, hidden 64, 4 experts, vocab 320) on arithmetic
  // level 0: seconds on one thread.
  static train::RunConfig config(int64_t steps, std::vector<std::string> sets = {}) {
    std::vector<std::string> all = {"model.hidden_size=64", "model.num_hidden_layers=2", "model.head_dim=16",
                                    "model.moe_intermediate_size=64", "model.num_experts=4",
                                    "model.vocab_size=320", "model.max_position_embeddings=32"};
    all.insert(all.end(), sets.begin(), sets.end());
    json j{{"model", "configs/tiny-moe.json"},
           {"seed", 3},
           {"batch_size", 16},
           {"seq_len", 8},
           {"steps", steps},
           {"optimizer", {{"lr", 1e-2}, {"weight_decay", 0.0}}},
           {"schedule", {{"type", "cosine"}, {"warmup_steps", 2}, {"final_lr_fraction", 0.1}}},
           {"eval", {{"interval", 10}, {"batches", 2}}},
           {"checkpoint", {{"interval", 0}, {"keep_last", 2}}},
           {"threads", 1},
           {"task", {{"name", "arithmetic"}, {"levels", {0}}, {"train_examples", 256}, {"val_examples", 32},
                     {"accuracy_examples", 8}, {"max_new_tokens", 4}}}};
    auto c = train::resolve_run_config(j, all);
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    return *c;
  }
  train::TrainOptions options(const std::string& name) const {
    train::TrainOptions o;
    o.run_dir = root_ + "/" + name;
    o.progress = false;
    return o;
  }
  std::string root_;
};

TEST_F(SftRun, LossFallsAndAccuracyIsLogged) {
  auto r = run_sft(config(30), options("a"));
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(r->losses.size(), 30u);
  double first = r->losses[0], last = (r->losses[27] + r->losses[28] + r->losses[29]) / 3;
  EXPECT_LT(last, first * 0.5) << "first " << first << " last " << last;
  auto metrics = train::read_metrics(root_ + "/a/metrics.jsonl");
  ASSERT_TRUE(metrics.is_ok());
  int validations = 0;
  for (const json& e : *metrics) {
    if (!e.contains("val_loss")) continue;
    ++validations;
    ASSERT_TRUE(e.contains("accuracy")) << e.dump();
    EXPECT_EQ(e["accuracy_total"], 8);
    EXPECT_GE(e["accuracy"].get<double>(), 0.0);
    EXPECT_LE(e["accuracy"].get<double>(), 1.0);
    EXPECT_EQ(e["accuracy"].get<double>(), e["accuracy_correct"].get<double>() / 8);
  }
  EXPECT_EQ(validations, 4) << "steps 10, 20, 30 and the end event";
  ASSERT_TRUE(r->validation_extra.contains("accuracy"));
  // The checkpoint is a pretraining one: it opens and loads as `nibble generate/eval` do, with
  // the task tokenizer beside it.
  auto ck = train::open_checkpoint(root_ + "/a");
  ASSERT_TRUE(ck.is_ok()) << ck.status().message();
  EXPECT_EQ(ck->step, 30);
  EXPECT_EQ(ck->run_config["task"]["name"], "arithmetic");
  auto model = train::load_checkpoint_model(*ck);
  ASSERT_TRUE(model.is_ok()) << model.status().message();
  auto tok = train::Tokenizer::load(ck->tokenizer_path);
  ASSERT_TRUE(tok.is_ok());
  auto held_out = sft_instances(arithmetic(), config(30).task, SftSplit::kAccuracy);
  ASSERT_TRUE(held_out.is_ok());
  auto acc = greedy_accuracy(**model, *tok, arithmetic(), *held_out, 4);
  ASSERT_TRUE(acc.is_ok()) << acc.status().message();
  EXPECT_EQ(acc->accuracy, r->validation_extra["accuracy"].get<double>()) << "the same greedy answers";
}

TEST_F(SftRun, ResumeIsBitIdentical) {
  auto full = run_sft(config(12), options("full"));
  ASSERT_TRUE(full.is_ok()) << full.status().message();
  train::TrainOptions o = options("split");
  o.stop_after_step = 5;
  auto first = run_sft(config(12), o);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  auto resumed_config = train::resume_run_config(o.run_dir, {});
  ASSERT_TRUE(resumed_config.is_ok()) << resumed_config.status().message();
  o.stop_after_step = -1;
  o.resume = true;
  auto second = run_sft(*resumed_config, o);
  ASSERT_TRUE(second.is_ok()) << second.status().message();
  ASSERT_EQ(first->losses.size() + second->losses.size(), 12u);
  for (size_t i = 0; i < 12; ++i) {
    double split = i < 5 ? first->losses[i] : second->losses[i - 5];
    EXPECT_EQ(std::memcmp(&full->losses[i], &split, sizeof(double)), 0) << "step " << i;
  }
  EXPECT_EQ(std::memcmp(&full->val_loss, &second->val_loss, sizeof(double)), 0);
  EXPECT_EQ(full->validation_extra, second->validation_extra);
}

TEST_F(SftRun, MisuseIsOneClearError) {
  auto no_task = run_sft(config(4, {"task.name=\"\""}), options("x"));
  ASSERT_FALSE(no_task.is_ok());
  EXPECT_EQ(no_task.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_task.status().message().find("'task.name' is empty"), std::string::npos) << no_task.status().message();
  auto unknown = run_sft(config(4, {"task.name=chess"}), options("x"));
  ASSERT_FALSE(unknown.is_ok());
  EXPECT_NE(unknown.status().message().find("unknown task 'chess'"), std::string::npos);
  auto level = run_sft(config(4, {"task.levels=[7]"}), options("x"));
  ASSERT_FALSE(level.is_ok());
  EXPECT_NE(level.status().message().find("not 7"), std::string::npos) << level.status().message();
  auto short_rows = run_sft(config(4, {"seq_len=3"}), options("x"));
  ASSERT_FALSE(short_rows.is_ok());
  EXPECT_NE(short_rows.status().message().find("'seq_len'"), std::string::npos) << short_rows.status().message();
  auto pretrain = train::run_pretraining(config(4), options("x"));
  ASSERT_FALSE(pretrain.is_ok());
  EXPECT_NE(pretrain.status().message().find("is for nibble sft"), std::string::npos) << pretrain.status().message();
  EXPECT_FALSE(fs::exists(root_ + "/x")) << "nothing trained, nothing left behind";
}

}  // namespace
}  // namespace nibble::rl
