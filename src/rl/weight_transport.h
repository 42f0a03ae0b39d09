// How a disaggregated RL run's policy versions go from rank 0 to the rollout ranks (issue #17
// item 3; rl/mpi_rollout.h picks one by device):
//   host    the version's host tensors (PolicyWeights::append_named's) serialized and broadcast
//           over the group's host path (broadcast_host) in buckets: MPI between CPU processes.
//   device  the version packed in one buffer of backend memory (PackedPolicy, rollout_worker.h)
//           and broadcast in buckets with the group's broadcast in group memory: on GPUs (NCCL)
//           from rank 0's device buffer straight into each rollout rank's (no host copy); CPU
//           processes (MPI) can run the same path on host memory (the tests do). Only a small
//           header {version, mode, bytes} goes over the host path.
// Either way one broadcast per bucket reaches every rollout rank at once. `auto` picks device
// where the group's memory and the model's backend are the GPU's, else host.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dist/process_group.h"
#include "rl/rollout_worker.h"

namespace nibble::rl {

inline constexpr int64_t kBucketBytes = int64_t{16} << 20;

enum class WeightTransportKind { kAuto, kHost, kDevice };
// "auto" | "host" | "device"; anything else: invalid_argument naming the three.
Result<WeightTransportKind> parse_weight_transport(const std::string& s);

class WeightTransport {
 public:
  virtual ~WeightTransport() = default;
  virtual const char* name() const = 0;  // "host" | "device"
  // Rank 0: whether send() wants packed versions (the loop's sync then packs in backend memory
  // instead of snapshotting to host). A host version given to a device transport is uploaded.
  virtual bool wants_packed() const = 0;
  // Rank 0: version `w` to every other rank (called where they call receive()).
  virtual Status send(const PolicyWeights& w) = 0;
  // A rollout rank: the version rank 0's send() carries. An error of the version itself (another
  // model's layout) is returned after its whole body went by, so that the ranks stay in step.
  virtual Result<PolicyWeights> receive() = 0;
};

// The device transport over `group` for `model`'s policy in `mode` (its layout; the packed buffers
// live in model.backend(), whose memory must be the group's: GPU with NCCL, host with MPI). A rollout rank holds at most
// `versions_held` versions at once (max_staleness + 2: those its worker may still generate
// from, and the one arriving): their buffers are allocated on the first receive, before any
// rollout runs, and reused once the worker released them, so that receiving never allocates
// backend memory while the worker's thread generates on the same backend. bucket_bytes: the
// largest single broadcast (tests use small ones to run several).
Result<std::unique_ptr<WeightTransport>> make_device_weight_transport(dist::ProcessGroup& group, model::Model& model,
                                                                      rollout::PrecisionMode mode,
                                                                      const std::string& recipe_name,
                                                                      int64_t versions_held,
                                                                      int64_t bucket_bytes = kBucketBytes);

}  // namespace nibble::rl
