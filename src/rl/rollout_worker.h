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

struct PackedPolicy;

// One policy version as the weight sync carries it (host memory, or packed in backend memory).
// Version v = the trainer's weights after v updates.
struct PolicyWeights {
  int64_t version = 0;
  rollout::PrecisionMode mode = rollout::PrecisionMode::kW4A4;
  // 4-bit modes, per block linear (linear_infos() order): codes (N, K/2) u8, block scales u8
  // E4M3 (QuantizedTensor::scale_bytes), outer scales f32 (QuantizedTensor::outer_count)
  std::vector<Tensor> codes, scales, outer;
  backend::QuantFormat format = backend::QuantFormat::kNvfp4TwoLevel;
  std::vector<Tensor> bf16;  // bf16 mode, per block linear: (N, K) BF16
  Tensor rest;               // (R) f32: the parameters outside the block linears, rest_segments() order
  // Set: the version lives packed in backend memory (the device weight transport) and the host
  // tensors above are empty.
  std::shared_ptr<const PackedPolicy> packed;
  // Bytes the sync carries: the linears' storage (QuantizedLinears::weight_bytes) + 4 R (packed:
  // its parts' bytes, PolicyLayout::payload_bytes).
  int64_t bytes() const;
  // Checkpoint form: tensors named "policy.v<version>.<linear index>.codes" (.scales, .outer,
  // .bf16) and "policy.v<version>.rest" (a packed version is copied to host first).
  void append_named(std::vector<io::NamedTensor>& out) const;
};

// ---- the packed form: a version in one buffer of backend memory (rl/weight_transport.h) ----
// Where each part sits: per block linear (linear_infos() order) the 4-bit modes' codes, block
// scales and outer scales, or the bf16 mode's weight as BF16 bits (N, K) (the host form's bits;
// the receiver widens them with from_bf16_bits), then the rest (R) f32; every part at a
// kPackedAlign-aligned offset.
struct PolicyLayout {
  static constexpr int64_t kPackedAlign = 256;
  struct Part {
    int64_t offset = 0, bytes = 0;
  };
  rollout::PrecisionMode mode = rollout::PrecisionMode::kW4A4;
  backend::QuantFormat format = backend::QuantFormat::kNvfp4TwoLevel;
  std::vector<Part> codes, scales, outer, weights;  // per linear (4-bit modes / bf16 mode)
  Part rest;
  int64_t total_bytes = 0;    // the buffer, alignment padding included
  int64_t payload_bytes = 0;  // the parts alone
};
PolicyLayout policy_layout(model::Model& m, rollout::PrecisionMode mode, const std::string& recipe_name);

struct PackedPolicy {
  PolicyLayout layout;
  backend::Backend* backend = nullptr;
  backend::Buffer<uint8_t> data;  // (layout.total_bytes) u8 in backend's memory
};
// A packed buffer of `layout` in `be`'s memory (contents undefined). Errors: out of memory.
Result<std::shared_ptr<PackedPolicy>> allocate_packed(backend::Backend& be, const PolicyLayout& layout);
// The trainer's policy packed in its own backend memory: the bits snapshot_policy copies to host
// (the same quantizer calls), gathered with device-to-device copies only.
Result<std::shared_ptr<PackedPolicy>> pack_policy(model::Model& trainer, rollout::PrecisionMode mode,
                                                  const std::string& recipe_name);
// `w`'s host tensors uploaded into `out` (a version read from a checkpoint, sent packed).
// Errors: parts whose sizes differ from out.layout's.
Status pack_host_policy(const PolicyWeights& w, PackedPolicy& out);
// The host form of packed version `version` (checkpoints, tests): bit for bit what
// snapshot_policy makes from the same weights.
PolicyWeights unpack_policy(const PackedPolicy& p, int64_t version);

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
  // Whether send() wants versions packed in the trainer's backend memory (pack_policy: the device
  // weight transport) rather than host snapshots (snapshot_policy). Either form is accepted.
  virtual bool wants_packed() const { return false; }
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
  Status apply(const PolicyWeights& w);         // worker thread
  Status apply_packed(const PolicyWeights& w);  // a packed version: device-to-device copies only
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
