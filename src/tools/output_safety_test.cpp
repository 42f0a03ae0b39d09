// Tests that no command loses a user's files (issue 12, items 1-3, 12, 16), driving the built
// binary: `export` never writes into, over or around the checkpoint being read and replaces an
// existing path only when it is an earlier export of the same kind (or --force); `quantize`
// never overwrites an input (path, hard link, symlink, shard), replaces only its own earlier
// output, and refuses an already-quantized input; `generate --dump-logits` never writes into the
// checkpoint; stale temporaries are removed by the next write; the run lock refuses a second
// `pretrain`; a damaged metrics.jsonl does not block --resume; SIGINT/SIGTERM stop `pretrain`
// with a checkpoint and the resume command (exit 130/143) and interrupt `quantize` cleanly.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/interrupt.h"
#include "model/tiny_olmo2_test_util.h"
#include "tools/cli_test_util.h"
#include "tools/quantize_io.h"
#include "train/run_lock.h"

namespace nibble::tools::test {
namespace {

using nlohmann::json;

// The pid of a process that has exited (and was reaped): what a killed writer leaves in names.
long dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return static_cast<long>(pid);
}

std::string q(const std::string& s) { return "'" + s + "'"; }

// One short pretraining run shared by the tests that only read it.
class OutputSafetyCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new ScratchDir("output_safety");
    json cfg{{"model", model::test::tiny_olmo2_model_json(300)},
             {"recipe", "bf16"},
             {"batch_size", 4},
             {"seq_len", 32},
             {"steps", 2},
             {"schedule", {{"type", "cosine"}, {"warmup_steps", 1}}},
             {"eval", {{"interval", 0}, {"batches", 1}}},
             {"checkpoint", {{"interval", 0}, {"keep_last", 2}}},
             {"threads", 1}};
    std::ofstream(*root_ / "run.json") << cfg.dump(2);
    std::string text;
    for (int i = 0; i < 400; ++i)
      text += "And the " + std::to_string(i % 29) + " sheep went over the hill, and the shepherd followed.\n" +
              (i % 20 == 19 ? "\n" : "");
    std::ofstream(*root_ / "corpus.txt") << text;
    run_ = *root_ / "run";
    RunResult r = run_nibble(root_->path, pretrain_args(run_));
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    delete root_;
    root_ = nullptr;
  }
  void SetUp() override {
    dir_ = root_->path / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::create_directories(dir_);
  }
  static std::string pretrain_args(const std::string& out, const std::string& extra = "") {
    return "pretrain --config " + q(*root_ / "run.json") + " --data " + q(*root_ / "corpus.txt") + " --out " + q(out) +
           " --no-progress " + extra;
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // The run's files are all still there.
  static void expect_run_intact() {
    for (const char* f : {"metrics.jsonl", "checkpoints/latest", "checkpoints/step_000002/model.safetensors",
                          "checkpoints/step_000002/optimizer.safetensors", "data/train.bin"})
      EXPECT_TRUE(fs::exists(run_ + "/" + f)) << f;
  }

  static ScratchDir* root_;
  static std::string run_;
  fs::path dir_;
};
ScratchDir* OutputSafetyCli::root_ = nullptr;
std::string OutputSafetyCli::run_;

// ---- export ----------------------------------------------------------------------------------

TEST_F(OutputSafetyCli, ExportRefusesAnUnrelatedFolderUnlessForced) {
  const std::string out = path("mine");
  fs::create_directories(out);
  std::ofstream(out + "/notes.txt") << "my notes";
  RunResult r = run_nibble(dir_, "export --checkpoint " + q(run_) + " --to hf " + q(out));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(out + "/notes.txt"), "my notes");
  r = run_nibble(dir_, "export --checkpoint " + q(run_) + " --to hf " + q(out) + " --force");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(out + "/notes.txt"));
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
}

TEST_F(OutputSafetyCli, ExportRefusesARegularFile) {
  const std::string out = path("file.txt");
  std::ofstream(out) << "mine";
  for (const char* to : {"hf", "nvfp4"}) {
    RunResult r = run_nibble(dir_, "export --checkpoint " + q(run_) + " --to " + to + " " + q(out));
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(slurp(out), "mine");
  }
}

