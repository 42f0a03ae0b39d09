// Tests that a run folder and a data folder are never damaged by a user's everyday mistakes or by
// interruptions: the run lock (a second writer is refused with one clear error, released on
// exit), a damaged metrics.jsonl never blocks a resume, a data folder holding foreign files is
// never replaced, the temporaries of killed writes are removed by the next write, SIGINT stops
// pretraining at a safe point with a checkpoint to resume from (and an export before its rename,
// leaving no temporary), and a failed run leaves no empty folder it created. Each case failed (or lost data) before the hardening of issue 12.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/interrupt.h"
#include "model/tiny_olmo2_test_util.h"
#include "train/atomic_dir.h"
#include "train/checkpoint.h"
#include "train/dataset.h"
#include "train/export.h"
#include "train/metrics.h"
#include "train/run_config.h"
#include "train/run_lock.h"
#include "train/trainer.h"

namespace nibble::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The pid of a process that has exited (and was reaped): what a killed writer leaves in names.
long dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return static_cast<long>(pid);
}

class RunSafetyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("nibble_run_safety_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::string text;
    for (int i = 0; i < 400; ++i)
      text += "And the " + std::to_string(i % 29) + " sheep went over the hill, and the shepherd followed.\n" +
              (i % 20 == 19 ? "\n" : "");
    corpus_ = (root_ / "corpus.txt").string();
    std::ofstream(corpus_) << text;
    clear_interrupt();
  }
  void TearDown() override {
    clear_interrupt();
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  RunConfig config(int64_t steps, const std::string& data_dir) const {
    json j{{"model", model::test::tiny_olmo2_model_json(300)},
           {"recipe", "bf16"},
           {"batch_size", 4},
           {"seq_len", 32},
           {"steps", steps},
           {"schedule", {{"type", "cosine"}, {"warmup_steps", 1}}},
           {"eval", {{"interval", 0}, {"batches", 1}}},
           {"checkpoint", {{"interval", 0}, {"keep_last", 2}}},
           {"data", {{"files", {corpus_}}, {"dir", data_dir}}},
           {"threads", 1}};
    auto c = resolve_run_config(j, {});
    EXPECT_TRUE(c) << c.status().message();
    return *c;
  }
  TrainOptions options(const std::string& name) const {
    TrainOptions o;
    o.run_dir = (root_ / name).string();
    o.progress = false;
    return o;
  }
  DatasetOptions data_options() const {
    DatasetOptions o;
    o.text_files = {corpus_};
    o.vocab_size = 300;
    return o;
  }
  fs::path root_;
  std::string corpus_;
};

TEST_F(RunSafetyTest, RunLockRefusesASecondHolderAndIsReleased) {
  const std::string run = (root_ / "run").string();
  fs::create_directories(run);
  auto first = RunLock::acquire(run);
  ASSERT_TRUE(first) << first.status().message();
  EXPECT_TRUE(fs::exists(run + "/nibble.lock"));
  auto second = RunLock::acquire(run);  // another open file description: flock conflicts
  ASSERT_FALSE(second);
  EXPECT_NE(second.status().message().find("in use by another nibble process (pid " + std::to_string(::getpid())),
            std::string::npos)
      << second.status().message();
  first->release();
  EXPECT_FALSE(fs::exists(run + "/nibble.lock"));
  auto third = RunLock::acquire(run);
  EXPECT_TRUE(third) << third.status().message();
}

TEST_F(RunSafetyTest, PretrainRefusesALockedRunFolderAndWritesNothing) {
  TrainOptions o = options("locked");
  fs::create_directories(o.run_dir);
  auto lock = RunLock::acquire(o.run_dir);
  ASSERT_TRUE(lock);
  auto r = run_pretraining(config(2, o.run_dir + "/data"), o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("is in use by another nibble process"), std::string::npos)
      << r.status().message();
  EXPECT_FALSE(fs::exists(o.run_dir + "/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(o.run_dir + "/data"));
}

TEST_F(RunSafetyTest, DamagedMetricsNeverBlockAResume) {
  const std::string path = (root_ / "metrics.jsonl").string();
  std::string text = "{\"event\":\"start\",\"step\":0}\n{\"step\":1,\"loss\":5.0}\n";
  text += std::string(6, '\0') + "{\"step\":2,\"loss\":4.5}\n";   // NULs a second writer left
  text += "{\"step\":3,\"lo\n";                                   // a torn line in the middle
  text += "{\"step\":4,\"loss\":4.0}\n{\"step\":5,\"loss\":3.9}\n{\"step\":6,\"lo";  // and a torn last one
  std::ofstream(path, std::ios::binary) << text;
  Status s = drop_metrics_after_step(path, 4);
  ASSERT_TRUE(s) << s.message();
  auto events = read_metrics(path);  // strict again: the rewritten file is clean
  ASSERT_TRUE(events) << events.status().message();
  std::vector<int64_t> steps;
  for (const auto& e : *events) steps.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 1, 2, 4}));
  EXPECT_EQ(slurp(path).find('\0'), std::string::npos);
}

