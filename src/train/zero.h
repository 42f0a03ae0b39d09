// ZeRO-1 data parallelism (issue #17; Rajbhandari et al. 2020, stage 1): the flat gradient is
// reduce-scattered in buckets (rank r owns the contiguous slice r of every bucket), each rank keeps
// AdamW moments and runs the update only for the elements it owns (views split at parameter
// boundaries, so weight decay flags and per-parameter semantics hold), and the updated weights are
// all-gathered bucket by bucket. ZeroLayout is the ownership arithmetic; the collectives below run
// over any dist::ProcessGroup whose memory is the backend's (MPI + CPU, NCCL + CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "dist/process_group.h"
#include "io/safetensors.h"
#include "train/optimizer.h"

namespace nibble::train {

// A half-open range [begin, end) of the flat parameter / gradient buffer.
struct FlatRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const FlatRange&) const = default;
};

// One bucket [begin, begin + size) of the flat buffer and its per-rank slice length
// shard = ceil(size / world): rank r owns [begin + r*shard, begin + min(size, (r+1)*shard)) (empty
// for high ranks of a bucket smaller than the world). padded() says whether world*shard > size,
// i.e. the collectives go through a zero-padded staging buffer.
struct ZeroBucket {
  int64_t begin = 0, size = 0, shard = 0;
  FlatRange owned(int rank) const;
  bool padded(int world) const { return shard * world != size; }
};

class ZeroLayout {
 public:
  // param_numels: the parameters' sizes in flat order (contiguous, no gaps); buckets of
  // bucket_elems (>= 1) elements from offset 0, the last one shorter.
  static Result<ZeroLayout> create(const std::vector<int64_t>& param_numels, int64_t bucket_elems, int world, int rank);

  int world() const { return world_; }
  int rank() const { return rank_; }
  int64_t num_elems() const { return n_; }
  const std::vector<ZeroBucket>& buckets() const { return buckets_; }
  size_t num_params() const { return owned_.size(); }
  int64_t param_offset(size_t i) const { return offsets_[i]; }  // i in [0, num_params()]
  // This rank's owned elements of parameter i, parameter-local [begin, end), ascending, adjacent
  // ranges merged (a one-rank world owns every parameter as one range).
  const std::vector<FlatRange>& owned_of_param(size_t i) const { return owned_[i]; }
  int64_t owned_elems() const { return owned_elems_; }
  // The largest padded bucket (world * shard), the staging buffer's size (0: none padded).
  int64_t max_padded_elems() const { return max_padded_; }

 private:
  int world_ = 1, rank_ = 0;
  int64_t n_ = 0, owned_elems_ = 0, max_padded_ = 0;
  std::vector<ZeroBucket> buckets_;
  std::vector<int64_t> offsets_;               // (params + 1): flat offset of each parameter
  std::vector<std::vector<FlatRange>> owned_;  // per parameter
};

// The optimizer's views of this rank's owned elements: one per owned range of each parameter
// (ParamView::offset = its start inside the parameter, full_numel = the parameter's size), and an
// empty view (numel 0) for a parameter this rank owns nothing of, so its state is still known.
// full: every parameter's view, in flat order.
std::vector<ParamView> owned_views(const std::vector<ParamView>& full, const ZeroLayout& layout);

// The collectives of a ZeRO-1 step; all buffers in be's memory, which must be the group's (the
// caller checks: group.device_memory() == (be.device() != CPU)). stage: scratch for padded buckets.
class Zero1 {
 public:
  Zero1(dist::ProcessGroup& group, backend::Backend& be, ZeroLayout layout)
      : group_(group), be_(be), layout_(std::move(layout)) {}
  const ZeroLayout& layout() const { return layout_; }

  // grads: (n) f32; afterwards the owned elements hold the sum over ranks (summed in the group's
  // fixed order: rank order for MPI, the same bits as dist all_reduce_sum); the other elements
  // keep this rank's own values.
  Status reduce_scatter(float* grads);
  // One bucket's reduce-scatter started (the gradient reduce overlapped with backward,
  // train/grad_overlap.h); finish_reduce_bucket after its wait() copies a padded bucket's result
  // back. Afterwards bucket k's elements are as reduce_scatter leaves them, bit for bit. Each
  // padded bucket has its own stage here (overlap_stage_), so several can be in flight.
  Result<std::unique_ptr<dist::PendingCollective>> start_reduce_bucket(float* grads, size_t k);
  void finish_reduce_bucket(float* grads, size_t k);
  // values: (n) f32 whose owned elements are current; afterwards every element is, on every rank.
  Status all_gather(float* values);
  // The squared L2 norm of grad*grad_scale over every rank's owned views (each rank's sum over its
  // views in view order and fixed chunks, then summed over ranks in the group's fixed order).
  Result<double> grad_sum_squares(const std::vector<ParamView>& owned, float grad_scale);
  // The checkpoint's optimizer state as AdamW::export_state writes it unsharded (full moments per
  // parameter), assembled from every rank's owned moments: collective; only ranks with `keep`
  // copy it to the host (the others return an empty list). full: every parameter's view in flat
  // order (names and sizes).
  Result<std::vector<io::NamedTensor>> gather_state(const AdamW& adamw, const std::vector<ParamView>& full,
                                                    bool keep = true);

 private:
  // Runs op over bucket b in place on `data` (or through the padded stage).
  Status each_bucket(float* data, bool reduce);
  // Bucket k's reduce-scatter started / finished; a padded bucket goes through stage
  // (world*shard f32 in be's memory).
  Result<std::unique_ptr<dist::PendingCollective>> start_reduce(float* grads, const ZeroBucket& k, float* stage);
  void finish_reduce(float* grads, const ZeroBucket& k, const float* stage);
  // Bucket k's own stage in overlap_stage_ (padded buckets only).
  float* overlap_stage(size_t k);

  dist::ProcessGroup& group_;
  backend::Backend& be_;
  ZeroLayout layout_;
  backend::Buffer<float> stage_, flat_moment_;
  backend::Buffer<float> overlap_stage_;  // every padded bucket's stage, end to end
  std::vector<int64_t> overlap_offsets_;  // (buckets) offset of bucket k's stage in overlap_stage_
};

}  // namespace nibble::train
