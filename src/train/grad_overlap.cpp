// The gradient reduce overlapped with backward: bucket readiness from the model's falling
// "final from" offsets, and the nonblocking per-bucket collectives; see grad_overlap.h.
#include "train/grad_overlap.h"

#include <algorithm>

#include "core/check.h"

namespace nibble::train {

BucketReadiness::BucketReadiness(std::vector<FlatRange> buckets) : buckets_(std::move(buckets)) {
  for (size_t k = 0; k < buckets_.size(); ++k)
    NIB_CHECK_MSG(buckets_[k].begin == (k == 0 ? 0 : buckets_[k - 1].end) && buckets_[k].end >= buckets_[k].begin,
                  "bucket {} [{}, {}) does not follow the one before", k, buckets_[k].begin, buckets_[k].end);
  reset();
}

Result<std::vector<size_t>> BucketReadiness::advance(int64_t final_from) {
  if (final_from < 0 || final_from > end())
    return Status(StatusCode::kInternal, fmt::format("gradients final from {}: outside [0, {}]", final_from, end()));
  if (final_from > final_from_)
    return Status(StatusCode::kInternal,
                  fmt::format("gradients final from {} after final from {}: the offsets must fall", final_from, final_from_));
  final_from_ = final_from;
  std::vector<size_t> ready;
  while (pending_ > 0 && buckets_[pending_ - 1].begin >= final_from) ready.push_back(--pending_);
  return ready;
}

namespace {

// The all-reduce buckets: [b, b + bucket_elems) over n, as all_reduce_gradients cuts them.
std::vector<FlatRange> all_reduce_buckets(int64_t n, int64_t bucket_elems) {
  NIB_CHECK_MSG(n >= 0 && bucket_elems >= 1, "n {} bucket {}", n, bucket_elems);
  std::vector<FlatRange> out;
  for (int64_t b = 0; b < n; b += bucket_elems) out.push_back({b, std::min(n, b + bucket_elems)});
  return out;
}

std::vector<FlatRange> zero_buckets(const ZeroLayout& layout) {
  std::vector<FlatRange> out;
  for (const ZeroBucket& k : layout.buckets()) out.push_back({k.begin, k.begin + k.size});
  return out;
}

}  // namespace

OverlappedGradReduce::OverlappedGradReduce(dist::ProcessGroup& group, float* grads, int64_t n, Zero1* zero,
                                           int64_t bucket_elems)
    : group_(group),
      grads_(grads),
      zero_(zero),
      buckets_(zero != nullptr ? zero_buckets(zero->layout()) : all_reduce_buckets(n, bucket_elems)),
      readiness_(buckets_) {
  NIB_CHECK_MSG(zero == nullptr || zero->layout().num_elems() == n, "ZeRO layout of {} elements, {} gradients",
                zero == nullptr ? 0 : zero->layout().num_elems(), n);
}

void OverlappedGradReduce::begin() {
  readiness_.reset();
  started_.clear();
  error_ = Status::ok();
  started_during_backward_ = 0;
  done_at_backward_end_ = 0;
}

Status OverlappedGradReduce::start(size_t k) {
  const FlatRange& r = buckets_[k];
  auto op = zero_ != nullptr ? zero_->start_reduce_bucket(grads_, k) : group_.start_all_reduce_sum(grads_ + r.begin, r.size());
  if (!op) return op.status();
  started_.emplace_back(k, std::move(op).value());
  return Status::ok();
}

void OverlappedGradReduce::on_grads_final(int64_t final_from) {
  if (!error_) return;
  auto ready = readiness_.advance(final_from);
  if (!ready) {
    error_ = ready.status();
    return;
  }
  for (size_t k : *ready) {
    error_ = start(k);
    if (!error_) return;
    ++started_during_backward_;
  }
  // MPI moves data only inside its calls: give the started ones a turn (each finishes at most once).
  for (auto& started : started_) {
    auto done = started.second->test();
    if (!done) {
      error_ = done.status();
      return;
    }
  }
}

Status OverlappedGradReduce::finish() {
  NIB_RETURN_IF_ERROR(error_);
  done_at_backward_end_ = 0;
  for (auto& started : started_) {
    NIB_ASSIGN_OR_RETURN(const bool done, started.second->test());
    done_at_backward_end_ += done ? 1 : 0;
  }
  NIB_ASSIGN_OR_RETURN(std::vector<size_t> rest, readiness_.advance(0));  // backward is over: all final
  for (size_t k : rest) NIB_RETURN_IF_ERROR(start(k));
  for (auto& [k, op] : started_) {  // in start order: the same on every rank
    NIB_RETURN_IF_ERROR(op->wait());
    if (zero_ != nullptr) zero_->finish_reduce_bucket(grads_, k);
  }
  started_.clear();
  return Status::ok();
}

}  // namespace nibble::train
