// Everyday mistakes a user makes with `nibble`, driven through the built binary (issue 12, items
// 4-10): a FIFO, device or directory given where a file is read (every command refuses it at
// once instead of hanging; each run is bounded by a deadline), numeric options out of range
// (exit 2, one line naming the option), generate's cap to the model's context and its
// token-by-token output, a resume with nothing to do, and checkpoints that every command loads
// the same way (wrong tensor shapes refused by export too; no optimizer state needed but to resume);
// generate on the rollout engine: --prompts to JSON lines, its output guard and option checks;
// generate and serve in the bf16 / w4a16 / w4a4 modes on a model of inference storage: the
// training model's tokens, and bad checkpoints refused alike.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <regex>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "model/tiny_olmo2_test_util.h"
#include "rollout/checkpoint_weights.h"
#include "rollout/engine.h"
#include "tools/cli_test_util.h"
#include "train/checkpoint.h"
#include "train/tokenizer.h"

namespace nibble::tools::test {
namespace {

using nlohmann::json;

// A run of `nibble` in a child process with a deadline: stdout is collected read by read (to see
// whether output arrives while the command runs), the child is killed at the deadline.
struct BoundedRun {
  int code = -1;           // exit status; -1 if killed or signalled
  bool timed_out = false;
  std::vector<std::string> out_reads;  // stdout, one entry per read() that returned data
  std::string err;
  std::string out() const {
    std::string s;
    for (const auto& r : out_reads) s += r;
    return s;
  }
  int err_lines() const { return static_cast<int>(std::count(err.begin(), err.end(), '\n')); }
};

BoundedRun run_bounded(const std::vector<std::string>& args, double seconds) {
  BoundedRun r;
  int out_pipe[2], err_pipe[2];
  if (::pipe(out_pipe) != 0 || ::pipe(err_pipe) != 0) {
    ADD_FAILURE() << "pipe failed";
    return r;
  }
  const std::string bin = nibble_binary();
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(bin.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    if (::poll(fds, 2, static_cast<int>(left.count())) < 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP))) continue;
      ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      } else if (i == 0) {
        r.out_reads.emplace_back(buf, static_cast<size_t>(n));
      } else {
        r.err.append(buf, static_cast<size_t>(n));
      }
    }
  }
  for (auto& f : fds)
    if (f.fd >= 0) ::close(f.fd);
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.code = !r.timed_out && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// One trained tiny run shared by the tests (128 positions, 4 steps, finished), a text file and a
// FIFO (which nothing ever writes to: a command that opens it for reading blocks forever).
class MisuseCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new ScratchDir("misuse");
    json model = model::test::tiny_olmo2_model_json(300);
    model["max_position_embeddings"] = 128;
    json cfg{{"model", model},
             {"recipe", "bf16"},
             {"batch_size", 4},
             {"seq_len", 32},
             {"steps", 4},
             {"optimizer", {{"lr", 1e-2}}},
             {"schedule", {{"type", "cosine"}, {"warmup_steps", 1}}},
             {"eval", {{"interval", 0}, {"batches", 2}}},
             {"checkpoint", {{"interval", 2}, {"keep_last", 2}}},
             {"threads", 1}};
    std::ofstream(*scratch_ / "run.json") << cfg.dump(2);
    std::string text;
    for (int i = 0; i < 600; ++i)
      text += "And the " + std::to_string(i % 37) + " sheep went over the hill, and the shepherd followed them.\n";
    std::ofstream(*scratch_ / "corpus.txt") << text;
    ASSERT_EQ(::mkfifo((*scratch_ / "fifo").c_str(), 0600), 0);
    RunResult r = run_nibble(scratch_->path, "pretrain --config '" + *scratch_ / "run.json" + "' --data '" +
                                                 *scratch_ / "corpus.txt" + "' --out '" + *scratch_ / "run" +
                                                 "' --no-progress");
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() {
    delete scratch_;
    scratch_ = nullptr;
  }
  static std::string at(const std::string& f) { return *scratch_ / f; }
  static std::string run_dir() { return at("run"); }
  static std::string fifo() { return at("fifo"); }
  // A copy of the run's last step folder, for tests that damage it.
  static std::string copy_checkpoint(const std::string& name) {
    const std::string dst = at(name);
    fs::remove_all(dst);
    fs::copy(run_dir() + "/checkpoints/step_000004", dst, fs::copy_options::recursive);
    return dst;
  }
  static ScratchDir* scratch_;
};
ScratchDir* MisuseCli::scratch_ = nullptr;

