// The rollout side of the RL loop (rl_loop.h) behind two small interfaces, so that the worker can
// later live on other ranks (issue #17 item 3) without the loop changing:
//   WeightSink     the trainer sends each policy version: the block linears already quantized by
//                  the engine's quantizer (NVFP4 codes + block scales + outer scales; BF16 in the
//                  bf16 mode) and the rest of the parameters (embedding, norms, router, lm_head) in
//                  FP32, which the rollout reads unquantized.
//   RolloutSource  start(job) generates one step's rollouts from a named policy version;
//                  finish() waits for them (completions, R3 routing and TRACE guidance records).
// ThreadRolloutWorker implements both in-process: its own model copy and engine on its own
// backend instance, generating on a thread so that rollout and training overlap. Its output is a
// function of (job, version weights) only, never of thread timing.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "core/tensor.h"
#include "io/safetensors.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "rollout/guidance_store.h"

namespace nibble::rl {

// One policy version as the weight sync carries it (host memory). Version v = the trainer's
// weights after v updates.
struct PolicyWeights {
  int64_t version = 0;
  rollout::PrecisionMode mode = rollout::PrecisionMode::kW4A4;
  // 4-bit modes, per block linear (linear_infos() order): codes (N, K/2) u8, block scales u8
  // E4M3 (QuantizedTensor::scale_bytes), outer scales f32 (QuantizedTensor::outer_count)
  std::vector<Tensor> codes, scales, outer;
  backend::QuantFormat format = backend::QuantFormat::kNvfp4TwoLevel;
  std::vector<Tensor> bf16;  // bf16 mode, per block linear: (N, K) BF16
  Tensor rest;               // (R) f32: the parameters outside the block linears, rest_segments() order
  // Bytes the sync carries: the linears' storage (QuantizedLinears::weight_bytes) + 4 R.
  int64_t bytes() const;
  // Checkpoint form: tensors named "policy.v<version>.<linear index>.codes" (.scales, .outer,
  // .bf16) and "policy.v<version>.rest".
  void append_named(std::vector<io::NamedTensor>& out) const;
};

// The flat-parameter ranges [offset, offset + count) of `m` that no block linear's weight covers.
struct ParamSegment {
  int64_t offset = 0, count = 0;
};
std::vector<ParamSegment> rest_segments(model::Model& m);

// The trainer's side of the sync: `trainer`'s block linears through the engine's quantizer for
// `mode` (QuantizedLinears::create, the bits a colocated engine's refresh_weights made; the bf16
// mode: the BF16-rounded weight) and the rest, copied to host.
Result<PolicyWeights> snapshot_policy(model::Model& trainer, rollout::PrecisionMode mode,
                                      const std::string& recipe_name, int64_t version);
// The versions stored by append_named in `tensors` (for `model`'s shapes). Errors (kDataLoss): a
// missing or mis-shaped member.
Result<std::vector<PolicyWeights>> policies_from_named(const std::vector<io::NamedTensor>& tensors,
                                                       model::Model& model, rollout::PrecisionMode mode,
                                                       const std::string& recipe_name);

class WeightSink {
 public:
  virtual ~WeightSink() = default;
  // Hands policy version w->version to the rollout side (versions arrive in increasing order).
  virtual Status send(std::shared_ptr<const PolicyWeights> weights) = 0;
};

// One step's rollout request: what to generate and what to record.
struct RolloutJob {
  int64_t step = 0;     // 0-based RL step the rollouts are for
  int64_t version = 0;  // the policy version to generate with (sent before start)
  std::vector<rollout::Request> requests;
  bool record_routing = false;
  bool record_guidance = false;
  rollout::GuidanceMode guidance_mode = rollout::GuidanceMode::kTraceFull;
  std::vector<int64_t> guidance_layers;
  std::string guidance_spill_dir;
};

struct RolloutBatch {
  int64_t step = 0, version = 0;  // version: the policy version the completions were generated with
  std::vector<rollout::Request> requests;  // the job's
  std::vector<rollout::Completion> completions;
  std::unique_ptr<rollout::RecordStore> routing, guidance;  // flushed
  int64_t generated_tokens = 0;
  std::chrono::steady_clock::time_point began, ended;  // the generation's wall-clock interval
};

// Opens `batch`'s two record stores (guidance spilling into `guidance_spill_dir`).
Status open_record_stores(RolloutBatch& batch, const std::string& guidance_spill_dir);

class RolloutSource {
 public:
  virtual ~RolloutSource() = default;
  // Starts generating `job` from policy version job.version; one job at a time. Versions below
  // job.version are not asked for again (the source may drop them).
  virtual Status start(RolloutJob job) = 0;
  // Waits for the started job and returns its rollouts (or its error).
  virtual Result<RolloutBatch> finish() = 0;
};

// The in-process worker: a model of the trainer's config (and recipe) on `backend` (not the
// trainer's backend object: the two run at once), an engine in `engine_options`, and a thread per
// job. The model's weights are only ever what the sync sent.
class ThreadRolloutWorker final : public WeightSink, public RolloutSource {
 public:
  static Result<std::unique_ptr<ThreadRolloutWorker>> create(const model::ModelConfig& config,
                                                             const model::RecipeConfig& recipe,
                                                             backend::Backend* backend,
                                                             const rollout::EngineOptions& engine_options);
  ~ThreadRolloutWorker() override;

  Status send(std::shared_ptr<const PolicyWeights> weights) override;
  Status start(RolloutJob job) override;
  Result<RolloutBatch> finish() override;

  // For tests: the engine (its linears hold the last applied version) and that version (-1: none).
  const rollout::Engine& engine() const { return *engine_; }
  model::Model& model() { return *model_; }  // its shapes (the weights it holds are the last applied version's)
  int64_t applied_version() const { return applied_version_; }

 private:
  ThreadRolloutWorker() = default;
  Status apply(const PolicyWeights& w);  // worker thread
  Result<RolloutBatch> run_job(const RolloutJob& job, std::shared_ptr<const PolicyWeights> w, int threads);

  std::unique_ptr<model::Model> model_;
  std::unique_ptr<rollout::Engine> engine_;
  std::vector<ParamSegment> rest_;
  std::vector<backend::QuantizedBuffer> staging_;  // per linear: a received version in backend memory
  std::map<int64_t, std::shared_ptr<const PolicyWeights>> versions_;  // received, not yet dropped
  int64_t applied_version_ = -1;
  std::thread thread_;
  bool running_ = false;
  Status job_status_;
  RolloutBatch job_batch_;
};

}  // namespace nibble::rl
