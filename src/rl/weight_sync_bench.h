// `nibble bench weight-sync` (issue #17 item 4): how long the RL weight sync takes to send one
// policy version from rank 0 to every other rank of a group, per weight transport (host: the
// version's host tensors serialized over the host path; device: the version packed in backend
// memory and broadcast in buckets, GPU to GPU under NCCL; rl/weight_transport.h) and precision
// mode (bf16, w4a16, w4a4), for a model config with random weights. Per (transport, mode): one
// version sent and received untimed (the receivers' buffers allocated), then, per timed send, a
// barrier, rank 0's send() and the others' receive(); a send's time is the slowest rank's, the
// row's the median. Rank 0's preparation of the version (snapshot to host, or pack in backend
// memory) is timed apart. GB/s = the version's payload bytes / sync time. In a one-rank world
// nobody receives: the time is the send path alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "model/transformer.h"
#include "rl/weight_transport.h"
#include "rollout/precision.h"

namespace nibble::rl {

struct WeightSyncBenchOptions {
  std::vector<WeightTransportKind> transports = {WeightTransportKind::kHost, WeightTransportKind::kDevice};
  std::vector<rollout::PrecisionMode> modes = {rollout::PrecisionMode::kBf16, rollout::PrecisionMode::kW4A16};
  std::string recipe_name = "tetrajet-v2";  // the rollout quantizer's recipe (policy_layout)
  int warmup = 1, iters = 5;
  int64_t bucket_bytes = kBucketBytes;  // the device transport's largest broadcast
};

struct WeightSyncRow {
  std::string transport, mode;  // "host" | "device"; "bf16" | "w4a16" | "w4a4"
  int world = 1;
  int64_t payload_bytes = 0;    // PolicyWeights::bytes() of the version (rank 0's)
  int64_t bf16_bytes = 0;       // the same model's bf16 version (the reference of <= 30%)
  double prepare_seconds = 0;   // rank 0: snapshot or pack, median
  double sync_seconds = 0;      // median of the slowest rank's send/receive
  double gbps = 0;              // payload_bytes / sync_seconds / 1e9
};

// Collective: every rank of `group` calls it with its own copy of the model (the same config and
// recipe; rank 0's weights are sent). Transport kinds as make_weight_transport takes them (auto
// resolves per group and backend). Errors: a transport or preparation error, agreed by every rank.
Result<std::vector<WeightSyncRow>> bench_weight_sync(dist::ProcessGroup& group, model::Model& model,
                                                     const WeightSyncBenchOptions& options);

}  // namespace nibble::rl
