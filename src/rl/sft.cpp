// The SFT warm start (sft.h): task examples as rows for the pretraining trainer, the task
// tokenizer, and greedy held-out accuracy through the rollout engine. run_sft fills the
// trainer's two seams (TrainOptions::row_data, after_validation) and runs run_pretraining, so
// the loop, checkpoints and resume are pretraining's own.
#include "rl/sft.h"

#include <filesystem>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "rollout/engine.h"
#include "train/atomic_dir.h"

namespace nibble::rl {

namespace fs = std::filesystem;

std::vector<std::string> task_tokenizer_texts(const Task& task, uint64_t seed) {
  std::vector<std::string> texts;
  for (int level = 0; level < task.num_levels(); ++level)
    for (int64_t i = 0; i < 200; ++i) {
      TaskInstance inst = task.make(level, seed + 7919, i);
      texts.push_back(inst.prompt + inst.solution);
    }
  return texts;
}

Result<std::vector<TaskInstance>> sft_instances(const Task& task, const train::TaskDataConfig& config, SftSplit split) {
  const int64_t L = static_cast<int64_t>(config.levels.size());
  for (int64_t level : config.levels)
    if (level < 0 || level >= task.num_levels())
      return invalid_argument("task.levels: {} has levels 0..{}, not {}", task.name(), task.num_levels() - 1, level);
  auto per_level = [&](int64_t n) { return (n + L - 1) / L; };  // indices a split of n takes per level
  int64_t base = 0, count = config.train_examples;
  if (split != SftSplit::kTrain) {
    base = per_level(config.train_examples);
    count = config.val_examples;
  }
  if (split == SftSplit::kAccuracy) {
    base += per_level(config.val_examples);
    count = config.accuracy_examples;
  }
  std::vector<TaskInstance> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k)
    out.push_back(task.make(static_cast<int>(config.levels[static_cast<size_t>(k % L)]), config.seed, base + k / L));
  return out;
}

Result<std::vector<int32_t>> prompt_tokens(const train::Tokenizer& tokenizer, const TaskInstance& instance) {
  return tokenizer.encode(instance.prompt);
}

Result<train::Rows> sft_rows(const train::Tokenizer& tokenizer, const std::vector<TaskInstance>& instances,
                             int64_t seq_len) {
  train::Rows rows;
  rows.count = static_cast<int64_t>(instances.size());
  rows.seq_len = seq_len;
  rows.tokens.assign(static_cast<size_t>(rows.count * seq_len), tokenizer.pad_id());
  rows.targets.assign(static_cast<size_t>(rows.count * seq_len), -1);
  for (int64_t r = 0; r < rows.count; ++r) {
    const TaskInstance& inst = instances[static_cast<size_t>(r)];
    NIB_ASSIGN_OR_RETURN(std::vector<int32_t> seq, prompt_tokens(tokenizer, inst));
    const int64_t prompt_len = static_cast<int64_t>(seq.size());
    NIB_ASSIGN_OR_RETURN(std::vector<int32_t> answer, tokenizer.encode(inst.solution));
    seq.insert(seq.end(), answer.begin(), answer.end());
    seq.push_back(tokenizer.eos_id());
    const int64_t n = static_cast<int64_t>(seq.size());
    if (prompt_len == 0) return data_loss("task example '{}' has an empty prompt", inst.prompt);
    if (n > seq_len + 1)
      return invalid_argument("run config: bad value for 'seq_len': {} is too short for the task's example '{}{}' "
                              "({} tokens with eos: seq_len must be at least {})",
                              seq_len, inst.prompt, inst.solution, n, n - 1);
    int32_t* tokens = rows.tokens.data() + r * seq_len;
    int32_t* targets = rows.targets.data() + r * seq_len;
    for (int64_t t = 0; t + 1 < n; ++t) {
      tokens[t] = seq[static_cast<size_t>(t)];
      // position t predicts token t+1: an answer token when t+1 >= prompt_len
      if (t + 1 >= prompt_len) targets[t] = seq[static_cast<size_t>(t + 1)];
    }
  }
  return rows;
}

Result<AccuracyResult> greedy_accuracy(model::Model& model, const train::Tokenizer& tokenizer, const Task& task,
                                       const std::vector<TaskInstance>& instances, int64_t max_new_tokens) {
  AccuracyResult r;
  if (instances.empty()) return r;
  rollout::EngineOptions eo;
  eo.mode = rollout::PrecisionMode::kRecipe;
  NIB_ASSIGN_OR_RETURN(auto engine, rollout::Engine::create(model, eo));
  std::vector<rollout::Request> requests;
  for (size_t i = 0; i < instances.size(); ++i) {
    rollout::Request q;
    NIB_ASSIGN_OR_RETURN(q.prompt, prompt_tokens(tokenizer, instances[i]));
    q.params.sampling.temperature = 0;  // greedy
    q.params.max_new_tokens = max_new_tokens;
    q.params.stop_ids = {tokenizer.eos_id()};
    q.id = i;
    requests.push_back(std::move(q));
  }
  NIB_ASSIGN_OR_RETURN(std::vector<rollout::Completion> completions, engine->generate(requests));
  int64_t tokens = 0;
  for (const rollout::Completion& c : completions) {
    std::vector<int32_t> ids = c.tokens;
    if (c.finish == rollout::FinishReason::kStopId && !ids.empty()) ids.pop_back();  // eos is not text
    NIB_ASSIGN_OR_RETURN(std::string text, tokenizer.decode(ids));
    r.correct += task.reward(instances[static_cast<size_t>(c.request)], text) == 1.0;
    tokens += static_cast<int64_t>(c.tokens.size());
  }
  r.total = static_cast<int64_t>(instances.size());
  r.accuracy = static_cast<double>(r.correct) / static_cast<double>(r.total);
  r.mean_tokens = static_cast<double>(tokens) / static_cast<double>(r.total);
  return r;
}

