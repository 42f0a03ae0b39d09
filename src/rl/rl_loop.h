// The RL loop of `nibble rl` (issue #16 items 3-5; ../shared/spec/03-rl-and-trace.md): per step,
// P prompts of a task x G samples rolled out by the rollout engine (rollout/engine.h) in the arm's
// precision with its recorders (R3 routing, TRACE guidance), exact rewards, group-normalised
// advantages, the trainer's log-probs of the rollout tokens (π_old: R3-forced routing, guided
// rounding) and optionally the frozen reference's, then GRPO/TIS minibatch updates (grpo.h)
// with AdamW, then the weight sync: the trainer's block linears quantized (codes + scales) and
// the FP32 rest sent as the next policy version to the rollout worker (rl/rollout_worker.h, its
// own model copy), timed and counted. Step t's rollouts come from version max(0, t - N)
// (`max_staleness` N; 0: on-policy); with N >= 1 they are generated while step t-1 trains.
// Per step a metrics.jsonl line (spec 03 §5);
// reward.png and logp_gap.png; atomic checkpoints; a resume reproduces the uninterrupted run's
// metrics bit for bit on the CPU (rollout seeds are a function of (seed, step)).
//
// The arms (spec 03 §3) set the rollout's precision and the trainer's linears:
//   bf16-rollout  rollout bf16,  trainer bf16
//   fp4-naive     rollout w4a4,  trainer bf16
//   qat           rollout w4a4,  trainer rl-fake-quant W4A4, RTN with its own scales
//   quads         rollout w4a4,  trainer rl-fake-quant W4A16 (weights only)
//   trace-full    rollout w4a4 + full-code guidance at every layer; trainer W4A4 guided
//   trace         rollout w4a4 + mantissa-bit guidance on `guidance_layers` (default: later half)
// `rollout_kv` nvfp4 gives the rollout NVFP4 KV pages; qat then rounds K and V as the pages do (RTN)
// and the trace arms guide them at kKeyCache / kValueCache (model::KvQuantizer, TraceKvQuantizer).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/status.h"
#include "dist/process_group.h"
#include "rl/grpo.h"
#include "rl/task.h"
#include "rl/weight_transport.h"

namespace nibble::rl {

enum class Arm { kBf16Rollout, kFp4Naive, kQat, kQuads, kTraceFull, kTrace };
Result<Arm> parse_arm(const std::string& s);
const char* arm_name(Arm a);

struct RlConfig {
  // what is trained: a checkpoint folder (pretrain/sft run or step folder; its tokenizer), or a
  // model config JSON with a seeded init and a tokenizer trained on the task's texts
  std::string init;
  nlohmann::json model;  // HF config object (used when init is empty)
  uint64_t model_seed = 1;
  int64_t tokenizer_vocab_size = 320;
  // the task
  std::string task = "arithmetic";
  int64_t level = 0;
  uint64_t task_seed = 1;
  // the arm
  Arm arm = Arm::kTrace;
  std::vector<int64_t> guidance_layers;  // trace: empty = later half; trace-full: empty = all
  bool r3 = true;                         // MoE: routing replay
  // The rollout engine's KV-cache pages: bf16 (the default) or nvfp4 (each (token, kv head) row
  // two-level NVFP4, backend/kv_page_codec.h). With nvfp4 the trainers that quantize activations
  // (qat, trace-full, trace) round K and V as the cache does (RTN; the trace arms guided at
  // kKeyCache / kValueCache of their guided layers).
  backend::KvPageFormat rollout_kv = backend::KvPageFormat::kBf16;
  // GRPO
  int64_t steps = 10;
  int64_t prompts_per_step = 4;  // P
  // > 0: the prompts cycle through instances 0 .. train_instances-1 of the level (a fixed
  // training set, seen again every train_instances / P steps); 0: fresh instances every step
  int64_t train_instances = 0;
  int64_t group_size = 4;        // G
  int64_t max_new_tokens = 16;
  int64_t minibatches = 1;       // updates per step (each over B / minibatches sequences)
  GrpoConfig grpo;
  // optimizer
  double lr = 1e-4;
  double weight_decay = 0.0;
  double grad_clip = 1.0;
  uint64_t seed = 1;             // rollout sampling seed base
  // Asynchronous rollouts: step t's rollouts come from policy version max(0, t - N) (version v =
  // the weights after v updates), generated while the trainer trains step t-1; 0: on-policy.
  int64_t max_staleness = 0;
  int64_t checkpoint_every = 0;  // 0: only at the end
  int64_t keep_checkpoints = 2;

