// `nibble eval`: validation loss and perplexity of a checkpoint on text files (tokenized with
// the checkpoint's tokenizer, each file followed by eos) or NIBTOK token shards, in windows of
// the run's sequence length (train/loader.h ValLoader: fixed order, full batches), on the backend
// of --device (tools/device_option.h), whichever device trained the checkpoint.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/regular_file.h"
#include "core/log.h"
#include "core/interrupt.h"
#include "tools/command.h"
#include "tools/device_option.h"
#include "tools/option_check.h"
#include "train/checkpoint.h"
#include "train/corpus.h"
#include "train/dataset.h"
#include "train/loader.h"
#include "train/progress.h"
#include "train/shards.h"
#include "train/tokenizer.h"
#include "train/trainer.h"

namespace nibble::tools {
namespace {

namespace fs = std::filesystem;

// --batch-size at most this: one batch's logits are batch x seq_len x vocab floats.
constexpr int64_t kMaxEvalBatchSize = 65536;

struct EvalArgs {
  std::string checkpoint, recipe, device;
  std::vector<std::string> data;
  bool json = false;
  int64_t batch_size = 0, seq_len = 0, batches = 0;
};

// Removes a temporary folder when the command ends.
struct TempDir {
  std::string path;
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

int run_eval(const EvalArgs& a) {
  install_interrupt_handlers();  // a Ctrl-C ends between batches, so the temporary shards are removed
  auto be = open_device(a.device);
  if (!be) return report_error("eval", be.status());
  auto ck = train::open_checkpoint(a.checkpoint);
  if (!ck) return report_error("eval", ck.status());
  if (a.data.empty()) return report_error("eval", invalid_argument("no --data given"));
  model::RecipeConfig rc;
  const model::RecipeConfig* rcp = nullptr;
  if (!a.recipe.empty()) {
    auto r = model::parse_recipe_config(nlohmann::json(a.recipe));
    if (!r) return report_error("eval", r.status());
    rc = *r;
    rcp = &rc;
  }
  auto m = train::load_checkpoint_model(*ck, rcp, **be);
  if (!m) return report_error("eval", m.status());
  const nlohmann::json& rj = ck->run_config;
  const int64_t B = a.batch_size > 0 ? a.batch_size : rj.value("batch_size", int64_t{8});
  const int64_t T = a.seq_len > 0 ? a.seq_len : rj.value("seq_len", int64_t{128});
  // The window cannot be longer than the positions the model has (RoPE tables, attention).
  const int64_t positions = (*m)->config().max_position_embeddings;
  if (T > positions)
    return report_error("eval", invalid_argument("--seq-len {} exceeds the model's max_position_embeddings {}", T, positions));

  TempDir tmp;
  std::vector<std::string> shards;
  // Per --data file: its token count, so a too-short input is named as the user gave it (text
  // files become temporary shards, whose names mean nothing to the user).
  std::vector<std::pair<std::string, int64_t>> sizes;
  for (const auto& path : a.data) {
    // A FIFO or device is refused here, before anything reads it (io/regular_file.h).
    if (Status st = io::check_regular_file(path, "data file"); !st) return report_error("eval", st);
    if (train::is_token_shard_file(path)) {
      auto shard = train::TokenShard::open(path);
      if (!shard) return report_error("eval", Status(shard.status().code(), "data: " + shard.status().message()));
      sizes.emplace_back(path, shard->size());
      shards.push_back(path);
      continue;
    }
    auto text = train::read_text_file(path);
    if (!text) return report_error("eval", text.status());
    auto tok = train::Tokenizer::load(ck->tokenizer_path);
    if (!tok) return report_error("eval", tok.status());
    auto ids = tok->encode(*text);
    if (!ids) return report_error("eval", ids.status());
    ids->push_back(tok->eos_id());
    sizes.emplace_back(path, static_cast<int64_t>(ids->size()));
    if (tmp.path.empty()) {
      char tmpl[] = "/tmp/nibble-eval-XXXXXX";
      if (!mkdtemp(tmpl)) return report_error("eval", io_error("cannot create a temporary folder in /tmp"));
      tmp.path = tmpl;
    }
    std::string shard = tmp.path + "/" + std::to_string(shards.size()) + ".bin";
    Status s = train::write_token_shard(shard, *ids, tok->vocab_size());
    if (!s) return report_error("eval", s);
    shards.push_back(shard);
    if (interrupt_signal() != 0) return report_error("eval", cancelled_status("while tokenizing the data"));
  }
  int64_t windows = 0;  // as ValLoader counts them: (n - 1) / T per input of n >= T + 1 tokens
  for (const auto& [path, n] : sizes) windows += n >= T + 1 ? (n - 1) / T : 0;
  if (windows == 0) {
    std::string which;
    for (const auto& [path, n] : sizes) which += fmt::format("{}'{}' ({} tokens)", which.empty() ? "" : ", ", path, n);
    return report_error("eval", data_loss("data: too short: {} {} no window of seq_len + 1 = {} tokens (give more "
                                          "text or a smaller --seq-len)",
                                          which, sizes.size() == 1 ? "holds" : "hold", T + 1));
  }
  auto val = train::ValLoader::open(shards, B, T, a.batches);
  if (!val) return report_error("eval", Status(val.status().code(), "data: " + val.status().message()));
  NIB_LOG_INFO("eval: on {}", (*be)->name());
  auto e = train::evaluate(m->get(), *val, /*stop_on_interrupt=*/true);
  if (!e) return report_error("eval", e.status());
  if (a.json) {
    nlohmann::json j{{"loss", e->loss},      {"ppl", e->ppl},         {"tokens", e->tokens},
                     {"batches", e->batches}, {"checkpoint", ck->dir}, {"step", ck->step},
                     {"device", (*be)->name()}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("eval: loss %.4f  ppl %s  (%lld tokens in %lld batches of %lldx%lld; checkpoint %s, step %lld)\n",
                e->loss, train::ProgressBar::format_perplexity(e->ppl).c_str(), static_cast<long long>(e->tokens),
                static_cast<long long>(e->batches),
                static_cast<long long>(B), static_cast<long long>(T), ck->dir.c_str(), static_cast<long long>(ck->step));
  }
  return 0;
}

}  // namespace

NIBBLE_REGISTER_COMMAND(kEvalCommand, "eval", "Validation loss and perplexity of a checkpoint on text files or token shards",
                        [](CLI::App& app) -> CommandRun {
                          auto a = std::make_shared<EvalArgs>();
                          app.add_option("--checkpoint", a->checkpoint, "Run folder (uses its latest checkpoint) or step folder")
                              ->required();
                          app.add_option("--data", a->data, "Text files or NIBTOK shards (e.g. RUN/data/val.bin)")->required();
                          app.add_flag("--json", a->json, "Print one JSON object");
                          app.add_option("--batch-size", a->batch_size, "Sequences per batch (default: the run's)")
                              ->check(IntegerIn(1, kMaxEvalBatchSize));
                          app.add_option("--seq-len", a->seq_len,
                                         "Window length, at most the model's max_position_embeddings (default: the run's)")
                              ->check(IntegerIn(1, std::numeric_limits<int32_t>::max()));
                          app.add_option("--batches", a->batches, "At most this many batches (default 0: all)")
                              ->check(IntegerIn(0, std::numeric_limits<int64_t>::max()));
                          app.add_option("--recipe", a->recipe, "Evaluate with this linear recipe (default: the run's)");
                          add_device_option(app, &a->device);
                          return [a] { return run_eval(*a); };
                        });

}  // namespace nibble::tools
