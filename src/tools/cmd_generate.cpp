// `nibble generate`: samples text from a checkpoint on the rollout engine (rollout/engine.h: paged
// KV cache, temperature / top-k / top-p, Philox per seed and sample), streaming one --prompt to
// stdout token by token, at most the model's context minus the prompt; or, with `--prompts FILE`
// (one prompt per line, or JSON lines with "prompt"), G samples per prompt batched continuously,
// written as JSON lines (text, tokens, log-probs, finish reason) to `--out FILE` (never over an
// existing file without --force, never over the prompts or into the checkpoint), progress on
// stderr. `--mode` picks the linears' precision (recipe: the run's own, as before; bf16, w4a16,
// w4a4). `--dump-logits FILE` also writes the prompt's logits (T, V) F32 and ids (T) I32 from the
// training forward as safetensors, to compare with transformers after `nibble export --to hf`;
// never into the checkpoint's folders, nor over a file that is not an earlier logits dump. The
// model runs on the backend of --device (tools/device_option.h); a backend without the engine's
// paged KV-cache ops streams one prompt through the training forward as before the engine.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>

#include <nlohmann/json.hpp>

#include "io/atomic_file.h"
#include "io/output_guard.h"
#include "io/safetensors.h"
#include "core/log.h"
#include "tools/command.h"
#include "tools/device_option.h"
#include "tools/generation_model.h"
#include "rollout/engine.h"
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
  // the engine
  std::string prompts, out, mode = "recipe", kv_dtype = "bf16";
  bool force = false;
  int64_t samples = 1, batch = 16, top_k = 0;
  std::vector<std::string> stop;
};

// The prompts of --prompts: one per line (blank lines skipped), or a JSON object with a string
// "prompt" on a line that starts with '{'. line: 1-based line number of each prompt.
struct PromptLine {
  int64_t line = 0;
  std::string text;
};
Result<std::vector<PromptLine>> read_prompts(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return not_found("--prompts '{}' is not a readable file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("--prompts '{}' cannot be opened", path);
  std::vector<PromptLine> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    if (line[0] != '{') {
      out.push_back({n, line});
      continue;
    }
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("prompt") || !j["prompt"].is_string())
      return data_loss("--prompts '{}' line {}: a JSON line needs a string \"prompt\"", path, n);
    out.push_back({n, j["prompt"].get<std::string>()});
  }
  if (in.bad()) return io_error("--prompts '{}': read error", path);
  if (out.empty()) return data_loss("--prompts '{}' holds no prompt", path);
  return out;
}

// Where --out may write: not over an existing file without --force, never over the prompts
// file, never inside the checkpoint being read.
Status check_out_target(const train::Checkpoint& ck, const GenerateArgs& a) {
  namespace fs = std::filesystem;
  if (a.out.empty()) return invalid_argument("--prompts needs --out FILE for the JSON lines");
  std::error_code ec;
  if (io::same_file(a.out, a.prompts)) return invalid_argument("--out '{}' is the --prompts file", a.out);
  if (io::path_within(a.out, io::resolved_path(ck.dir)))
    return invalid_argument("--out '{}' is inside the checkpoint being read: choose a path outside it", a.out);
  if (fs::exists(fs::symlink_status(a.out, ec))) {
    if (!a.force) return invalid_argument("--out '{}' exists: pass --force to replace it", a.out);
    if (fs::is_directory(a.out, ec)) return invalid_argument("--out '{}' is a folder", a.out);
  }
  return Status::ok();
}

Result<rollout::EngineOptions> engine_options(const GenerateArgs& a) {
  rollout::EngineOptions o;
  NIB_ASSIGN_OR_RETURN(o.mode, rollout::parse_precision_mode(a.mode));
  if (a.kv_dtype == "f32") o.kv_format = backend::KvPageFormat::kF32;
  else if (a.kv_dtype == "fp8") o.kv_format = backend::KvPageFormat::kFp8;
  else if (a.kv_dtype == "nvfp4") o.kv_format = backend::KvPageFormat::kNvfp4;
  else if (a.kv_dtype != "bf16") return invalid_argument("--kv-dtype '{}': bf16, fp8, nvfp4 or f32", a.kv_dtype);
  o.max_batch = a.batch;
  return o;
}

rollout::GenerationParams generation_params(const GenerateArgs& a, int32_t eos) {
  rollout::GenerationParams g;
  g.sampling = rollout::SamplingParams{a.sampling.temperature, a.top_k, a.sampling.top_p};
  g.max_new_tokens = a.sampling.max_new_tokens;
  if (!a.no_stop) g.stop_ids = {eos};
  g.stop_strings = a.stop;
  g.seed = a.sampling.seed;
  g.num_samples = a.samples;
  return g;
}

// The text of a completion: its tokens without a final eos, cut before the first stop string.
Result<std::string> completion_text(const train::Tokenizer& tok, const rollout::Completion& c,
                                    const std::vector<std::string>& stops) {
  std::vector<int32_t> ids = c.tokens;
  if (c.finish == rollout::FinishReason::kStopId && !ids.empty()) ids.pop_back();
  NIB_ASSIGN_OR_RETURN(std::string text, tok.decode(ids));
  size_t cut = std::string::npos;
  for (const std::string& s : stops) cut = std::min(cut, text.find(s));
  if (cut != std::string::npos) text.resize(cut);
  return text;
}

