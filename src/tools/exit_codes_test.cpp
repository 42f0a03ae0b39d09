// The exit-code rule of docs/cli.md, command by command: 2 for bad arguments (unknown command or
// option, a bad option or run-config value), 1 for bad or missing input (a missing, unreadable or
// corrupt file, data that cannot serve), each with exactly one line on stderr. A table of
// command x {bad flag, bad value, missing file, corrupt file} drives the built `nibble` against a
// tiny trained run; then the messages that used to name the wrong thing (SentencePiece
// internals, a temporary shard, DBL_MAX, "A subcommand is required", std::bad_alloc).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/tiny_olmo2_test_util.h"
#include "tools/cli_test_util.h"

namespace nibble::tools::test {
namespace {

using nlohmann::json;

// One trained run (2 steps of a tiny OLMo-2) and the broken inputs the table needs, made once.
class ExitCodesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<ScratchDir>("exit_codes");
    const ScratchDir& d = *dir_;
    json cfg{{"model", model::test::tiny_olmo2_model_json(300)},
             {"recipe", "bf16"},
             {"batch_size", 2},
             {"seq_len", 16},
             {"steps", 2},
             {"schedule", {{"type", "constant"}, {"warmup_steps", 0}}},
             {"eval", {{"interval", 0}, {"batches", 1}}},
             {"threads", 1}};
    std::ofstream(d / "run.json") << cfg.dump(2);
    std::string text;
    for (int i = 0; i < 400; ++i)
      text += "The " + std::to_string(i % 29) + " lambs went over the hill, and the shepherd followed them.\n";
    std::ofstream(d / "corpus.txt") << text;
    std::ofstream(d / "empty.txt") << " \n\n\t\n";
    std::ofstream(d / "notjson.json") << "{\"steps\": ";
    std::ofstream(d / "garbage.bin") << std::string("\x13\x00\x00\x00\x00\x00\x00\x00{\"a\":", 13) << "garbage";
    // A corpus too small for a 300-piece tokenizer, and one with too many distinct characters
    // for it (each needs a piece next to the 4 specials and 256 byte pieces).
    std::ofstream(d / "tiny.txt") << "ab ab ab\nba ba\n";
    std::string varied;
    for (int c = 0x4E00; c < 0x4E00 + 120; ++c) {  // 120 CJK ideographs, 3 UTF-8 bytes each
      varied += static_cast<char>(0xE0 | (c >> 12));
      varied += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      varied += static_cast<char>(0x80 | (c & 0x3F));
      if (c % 10 == 9) varied += "\n";
    }
    std::ofstream(d / "varied.txt") << varied;
    RunResult r = run_nibble(d.path, "-q pretrain --config '" + (d / "run.json") + "' --data '" + (d / "corpus.txt") +
                                         "' --out '" + (d / "run") + "' --no-progress");
    ASSERT_EQ(r.code, 0) << r.err;
    ASSERT_TRUE(fs::exists(d / "run/checkpoints/latest"));
    // Copies of the run with a corrupt tokenizer and a corrupt model file.
    fs::copy(d / "run", d / "badtok", fs::copy_options::recursive);
    std::ofstream(d / "badtok/checkpoints/step_000002/tokenizer.model", std::ios::trunc) << "not a sentencepiece model";
    fs::copy(d / "run", d / "badmodel", fs::copy_options::recursive);
    std::ofstream(d / "badmodel/checkpoints/step_000002/model.safetensors", std::ios::trunc) << "garbage";
  }
  static void TearDownTestSuite() { dir_.reset(); }

  static std::string path(const std::string& f) { return *dir_ / f; }
  static std::string q(const std::string& f) { return "'" + path(f) + "'"; }

  static std::unique_ptr<ScratchDir> dir_;
};
std::unique_ptr<ScratchDir> ExitCodesTest::dir_;

struct Case {
  std::string what;    // "pretrain: missing --config"
  std::string args;    // after `nibble -q`
  int code;            // expected exit code
  std::string expect;  // in the one stderr line
};

void expect_case(const Case& c, const fs::path& cwd) {
  RunResult r = run_nibble(cwd, "-q " + c.args);
  EXPECT_EQ(r.code, c.code) << c.what << "\n  nibble " << c.args << "\n  " << r.err;
  EXPECT_EQ(r.err_lines(), 1) << c.what << ": stderr is not one line:\n" << r.err;
  EXPECT_EQ(r.err.rfind("nibble", 0), 0u) << c.what << "\n" << r.err;
  EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.what << ": no '" << c.expect << "' in\n  " << r.err;
  EXPECT_EQ(r.err.find(".cc("), std::string::npos) << c.what << ": a library's source position leaks:\n  " << r.err;
}