// ---- item 4: FIFOs, devices and directories where a file is read ---------------------------

void expect_refused_in_time(const std::vector<std::string>& args, const std::string& kind) {
  SCOPED_TRACE(::testing::PrintToString(args));
  BoundedRun r = run_bounded(args, 60);
  ASSERT_FALSE(r.timed_out) << "the command hung on a " << kind;
  EXPECT_EQ(r.code, 1) << r.err;
  // One error line, the last; before it only log lines (pretrain's "[nibble] info: ..." line).
  ASSERT_FALSE(r.err.empty());
  const std::string last = r.err.substr(r.err.rfind('\n', r.err.size() - 2) + 1);
  EXPECT_EQ(last.rfind("nibble " + args[0] + ": ", 0), 0u) << r.err;
  EXPECT_NE(last.find("is a " + kind + ", not a regular file"), std::string::npos) << r.err;
  std::istringstream lines(r.err.substr(0, r.err.size() - last.size()));
  for (std::string line; std::getline(lines, line);) EXPECT_EQ(line.rfind("[nibble] ", 0), 0u) << r.err;
}

TEST_F(MisuseCli, FifoInputIsRefusedByEveryCommand) {
  const std::string f = fifo(), out = at("never_written");
  std::vector<io::NamedTensor> t = test_checkpoint();
  ASSERT_TRUE(io::write_safetensors(at("in.safetensors"), t).is_ok());
  const std::string kind = "named pipe (FIFO)";
  expect_refused_in_time({"inspect", f}, kind);
  expect_refused_in_time({"inspect", at("in.safetensors"), "--against", f}, kind);
  expect_refused_in_time({"quantize", f, out, "--format", "nvfp4"}, kind);
  expect_refused_in_time({"eval", "--checkpoint", run_dir(), "--data", f}, kind);
  expect_refused_in_time({"pretrain", "--config", f, "--out", at("r_cfg")}, kind);
  expect_refused_in_time({"pretrain", "--config", at("run.json"), "--data", f, "--out", at("r_data"), "--no-progress"},
                         kind);
  expect_refused_in_time({"pretrain", "--config", at("run.json"), "--data", at("corpus.txt"), "--set",
                          "data.tokenizer=" + f, "--out", at("r_tok"), "--no-progress"},
                         kind);
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(MisuseCli, FifoInsideACheckpointIsRefused) {
  // A checkpoint whose tokenizer.model is a FIFO: eval, generate and export read it.
  const std::string ck = copy_checkpoint("ck_fifo");
  fs::remove(ck + "/tokenizer.model");
  ASSERT_EQ(::mkfifo((ck + "/tokenizer.model").c_str(), 0600), 0);
  const std::string kind = "named pipe (FIFO)";
  expect_refused_in_time({"generate", "--checkpoint", ck, "--prompt", "And"}, kind);
  expect_refused_in_time({"eval", "--checkpoint", ck, "--data", at("corpus.txt")}, kind);
  expect_refused_in_time({"export", "--checkpoint", ck, "--to", "hf", at("hf_fifo")}, kind);
  // Same for its config.json (read by every command that opens a checkpoint).
  const std::string ck2 = copy_checkpoint("ck_fifo_cfg");
  fs::remove(ck2 + "/config.json");
  ASSERT_EQ(::mkfifo((ck2 + "/config.json").c_str(), 0600), 0);
  expect_refused_in_time({"generate", "--checkpoint", ck2, "--prompt", "And"}, kind);
}

// Files nibble reads to decide whether an output path is its own: a FIFO there is refused
// without being opened for reading (and never written into).
TEST_F(MisuseCli, FifoWhereAnOutputGoesIsNotRead) {
  fs::create_directories(at("out_fifo_metrics"));
  ASSERT_EQ(::mkfifo(at("out_fifo_metrics/metrics.jsonl").c_str(), 0600), 0);
  BoundedRun r = run_bounded({"pretrain", "--config", at("run.json"), "--data", at("corpus.txt"), "--out",
                              at("out_fifo_metrics"), "--no-progress"},
                             60);
  ASSERT_FALSE(r.timed_out) << "pretrain hung on a FIFO named metrics.jsonl";
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("metrics.jsonl"), std::string::npos) << r.err;

  fs::create_directories(at("data_fifo"));
  ASSERT_EQ(::mkfifo(at("data_fifo/data.json").c_str(), 0600), 0);
  r = run_bounded({"pretrain", "--config", at("run.json"), "--data", at("corpus.txt"), "--set",
                   "data.dir=" + at("data_fifo"), "--out", at("out_data_fifo"), "--no-progress"},
                  60);
  ASSERT_FALSE(r.timed_out) << "pretrain hung on a FIFO named data.json";
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("data_fifo"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::is_fifo(at("data_fifo/data.json")));

  std::vector<io::NamedTensor> t = test_checkpoint();
  fs::create_directories(at("q_fifo"));
  ASSERT_TRUE(io::write_safetensors(at("q_fifo_in.safetensors"), t).is_ok());
  ASSERT_EQ(::mkfifo(at("q_fifo/hf_quant_config.json").c_str(), 0600), 0);
  r = run_bounded({"quantize", at("q_fifo_in.safetensors"), at("q_fifo/q.safetensors"), "--format", "nvfp4",
                   "--layout", "modelopt"},
                  60);
  ASSERT_FALSE(r.timed_out) << "quantize hung on a FIFO named hf_quant_config.json";
  EXPECT_NE(r.code, 0);
  EXPECT_TRUE(fs::is_fifo(at("q_fifo/hf_quant_config.json")));
}

