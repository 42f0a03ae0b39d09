// `nibble bench weight-sync`: see weight_sync_bench.h. Rank 0 prepares each version the way the
// RL loop's sync does (pack_policy for a transport that wants packed versions, snapshot_policy
// otherwise); every error is agreed (dist::agree) before the next collective so that a failure on
// one rank cannot leave the others waiting in a broadcast.
#include "rl/weight_sync_bench.h"

#include <algorithm>
#include <chrono>

#include "dist/collectives_bench.h"
#include "rl/mpi_rollout.h"

namespace nibble::rl {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Rank 0: version `version` of `model` as `transport` wants it.
Result<PolicyWeights> prepare(WeightTransport& transport, model::Model& model, rollout::PrecisionMode mode,
                              const std::string& recipe, int64_t version) {
  if (!transport.wants_packed()) return snapshot_policy(model, mode, recipe, version);
  NIB_ASSIGN_OR_RETURN(std::shared_ptr<PackedPolicy> packed, pack_policy(model, mode, recipe));
  PolicyWeights w;
  w.version = version, w.mode = mode, w.format = packed->layout.format, w.packed = std::move(packed);
  return w;
}

// The bytes of `model`'s bf16 version (the linears' BF16 bits and the FP32 rest; host and packed
// forms carry the same).
int64_t bf16_bytes(model::Model& model, const std::string& recipe) {
  return policy_layout(model, rollout::PrecisionMode::kBf16, recipe).payload_bytes;
}

}  // namespace

Result<std::vector<WeightSyncRow>> bench_weight_sync(dist::ProcessGroup& group, model::Model& model,
                                                     const WeightSyncBenchOptions& o) {
  if (o.warmup < 0 || o.iters < 1 || o.transports.empty() || o.modes.empty() || o.bucket_bytes < 1)
    return invalid_argument("weight-sync bench: {} warm-up and {} timed sends, {} transports, {} modes, {} bytes a "
                            "bucket (need >= 0, >= 1, >= 1, >= 1, >= 1)",
                            o.warmup, o.iters, o.transports.size(), o.modes.size(), o.bucket_bytes);
  const int rank = group.rank(), world = group.world_size();
  const bool rank0 = rank == 0;
  std::vector<WeightSyncRow> rows;
  for (WeightTransportKind kind : o.transports)
    for (rollout::PrecisionMode mode : o.modes) {
      if (mode == rollout::PrecisionMode::kRecipe)
        return invalid_argument("weight-sync bench: mode 'recipe' has no rollout weights (bf16, w4a16 or w4a4)");
      Result<std::unique_ptr<WeightTransport>> made =
          kind == WeightTransportKind::kDevice
              ? make_device_weight_transport(group, model, mode, o.recipe_name, /*versions_held=*/2, o.bucket_bytes)
              : make_weight_transport(group, model, mode, o.recipe_name, /*versions_held=*/2, kind);
      NIB_RETURN_IF_ERROR(dist::agree(group, made.status()));
      WeightTransport& transport = **made;
      WeightSyncRow row;
      row.transport = transport.name();
      row.mode = rollout::precision_mode_name(mode);
      row.world = world;
      row.bf16_bytes = bf16_bytes(model, o.recipe_name);
      std::vector<double> prepare_s;
      std::vector<double> times;  // this rank's timed sends/receives
      // The untimed sends first (warm-up, at least one: the receivers allocate their buffers).
      const int untimed = std::max(1, o.warmup);
      for (int i = 0; i < untimed + o.iters; ++i) {
        const int64_t version = i + 1;
        PolicyWeights w;
        Status prepared = Status::ok();
        if (rank0) {
          const auto t0 = Clock::now();
          Result<PolicyWeights> p = prepare(transport, model, mode, o.recipe_name, version);
          if (i >= untimed) prepare_s.push_back(seconds_since(t0));
          if (p.is_ok()) {
            w = std::move(p).value();
            row.payload_bytes = w.bytes();
          }
          prepared = p.status();
        }
        NIB_RETURN_IF_ERROR(dist::agree(group, prepared));
        NIB_RETURN_IF_ERROR(group.barrier());
        const auto t0 = Clock::now();
        Status sent = Status::ok();
        if (rank0) {
          sent = transport.send(w);
        } else {
          Result<PolicyWeights> got = transport.receive();  // dropped at once: its pool buffer is free again
          if (got.is_ok() && got->version != version)
            sent = data_loss("weight-sync bench: received version {}, rank 0 sent {}", got->version, version);
          else if (!got.is_ok())
            sent = got.status();
        }
        const double t = seconds_since(t0);
        NIB_RETURN_IF_ERROR(dist::agree(group, sent));
        if (i >= untimed) times.push_back(t);
      }
      NIB_ASSIGN_OR_RETURN(row.sync_seconds, dist::slowest_rank_median(group, times, o.iters));
      row.prepare_seconds = dist::median(prepare_s);
      // every rank ends with rank 0's figures (only rank 0 knows the version's bytes)
      double shared[2] = {static_cast<double>(row.payload_bytes), row.prepare_seconds};
      NIB_RETURN_IF_ERROR(group.broadcast_host(shared, sizeof shared, 0));
      row.payload_bytes = static_cast<int64_t>(shared[0]);
      row.prepare_seconds = shared[1];
      row.gbps = row.sync_seconds > 0 ? static_cast<double>(row.payload_bytes) / row.sync_seconds / 1e9 : 0;
      rows.push_back(row);
    }
  return rows;
}

}  // namespace nibble::rl