TEST_F(ExitCodesTest, EveryCommandBadFlagBadValueMissingFileCorruptFile) {
  const std::string run = q("run"), corpus = q("corpus.txt");
  const std::string pre = "pretrain --config " + q("run.json") + " --no-progress ";
  const std::vector<Case> cases = {
      // pretrain
      {"pretrain: bad flag", pre + "--bogus --out " + q("p1"), 2, "--bogus"},
      {"pretrain: bad --set value", pre + "--set steps=0 --out " + q("p2"), 2, "'steps'"},
      {"pretrain: bad --stop-after value", pre + "--stop-after abc --out " + q("p3"), 2, "--stop-after"},
      {"pretrain: missing --config", "pretrain --config " + q("nope.json") + " --out " + q("p4"), 1, "nope.json"},
      {"pretrain: missing --data", pre + "--data " + q("nope.txt") + " --out " + q("p5"), 1, "nope.txt"},
      {"pretrain: corrupt --config (not JSON)", "pretrain --config " + q("notjson.json") + " --out " + q("p6"), 1,
       "not valid JSON"},
      {"pretrain: empty corpus", pre + "--data " + q("empty.txt") + " --out " + q("p7"), 1, "empty.txt"},
      {"pretrain: corrupt data.tokenizer",
       pre + "--data " + corpus + " --set data.tokenizer=" + q("corpus.txt") + " --out " + q("p8"), 1,
       "not a sentencepiece model"},
      {"pretrain: corpus too small for the vocabulary", pre + "--data " + q("tiny.txt") + " --out " + q("p9"), 1,
       "data.vocab_size"},
      {"pretrain: corpus too varied for the vocabulary", pre + "--data " + q("varied.txt") + " --out " + q("p10"), 1,
       "distinct characters"},
      // eval
      {"eval: bad flag", "eval --checkpoint " + run + " --data " + corpus + " --bogus", 2, "--bogus"},
      {"eval: bad value", "eval --checkpoint " + run + " --data " + corpus + " --batches abc", 2, "--batches"},
      {"eval: missing checkpoint", "eval --checkpoint " + q("nothing") + " --data " + corpus, 1, "does not exist"},
      {"eval: missing --data", "eval --checkpoint " + run + " --data " + q("nope.txt"), 1, "nope.txt"},
      {"eval: corrupt tokenizer", "eval --checkpoint " + q("badtok") + " --data " + corpus, 1, "tokenizer"},
      {"eval: corrupt model", "eval --checkpoint " + q("badmodel") + " --data " + corpus, 1, "model.safetensors"},
      {"eval: empty text", "eval --checkpoint " + run + " --data " + q("empty.txt"), 1, "empty.txt"},
      // generate
      {"generate: bad flag", "generate --checkpoint " + run + " --bogus", 2, "--bogus"},
      {"generate: bad value", "generate --checkpoint " + run + " --temperature -1", 2, "--temperature"},
      {"generate: missing checkpoint", "generate --checkpoint " + q("nothing"), 1, "does not exist"},
      {"generate: corrupt tokenizer", "generate --checkpoint " + q("badtok"), 1, "tokenizer"},
      {"generate: corrupt model", "generate --checkpoint " + q("badmodel"), 1, "model.safetensors"},
      // serve (all before it binds a port)
      {"serve: bad flag", "serve --checkpoint " + run + " --bogus", 2, "--bogus"},
      {"serve: bad value", "serve --checkpoint " + run + " --port 70000", 2, "--port"},
      {"serve: bad mode", "serve --checkpoint " + run + " --mode fp8", 2, "fp8"},
      {"serve: missing checkpoint", "serve --checkpoint " + q("nothing"), 1, "does not exist"},
      {"serve: corrupt tokenizer", "serve --checkpoint " + q("badtok"), 1, "tokenizer"},
      {"serve: corrupt model", "serve --checkpoint " + q("badmodel"), 1, "model.safetensors"},
      // export
      {"export: bad flag", "export --checkpoint " + run + " --to hf " + q("e1") + " --bogus", 2, "--bogus"},
      {"export: bad value", "export --checkpoint " + run + " --to onnx " + q("e2"), 2, "--to"},
      {"export: missing checkpoint", "export --checkpoint " + q("nothing") + " --to hf " + q("e3"), 1,
       "does not exist"},
      {"export: corrupt tokenizer", "export --checkpoint " + q("badtok") + " --to hf " + q("e4"), 1, "tokenizer"},
      {"export: corrupt model", "export --checkpoint " + q("badmodel") + " --to hf " + q("e5"), 1,
       "model.safetensors"},
      // quantize
      {"quantize: bad flag", "quantize " + q("a.safetensors") + " " + q("b.safetensors") + " --format nvfp4 --bogus", 2,
       "--bogus"},
      {"quantize: bad value", "quantize " + q("a.safetensors") + " " + q("b.safetensors") + " --format nvfp5", 2,
       "--format nvfp5"},
      {"quantize: missing IN", "quantize " + q("a.safetensors") + " " + q("b.safetensors") + " --format nvfp4", 1,
       "a.safetensors"},
      {"quantize: corrupt IN", "quantize " + q("garbage.bin") + " " + q("b.safetensors") + " --format nvfp4", 1,
       "garbage.bin"},
      // inspect
      {"inspect: bad flag", "inspect " + q("garbage.bin") + " --bogus", 2, "--bogus"},
      {"inspect: bad value (two files)", "inspect " + q("garbage.bin") + " " + q("corpus.txt"), 2, "corpus.txt"},
      {"inspect: missing FILE", "inspect " + q("nope.safetensors"), 1, "nope.safetensors"},
      {"inspect: corrupt FILE", "inspect " + q("garbage.bin"), 1, "garbage.bin"},
      // bench (no input files)
      {"bench: bad flag", "bench quantize --bogus", 2, "--bogus"},
      {"bench: bad value", "bench quantize --size 100x100", 2, "--size 100x100"},
      // the command itself
      {"unknown command", "frobnicate", 2, "unknown command 'frobnicate'"},
      {"unknown bench command", "bench frobnicate", 2, "unknown bench command 'frobnicate'"},
  };
  for (const Case& c : cases) expect_case(c, dir_->path);
  EXPECT_FALSE(fs::exists(path("b.safetensors")));
}