TEST_F(MisuseCli, DevicesAndDirectoriesAreRefusedAsData) {
  expect_refused_in_time({"eval", "--checkpoint", run_dir(), "--data", "/dev/null"}, "character device");
  expect_refused_in_time({"eval", "--checkpoint", run_dir(), "--data", at("run")}, "directory");
  expect_refused_in_time({"pretrain", "--config", at("run.json"), "--data", "/dev/zero", "--out", at("r_dev"),
                          "--no-progress"},
                         "character device");
}

// ---- item 6: every numeric option is validated (exit 2, one line naming the option) -------

void expect_bad_option(const std::vector<std::string>& args, const std::string& option) {
  SCOPED_TRACE(::testing::PrintToString(args));
  BoundedRun r = run_bounded(args, 120);
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.code, 2) << r.out() << r.err;
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_NE(r.err.find(option), std::string::npos) << r.err;
  // No internal check, source path or stack of messages.
  EXPECT_EQ(r.err.find("check failed"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(".cpp"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(".h:"), std::string::npos) << r.err;
}

TEST_F(MisuseCli, EvalNumericOptions) {
  const std::vector<std::string> base = {"eval", "--checkpoint", run_dir(), "--data", at("corpus.txt")};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  expect_bad_option(with({"--seq-len", "1000"}), "--seq-len 1000 exceeds the model's max_position_embeddings 128");
  expect_bad_option(with({"--seq-len", "129"}), "--seq-len");
  expect_bad_option(with({"--seq-len", "0"}), "--seq-len");
  expect_bad_option(with({"--seq-len", "-5"}), "--seq-len");
  expect_bad_option(with({"--seq-len", "99999999999999999999"}), "--seq-len");
  expect_bad_option(with({"--batch-size", "-3"}), "--batch-size");
  expect_bad_option(with({"--batch-size", "0"}), "--batch-size");
  expect_bad_option(with({"--batch-size", "1e3"}), "--batch-size");
  expect_bad_option(with({"--batches", "-1"}), "--batches");
  // The bounds themselves are accepted.
  BoundedRun ok = run_bounded(with({"--seq-len", "128", "--batch-size", "1", "--batches", "1"}), 120);
  EXPECT_EQ(ok.code, 0) << ok.err;
}

TEST_F(MisuseCli, GenerateNumericOptions) {
  const std::vector<std::string> base = {"generate", "--checkpoint", run_dir(), "--prompt", "And"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  for (const char* v : {"nan", "inf", "-1", "-0.5", "abc", "1e999"}) expect_bad_option(with({"--temperature", v}), "--temperature");
  for (const char* v : {"0", "1.5", "nan", "-0.1"}) expect_bad_option(with({"--top-p", v}), "--top-p");
  for (const char* v : {"99999999999999999999", "-1", "1.5", "0x10"})
    expect_bad_option(with({"--max-new-tokens", v}), "--max-new-tokens");
  for (const char* v : {"-1", "99999999999999999999999", "1e3"}) expect_bad_option(with({"--seed", v}), "--seed");
}

TEST_F(MisuseCli, OtherCommandsNumericOptions) {
  expect_bad_option({"bench", "quantize", "--cpu-only", "--size", "128x128", "--repeats", "0"}, "--repeats");
  expect_bad_option({"bench", "quantize", "--cpu-only", "--size", "128x128", "--repeats", "-2"}, "--repeats");
  expect_bad_option({"bench", "quantize", "--cpu-only", "--size", "128x128", "--threads", "0"}, "--threads");
  expect_bad_option({"bench", "quantize", "--cpu-only", "--size", "128x128", "--threads", "-1"}, "--threads");
  std::vector<io::NamedTensor> t = test_checkpoint();
  ASSERT_TRUE(io::write_safetensors(at("q_in.safetensors"), t).is_ok());
  expect_bad_option({"quantize", at("q_in.safetensors"), at("q_out.safetensors"), "--format", "nvfp4", "--rounding",
                     "sr", "--seed", "-1"},
                    "--seed");
  EXPECT_FALSE(fs::exists(at("q_out.safetensors")));
  expect_bad_option({"pretrain", "--config", at("run.json"), "--out", at("r_stop"), "--stop-after", "0"}, "--stop-after");
  expect_bad_option({"pretrain", "--config", at("run.json"), "--out", at("r_stop"), "--stop-after", "-3"}, "--stop-after");
  EXPECT_FALSE(fs::exists(at("r_stop/checkpoints")));
}

// ---- item 5: generate is capped to the context and streams ---------------------------------

TEST_F(MisuseCli, GenerateCapsNewTokensToTheContext) {
  BoundedRun r = run_bounded({"generate", "--checkpoint", run_dir(), "--prompt", "And the sheep", "--no-stop",
                              "--temperature", "0", "--max-new-tokens", "9223372036854775807"},
                             120);
  ASSERT_FALSE(r.timed_out) << "unbounded generation";
  ASSERT_EQ(r.code, 0) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m,
                                std::regex("--max-new-tokens 9223372036854775807 capped to ([0-9]+) "
                                           "\\(max_position_embeddings 128 minus the ([0-9]+)-token prompt\\)")))
      << r.err;
  EXPECT_EQ(std::stoll(m[1]) + std::stoll(m[2]), 128);
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_EQ(r.out().rfind("And the sheep", 0), 0u) << r.out();
  // The same text as asking for exactly the cap: nothing is lost or added by capping.
  BoundedRun exact = run_bounded({"generate", "--checkpoint", run_dir(), "--prompt", "And the sheep", "--no-stop",
                                  "--temperature", "0", "--max-new-tokens", m[1].str()},
                                 120);
  ASSERT_EQ(exact.code, 0) << exact.err;
  EXPECT_EQ(exact.out(), r.out());
  EXPECT_TRUE(exact.err.empty()) << exact.err;

  // A prompt longer than the context is an argument error.
  std::string long_prompt;
  for (int i = 0; i < 200; ++i) long_prompt += "sheep ";
  expect_bad_option({"generate", "--checkpoint", run_dir(), "--prompt", long_prompt}, "--prompt");
}