namespace {

// The run's tokenizer: the resumed checkpoint's; else data.tokenizer's; else one trained on
// the task's text. The run keeps it as RUN_DIR/data/tokenizer.model once its rows are made.
Result<train::Tokenizer> sft_tokenizer(const train::RunConfig& config, const Task& task,
                                       const std::string& resume_checkpoint) {
  if (!resume_checkpoint.empty()) return train::Tokenizer::load((fs::path(resume_checkpoint) / "tokenizer.model").string());
  if (!config.tokenizer_file.empty()) return train::Tokenizer::load(config.tokenizer_file);
  train::TokenizerTrainOptions to;
  to.vocab_size = static_cast<int>(config.vocab_size);
  to.hard_vocab_limit = false;  // task text is small: fewer pieces than asked is fine
  to.vocab_size_name = "data.vocab_size";
  return train::Tokenizer::train(task_tokenizer_texts(task, config.task.seed), to);
}

}  // namespace

Result<train::TrainResult> run_sft(const train::RunConfig& config, train::TrainOptions options) {
  if (config.task.name.empty())
    return invalid_argument("run config: 'task.name' is empty: name the task to train on ({})",
                            fmt::format("{}", fmt::join(task_names(), ", ")));
  auto task_or = make_task(config.task.name);
  if (!task_or) return invalid_argument("run config: bad value for 'task.name': {}", task_or.status().message());
  std::shared_ptr<const Task> task = std::move(task_or).value();
  // Checked before the trainer touches the run folder.
  NIB_RETURN_IF_ERROR(sft_instances(*task, config.task, SftSplit::kAccuracy).status());
  auto tokenizer = std::make_shared<std::unique_ptr<train::Tokenizer>>();
  auto accuracy_set = std::make_shared<std::vector<TaskInstance>>();
  const std::string run_dir = options.run_dir;
  options.row_data = [task, tokenizer, accuracy_set, run_dir](const train::RunConfig& cfg,
                                                              const std::string& resume) -> Result<train::RowData> {
    train::RowData d;
    NIB_ASSIGN_OR_RETURN(train::Tokenizer tok, sft_tokenizer(cfg, *task, resume));
    if (tok.vocab_size() > cfg.model.vocab_size)
      return invalid_argument("the tokenizer has {} pieces, more than the model's vocab_size {}", tok.vocab_size(),
                              cfg.model.vocab_size);
    NIB_ASSIGN_OR_RETURN(auto train_set, sft_instances(*task, cfg.task, SftSplit::kTrain));
    NIB_ASSIGN_OR_RETURN(auto val_set, sft_instances(*task, cfg.task, SftSplit::kValidation));
    NIB_ASSIGN_OR_RETURN(*accuracy_set, sft_instances(*task, cfg.task, SftSplit::kAccuracy));
    NIB_ASSIGN_OR_RETURN(train::Rows train_rows, sft_rows(tok, train_set, cfg.seq_len));
    NIB_ASSIGN_OR_RETURN(train::Rows val_rows, sft_rows(tok, val_set, cfg.seq_len));
    // Checkpoints copy it from here (a resumed checkpoint's folder may be pruned while the run goes on).
    const fs::path data = fs::path(run_dir) / "data";
    NIB_RETURN_IF_ERROR(train::make_dirs(data.string()));
    d.tokenizer_path = (data / "tokenizer.model").string();
    NIB_RETURN_IF_ERROR(tok.save(d.tokenizer_path));
    d.train = std::make_shared<const train::Rows>(std::move(train_rows));
    d.val = std::make_shared<const train::Rows>(std::move(val_rows));
    d.description = fmt::format("task {} levels [{}] seed {}: {} train / {} validation / {} accuracy examples, "
                                "tokenizer {} ({} pieces)",
                                task->name(), fmt::join(cfg.task.levels, ","), cfg.task.seed, d.train->count,
                                d.val->count, accuracy_set->size(), d.tokenizer_path, tok.vocab_size());
    *tokenizer = std::make_unique<train::Tokenizer>(std::move(tok));
    return d;
  };
  const int64_t max_new_tokens = config.task.max_new_tokens;
  if (config.task.accuracy_examples == 0) return train::run_pretraining(config, options);
  options.after_validation = [task, tokenizer, accuracy_set, max_new_tokens](
                                 model::Model& model, int64_t) -> Result<nlohmann::json> {
    NIB_ASSIGN_OR_RETURN(AccuracyResult a, greedy_accuracy(model, **tokenizer, *task, *accuracy_set, max_new_tokens));
    return nlohmann::json{{"accuracy", a.accuracy}, {"accuracy_correct", a.correct}, {"accuracy_total", a.total},
                          {"accuracy_mean_tokens", a.mean_tokens}};
  };
  return train::run_pretraining(config, options);
}

}  // namespace nibble::rl
