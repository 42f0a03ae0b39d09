// `nibble bench rl` (issue #16 item 7): RL step time split into rollout, log-prob recompute,
// train and weight sync per arm, on a model config with random weights and a task of rl/task.h,
// through the RL loop itself (run_rl, no checkpoints). Each arm runs `steps` steps; the first is a
// warm-up and is dropped, the rest give medians. The summary: the `trace` arm's step-time overhead
// over `fp4-naive` (median step time ratio - 1) and the NVFP4 / BF16 weight-sync byte ratio (an
// FP4 arm's sync_bytes over bf16-rollout's; also for the block linears alone).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/status.h"
#include "rl/rl_loop.h"
#include "rl/task.h"

namespace nibble::rl {

struct RlBenchOptions {
  nlohmann::json model;  // a model config object (HF config.json); random init
  std::vector<Arm> arms = {Arm::kFp4Naive, Arm::kTrace, Arm::kBf16Rollout};
  int64_t steps = 4;  // per arm and round, >= 2: the first is a warm-up
  // the arm list runs `rounds` times in turn (a, b, a, b, ...), so slow drifts of the machine fall on
  // every arm alike; an arm's timed steps are pooled over its rounds
  int64_t rounds = 1;
  int64_t prompts_per_step = 8, group_size = 8, max_new_tokens = 32;
  int64_t level = 0;
  backend::Backend* backend = nullptr;  // null: the CPU backend
  // the arms' run folders go under it (each removed after its arm); empty: a temporary folder
  std::string scratch_dir;
};

// One arm: medians over the timed steps (each part's median on its own: the parts' medians need
// not add up to the step's), and the per-step constants.
struct RlBenchRow {
  Arm arm = Arm::kTrace;
  int64_t timed_steps = 0;  // over all rounds
  int64_t rounds = 0;
  double step_seconds = 0, rollout_seconds = 0, logprob_seconds = 0, moe_check_seconds = 0, train_seconds = 0,
         sync_seconds = 0, other_seconds = 0;
  double rollout_tokens_per_s = 0, train_tokens_per_s = 0, response_len = 0;
  double sync_bytes = 0, sync_linear_bytes = 0;  // the last timed step's (a function of the model and arm)
  nlohmann::json to_json() const;
};

struct RlBenchSummary {
  // NaN where an arm it needs was not run
  double trace_overhead = 0;          // step(trace) / step(fp4-naive) - 1
  double sync_bytes_ratio = 0;        // sync_bytes of the first FP4 arm / bf16-rollout's
  double sync_linear_bytes_ratio = 0; // the same for the block linears alone
  nlohmann::json to_json() const;
};

// The median of v (the mean of the two middle values for an even count); v must not be empty.
double median_of(std::vector<double> v);
// The summary of rows (any subset of arms, in any order).
RlBenchSummary summarize_rl_bench(const std::vector<RlBenchRow>& rows);

// Runs every arm in turn on `task`, `rounds` times; `on_row` gets each arm's row as soon as its
// last round is measured. Rows come in the order of o.arms' first appearances.
// Errors: bad options (invalid argument), and whatever run_rl returns.
Result<std::vector<RlBenchRow>> bench_rl(const RlBenchOptions& options, const Task& task,
                                         const std::function<void(const RlBenchRow&)>& on_row = nullptr);

}  // namespace nibble::rl