TEST_F(MisuseCli, GenerateStreamsTokensAsTheyAreSampled) {
  // Greedy, no stop: ~125 tokens, each written and flushed when sampled. Output buffered until
  // the end arrives in one read (it is under the pipe's atomic size); streamed output in many.
  BoundedRun r = run_bounded({"generate", "--checkpoint", run_dir(), "--prompt", "And", "--no-stop", "--temperature",
                              "0", "--max-new-tokens", "125"},
                             120);
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GE(r.out_reads.size(), 3u) << "stdout arrived in " << r.out_reads.size() << " piece(s)";
  EXPECT_EQ(r.out_reads.front().rfind("And", 0), 0u);
  // The streamed text equals the text decoded at once (what the old command printed).
  BoundedRun again = run_bounded({"generate", "--checkpoint", run_dir(), "--prompt", "And", "--no-stop",
                                  "--temperature", "0", "--max-new-tokens", "125"},
                                 120);
  EXPECT_EQ(again.out(), r.out());
  EXPECT_EQ(r.out().back(), '\n');
}

// ---- item 7: a resume with nothing to do ---------------------------------------------------

TEST_F(MisuseCli, ResumeOfAFinishedRun) {
  const std::string metrics = slurp(run_dir() + "/metrics.jsonl");
  BoundedRun fewer = run_bounded({"pretrain", "--out", run_dir(), "--resume", "--set", "steps=2", "--no-progress"}, 120);
  EXPECT_EQ(fewer.code, 2) << fewer.out() << fewer.err;
  EXPECT_NE(fewer.err.find("steps=2 is below the step the run is at"), std::string::npos) << fewer.err;
  EXPECT_EQ(fewer.err.substr(fewer.err.rfind('\n', fewer.err.size() - 2) + 1).rfind("nibble pretrain: ", 0), 0u)
      << fewer.err;
  EXPECT_TRUE(fewer.out().empty()) << fewer.out();
  EXPECT_EQ(slurp(run_dir() + "/metrics.jsonl"), metrics);

  BoundedRun plain = run_bounded({"pretrain", "--out", run_dir(), "--resume", "--no-progress"}, 120);
  EXPECT_EQ(plain.code, 0) << plain.err;
  EXPECT_NE(plain.out().find("is already finished at step 4/4; checkpoint " + run_dir() + "/checkpoints/step_000004"),
            std::string::npos)
      << plain.out();
  EXPECT_EQ(plain.out().find("step 4/4  val loss"), std::string::npos) << plain.out();
  EXPECT_EQ(slurp(run_dir() + "/metrics.jsonl"), metrics);  // no second "end" event
}

