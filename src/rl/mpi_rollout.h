// Disaggregated rollouts across processes (issue #17 item 3; `mpirun -np N nibble rl`, N >= 2):
// rank 0 trains, ranks 1..N-1 roll out. MpiRolloutClient is rank 0's WeightSink and
// RolloutSource (rollout_worker.h); serve_rollouts is a rollout rank's loop, which runs the
// messages on a ThreadRolloutWorker of its own, so its generation overlaps the weights arriving
// for later steps. Transport: the process group's host broadcasts (dist/process_group.h), rank 0
// the root of what it sends and each rollout rank, in rank order, of its reply (the group has
// collectives only: the other rollout ranks receive a reply and drop it); each message is a
// header {kind, bytes} and its payload in buckets of kBucketBytes. Messages: weights (a policy
// version's NVFP4 codes + scales + outer scales, or BF16, and the FP32 rest, through the weight
// transport (weight_transport.h): the host one serializes PolicyWeights::append_named's tensors
// over the host path; on CUDA with an NCCL group the device one broadcasts the packed version
// GPU to GPU), job (a step's requests and what to record; every rollout
// rank takes its share, rollout_share), finish (the replies: completions with their log-probs, the
// R3 routing and TRACE guidance records, the version id the worker generated with, or its error),
// stop. A request keeps its id on its rank, so it draws from the Philox streams and writes the
// record keys it would in one process; rank 0 puts the completions back in (request, sample)
// order. The rollouts equal the in-process worker's bit for bit: the same weights, requests and
// seeds reach the same engine code, whatever N.
#pragma once

#include <cstdint>
#include <memory>

#include "dist/process_group.h"
#include "rl/rollout_worker.h"
#include "rl/weight_transport.h"

namespace nibble::rl {

// The requests [begin, end) of a step's `requests` (whole GRPO groups: a request carries its G
// samples) that rollout rank `index` (0 .. rollout_ranks-1, i.e. world rank index+1) generates:
// contiguous shares in rank order, sizes differing by at most one, the larger ones first.
struct RequestShare {
  int64_t begin = 0, end = 0;
};
RequestShare rollout_share(int64_t requests, int rollout_ranks, int index);

// The one-line error of a world whose rollout ranks (world_size - 1) exceed the prompts per step,
// or of a world of one; ok otherwise.
Status check_rollout_world(int world_size, int64_t prompts_per_step);

class MpiRolloutClient final : public WeightSink, public RolloutSource {
 public:
  // `group`: a world of N >= 2 whose ranks 1..N-1 run serve_rollouts; this is rank 0 (else
  // invalid_argument). Every job must hold at least N-1 requests (check_rollout_world).
  // The weight transport: `transport` for `trainer`'s policy in rollout `mode`
  // (make_weight_transport); the rollout ranks must be given the same kind.
  static Result<std::unique_ptr<MpiRolloutClient>> create(dist::ProcessGroup& group, model::Model& trainer,
                                                          rollout::PrecisionMode mode, const std::string& recipe_name,
                                                          WeightTransportKind transport);
  ~MpiRolloutClient() override;  // stops the worker's loop (a job in flight is dropped)

  Status send(std::shared_ptr<const PolicyWeights> weights) override;
  bool wants_packed() const override { return transport_->wants_packed(); }
  const char* transport_name() const { return transport_->name(); }
  Status start(RolloutJob job) override;
  Result<RolloutBatch> finish() override;

 private:
  explicit MpiRolloutClient(dist::ProcessGroup& group) : group_(group) {}
  dist::ProcessGroup& group_;
  std::unique_ptr<WeightTransport> transport_;
  bool running_ = false, stopped_ = false;
  RolloutJob job_;  // the started job's requests and record options
};

// Ranks 1..N-1: serves MpiRolloutClient's messages with a ThreadRolloutWorker (model `config` with
// `recipe` on `backend`, engine `engine_options`) until the client stops, generating this rank's
// share of each job. Errors of a job or of a version received go back in the next finish reply;
// a transport error is returned. `transport`: the client's kind (the same rule on `backend`);
// max_staleness: the run's (how many versions the device transport keeps room for).
Status serve_rollouts(dist::ProcessGroup& group, const model::ModelConfig& config, const model::RecipeConfig& recipe,
                      backend::Backend* backend, const rollout::EngineOptions& engine_options, int64_t max_staleness,
                      WeightTransportKind transport);

// The weight transport of `group` for `model`'s policy in `mode`: `kind`, where auto is device
// when group.device_memory() and model's backend is not the CPU (NCCL on CUDA), else host.
Result<std::unique_ptr<WeightTransport>> make_weight_transport(dist::ProcessGroup& group, model::Model& model,
                                                               rollout::PrecisionMode mode,
                                                               const std::string& recipe_name, int64_t versions_held,
                                                               WeightTransportKind kind);

}  // namespace nibble::rl
