// Disaggregated rollouts across processes (issue #17 item 3; CPU processes under `mpirun -np 2
// nibble rl`): rank 0 trains, rank 1 rolls out. MpiRolloutClient is rank 0's WeightSink and
// RolloutSource (rollout_worker.h); serve_rollouts is rank 1's loop, which runs the messages on a
// ThreadRolloutWorker of its own, so its generation overlaps the weights arriving for later steps.
// Transport: the process group's host broadcasts (dist/process_group.h), rank 0 the root of what
// it sends and rank 1 of its replies; each message is a header {kind, bytes} and its payload in
// buckets of kBucketBytes. Messages: weights (a policy version's NVFP4 codes + scales + outer
// scales, or BF16, and the FP32 rest: PolicyWeights::append_named's tensors), job (a step's
// requests and what to record), finish (the reply: completions with their log-probs, the R3
// routing and TRACE guidance records, the version id the worker generated with, or its error),
// stop. The rollouts equal the in-process worker's bit for bit: the same weights, requests and
// seeds reach the same engine code.
#pragma once

#include <cstdint>
#include <memory>

#include "dist/process_group.h"
#include "rl/rollout_worker.h"

namespace nibble::rl {

inline constexpr int64_t kBucketBytes = int64_t{16} << 20;

class MpiRolloutClient final : public WeightSink, public RolloutSource {
 public:
  // `group`: a world of 2 whose rank 1 runs serve_rollouts; this is rank 0 (else invalid_argument).
  static Result<std::unique_ptr<MpiRolloutClient>> create(dist::ProcessGroup& group);
  ~MpiRolloutClient() override;  // stops the worker's loop (a job in flight is dropped)

  Status send(std::shared_ptr<const PolicyWeights> weights) override;
  Status start(RolloutJob job) override;
  Result<RolloutBatch> finish() override;

 private:
  explicit MpiRolloutClient(dist::ProcessGroup& group) : group_(group) {}
  dist::ProcessGroup& group_;
  bool running_ = false, stopped_ = false;
  RolloutJob job_;  // the started job's requests and record options
};

// Rank 1: serves MpiRolloutClient's messages with a ThreadRolloutWorker (model `config` with
// `recipe` on `backend`, engine `engine_options`) until the client stops. Errors of a job or of a
// version received go back in the next finish reply; a transport error is returned.
Status serve_rollouts(dist::ProcessGroup& group, const model::ModelConfig& config, const model::RecipeConfig& recipe,
                      backend::Backend* backend, const rollout::EngineOptions& engine_options);

}  // namespace nibble::rl