// ---- item 8 (and 15): one checkpoint loader for every command ------------------------------

TEST_F(MisuseCli, ExportRefusesTensorsThatDisagreeWithTheConfig) {
  const std::string ck = copy_checkpoint("ck_bad_shape");
  std::vector<io::NamedTensor> t;
  {
    auto f = io::SafetensorsFile::open(ck + "/model.safetensors");
    ASSERT_TRUE(f.is_ok());
    for (const auto& n : f->names()) t.push_back({n, f->get(n)->clone()});
  }
  for (auto& nt : t)
    if (nt.name == "model.layers.1.self_attn.o_proj.weight") nt.tensor = Tensor(DType::kF32, Shape{64, 32});
  ASSERT_TRUE(io::write_safetensors(ck + "/model.safetensors", t).is_ok());
  for (const char* to : {"hf", "nvfp4"}) {
    BoundedRun r = run_bounded({"export", "--checkpoint", ck, "--to", to, at(std::string("bad_") + to)}, 120);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
    EXPECT_NE(r.err.find("model.layers.1.self_attn.o_proj.weight"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(at(std::string("bad_") + to)));
  }
  // eval and generate refuse it with the same words.
  BoundedRun e = run_bounded({"generate", "--checkpoint", ck, "--prompt", "And"}, 120);
  EXPECT_EQ(e.code, 1);
  EXPECT_NE(e.err.find("model.layers.1.self_attn.o_proj.weight' has the wrong shape"), std::string::npos) << e.err;
}

TEST_F(MisuseCli, OnlyResumeNeedsTheOptimizerState) {
  const std::string ck = copy_checkpoint("ck_no_opt");
  fs::remove(ck + "/optimizer.safetensors");
  BoundedRun g = run_bounded({"generate", "--checkpoint", ck, "--prompt", "And", "--max-new-tokens", "3"}, 120);
  EXPECT_EQ(g.code, 0) << g.err;
  BoundedRun e = run_bounded({"eval", "--checkpoint", ck, "--data", at("corpus.txt"), "--batches", "1"}, 120);
  EXPECT_EQ(e.code, 0) << e.err;
  BoundedRun x = run_bounded({"export", "--checkpoint", ck, "--to", "hf", at("hf_no_opt")}, 120);
  EXPECT_EQ(x.code, 0) << x.err;
  EXPECT_TRUE(fs::exists(at("hf_no_opt/model.safetensors")));
}

// ---- generate on the rollout engine: a file of prompts to JSON lines --------------------------

TEST_F(MisuseCli, GeneratePromptsFileWritesJsonLinesAndNeverOverwrites) {
  std::ofstream(at("prompts.txt")) << "And the sheep\n\n{\"prompt\": \"the shepherd\"}\n";
  const std::string out = at("gen.jsonl");
  const std::vector<std::string> args = {"generate", "--checkpoint", run_dir(), "--prompts", at("prompts.txt"),
                                         "--out", out, "--samples", "2", "--max-new-tokens", "12", "--top-k", "20",
                                         "--seed", "3"};
  BoundedRun r = run_bounded(args, 120);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.out().empty()) << r.out();
  EXPECT_NE(r.err.find("4 samples of 2 prompts"), std::string::npos) << r.err;
  std::ifstream in(out);
  std::string line;
  std::vector<json> rows;
  while (std::getline(in, line)) rows.push_back(json::parse(line));
  ASSERT_EQ(rows.size(), 4u);
  for (size_t i = 0; i < rows.size(); ++i) {
    const json& j = rows[i];
    EXPECT_EQ(j["index"], i / 2);
    EXPECT_EQ(j["sample"], i % 2);
    EXPECT_EQ(j["line"], i < 2 ? 1 : 3);
    EXPECT_EQ(j["prompt"], i < 2 ? "And the sheep" : "the shepherd");
    ASSERT_EQ(j["tokens"].size(), j["logprobs"].size());
    ASSERT_GE(j["tokens"].size(), 1u);
    EXPECT_LE(j["tokens"].size(), 12u);
    for (double lp : j["logprobs"]) EXPECT_LE(lp, 0.0);
    const std::string fr = j["finish_reason"];
    EXPECT_TRUE(fr == "eos" || fr == "length") << fr;
    EXPECT_EQ(fr == "length", j["tokens"].size() == 12u);
  }
  // never over an existing file without --force; with it, the same seed writes the same lines
  const std::string first = slurp(out);
  BoundedRun again = run_bounded(args, 120);
  EXPECT_EQ(again.code, 2) << again.err;
  EXPECT_NE(again.err.find("--force"), std::string::npos) << again.err;
  EXPECT_EQ(again.err_lines(), 1) << again.err;
  std::vector<std::string> forced = args;
  forced.push_back("--force");
  BoundedRun f = run_bounded(forced, 120);
  ASSERT_EQ(f.code, 0) << f.err;
  EXPECT_EQ(slurp(out), first);
  // nor over the prompts file, even with --force
  std::vector<std::string> onto_input = forced;
  onto_input[6] = at("prompts.txt");
  BoundedRun o = run_bounded(onto_input, 120);
  EXPECT_EQ(o.code, 2) << o.err;
  EXPECT_NE(o.err.find("is the --prompts file"), std::string::npos) << o.err;
}