TEST_F(OutputSafetyCli, ExportNeverWritesIntoOrOverTheCheckpoint) {
  const std::string step = run_ + "/checkpoints/step_000002";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {run_, run_},                   // over the run being exported
      {run_, run_ + "/hf"},           // into it
      {run_, step},                   // over its checkpoint
      {step, run_},                   // a step folder given: its run folder is protected too
      {step, run_ + "/exports/hf"},
      {run_, root_->path.string()},   // around it (the run is inside OUT), even with --force
      {run_, run_ + "/./checkpoints/../"},
  };
  for (const auto& [ck, out] : cases) {
    for (const char* extra : {"", " --force"}) {
      RunResult r = run_nibble(dir_, "export --checkpoint " + q(ck) + " --to hf " + q(out) + extra);
      EXPECT_EQ(r.code, 2) << ck << " -> " << out << extra << "\n" << r.err;
      EXPECT_NE(r.err.find("checkpoint being read"), std::string::npos) << r.err;
      expect_run_intact();
    }
  }
  EXPECT_FALSE(fs::exists(run_ + "/hf"));
  EXPECT_FALSE(fs::exists(run_ + "/exports"));
}

TEST_F(OutputSafetyCli, ExportReplacesOnlyAnEarlierExportOfTheSameKind) {
  const std::string hf = path("hf");
  RunResult r = run_nibble(dir_, "export --checkpoint " + q(run_) + " --to hf " + q(hf));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_nibble(dir_, "export --checkpoint " + q(run_) + " --to hf " + q(hf) + " --dtype f32");
  EXPECT_EQ(r.code, 0) << r.err;  // an earlier hf export: replaced
  r = run_nibble(dir_, "export --checkpoint " + q(run_) + " --to nvfp4 " + q(hf));
  EXPECT_EQ(r.code, 2) << r.err;  // another kind: refused
  EXPECT_FALSE(fs::exists(hf + "/hf_quant_config.json"));
  fs::create_directories(path("empty"));
  r = run_nibble(dir_, "export --checkpoint " + q(run_) + " --to nvfp4 " + q(path("empty")));
  EXPECT_EQ(r.code, 0) << r.err;  // an empty folder holds nothing to lose
}

TEST_F(OutputSafetyCli, ExportRemovesStaleTemporaries) {
  const std::string out = path("hf");
  const std::string stale = out + ".tmp." + std::to_string(dead_pid());
  fs::create_directories(stale);
  std::ofstream(stale + "/model.safetensors") << "partial";
  RunResult r = run_nibble(dir_, "export --checkpoint " + q(run_) + " --to hf " + q(out));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(stale));
}

// ---- quantize --------------------------------------------------------------------------------

class QuantizeSafetyCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(io::write_safetensors(dir / "in.safetensors", test_checkpoint()).is_ok());
    in_bytes = slurp(dir / "in.safetensors");
    clear_interrupt();
  }
  void TearDown() override { clear_interrupt(); }
  RunResult quantize(const std::string& in, const std::string& out, const std::string& extra = "") {
    return run_nibble(dir.path, "quantize " + q(in) + " " + q(out) + " --format nvfp4" + extra);
  }
  ScratchDir dir{::testing::UnitTest::GetInstance()->current_test_info()->name()};
  std::string in_bytes;
};

TEST_F(QuantizeSafetyCli, NeverOverwritesAnInputFile) {
  const std::string in = dir / "in.safetensors";
  ASSERT_EQ(::link(in.c_str(), (dir / "hardlink.safetensors").c_str()), 0);
  fs::create_symlink(in, dir / "symlink.safetensors");
  for (const std::string& out : {in, dir / "hardlink.safetensors", dir / "symlink.safetensors",
                                 dir.path.string() + "/./in.safetensors"}) {
    for (const char* extra : {"", " --force"}) {
      RunResult r = quantize(in, out, extra);
      EXPECT_EQ(r.code, 2) << out << extra << "\n" << r.err;
      EXPECT_EQ(r.err_lines(), 1) << r.err;
      EXPECT_NE(r.err.find("is the input file"), std::string::npos) << r.err;
      EXPECT_EQ(slurp(in), in_bytes) << out;
    }
  }
  // A shard of a sharded input, and its index.
  ASSERT_TRUE(io::write_safetensors_sharded(dir / "sharded", test_checkpoint(), 20000).is_ok());
  for (const auto& e : fs::directory_iterator(dir.path / "sharded")) {
    const std::string before = slurp(e.path());
    RunResult r = quantize(dir / "sharded", e.path().string(), " --force");
    EXPECT_EQ(r.code, 2) << e.path() << "\n" << r.err;
    EXPECT_EQ(slurp(e.path()), before) << e.path();
  }
}

