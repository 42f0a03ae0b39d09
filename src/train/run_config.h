// The run config of `nibble pretrain`: one JSON file (model, recipe, seed, batch, schedule,
// optimizer, eval, checkpoint and data settings) merged over documented defaults, plus
// `--set dotted.key=value` overrides (values parsed as JSON when they parse, else strings), in
// the spirit of OLMo/torchtitan YAML configs with CLI overrides. Unknown keys and bad values give
// one-line errors naming the key. The resolved JSON is what a checkpoint stores (run_config.json).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "model/config.h"
#include "model/linear.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace nibble::train {

// The "task" section: what `nibble sft` (rl/sft.h) trains on, generated examples of a task with
// verifiable rewards (rl/task.h). Empty name: no task (pretraining refuses a config naming one).
struct TaskDataConfig {
  std::string name;                 // "arithmetic" | "countdown" | "sorting" (rl::task_names())
  std::vector<int64_t> levels{0};   // example k is of level levels[k % levels.size()]
  uint64_t seed = 1;                // the instances' Philox key
  int64_t train_examples = 2048;    // training rows (instance indices [0, n) of each level)
  int64_t val_examples = 128;       // validation rows (the next indices: held out)
  int64_t accuracy_examples = 64;   // greedy accuracy at each validation (the indices after those)
  int64_t max_new_tokens = 32;      // the accuracy check's generation limit
};

struct RunConfig {
  nlohmann::json json;            // the resolved config (defaults + file + overrides; model inlined)
  model::ModelConfig model;
  nlohmann::json model_json;      // the model's HF config object
  model::RecipeConfig recipe;
  uint64_t seed = 1234;
  int64_t batch_size = 8;         // sequences per micro-batch
  int64_t seq_len = 128;
  int64_t grad_accum = 1;         // micro-batches per optimizer step
  int64_t steps = 200;            // optimizer steps in total
  double lr = 1e-3;               // peak learning rate
  AdamWConfig adamw;
  double grad_clip = 1.0;         // global L2 norm; <= 0: off
  ScheduleConfig schedule;
  double z_loss = 1e-5;
  int64_t eval_interval = 50;     // steps between validations (0: only at the end)
  int64_t eval_batches = 8;       // validation batches (0: the whole validation split)
  int64_t checkpoint_interval = 100;  // steps between checkpoints (0: only at the end)
  int64_t keep_last = 2;          // checkpoints kept (>= 1)
  std::vector<std::string> data_files;  // text files or NIBTOK token shards; empty: the default corpus
  std::string tokenizer_file;     // sentencepiece .model to load ("" : train one on the corpus)
  std::vector<std::string> val_files;  // validation token shards (shard input only; empty: hold out the tail)
  std::string data_dir;           // prepared data folder ("" : <run dir>/data)
  int64_t vocab_size = 0;         // tokenizer vocabulary (0: the model's vocab_size)
  double val_fraction = 0.05;
  int64_t max_bad_steps = 5;      // consecutive NaN/Inf steps before aborting
  int threads = 0;                // OpenMP threads (0: leave the default)
  int64_t log_interval = 10;      // plain progress lines at its multiples (plus the first and last step)
  int64_t zero = 1;               // dist.zero: 1 = ZeRO-1 in a data-parallel run (train/zero.h), 0 = off
  int64_t bucket_elems = int64_t{1} << 22;  // dist.bucket_elems: FP32 elements per gradient bucket (16 MiB)
  int64_t overlap = 1;            // dist.overlap: 1 = buckets reduced during backward (train/grad_overlap.h), 0 = after it
  TaskDataConfig task;            // nibble sft only
};

// The defaults, as a JSON object (the schema: keys outside it are unknown, except inside
// "model", "recipe" and "schedule", which their own parsers check).
nlohmann::json default_run_config_json();

// Applies one "dotted.key=value" override to `j` (a run config object). Value: JSON if it parses
// (numbers, true/false, null, arrays, objects, quoted strings), else the raw string.
Status apply_override(nlohmann::json* j, const std::string& assignment);

// Merges `user` over the defaults (unknown keys are errors), applies `overrides`, inlines the
// model config (a path is read relative to the current folder, then to `base_dir`, then to the
// source tree) and validates everything.
Result<RunConfig> resolve_run_config(const nlohmann::json& user, const std::vector<std::string>& overrides,
                                     const std::string& base_dir = "");
// Reads `path` (JSON) and resolves it (base_dir = the file's folder). Relative data paths in the
// file (data.files, data.val_files, data.tokenizer, data.dir) are made relative to its folder
// first; `overrides` keep theirs (relative to the current folder). A missing file or one that is
// not a JSON object is kNotFound / kDataLoss (bad input), a bad key or value kInvalidArgument.
Result<RunConfig> load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});

}  // namespace nibble::train
