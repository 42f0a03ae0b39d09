// `nibble sft` (issue #16 item 2): a supervised warm start on generated task solutions before RL,
// run by the pretraining trainer (train/trainer.h) with its checkpoints, resume and metrics. Each
// example is one row: encode(prompt) ++ encode(solution) ++ [eos], padded; the loss is on the
// answer tokens only (the solution and its eos; prompt and padding targets are ignored, -1).
// After each validation the model answers held-out instances greedily through the rollout engine
// (rollout/engine.h) and the task's reward scores them: "accuracy" in metrics.jsonl. The
// tokenizer is trained on task text (digits split) or loaded (data.tokenizer); see docs/rl.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/transformer.h"
#include "rl/task.h"
#include "train/loader.h"
#include "train/run_config.h"
#include "train/tokenizer.h"
#include "train/trainer.h"

namespace nibble::rl {

// The text a task tokenizer is trained on (by `nibble sft`, and by `nibble rl` for a model
// without a checkpoint): prompt + solution of 200 instances of every level,
// drawn under seed + 7919 (a key the SFT splits, drawn under seed, do not use).
std::vector<std::string> task_tokenizer_texts(const Task& task, uint64_t seed);

// The SFT splits of a TaskDataConfig: example k is instance (levels[k % L], seed, base + k / L)
// with L = levels.size(); each split starts where the previous one ends, so per level the train,
// validation and accuracy indices are disjoint (held out). A level outside the task's is an error.
enum class SftSplit { kTrain, kValidation, kAccuracy };
Result<std::vector<TaskInstance>> sft_instances(const Task& task, const train::TaskDataConfig& config, SftSplit split);

// The prompt's token ids as the model sees them (encode(prompt); no bos), and the answer's
// (encode(solution) then eos): the row an example trains on is their concatenation.
Result<std::vector<int32_t>> prompt_tokens(const train::Tokenizer& tokenizer, const TaskInstance& instance);

// Rows (count, seq_len) of the examples: tokens padded with the pad id; targets the next token
// at the positions that predict an answer token (the last prompt token .. the last solution
// token), -1 elsewhere. An example longer than seq_len + 1 tokens is an error naming seq_len.
Result<train::Rows> sft_rows(const train::Tokenizer& tokenizer, const std::vector<TaskInstance>& instances,
                             int64_t seq_len);

struct AccuracyResult {
  int64_t correct = 0, total = 0;
  double accuracy = 0;       // correct / total (reward 1)
  double mean_tokens = 0;    // generated tokens per answer (eos included)
};
// Greedy answers (temperature 0, stop at eos, at most max_new_tokens) of `model` in its own
// recipe's precision, through the rollout engine, scored by the task's reward.
Result<AccuracyResult> greedy_accuracy(model::Model& model, const train::Tokenizer& tokenizer, const Task& task,
                                       const std::vector<TaskInstance>& instances, int64_t max_new_tokens);

// Trains per `config` (config.task names the task): `options` as for run_pretraining, whose
// row_data and after_validation this sets. A fresh run trains the tokenizer into RUN_DIR/data/
// (or copies data.tokenizer there); a resume takes the checkpoint's, so the rows are the same.
Result<train::TrainResult> run_sft(const train::RunConfig& config, train::TrainOptions options);

}  // namespace nibble::rl