TEST_F(RunSafetyTest, DataFolderWithForeignFilesIsNeverReplaced) {
  const fs::path dir = root_ / "mydata";
  fs::create_directories(dir);
  std::ofstream(dir / "notes.txt") << "mine";
  auto d = prepare_dataset(dir.string(), data_options());
  ASSERT_FALSE(d);
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("holds files nibble did not write"), std::string::npos) << d.status().message();
  EXPECT_EQ(slurp(dir / "notes.txt"), "mine");
  // A regular file at the path is refused too, and kept.
  std::ofstream(root_ / "afile") << "mine";
  EXPECT_FALSE(prepare_dataset((root_ / "afile").string(), data_options()));
  EXPECT_EQ(slurp(root_ / "afile"), "mine");
}

TEST_F(RunSafetyTest, StaleDataTemporariesAreRemovedByTheNextPreparation) {
  const fs::path dir = root_ / "data";
  ASSERT_TRUE(prepare_dataset(dir.string(), data_options()));
  const long dead = dead_pid();
  const fs::path stale_tmp = root_ / ("data.tmp." + std::to_string(dead));
  const fs::path stale_old = root_ / ("data.old." + std::to_string(dead));
  const fs::path live_tmp = root_ / ("data.tmp." + std::to_string(::getppid()));  // a live process: kept
  for (const fs::path& p : {stale_tmp, stale_old, live_tmp}) {
    fs::create_directories(p);
    std::ofstream(p / "train.bin") << "partial";
  }
  auto again = prepare_dataset(dir.string(), data_options());  // reused, and still cleans
  ASSERT_TRUE(again) << again.status().message();
  EXPECT_TRUE(again->reused);
  EXPECT_FALSE(fs::exists(stale_tmp));
  EXPECT_FALSE(fs::exists(stale_old));
  EXPECT_TRUE(fs::exists(live_tmp));
}

TEST_F(RunSafetyTest, InterruptedDataPreparationLeavesNothing) {
  install_interrupt_handlers();
  ::raise(SIGINT);
  ASSERT_EQ(interrupt_signal(), SIGINT);
  const fs::path dir = root_ / "data";
  auto d = prepare_dataset(dir.string(), data_options());
  clear_interrupt();
  ASSERT_FALSE(d);
  EXPECT_NE(d.status().message().find("interrupted by SIGINT"), std::string::npos) << d.status().message();
  for (const auto& e : fs::directory_iterator(root_))
    EXPECT_EQ(e.path().filename().string().rfind("data", 0), std::string::npos) << e.path();
}

TEST_F(RunSafetyTest, SigintStopsPretrainingWithACheckpointToResumeFrom) {
  TrainOptions o = options("interrupted");
  const RunConfig c = config(6, o.run_dir + "/data");
  install_interrupt_handlers();
  o.grad_hook = [](int64_t step, float*, int64_t) {
    if (step == 1) ::raise(SIGINT);  // during step 2: it finishes, then the run stops
  };
  auto r = run_pretraining(c, o);
  clear_interrupt();
  ASSERT_FALSE(r);
  const std::string msg = r.status().message();
  EXPECT_NE(msg.find("interrupted by SIGINT after step 2/6"), std::string::npos) << msg;
  EXPECT_NE(msg.find("step_000002"), std::string::npos) << msg;
  auto ck = open_checkpoint(o.run_dir);
  ASSERT_TRUE(ck) << ck.status().message();
  EXPECT_EQ(ck->step, 2);
  EXPECT_FALSE(fs::exists(o.run_dir + "/nibble.lock"));
  o.grad_hook = nullptr;
  o.resume = true;
  auto rc = resume_run_config(o.run_dir, {});
  ASSERT_TRUE(rc);
  auto done = run_pretraining(*rc, o);
  ASSERT_TRUE(done) << done.status().message();
  EXPECT_EQ(done->start_step, 2);
  EXPECT_EQ(done->end_step, 6);
}