TEST_F(QuantizeSafetyCli, ReplacesOnlyItsOwnEarlierOutputUnlessForced) {
  const std::string out = dir / "out.safetensors";
  std::ofstream(out) << "my file";
  RunResult r = quantize(dir / "in.safetensors", out);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(out), "my file");
  r = quantize(dir / "in.safetensors", out, " --force");
  EXPECT_EQ(r.code, 0) << r.err;
  r = quantize(dir / "in.safetensors", out, " --rounding sr --seed 3");  // its own earlier output
  EXPECT_EQ(r.code, 0) << r.err;
  fs::create_directories(dir / "folder.safetensors");
  r = quantize(dir / "in.safetensors", dir / "folder.safetensors", " --force");
  EXPECT_EQ(r.code, 2) << r.err;
}

TEST_F(QuantizeSafetyCli, RefusesAForeignHfQuantConfig) {
  std::ofstream(dir / "hf_quant_config.json") << "{\"quantization\": {\"quant_algo\": \"FP8\"}}";
  RunResult r = quantize(dir / "in.safetensors", dir / "out.safetensors", " --layout modelopt");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("hf_quant_config.json"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(dir / "hf_quant_config.json"), "{\"quantization\": {\"quant_algo\": \"FP8\"}}");
  EXPECT_FALSE(fs::exists(dir / "out.safetensors"));
  r = quantize(dir / "in.safetensors", dir / "out.safetensors", " --layout modelopt --force");
  EXPECT_EQ(r.code, 0) << r.err;
  r = quantize(dir / "in.safetensors", dir / "out.safetensors", " --layout modelopt");  // now nibble's own
  EXPECT_EQ(r.code, 0) << r.err;
}

TEST_F(QuantizeSafetyCli, RefusesAnAlreadyQuantizedInput) {
  for (const char* layout : {"raw", "modelopt", "compressed-tensors"}) {
    const std::string qfile = dir / (std::string("q-") + layout + ".safetensors");
    ASSERT_EQ(quantize(dir / "in.safetensors", qfile, std::string(" --layout ") + layout).code, 0);
    RunResult r = quantize(qfile, dir / "qq.safetensors");
    EXPECT_EQ(r.code, 2) << layout << "\n" << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
    EXPECT_NE(r.err.find("already quantized"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir / "qq.safetensors"));
  }
  // Without nibble's metadata (another tool's ModelOpt file): recognised by names and dtypes.
  Tensor codes(DType::kU8, Shape{4, 8}), scale(DType::kF8E4M3, Shape{4, 1}), scale2(DType::kF32, Shape{});
  std::memset(codes.raw(), 0x11, codes.nbytes());
  std::memset(scale.raw(), 0x38, scale.nbytes());
  scale2.data<float>()[0] = 1.0f;
  ASSERT_TRUE(io::write_safetensors(dir / "modelopt.safetensors",
                                    {{"x.weight", codes}, {"x.weight_scale", scale}, {"x.weight_scale_2", scale2},
                                     {"norm.weight", gaussian(DType::kBF16, {32}, 9)}})
                  .is_ok());
  RunResult r = quantize(dir / "modelopt.safetensors", dir / "qq.safetensors");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("already quantized"), std::string::npos) << r.err;
}

TEST_F(QuantizeSafetyCli, RemovesStaleTemporariesOfKilledRuns) {
  const std::string out = dir / "out.safetensors";
  const std::string stale = out + ".tmp." + std::to_string(dead_pid()) + ".0";
  const std::string live = out + ".tmp." + std::to_string(::getpid()) + ".0";  // this test process: alive
  std::ofstream(stale) << "partial";
  std::ofstream(live) << "in progress";
  RunResult r = quantize(dir / "in.safetensors", out);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
}

TEST_F(QuantizeSafetyCli, AnInterruptLeavesNoOutputAndNoTemporary) {
  auto options = make_quantize_options("nvfp4", std::nullopt, std::nullopt, "rtn", std::nullopt, "raw", "");
  ASSERT_TRUE(options);
  install_interrupt_handlers();
  ::raise(SIGINT);
  auto report = quantize_checkpoint(dir / "in.safetensors", dir / "out.safetensors", *options);
  clear_interrupt();
  ASSERT_FALSE(report);
  EXPECT_NE(report.status().message().find("interrupted by SIGINT"), std::string::npos) << report.status().message();
  for (const auto& e : fs::directory_iterator(dir.path))
    EXPECT_EQ(e.path().filename().string().rfind("out.safetensors", 0), std::string::npos) << e.path();
}

// ---- generate --------------------------------------------------------------------------------