TEST_F(MisuseCli, GenerateEngineOptionsAndInputsAreChecked) {
  std::ofstream(at("prompts2.txt")) << "And\n";
  expect_bad_option({"generate", "--checkpoint", run_dir(), "--prompt", "And", "--mode", "fp8"}, "fp8");
  expect_bad_option({"generate", "--checkpoint", run_dir(), "--prompt", "And", "--kv-dtype", "fp4"}, "--kv-dtype");
  expect_bad_option({"generate", "--checkpoint", run_dir(), "--prompts", at("prompts2.txt")}, "--out");
  expect_bad_option({"generate", "--checkpoint", run_dir(), "--prompts", at("prompts2.txt"), "--out", at("g2.jsonl"),
                     "--samples", "4", "--batch", "2"},
                    "--samples 4 exceeds --batch 2");
  expect_bad_option({"generate", "--checkpoint", run_dir(), "--prompt", "And", "--top-k", "-1"}, "--top-k");
  // bad input files: exit 1, one line naming the line
  std::ofstream(at("prompts_bad.txt")) << "And\n{\"text\": 1}\n";
  BoundedRun r = run_bounded({"generate", "--checkpoint", run_dir(), "--prompts", at("prompts_bad.txt"), "--out",
                              at("g3.jsonl")},
                             120);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_NE(r.err.find("line 2"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(at("g3.jsonl")));
  std::string long_prompt;
  for (int i = 0; i < 200; ++i) long_prompt += "sheep ";
  std::ofstream(at("prompts_long.txt")) << "And\n" << long_prompt << "\n";
  BoundedRun l = run_bounded({"generate", "--checkpoint", run_dir(), "--prompts", at("prompts_long.txt"), "--out",
                              at("g4.jsonl")},
                             120);
  EXPECT_EQ(l.code, 1) << l.err;
  EXPECT_NE(l.err.find("line 2: prompt of"), std::string::npos) << l.err;
  BoundedRun missing = run_bounded({"generate", "--checkpoint", run_dir(), "--prompts", at("nothing.txt"), "--out",
                                    at("g5.jsonl")},
                                   120);
  EXPECT_EQ(missing.code, 1) << missing.err;
  // --stop: the streamed text ends before the first occurrence of the stop string
  BoundedRun full = run_bounded({"generate", "--checkpoint", run_dir(), "--prompt", "And the", "--temperature", "0",
                                 "--max-new-tokens", "20", "--no-stop"},
                                120);
  ASSERT_EQ(full.code, 0) << full.err;
  const std::string gen = full.out().substr(7, full.out().size() - 8);  // between the prompt and the newline
  ASSERT_GE(gen.size(), 4u) << full.out();
  const std::string stop = gen.substr(2, 2);
  BoundedRun cut = run_bounded({"generate", "--checkpoint", run_dir(), "--prompt", "And the", "--temperature", "0",
                                "--max-new-tokens", "20", "--no-stop", "--stop", stop},
                               120);
  ASSERT_EQ(cut.code, 0) << cut.err;
  EXPECT_EQ(cut.out(), "And the" + gen.substr(0, gen.find(stop)) + "\n") << "stop '" << stop << "'";
  // one prompt in the bf16, w4a16 and w4a4 modes, greedy: each runs and the modes are deterministic
  for (const char* mode : {"bf16", "w4a16", "w4a4"}) {
    std::vector<std::string> a = {"generate", "--checkpoint", run_dir(), "--prompt", "And the", "--mode", mode,
                                  "--temperature", "0", "--max-new-tokens", "8", "--no-stop"};
    BoundedRun x = run_bounded(a, 120), y = run_bounded(a, 120);
    ASSERT_EQ(x.code, 0) << mode << x.err;
    EXPECT_EQ(x.out(), y.out()) << mode;
    EXPECT_EQ(x.out().rfind("And the", 0), 0u) << x.out();
  }
}

// ---- generate in the engine's modes: inference storage, today's tokens ---------------------

// `generate --prompts --mode M` (greedy, and sampled with G = 2) writes the tokens and log-probs
// of the path before inference storage, computed here in-process: the checkpoint's training model
// (train::load_checkpoint_model) and an engine quantizing its master weights, with the requests
// generate makes (stop at eos, Philox stream of the line index). Its summary line says the model
// was of inference storage (the recipe mode's says training).
TEST_F(MisuseCli, GenerateModesRunOnInferenceStorageWithTheTrainingModelsTokens) {
  std::ofstream(at("prompts_storage.txt")) << "And the sheep\nthe shepherd followed\n";
  auto ck = train::open_checkpoint(run_dir());
  ASSERT_TRUE(ck.is_ok()) << ck.status().message();
  auto trained = train::load_checkpoint_model(*ck);
  ASSERT_TRUE(trained.is_ok()) << trained.status().message();
  auto tok = train::Tokenizer::load(ck->tokenizer_path);
  ASSERT_TRUE(tok.is_ok());
  for (const char* mode : {"bf16", "w4a16", "w4a4"})
    for (const char* temperature : {"0", "0.8"}) {
      SCOPED_TRACE(std::string(mode) + " temperature " + temperature);
      const std::string out = at(std::string("storage_") + mode + temperature + ".jsonl");
      BoundedRun r = run_bounded({"generate", "--checkpoint", run_dir(), "--prompts", at("prompts_storage.txt"),
                                  "--out", out, "--mode", mode, "--samples", "2", "--temperature", temperature,
                                  "--top-p", "0.9", "--seed", "5", "--max-new-tokens", "10"},
                                 120);
      ASSERT_EQ(r.code, 0) << r.err;
      EXPECT_NE(r.err.find(std::string("(mode ") + mode + ", inference storage)"), std::string::npos) << r.err;
      rollout::EngineOptions eo;
      eo.mode = rollout::parse_precision_mode(mode).value();
      eo.recipe_name = rollout::weight_layout_recipe(**trained);
      auto engine = rollout::Engine::create(**trained, eo);
      ASSERT_TRUE(engine.is_ok()) << engine.status().message();
      std::vector<rollout::Request> reqs;
      for (const char* prompt : {"And the sheep", "the shepherd followed"}) {
        rollout::Request q;
        q.prompt = tok->encode(prompt).value();
        q.params.sampling = rollout::SamplingParams{std::stod(temperature), 0, 0.9};
        q.params.max_new_tokens = 10;
        q.params.stop_ids = {tok->eos_id()};
        q.params.seed = 5;
        q.params.num_samples = 2;
        q.id = reqs.size();
        reqs.push_back(q);
      }
      auto want = (*engine)->generate(reqs);
      ASSERT_TRUE(want.is_ok()) << want.status().message();
      std::ifstream in(out);
      std::string line;
      size_t i = 0;
      for (; std::getline(in, line); ++i) {
        ASSERT_LT(i, want->size());
        const json j = json::parse(line);
        EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), (*want)[i].tokens) << "line " << i;
        EXPECT_EQ(j["logprobs"].get<std::vector<double>>(), (*want)[i].logprobs) << "line " << i;
      }
      EXPECT_EQ(i, want->size());
    }
  BoundedRun recipe = run_bounded({"generate", "--checkpoint", run_dir(), "--prompts", at("prompts_storage.txt"),
                                   "--out", at("storage_recipe.jsonl"), "--max-new-tokens", "2"},
                                  120);
  ASSERT_EQ(recipe.code, 0) << recipe.err;
  EXPECT_NE(recipe.err.find("(mode recipe, training storage)"), std::string::npos) << recipe.err;
}

