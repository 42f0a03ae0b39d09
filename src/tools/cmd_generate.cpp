// `nibble generate`: samples text from a checkpoint (train/generate.h: temperature, top-p,
// Philox per seed), streaming it to stdout token by token, at most the model's context minus the
// prompt; `--dump-logits FILE` also writes the prompt's logits (T, V) F32 and ids (T) I32 as
// safetensors, to compare with transformers after `nibble export --to hf`; never into the
// checkpoint's folders, nor over a file that is not an earlier logits dump. The model runs on the
// backend of --device (tools/device_option.h), whichever device trained the checkpoint.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>

#include <nlohmann/json.hpp>

#include "io/output_guard.h"
#include "io/safetensors.h"
#include "core/log.h"
#include "tools/command.h"
#include "tools/device_option.h"
#include "tools/option_check.h"
#include "train/checkpoint.h"
#include "train/generate.h"
#include "train/tokenizer.h"

namespace nibble::tools {
namespace {

struct GenerateArgs {
  std::string checkpoint, prompt, dump_logits, recipe, device;
  train::SamplingOptions sampling;
  bool no_stop = false;
};

// Where --dump-logits may write: outside the checkpoint's step and run folders, and over an
// existing file only when it is an earlier dump (a safetensors file of input_ids and logits).
Status check_dump_target(const train::Checkpoint& ck, const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path step(io::resolved_path(ck.dir));
  std::vector<std::string> folders{step.string()};
  if (step.parent_path().filename() == "checkpoints") folders.push_back(step.parent_path().parent_path().string());
  for (const std::string& f : folders)
    if (io::path_within(path, f))
      return invalid_argument("--dump-logits '{}' is inside the checkpoint being read ('{}'): choose a path outside it",
                              path, f);
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return Status::ok();
  auto f = io::SafetensorsFile::open(path);
  if (!f || f->names().size() != 2 || !f->contains("input_ids") || !f->contains("logits"))
    return invalid_argument("--dump-logits '{}' exists and is not an earlier logits dump: choose a new path", path);
  return Status::ok();
}

int run_generate(GenerateArgs a) {
  auto be = open_device(a.device);
  if (!be) return report_error("generate", be.status());
  auto ck = train::open_checkpoint(a.checkpoint);
  if (!ck) return report_error("generate", ck.status());
  if (!a.dump_logits.empty())
    if (Status s = check_dump_target(*ck, a.dump_logits); !s) return report_error("generate", s);
  model::RecipeConfig rc;
  const model::RecipeConfig* rcp = nullptr;
  if (!a.recipe.empty()) {
    auto r = model::parse_recipe_config(nlohmann::json(a.recipe));
    if (!r) return report_error("generate", r.status());
    rc = *r;
    rcp = &rc;
  }
  auto m = train::load_checkpoint_model(*ck, rcp, **be);
  if (!m) return report_error("generate", m.status());
  auto tok = train::Tokenizer::load(ck->tokenizer_path);
  if (!tok) return report_error("generate", tok.status());
  auto ids = tok->encode(a.prompt);
  if (!ids) return report_error("generate", ids.status());
  if (ids->empty()) ids->push_back(tok->eos_id());  // an empty prompt starts a new document
  // The model sees at most max_position_embeddings tokens: cap the new ones to what is left
  // after the prompt (one line on stderr says so) instead of sliding the window.
  const int64_t context = (*m)->config().max_position_embeddings;
  const int64_t prompt_tokens = static_cast<int64_t>(ids->size());
  if (prompt_tokens > context)
    return report_error("generate", invalid_argument("--prompt is {} tokens, more than the model's context of {} "
                                                     "(max_position_embeddings)", prompt_tokens, context));
  if (a.sampling.max_new_tokens > context - prompt_tokens) {
    std::fprintf(stderr, "nibble generate: --max-new-tokens %lld capped to %lld (max_position_embeddings %lld minus the "
                 "%lld-token prompt)\n", static_cast<long long>(a.sampling.max_new_tokens),
                 static_cast<long long>(context - prompt_tokens), static_cast<long long>(context),
                 static_cast<long long>(prompt_tokens));
    a.sampling.max_new_tokens = context - prompt_tokens;
  }
  if (!a.dump_logits.empty()) {
    std::vector<float> logits;
    Status s = train::context_logits(&logits, m->get(), *ids);
    if (!s) return report_error("generate", s);
    const int64_t T = static_cast<int64_t>(ids->size()), V = (*m)->config().vocab_size;
    Tensor lt(DType::kF32, Shape{T, V});
    std::copy(logits.begin(), logits.end(), lt.data<float>());
    Tensor it(DType::kI32, Shape{T});
    std::copy(ids->begin(), ids->end(), it.data<int32_t>());
    s = io::write_safetensors(a.dump_logits, {{"input_ids", it}, {"logits", lt}});
    if (!s) return report_error("generate", s);
  }
  a.sampling.stop_id = a.no_stop ? -1 : tok->eos_id();
  // Debug level (-v): stdout is the text and stderr stays empty unless something needs saying.
  NIB_LOG_DEBUG("generate: on {}", (*be)->name());

  // Streamed: the prompt at once, then each token's text as soon as it is sampled (stdout
  // flushed per token). Pieces are not always whole characters (byte fallback), so the new ids
  // are decoded together and only the text past what was printed is written, holding back a
  // trailing U+FFFD that may be a character whose bytes have not all arrived.
  std::string printed;
  std::vector<int32_t> shown;
  auto emit = [&](std::string text, bool final) -> Status {
    static const std::string kReplacement = "\xEF\xBF\xBD";
    while (!final && text.size() >= kReplacement.size() &&
           text.compare(text.size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0)
      text.resize(text.size() - kReplacement.size());
    if (text.size() <= printed.size() || text.compare(0, printed.size(), printed) != 0) return Status::ok();
    const std::string more = text.substr(printed.size());
    if (std::fwrite(more.data(), 1, more.size(), stdout) != more.size() || std::fflush(stdout) != 0)
      return io_error("cannot write to stdout");
    printed = std::move(text);
    return Status::ok();
  };
  if (std::fputs(a.prompt.c_str(), stdout) < 0 || std::fflush(stdout) != 0)
    return report_error("generate", io_error("cannot write to stdout"));
  auto on_token = [&](int32_t id) -> Status {
    if (id == a.sampling.stop_id) return Status::ok();  // eos ends the text, it is not part of it
    shown.push_back(id);
    NIB_ASSIGN_OR_RETURN(std::string text, tok->decode(shown));
    return emit(std::move(text), /*final=*/false);
  };
  auto out = train::generate_tokens(m->get(), *ids, a.sampling, on_token);
  if (!out) {
    std::fputc('\n', stdout);  // the error line on stderr stays a line of its own on a terminal
    return report_error("generate", out.status());
  }
  auto text = tok->decode(shown);
  if (!text) return report_error("generate", text.status());
  if (Status s = emit(std::move(*text), /*final=*/true); !s) return report_error("generate", s);
  std::printf("\n");
  return 0;
}

}  // namespace

NIBBLE_REGISTER_COMMAND(kGenerateCommand, "generate", "Sample text from a checkpoint (temperature, top-p, seed)",
                        [](CLI::App& app) -> CommandRun {
                          auto a = std::make_shared<GenerateArgs>();
                          app.add_option("--checkpoint", a->checkpoint, "Run folder (uses its latest checkpoint) or step folder")
                              ->required();
                          app.add_option("--prompt", a->prompt, "Prompt text (empty: start a new document)");
                          app.add_option("--max-new-tokens", a->sampling.max_new_tokens,
                                         "Tokens to sample (default 64; capped to the model's context minus the prompt)")
                              ->check(IntegerIn(0, std::numeric_limits<int64_t>::max()));
                          app.add_option("--temperature", a->sampling.temperature, "Softmax temperature; 0 = greedy (default 0.8)")
                              ->check(FiniteIn(0, INFINITY));
                          app.add_option("--top-p", a->sampling.top_p, "Nucleus mass in (0, 1] (default 0.95)")
                              ->check(FiniteIn(0, 1, /*lo_open=*/true));
                          app.add_option("--seed", a->sampling.seed, "Sampling seed (Philox; default 0)")->check(Unsigned64());
                          app.add_flag("--no-stop", a->no_stop, "Do not stop at eos");
                          app.add_option("--dump-logits", a->dump_logits,
                                         "Write the prompt's logits (T,V) and input_ids to this safetensors file");
                          app.add_option("--recipe", a->recipe, "Run the model with this linear recipe (default: the run's)");
                          add_device_option(app, &a->device);
                          return [a] { return run_generate(*a); };
                        });

}  // namespace nibble::tools
