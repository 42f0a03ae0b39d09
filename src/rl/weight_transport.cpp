// The device weight transport (weight_transport.h): a header over the host path, then the packed
// version's buffer in kBucketBytes buckets with the group's broadcast; on the rollout ranks a pool
// of packed buffers allocated before the first rollout and reused, and a one-bucket drop buffer
// that a body which cannot be kept is received into (so that the ranks stay in step).
#include "rl/weight_transport.h"

#include <algorithm>
#include <vector>

#include "core/check.h"

namespace nibble::rl {

namespace {

class DeviceWeightTransport final : public WeightTransport {
 public:
  DeviceWeightTransport(dist::ProcessGroup& group, model::Model& model, PolicyLayout layout, int64_t versions_held,
                        int64_t bucket_bytes)
      : group_(group), model_(model), layout_(std::move(layout)), versions_held_(versions_held),
        bucket_bytes_(bucket_bytes) {}

  const char* name() const override { return "device"; }
  bool wants_packed() const override { return true; }

  Status send(const PolicyWeights& w) override {
    std::shared_ptr<const PackedPolicy> packed = w.packed;
    if (!packed) {  // a host version (read from a checkpoint): uploaded first
      NIB_ASSIGN_OR_RETURN(std::shared_ptr<PackedPolicy> up, allocate_packed(model_.backend(), layout_));
      NIB_RETURN_IF_ERROR(pack_host_policy(w, *up));
      packed = std::move(up);
    }
    if (packed->layout.total_bytes != layout_.total_bytes || packed->layout.mode != layout_.mode)
      return invalid_argument("device weight transport: version {} is laid out for another model", w.version);
    int64_t header[3] = {w.version, static_cast<int64_t>(layout_.mode), layout_.total_bytes};
    NIB_RETURN_IF_ERROR(group_.broadcast_host(header, sizeof header, 0));
    return broadcast_body(packed->data.data(), layout_.total_bytes, layout_.total_bytes);
  }

  Result<PolicyWeights> receive() override {
    int64_t header[3] = {0, 0, 0};
    NIB_RETURN_IF_ERROR(group_.broadcast_host(header, sizeof header, 0));
    const int64_t version = header[0], bytes = header[2];
    if (bytes < 0) return data_loss("device weight transport: version {} of negative size {}", version, bytes);
    NIB_RETURN_IF_ERROR(grow_pool());
    std::shared_ptr<PackedPolicy> buf = free_buffer();
    const bool fits = bytes == layout_.total_bytes && header[1] == static_cast<int64_t>(layout_.mode);
    if (!fits || buf == nullptr) {
      // the body still goes by in full (bucket by bucket into the drop buffer): the ranks stay in step
      NIB_RETURN_IF_ERROR(broadcast_body(drop_.data(), bytes, drop_.size()));
      if (buf == nullptr)
        return Status(StatusCode::kInternal,
                      fmt::format("device weight transport: version {} arrived while all {} version buffers are in use",
                                  version, pool_.size()));
      return data_loss("device weight transport: version {} holds {} bytes in mode {}, this model's {} bytes in mode {}",
                       version, bytes, header[1], layout_.total_bytes, static_cast<int64_t>(layout_.mode));
    }
    NIB_RETURN_IF_ERROR(broadcast_body(buf->data.data(), bytes, bytes));
    PolicyWeights w;
    w.version = version, w.mode = layout_.mode, w.format = layout_.format;
    w.packed = std::move(buf);
    return w;
  }

 private:
  // data: (room) u8 device memory; the body's `bytes` in buckets of at most bucket_bytes_ (and
  // `room`: a body that does not fit wraps around, received only to be dropped).
  Status broadcast_body(uint8_t* data, int64_t bytes, int64_t room) {
    NIB_CHECK(room > 0 || bytes == 0);
    const int64_t step = std::min(bucket_bytes_, std::max<int64_t>(room, 1));
    for (int64_t o = 0; o < bytes; o += step) {
      const int64_t at = room >= bytes ? o : 0;
      NIB_RETURN_IF_ERROR(group_.broadcast(data + at, std::min(step, bytes - o), 0));
    }
    return Status::ok();
  }

  // The pool's versions_held_ buffers and the drop buffer (one bucket), allocated on the first
  // receive (before any rollout runs), then never again.
  Status grow_pool() {
    while (static_cast<int64_t>(pool_.size()) < versions_held_) {
      NIB_ASSIGN_OR_RETURN(std::shared_ptr<PackedPolicy> b, allocate_packed(model_.backend(), layout_));
      pool_.push_back(std::move(b));
    }
    if (drop_.data() == nullptr) {
      try {
        drop_.ensure(model_.backend(), std::min(bucket_bytes_, layout_.total_bytes), "rl weight transport drop bucket");
      } catch (const backend::AllocationError& e) {
        return Status(StatusCode::kInternal, e.what());
      }
    }
    return Status::ok();
  }

  // A pooled buffer no version still uses (the pool holds the only reference), or null.
  std::shared_ptr<PackedPolicy> free_buffer() {
    for (const std::shared_ptr<PackedPolicy>& b : pool_)
      if (b.use_count() == 1) return b;
    return nullptr;
  }

  dist::ProcessGroup& group_;
  model::Model& model_;
  PolicyLayout layout_;
  int64_t versions_held_, bucket_bytes_;
  std::vector<std::shared_ptr<PackedPolicy>> pool_;
  backend::Buffer<uint8_t> drop_;  // (min(bucket, layout total)) u8 backend memory: bodies received to be dropped
};

}  // namespace

Result<WeightTransportKind> parse_weight_transport(const std::string& s) {
  if (s == "auto") return WeightTransportKind::kAuto;
  if (s == "host") return WeightTransportKind::kHost;
  if (s == "device") return WeightTransportKind::kDevice;
  return invalid_argument("weight transport '{}': use auto, host or device", s);
}

Result<std::unique_ptr<WeightTransport>> make_device_weight_transport(dist::ProcessGroup& group, model::Model& model,
                                                                      rollout::PrecisionMode mode,
                                                                      const std::string& recipe_name,
                                                                      int64_t versions_held, int64_t bucket_bytes) {
  const bool model_on_device = model.backend().device() != Device::kCPU;
  if (group.device_memory() != model_on_device)
    return invalid_argument("device weight transport: the {} group broadcasts {} memory, the model lives in {} ({})",
                            group.kind(), group.device_memory() ? "device" : "host",
                            model_on_device ? "device memory" : "host memory", model.backend().name());
  if (versions_held < 1 || bucket_bytes < 1)
    return invalid_argument("device weight transport: {} versions held, {} bytes a bucket", versions_held, bucket_bytes);
  return std::unique_ptr<WeightTransport>(
      new DeviceWeightTransport(group, model, policy_layout(model, mode, recipe_name), versions_held, bucket_bytes));
}

}  // namespace nibble::rl