TEST_F(OutputSafetyCli, DumpLogitsNeverWritesIntoTheCheckpointNorOverOtherFiles) {
  const std::string model = run_ + "/checkpoints/step_000002/model.safetensors";
  const std::string before = slurp(model);
  const std::string gen = "generate --checkpoint " + q(run_) + " --prompt 'And the' --max-new-tokens 1 --dump-logits ";
  RunResult r = run_nibble(dir_, gen + q(model));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(slurp(model), before);
  r = run_nibble(dir_, gen + q(run_ + "/logits.safetensors"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(fs::exists(run_ + "/logits.safetensors"));
  std::ofstream(path("mine.safetensors")) << "mine";
  r = run_nibble(dir_, gen + q(path("mine.safetensors")));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(slurp(path("mine.safetensors")), "mine");
  r = run_nibble(dir_, gen + q(path("logits.safetensors")));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_nibble(dir_, gen + q(path("logits.safetensors")));  // an earlier dump: replaced
  EXPECT_EQ(r.code, 0) << r.err;
}

// ---- pretrain: lock, damaged metrics, signals ---------------------------------------------------

TEST_F(OutputSafetyCli, ASecondPretrainOnALockedRunFolderIsRefused) {
  const std::string run = path("run");
  fs::create_directories(run);
  auto lock = train::RunLock::acquire(run);  // as a running `nibble pretrain --out run` holds it
  ASSERT_TRUE(lock) << lock.status().message();
  RunResult r = run_nibble(dir_, pretrain_args(run));
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("is in use by another nibble process (pid " + std::to_string(::getpid())), std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(run + "/metrics.jsonl"));
  lock->release();
  r = run_nibble(dir_, pretrain_args(run));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(run + "/nibble.lock"));
}

TEST_F(OutputSafetyCli, ResumeWithADamagedMetricsFileWarnsAndContinues) {
  const std::string run = path("run");
  ASSERT_EQ(run_nibble(dir_, pretrain_args(run, "--set steps=4 --stop-after 2")).code, 0);
  // What two writers of one file leave: NUL bytes, a torn line in the middle.
  std::string metrics = slurp(run + "/metrics.jsonl");
  const size_t second_line = metrics.find('\n') + 1;
  metrics.insert(second_line, std::string(16, '\0') + "{\"step\": 1, \"lo\n");
  std::ofstream(run + "/metrics.jsonl", std::ios::binary) << metrics;
  RunResult r = run_nibble(dir_, "pretrain --out " + q(run) + " --resume --no-progress");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step 4/4"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("damaged line"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(run + "/metrics.jsonl").find('\0'), std::string::npos);
}

// Starts `nibble pretrain` in the background; its stdout/stderr go to files in `dir`.
pid_t spawn_nibble(const fs::path& dir, const std::vector<std::string>& args) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int out = ::open((dir / "stdout.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open((dir / "stderr.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(err, 2);
    std::vector<char*> argv;
    const std::string bin = nibble_binary();
    argv.push_back(const_cast<char*>(bin.c_str()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// Waits at most `seconds` for `pid`; kills it (and fails) past that. Returns the wait status.
int wait_bounded(pid_t pid, int seconds) {
  int status = 0;
  for (int i = 0; i < seconds * 20; ++i) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  ADD_FAILURE() << "nibble did not exit within " << seconds << " s";
  return status;
}

TEST_F(OutputSafetyCli, SignalsStopPretrainAtASafePointWithTheResumeCommand) {
  for (int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(signal_name(sig));
    const fs::path d = dir_ / signal_name(sig);
    fs::create_directories(d);
    const std::string run = (d / "run").string();
    pid_t pid = spawn_nibble(d, {"pretrain", "--config", *root_ / "run.json", "--data", *root_ / "corpus.txt", "--out",
                                 run, "--no-progress", "--set", "steps=100000"});
    ASSERT_GT(pid, 0);
    // Wait (bounded) until it has trained a step, then signal it.
    bool training = false;
    for (int i = 0; i < 1200 && !training; ++i) {
      training = slurp(run + "/metrics.jsonl").find("\"loss\"") != std::string::npos;
      if (!training) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(training) << slurp(d / "stderr.txt");
    ASSERT_EQ(::kill(pid, sig), 0);
    const int status = wait_bounded(pid, 120);
    const std::string err = slurp(d / "stderr.txt");
    ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << "\n" << err;
    EXPECT_EQ(WEXITSTATUS(status), 128 + sig) << err;
    EXPECT_NE(err.find("interrupted by " + signal_name(sig) + " after step "), std::string::npos) << err;
    EXPECT_NE(err.find("resume with: nibble pretrain --out '" + run + "' --resume"), std::string::npos) << err;
    EXPECT_TRUE(fs::exists(run + "/checkpoints/latest"));
    EXPECT_FALSE(fs::exists(run + "/nibble.lock"));
    for (const std::string& folder : {run, run + "/checkpoints"})
      for (const auto& e : fs::directory_iterator(folder))
        EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace nibble::tools::test