TEST_F(RunSafetyTest, AnInterruptedExportLeavesNoFolderAndNoTemporary) {
  TrainOptions o = options("run");
  ASSERT_TRUE(run_pretraining(config(2, o.run_dir + "/data"), o));
  auto ck = open_checkpoint(o.run_dir);
  ASSERT_TRUE(ck) << ck.status().message();
  install_interrupt_handlers();
  ::raise(SIGINT);
  Status hf = export_hf(*ck, (root_ / "hf").string(), DType::kBF16);
  Status nv = export_nvfp4(*ck, (root_ / "nvfp4").string());
  clear_interrupt();
  for (const Status& s : {hf, nv}) {
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("interrupted by SIGINT"), std::string::npos) << s.message();
  }
  for (const auto& e : fs::directory_iterator(root_)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name.rfind("hf", 0) != 0 && name.rfind("nvfp4", 0) != 0) << name;
  }
}

TEST_F(RunSafetyTest, StaleCheckpointTemporariesAreRemovedUnderTheLock) {
  TrainOptions o = options("stale");
  o.stop_after_step = 1;
  const RunConfig c = config(3, o.run_dir + "/data");
  ASSERT_TRUE(run_pretraining(c, o));
  // What writers killed mid-write leave (any pid: under the run lock no one else writes here).
  const std::string ckpts = o.run_dir + "/checkpoints";
  std::ofstream(ckpts + "/latest.tmp.4242") << "step_000009\n";
  fs::create_directories(ckpts + "/step_000002.tmp.4243");
  std::ofstream(o.run_dir + "/metrics.jsonl.tmp.4244") << "{}";
  std::ofstream(o.run_dir + "/loss.png.tmp.4245") << "png";
  o.resume = true;
  o.stop_after_step = -1;
  auto r = run_pretraining(*resume_run_config(o.run_dir, {}), o);
  ASSERT_TRUE(r) << r.status().message();
  for (const auto& folder : {o.run_dir, ckpts})
    for (const auto& e : fs::directory_iterator(folder))
      EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

TEST_F(RunSafetyTest, FreshRunRefusesForeignFilesItWouldReplace) {
  TrainOptions o = options("foreign");
  fs::create_directories(o.run_dir);
  std::ofstream(o.run_dir + "/metrics.jsonl") << "my own notes\n";
  auto r = run_pretraining(config(2, o.run_dir + "/data"), o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("metrics.jsonl that nibble did not write"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(slurp(o.run_dir + "/metrics.jsonl"), "my own notes\n");
  // A checkpoints/ folder of other files would be pruned: refused too.
  fs::remove(o.run_dir + "/metrics.jsonl");
  fs::create_directories(o.run_dir + "/checkpoints");
  std::ofstream(o.run_dir + "/checkpoints/best.pt") << "weights";
  r = run_pretraining(config(2, o.run_dir + "/data"), o);
  ASSERT_FALSE(r);
  EXPECT_EQ(slurp(o.run_dir + "/checkpoints/best.pt"), "weights");
}

TEST_F(RunSafetyTest, FailedRunRemovesOnlyTheEmptyFoldersItCreated) {
  TrainOptions o = options("new/nested/run");
  RunConfig c = config(2, o.run_dir + "/data");
  c.data_files = {(root_ / "missing.txt").string()};
  auto r = run_pretraining(c, o);
  ASSERT_FALSE(r);
  EXPECT_FALSE(fs::exists(root_ / "new")) << "the folders this run created are removed";
  // An --out that existed before is kept, even when empty.
  TrainOptions kept = options("existing");
  fs::create_directories(kept.run_dir);
  r = run_pretraining(c, kept);
  ASSERT_FALSE(r);
  EXPECT_TRUE(fs::is_directory(kept.run_dir));
}

}  // namespace
}  // namespace nibble::train