  nlohmann::json to_json() const;
};
// The config file: a JSON object with the fields above ("grpo" fields at top level: clip_eps,
// aggregation, kl_coef, tis, tis_cap, temperature); unknown keys and bad values are errors.
Result<RlConfig> parse_rl_config(const nlohmann::json& j);
Result<RlConfig> load_rl_config(const std::string& path);
// The task instance index of prompt i (0 .. P-1) of step s (0-based): s*P + i, modulo
// train_instances when that is set.
int64_t prompt_instance_index(const RlConfig& c, int64_t step, int64_t i);

struct RlOptions {
  std::string run_dir;        // must not hold a run unless resume
  bool resume = false;
  int64_t stop_after_step = -1;  // > 0: stop (with a checkpoint) after this step, as if interrupted
  backend::Backend* backend = nullptr;  // null: the CPU backend
  // The rollout worker's backend: not the trainer's object (both run at once); null: a fresh
  // instance of the trainer's kind (backend::make_backend).
  backend::Backend* rollout_backend = nullptr;
  // Disaggregated (rl/mpi_rollout.h): a world of N >= 2 whose ranks 1..N-1 run serve_rl_rollouts
  // (at most prompts_per_step of them); this process (rank 0) trains and its rollouts come from
  // them. Null or a world of 1: in-process.
  dist::ProcessGroup* group = nullptr;
  // Disaggregated: how the policy versions travel (rl/weight_transport.h); the rollout ranks'
  // serve_rl_rollouts must be given the same.
  WeightTransportKind weight_transport = WeightTransportKind::kAuto;
  bool progress = false;
  // false: no checkpoints (not even the last) and no plots; metrics.jsonl only (benchmarks)
  bool checkpoints = true;
};

// Per-step metrics (also written to metrics.jsonl).
struct RlStepMetrics {
  int64_t step = 0;
  double reward_mean = 0, reward_std = 0, response_len = 0, entropy = 0;
  double logp_diff_mean = 0, logp_diff_max = 0, kl_rollout_train = 0;
  double guided_mismatch = 0, guided_one_step = 0, guided_reproduced = 0;  // NaN without guidance
  // routed experts' rows (guided layers, recorded tokens) without a rollout record for their expert,
  // hence RTN: 0 with R3; NaN without guidance or without routed experts at the guided layers
  double guided_expert_fallback = 0;
  double moe_set_mismatch = 0;  // NaN for a dense model
  double guidance_bytes_per_token = 0, rollout_tokens_per_s = 0, train_tokens_per_s = 0;
  double sync_seconds = 0, sync_bytes = 0, step_seconds = 0;
  double sync_linear_bytes = 0;  // of sync_bytes, the block linears' (the rest: 4 bytes per FP32 parameter)
  // The step's wall time split (seconds; docs/rl.md "Step time"): the rollout's generation, the
  // trainer's π_old / π_ref forwards, its extra forward without R3 measuring moe_set_mismatch (0
  // for a dense model), the GRPO updates, the weight sync (sync_seconds above) and the rest
  // (rewards, batching, record stores, and what of the loop's bookkeeping fell outside the rollout).
  // step_seconds runs from the end of the previous step's sync (or the loop's start) to the end of
  // this one's. On-policy (max_staleness 0) the six add up to step_seconds; asynchronous, the
  // rollout ran beside the previous step and other_seconds leaves out only its part in this step.
  double rollout_seconds = 0, logprob_seconds = 0, moe_check_seconds = 0, train_seconds = 0, other_seconds = 0;
  double loss = 0, clip_fraction = 0, tis_fraction = 0, kl_ref = 0, grad_norm = 0;
  // the policy version the step's rollouts were generated with, step - 1 - that (versions stale),
  // and the seconds this step's training overlapped the next step's rollout
  int64_t policy_version = 0, staleness = 0;
  double overlap_seconds = 0;
  nlohmann::json to_json() const;
};

struct RlResult {
  int64_t start_step = 0, end_step = 0;
  std::vector<RlStepMetrics> steps;  // this call's
  std::string checkpoint_dir;  // empty when RlOptions::checkpoints is false
};

// Runs (or resumes) the RL job. `task` makes the prompts and scores the completions.
Result<RlResult> run_rl(const RlConfig& config, const Task& task, const RlOptions& options);

// A rollout rank (1..N-1) of a disaggregated run: the rollout worker for the model `config`
// describes (its "init" checkpoint's config or its "model"), on `backend`, serving rank 0's run_rl
// until it ends.
Status serve_rl_rollouts(const RlConfig& config, dist::ProcessGroup& group, backend::Backend* backend,
                         WeightTransportKind weight_transport);

}  // namespace nibble::rl