// A truncated model.safetensors, a missing tensor and a config.json that does not match the
// tensors: generate and serve in an engine mode (inference storage) refuse each with one line
// naming the file or tensor, exit 1, and write nothing (generate's --out stays absent; serve never
// listens).
TEST_F(MisuseCli, InferenceModesRefuseBadCheckpointsInOneLine) {
  std::ofstream(at("prompts_bad_ck.txt")) << "And\n";
  const std::string truncated = copy_checkpoint("ck_truncated");
  fs::resize_file(truncated + "/model.safetensors", fs::file_size(truncated + "/model.safetensors") - 64);
  const std::string missing = copy_checkpoint("ck_missing_tensor");
  const std::string gone = "model.layers.1.mlp.down_proj.weight";
  {
    std::vector<io::NamedTensor> t;
    auto f = io::SafetensorsFile::open(missing + "/model.safetensors");
    ASSERT_TRUE(f.is_ok());
    for (const auto& n : f->names())
      if (n != gone) t.push_back({n, f->get(n)->clone()});
    ASSERT_TRUE(io::write_safetensors(missing + "/model.safetensors", t).is_ok());
  }
  const std::string config = copy_checkpoint("ck_other_config");
  {
    json c = json::parse(slurp(config + "/config.json"));
    c["intermediate_size"] = 96;
    std::ofstream(config + "/config.json", std::ios::trunc) << c.dump(2);
  }
  const std::vector<std::pair<std::string, std::string>> cases{
      {truncated, "corrupt checkpoint file '" + truncated + "/model.safetensors'"},
      {missing, "lacks tensor '" + gone + "'"},
      {config, "tensor 'model.layers.0.mlp.gate_proj.weight' has the wrong shape for this model config"}};
  for (const auto& c : cases) {
    const std::string& ck = c.first;
    const std::string& words = c.second;
    SCOPED_TRACE(ck);
    const std::string out = ck + "_out.jsonl";
    BoundedRun g = run_bounded({"generate", "--checkpoint", ck, "--prompts", at("prompts_bad_ck.txt"), "--out", out,
                                "--mode", "w4a16"},
                               120);
    EXPECT_EQ(g.code, 1) << g.err;
    EXPECT_EQ(g.err_lines(), 1) << g.err;
    EXPECT_NE(g.err.find(words), std::string::npos) << g.err;
    EXPECT_FALSE(fs::exists(out));
    BoundedRun s = run_bounded({"serve", "--checkpoint", ck, "--port", "0", "--mode", "bf16"}, 120);
    EXPECT_FALSE(s.timed_out);
    EXPECT_EQ(s.code, 1) << s.err;
    EXPECT_EQ(s.err_lines(), 1) << s.err;
    EXPECT_NE(s.err.find(words), std::string::npos) << s.err;
    EXPECT_EQ(s.out().find("listening"), std::string::npos) << s.out();
  }
}

}  // namespace
}  // namespace nibble::tools::test