// --prompts FILE --out FILE: every prompt's G samples through the engine, JSON lines in
// (prompt, sample) order written atomically at the end; progress on stderr.
int run_prompts_file(const GenerateArgs& a, const GenerationModel& gm, const train::Tokenizer& tok) {
  const model::Model& m = *gm.model;
  auto lines = read_prompts(a.prompts);
  if (!lines) return report_error("generate", lines.status());
  if (lines->size() > 65536) return report_error("generate", data_loss("--prompts holds more than 65536 prompts"));
  const int64_t context = m.config().max_position_embeddings;
  std::vector<rollout::Request> reqs;
  for (const PromptLine& pl : *lines) {
    auto ids = tok.encode(pl.text);
    if (!ids) return report_error("generate", ids.status());
    if (ids->empty())
      return report_error("generate", data_loss("--prompts line {}: the prompt encodes to no tokens", pl.line));
    if (static_cast<int64_t>(ids->size()) > context)
      return report_error("generate", data_loss("--prompts line {}: prompt of {} tokens is longer than the model's "
                                                "context of {} tokens", pl.line, ids->size(), context));
    rollout::Request r;
    r.prompt = std::move(*ids);
    r.params = generation_params(a, tok.eos_id());
    r.id = static_cast<uint64_t>(reqs.size());
    reqs.push_back(std::move(r));
  }
  if (!gm.engine)
    return report_error("generate", unimplemented("backend '{}' has no paged KV-cache ops yet (issue #15): --prompts "
                                                  "needs --device cpu", m.backend().name()));
  rollout::Engine& engine = *gm.engine;
  const int64_t total = static_cast<int64_t>(reqs.size()) * a.samples;
  const bool tty = isatty(fileno(stderr)) == 1;
  int64_t finished = 0, tokens = 0;
  rollout::EngineCallbacks cb;
  cb.detokenize = [&](std::span<const int32_t> ids) { return tok.decode(ids); };
  cb.on_finish = [&](const rollout::Completion& c) -> Status {
    ++finished;
    tokens += static_cast<int64_t>(c.tokens.size());
    if (tty) std::fprintf(stderr, "\rnibble generate: %lld/%lld samples, %lld tokens", static_cast<long long>(finished),
                          static_cast<long long>(total), static_cast<long long>(tokens));
    return Status::ok();
  };
  auto out = engine.generate(reqs, cb);
  if (tty) std::fputc('\n', stderr);
  if (!out) return report_error("generate", out.status());
  auto w = io::AtomicFileWriter::create(a.out);
  if (!w) return report_error("generate", w.status());
  w->stop_on_interrupt();
  for (const rollout::Completion& c : *out) {
    auto text = completion_text(tok, c, a.stop);
    if (!text) return report_error("generate", text.status());
    nlohmann::json j = {{"index", c.request},
                        {"line", (*lines)[c.request].line},
                        {"sample", c.sample},
                        {"prompt", (*lines)[c.request].text},
                        {"text", *text},
                        {"tokens", c.tokens},
                        {"logprobs", c.logprobs},
                        {"finish_reason", rollout::finish_reason_name(c.finish)}};
    const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    if (Status s = w->append(line.data(), line.size()); !s) return report_error("generate", s);
  }
  if (Status s = w->commit(); !s) return report_error("generate", s);
  const auto& st = engine.stats();
  std::fprintf(stderr,
               "nibble generate: %lld samples of %zu prompts, %lld new tokens in %lld steps (mode %s, %s storage) -> "
               "%s (cuda graphs %s, %lld steps replayed)\n",
               static_cast<long long>(total), reqs.size(), static_cast<long long>(st.generated_tokens),
               static_cast<long long>(st.steps), rollout::precision_mode_name(engine.options().mode),
               gm.inference_storage() ? "inference" : "training", a.out.c_str(), engine.decode_graphs_status().c_str(),
               static_cast<long long>(st.graph_replays));
  return 0;
}

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
  const bool file_mode = !a.prompts.empty();
  if (file_mode && (!a.prompt.empty() || !a.dump_logits.empty()))
    return report_error("generate", invalid_argument("--prompts goes without --prompt and --dump-logits"));
  if (!file_mode && (!a.out.empty() || a.samples != 1))
    return report_error("generate", invalid_argument("--out and --samples go with --prompts FILE"));
  if (a.samples > a.batch)
    return report_error("generate", invalid_argument("--samples {} exceeds --batch {}", a.samples, a.batch));
  if (file_mode)
    if (Status s = check_out_target(*ck, a); !s) return report_error("generate", s);
  model::RecipeConfig rc;
  const model::RecipeConfig* rcp = nullptr;
  if (!a.recipe.empty()) {
    auto r = model::parse_recipe_config(nlohmann::json(a.recipe));
    if (!r) return report_error("generate", r.status());
    rc = *r;
    rcp = &rc;
  }
  auto eo = engine_options(a);
  if (!eo) return report_error("generate", eo.status());
  // bf16 / w4a16 / w4a4: inference storage, unless --dump-logits needs the training forward
  auto gm = load_generation_model(*ck, rcp, *eo, **be, /*training_forward=*/!a.dump_logits.empty());
  if (!gm) return report_error("generate", gm.status());
  model::Model* m = gm->model.get();
  auto tok = train::Tokenizer::load(ck->tokenizer_path);
  if (!tok) return report_error("generate", tok.status());
  if (file_mode) return run_prompts_file(a, *gm, *tok);
  auto ids = tok->encode(a.prompt);
  if (!ids) return report_error("generate", ids.status());
  if (ids->empty()) ids->push_back(tok->eos_id());  // an empty prompt starts a new document
  // The model sees at most max_position_embeddings tokens: cap the new ones to what is left
  // after the prompt (one line on stderr says so) instead of sliding the window.
  const int64_t context = m->config().max_position_embeddings;
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
    Status s = train::context_logits(&logits, m, *ids);
    if (!s) return report_error("generate", s);
    const int64_t T = static_cast<int64_t>(ids->size()), V = m->config().vocab_size;
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
  // With --stop the last (longest stop string - 1) bytes wait too, and the text of the token that
  // completes a stop string is cut before it (the sample ends there): nothing printed reaches one.
  size_t hold = 0;
  for (const std::string& st : a.stop) hold = std::max(hold, st.size() - 1);
  std::string printed;
  std::vector<int32_t> shown;
  auto emit = [&](std::string text, bool final) -> Status {
    static const std::string kReplacement = "\xEF\xBF\xBD";
    while (!final && text.size() >= kReplacement.size() &&
           text.compare(text.size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0)
      text.resize(text.size() - kReplacement.size());
    if (!final) {  // up to a stop string the last token completed, else all but the held-back bytes
      size_t cut = std::string::npos;
      for (const std::string& st : a.stop) cut = std::min(cut, text.find(st));
      text.resize(cut != std::string::npos ? cut : text.size() > hold ? text.size() - hold : 0);
    }
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
  Result<std::vector<int32_t>> out = std::vector<int32_t>{};
  if (gm->engine) {
    rollout::Request req;
    req.prompt = *ids;
    req.params = generation_params(a, tok->eos_id());
    req.params.stop_ids = {};
    if (a.sampling.stop_id >= 0) req.params.stop_ids = {a.sampling.stop_id};
    rollout::EngineCallbacks cb;
    cb.detokenize = [&](std::span<const int32_t> t) { return tok->decode(t); };
    cb.on_token = [&](int64_t, int64_t, int32_t id) { return on_token(id); };
    auto done = gm->engine->generate({req}, cb);
    if (done) out = std::move((*done)[0].tokens);
    else out = done.status();
    if (done && (*done)[0].finish == rollout::FinishReason::kStopString) {  // cut before the stop string
      auto text = completion_text(*tok, (*done)[0], a.stop);
      if (!text) return report_error("generate", text.status());
      if (Status s = emit(*text, /*final=*/true); !s) return report_error("generate", s);
      std::printf("\n");
      return 0;
    }
  } else if (eo->mode != rollout::PrecisionMode::kRecipe || a.top_k > 0 || !a.stop.empty()) {
    return report_error("generate", unimplemented("backend '{}' has no paged KV-cache ops yet (issue #15): --mode, "
                                                  "--top-k and --stop need --device cpu", (*be)->name()));
  } else {
    NIB_LOG_DEBUG("generate: {} has no paged KV-cache ops: recomputing the context per token", (*be)->name());
    out = train::generate_tokens(m, *ids, a.sampling, on_token);
  }
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
                          app.add_option("--top-k", a->top_k, "Keep the k most likely tokens before top-p; 0 = off (default)")
                              ->check(IntegerIn(0, std::numeric_limits<int32_t>::max()));
                          app.add_option("--stop", a->stop, "Stop a sample when its text contains this string (repeatable)");
                          app.add_option("--mode", a->mode,
                                         "Linear precision: recipe (the run's, default), bf16, w4a16, w4a4");
                          app.add_option("--kv-dtype", a->kv_dtype, "KV cache pages: bf16 (default), fp8, nvfp4 or f32");
                          app.add_option("--prompts", a->prompts,
                                         "File of prompts (one per line, or JSON lines with \"prompt\"): JSON lines to --out");
                          app.add_option("--out", a->out, "JSON lines output of --prompts (text, tokens, logprobs, finish_reason)");
                          app.add_flag("--force", a->force, "Replace an existing --out file");
                          app.add_option("--samples", a->samples, "Samples per prompt of --prompts (G, default 1)")
                              ->check(IntegerIn(1, 65535));
                          app.add_option("--batch", a->batch, "Sequences decoded at once (default 16)")
                              ->check(IntegerIn(1, 65536));
                          add_device_option(app, &a->device);
                          return [a] { return run_generate(*a); };
                        });

}  // namespace nibble::tools