// `nibble frobnicate` said "A subcommand is required"; it names the word and lists the commands.
TEST_F(ExitCodesTest, UnknownCommandIsNamedWithTheCommands) {
  RunResult r = run_nibble(dir_->path, "frobnicate --help");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_NE(r.err.find("unknown command 'frobnicate'"), std::string::npos) << r.err;
  for (const char* name : {"bench", "eval", "export", "generate", "inspect", "pretrain", "quantize"})
    EXPECT_NE(r.err.find(name), std::string::npos) << name << ": " << r.err;
  EXPECT_EQ(r.err.find("subcommand is required"), std::string::npos) << r.err;
  // No command at all (and `bench` without its own): say one is needed, with the choices.
  r = run_nibble(dir_->path, "-q");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("a command is required (commands: bench, data, eval,"), std::string::npos) << r.err;
  r = run_nibble(dir_->path, "bench");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("a bench command is required (commands: quantize"), std::string::npos) << r.err;
  // --help still works.
  EXPECT_EQ(run_nibble(dir_->path, "--help").code, 0);
  EXPECT_EQ(run_nibble(dir_->path, "bench --help").code, 0);
}

// CLI11's range checks printed DBL_MAX in full ("[0 - 1.797693134862316e+308]").
TEST_F(ExitCodesTest, RangeErrorsPrintReadableBounds) {
  const std::string gen = "generate --checkpoint " + q("run") + " ";
  for (const auto& [args, bound] : std::vector<std::pair<std::string, std::string>>{
           {"--temperature -1", ">= 0"}, {"--max-new-tokens -5", ">= 0"}, {"--top-p 0", "(0, 1]"},
           {"--top-p 1.5", "(0, 1]"}, {"--temperature nan", ">= 0"}}) {
    RunResult r = run_nibble(dir_->path, gen + args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
    EXPECT_NE(r.err.find(bound), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(r.err.find("e+308"), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(r.err.find("1797693"), std::string::npos) << args << ": " << r.err;
  }
}

// A --size the machine cannot hold was allocated anyway and died in "std::bad_alloc".
TEST_F(ExitCodesTest, BenchSizeBeyondMemoryIsRefusedNamingTheOption) {
  RunResult r = run_nibble(dir_->path, "bench quantize --size 1048576x1048576 --cpu-only");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_NE(r.err.find("--size 1048576x1048576"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("GiB"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("bad_alloc"), std::string::npos) << r.err;
}

// SentencePiece's errors named its own internals ("trainer_interface.cc(580) ...
// --character_coverage option", "Vocabulary size too high (300)"); they name nibble's key.
TEST_F(ExitCodesTest, TokenizerTrainingErrorsNameNibblesKeys) {
  const std::string pre = "pretrain --config " + q("run.json") + " --no-progress ";
  for (const char* corpus : {"tiny.txt", "varied.txt"}) {
    const std::string out = q(std::string("sp_") + corpus);
    RunResult r = run_nibble(dir_->path, "-q " + pre + "--data " + q(corpus) + " --out " + out);
    EXPECT_EQ(r.code, 1) << corpus << ": " << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
    EXPECT_NE(r.err.find("data.vocab_size = 300"), std::string::npos) << r.err;
    for (const char* internal : {".cc(", "character_coverage", "Vocabulary size", "required_chars"})
      EXPECT_EQ(r.err.find(internal), std::string::npos) << internal << ": " << r.err;
  }
}

// SentencePiece printed a LOG(INFO) line ("trainer_interface.cc ... Running command") on every
// tokenizer training; a successful run's stderr holds only nibble's own lines.
TEST_F(ExitCodesTest, TokenizerTrainingIsSilent) {
  RunResult r = run_nibble(dir_->path, "pretrain --config " + q("run.json") + " --data " + q("corpus.txt") +
                                           " --set steps=1 --out " + q("silent") + " --no-progress");
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(fs::exists(path("silent/data/tokenizer.model")));  // the tokenizer was trained here
  EXPECT_EQ(r.err.find(".cc("), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("Running command"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("LOG("), std::string::npos) << r.err;
}

// `--set model.vocab_size=100` was blamed on data.vocab_size (which defaults to it).
TEST_F(ExitCodesTest, SmallModelVocabularyNamesModelVocabSize) {
  RunResult r = run_nibble(dir_->path, "-q pretrain --config " + q("run.json") + " --set model.vocab_size=100 --out " +
                                           q("vocab100"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("'model.vocab_size': 100 < 261"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("data.vocab_size"), std::string::npos) << r.err;
}

// eval on a text shorter than one window named a temporary shard (/tmp/nibble-eval-XXXXXX/0.bin).
TEST_F(ExitCodesTest, EvalOnATooShortTextNamesTheUsersFile) {
  std::ofstream(path("short.txt")) << "The lambs.\n";
  RunResult r = run_nibble(dir_->path, "eval --checkpoint " + q("run") + " --data " + q("short.txt"));
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_NE(r.err.find(path("short.txt")), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("seq_len + 1 = 17"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("nibble-eval-"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(".bin"), std::string::npos) << r.err;
}

// `inspect RUN_DIR` refused the run folder every other command takes; it inspects the latest
// checkpoint's model file.
TEST_F(ExitCodesTest, InspectAcceptsARunFolder) {
  RunResult r = run_nibble(dir_->path, "inspect " + q("run"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step_000002/model.safetensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.embed_tokens.weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("lm_head.weight"), std::string::npos) << r.out;
  // The same file given directly lists the same tensors.
  RunResult direct = run_nibble(dir_->path, "inspect " + q("run/checkpoints/step_000002/model.safetensors"));
  ASSERT_EQ(direct.code, 0) << direct.err;
  EXPECT_EQ(r.out.substr(r.out.find('\n')), direct.out.substr(direct.out.find('\n')));
}

// --stop-after before the first validation printed "val loss 0.0000  val ppl 0.000".
TEST_F(ExitCodesTest, StopAfterWithoutValidationSaysSo) {
  RunResult r = run_nibble(dir_->path, "pretrain --config " + q("run.json") + " --data " + q("corpus.txt") +
                                           " --set steps=4 --set eval.interval=3 --stop-after 1 --out " + q("stopped") +
                                           " --no-progress");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step 1/4"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no validation ran"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("val loss"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("0.0000"), std::string::npos) << r.out;
  const std::string metrics = slurp(path("stopped/metrics.jsonl"));
  const size_t at = metrics.rfind("\"event\":\"end\"");
  ASSERT_NE(at, std::string::npos) << metrics;
  const std::string end = metrics.substr(at);
  EXPECT_EQ(end.find("val_loss"), std::string::npos) << end;
}

}  // namespace
}  // namespace nibble::tools::test
