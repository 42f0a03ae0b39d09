// Gradient all-reduce in buckets and the row split of the global batch; see data_parallel.h.
#include "train/data_parallel.h"

#include <algorithm>

#include "core/check.h"

namespace nibble::train {

RowRange rank_rows(int64_t batch, int rank, int world) {
  NIB_CHECK_MSG(world >= 1 && rank >= 0 && rank < world && batch % world == 0, "rank {} of {}, batch {}", rank, world,
                batch);
  const int64_t per = batch / world;
  return {rank * per, (rank + 1) * per};
}

Status all_reduce_gradients(dist::ProcessGroup& group, backend::Backend& be, float* grads, int64_t n,
                            std::vector<float>* host_stage, int64_t bucket_elems) {
  if (n < 0 || bucket_elems < 1) return invalid_argument("all_reduce_gradients: n {} bucket {}", n, bucket_elems);
  if (group.world_size() == 1 && group.kind() == "single") return Status::ok();
  const bool host_backend = be.device() == Device::kCPU;
  if (group.device_memory() && host_backend)
    return invalid_argument("the {} process group reduces GPU memory but the model is on {}", group.kind(), be.name());
  const bool in_place = group.device_memory() || host_backend;
  for (int64_t b = 0; b < n; b += bucket_elems) {
    const int64_t m = std::min(bucket_elems, n - b);
    if (in_place) {
      NIB_RETURN_IF_ERROR(group.all_reduce_sum(grads + b, m));
      continue;
    }
    host_stage->resize(static_cast<size_t>(m));
    const size_t bytes = static_cast<size_t>(m) * sizeof(float);
    be.copy_to_host(host_stage->data(), grads + b, bytes);
    NIB_RETURN_IF_ERROR(group.all_reduce_sum(host_stage->data(), m));
    be.copy_to_device(grads + b, host_stage->data(), bytes);
  }
  return Status::ok();
}

}  // namespace nibble::train
