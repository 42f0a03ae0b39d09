// Data parallelism of `nibble pretrain` (issue #17): each rank of a dist::ProcessGroup takes
// batch_size/world consecutive rows of every micro-batch of the global batch (the 1-process run's
// batch and order), runs forward+backward on them, and the gradients are summed over ranks here,
// in buckets, after backward (dist.overlap=0; grad_overlap.h starts the same buckets during it). Every
// rank then runs the same AdamW on the same summed gradients, so the weights stay identical.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "dist/process_group.h"

namespace nibble::train {

// Elements per gradient bucket (16 MiB of FP32): the unit of one all-reduce call.
inline constexpr int64_t kGradBucketElems = int64_t{1} << 22;

// The rows [begin, end) of a batch of `batch` rows that `rank` of `world` takes; batch must be a
// multiple of world (run_pretraining checks it and says so).
struct RowRange {
  int64_t begin = 0, end = 0;
};
RowRange rank_rows(int64_t batch, int rank, int world);

// grads: (n) f32 in be's memory, replaced by the sum over ranks, bucket by bucket of
// bucket_elems. In place where the group reaches be's memory (MPI + CPU backend, NCCL + CUDA);
// else staged through host_stage (MPI + CUDA backend). A world of one returns at once.
Status all_reduce_gradients(dist::ProcessGroup& group, backend::Backend& be, float* grads, int64_t n,
                            std::vector<float>* host_stage, int64_t bucket_elems = kGradBucketElems);

}  // namespace nibble::train
