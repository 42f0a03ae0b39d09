// The data-parallel gradient reduce overlapped with backward (issue #17, `dist.overlap`): the
// model says during backward which gradients are final (Model::set_grads_final_hook: every
// gradient from a flat offset to the end), BucketReadiness turns that into the buckets whose
// every element is final, highest first, each once, and OverlappedGradReduce starts their
// reduce-scatter (ZeRO-1) or all-reduce at once with the process group's nonblocking forms
// (MPI_Ialltoall of the rank-order sums; NCCL on its stream after a CUDA event), then waits for
// all of them before the optimizer. Same buckets, same calls per bucket: the result is the
// after-backward path's bit for bit. With gradient accumulation only the last micro-batch's
// backward reduces (the trainer sets the hook for it alone).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"
#include "dist/process_group.h"
#include "train/zero.h"

namespace nibble::train {

// The buckets of a backward that are ready to reduce. buckets: ascending, adjacent ranges
// covering [0, n) of the flat gradient.
class BucketReadiness {
 public:
  explicit BucketReadiness(std::vector<FlatRange> buckets);
  // A new backward: no bucket ready yet.
  void reset() { pending_ = buckets_.size(), final_from_ = end(); }
  // Every gradient in [final_from, n) is final: the buckets that became ready by it (all their
  // elements at or above final_from) and were not returned before, highest first. final_from
  // must not rise within a backward, nor leave [0, n] (internal errors).
  Result<std::vector<size_t>> advance(int64_t final_from);
  bool all_ready() const { return pending_ == 0; }
  size_t num_buckets() const { return buckets_.size(); }

 private:
  int64_t end() const { return buckets_.empty() ? 0 : buckets_.back().end; }
  std::vector<FlatRange> buckets_;
  size_t pending_ = 0;     // buckets [0, pending_) are not ready yet
  int64_t final_from_ = 0;
};

// One rank's overlapped gradient reduce over `group` (whose memory must be the gradients': the
// trainer checks). zero: reduce-scatter in Zero1's buckets; null: all-reduce (summed in the group's
// fixed order) in buckets of bucket_elems over grads (n) f32.
class OverlappedGradReduce {
 public:
  OverlappedGradReduce(dist::ProcessGroup& group, float* grads, int64_t n, Zero1* zero, int64_t bucket_elems);

  // Before the backward that reduces: nothing started yet.
  void begin();
  // The model's grads_final_hook: starts the buckets that became ready (highest first), then
  // lets the started ones progress. An error is kept for finish() (later calls start nothing).
  void on_grads_final(int64_t final_from);
  // After backward: starts any bucket not started yet (every gradient is final now), then waits
  // for each in the order they were started; a padded ZeRO bucket's result is copied back.
  Status finish();
  // Buckets started by on_grads_final (during backward) in the last begin()..finish().
  int64_t started_during_backward() const { return started_during_backward_; }
  // Of those, the ones already complete when finish() was called (how much the transport did
  // during backward; an MPI all-reduce completes only in finish(): its all-gather runs there).
  int64_t done_at_backward_end() const { return done_at_backward_end_; }
  size_t num_buckets() const { return readiness_.num_buckets(); }

 private:
  Status start(size_t k);

  dist::ProcessGroup& group_;
  float* grads_;
  Zero1* zero_;
  std::vector<FlatRange> buckets_;
  BucketReadiness readiness_;
  std::vector<std::pair<size_t, std::unique_ptr<dist::PendingCollective>>> started_;  // in start order
  Status error_ = Status::ok();
  int64_t started_during_backward_ = 0;
  int64_t done_at_backward_end_ = 0;
};

}  // namespace nibble::train
