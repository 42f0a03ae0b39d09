// ZeRO-1: the ownership arithmetic and the bucketed reduce-scatter / all-gather; see zero.h.
// Full buckets (size a multiple of the world) are reduced and gathered in place: NCCL's in-place
// layout (recv = send + rank*count) and the MPI group's, which copies its input before writing.
// A padded bucket (the last one, or any smaller than the world) goes through a zero-padded stage.
#include "train/zero.h"

#include <algorithm>
#include <map>

#include "core/check.h"

namespace nibble::train {

FlatRange ZeroBucket::owned(int rank) const {
  const int64_t b = std::min(size, rank * shard), e = std::min(size, (rank + 1) * shard);
  return {begin + b, begin + e};
}

Result<ZeroLayout> ZeroLayout::create(const std::vector<int64_t>& param_numels, int64_t bucket_elems, int world,
                                      int rank) {
  if (world < 1 || rank < 0 || rank >= world) return invalid_argument("zero: rank {} outside a world of {}", rank, world);
  if (bucket_elems < 1) return invalid_argument("zero: bucket of {} elements", bucket_elems);
  ZeroLayout l;
  l.world_ = world;
  l.rank_ = rank;
  l.offsets_.push_back(0);
  for (int64_t n : param_numels) {
    if (n < 0) return invalid_argument("zero: parameter of {} elements", n);
    l.offsets_.push_back(l.offsets_.back() + n);
  }
  l.n_ = l.offsets_.back();
  // This rank's owned flat ranges, ascending, adjacent ones merged.
  std::vector<FlatRange> owned;
  for (int64_t b = 0; b < l.n_; b += bucket_elems) {
    ZeroBucket k;
    k.begin = b;
    k.size = std::min(bucket_elems, l.n_ - b);
    k.shard = (k.size + world - 1) / world;
    if (k.padded(world)) l.max_padded_ = std::max(l.max_padded_, k.shard * world);
    l.buckets_.push_back(k);
    const FlatRange r = k.owned(rank);
    if (r.size() == 0) continue;
    if (!owned.empty() && owned.back().end == r.begin) owned.back().end = r.end;
    else owned.push_back(r);
  }
  // Split at parameter boundaries (one sweep: both lists ascend).
  l.owned_.resize(param_numels.size());
  size_t j = 0;
  for (size_t i = 0; i < param_numels.size(); ++i) {
    const int64_t pb = l.offsets_[i], pe = l.offsets_[i + 1];
    while (j < owned.size() && owned[j].end <= pb) ++j;
    for (size_t k = j; k < owned.size() && owned[k].begin < pe; ++k) {
      const int64_t b = std::max(pb, owned[k].begin), e = std::min(pe, owned[k].end);
      if (e > b) {
        l.owned_[i].push_back({b - pb, e - pb});
        l.owned_elems_ += e - b;
      }
    }
  }
  return l;
}

std::vector<ParamView> owned_views(const std::vector<ParamView>& full, const ZeroLayout& layout) {
  NIB_CHECK_MSG(full.size() == layout.num_params(), "{} views, {} parameters in the layout", full.size(),
                layout.num_params());
  std::vector<ParamView> out;
  for (size_t i = 0; i < full.size(); ++i) {
    const ParamView& p = full[i];
    NIB_CHECK_MSG(layout.param_offset(i + 1) - layout.param_offset(i) == p.numel, "param {}", p.name);
    ParamView v = p;
    v.full_numel = p.numel;
    const std::vector<FlatRange>& ranges = layout.owned_of_param(i);
    if (ranges.empty()) {  // nothing owned here: an empty slice keeps the parameter known
      v.numel = 0;
      out.push_back(v);
      continue;
    }
    for (const FlatRange& r : ranges) {
      v.offset = r.begin;
      v.numel = r.size();
      v.value = p.value + r.begin;
      v.grad = p.grad + r.begin;
      out.push_back(v);
    }
  }
  return out;
}

Result<std::unique_ptr<dist::PendingCollective>> Zero1::start_reduce(float* grads, const ZeroBucket& k, float* stage) {
  const int world = layout_.world(), rank = layout_.rank();
  const int64_t c = k.shard;
  if (!k.padded(world)) return group_.start_reduce_scatter_sum(grads + k.begin, grads + k.begin + rank * c, c);
  // stage: (world*c) f32: the bucket, zero past its end.
  be_.fill_zero(stage, static_cast<size_t>(world * c) * sizeof(float));
  be_.copy(stage, grads + k.begin, static_cast<size_t>(k.size) * sizeof(float));
  return group_.start_reduce_scatter_sum(stage, stage + rank * c, c);
}

void Zero1::finish_reduce(float* grads, const ZeroBucket& k, const float* stage) {
  const FlatRange own = k.owned(layout_.rank());
  if (k.padded(layout_.world()) && own.size() > 0)
    be_.copy(grads + own.begin, stage + layout_.rank() * k.shard, static_cast<size_t>(own.size()) * sizeof(float));
}

float* Zero1::overlap_stage(size_t k) {
  if (overlap_offsets_.empty()) {  // first use: every padded bucket's place, end to end
    int64_t total = 0;
    for (const ZeroBucket& b : layout_.buckets()) {
      overlap_offsets_.push_back(total);
      if (b.padded(layout_.world())) total += b.shard * layout_.world();
    }
    if (total > 0) overlap_stage_.ensure(be_, total, "ZeRO-1 padded buckets (overlapped reduce)");
  }
  return overlap_stage_.data() + overlap_offsets_[k];
}

Result<std::unique_ptr<dist::PendingCollective>> Zero1::start_reduce_bucket(float* grads, size_t k) {
  NIB_CHECK_MSG(k < layout_.buckets().size(), "bucket {} of {}", k, layout_.buckets().size());
  return start_reduce(grads, layout_.buckets()[k], overlap_stage(k));
}

void Zero1::finish_reduce_bucket(float* grads, size_t k) {
  NIB_CHECK_MSG(k < layout_.buckets().size(), "bucket {} of {}", k, layout_.buckets().size());
  finish_reduce(grads, layout_.buckets()[k], overlap_stage(k));
}

Status Zero1::each_bucket(float* data, bool reduce) {
  const int world = layout_.world(), rank = layout_.rank();
  for (const ZeroBucket& k : layout_.buckets()) {
    const int64_t c = k.shard;
    float* stage = k.padded(world) ? stage_.ensure(be_, layout_.max_padded_elems(), "ZeRO-1 padded bucket") : nullptr;
    if (reduce) {
      NIB_ASSIGN_OR_RETURN(auto op, start_reduce(data, k, stage));
      NIB_RETURN_IF_ERROR(op->wait());
      finish_reduce(data, k, stage);
      continue;
    }
    float* mine = data + k.begin + rank * c;
    if (!k.padded(world)) {
      NIB_RETURN_IF_ERROR(group_.all_gather(mine, data + k.begin, c));
      continue;
    }
    const FlatRange own = k.owned(rank);
    be_.fill_zero(stage, static_cast<size_t>(world * c) * sizeof(float));
    if (own.size() > 0) be_.copy(stage + rank * c, data + own.begin, static_cast<size_t>(own.size()) * sizeof(float));
    NIB_RETURN_IF_ERROR(group_.all_gather(stage + rank * c, stage, c));
    be_.copy(data + k.begin, stage, static_cast<size_t>(k.size) * sizeof(float));
  }
  return Status::ok();
}

Status Zero1::reduce_scatter(float* grads) { return each_bucket(grads, true); }
Status Zero1::all_gather(float* values) { return each_bucket(values, false); }

Result<double> Zero1::grad_sum_squares(const std::vector<ParamView>& owned, float grad_scale) {
  double total = train::grad_sum_squares(owned, grad_scale, be_);
  NIB_RETURN_IF_ERROR(group_.all_reduce_sum_host(&total, 1));
  return total;
}

Result<std::vector<io::NamedTensor>> Zero1::gather_state(const AdamW& adamw, const std::vector<ParamView>& full,
                                                        bool keep) {
  if (full.size() != layout_.num_params())
    return Status(StatusCode::kInternal, fmt::format("zero: {} parameters, {} in the layout", full.size(),
                                                     layout_.num_params()));
  std::map<std::string, std::pair<Tensor, Tensor>> moments;  // name -> (exp_avg, exp_avg_sq), sorted as export_state
  float* flat = flat_moment_.ensure(be_, layout_.num_elems(), "ZeRO-1 moment gather");
  for (int which = 0; which < 2; ++which) {
    be_.fill_zero(flat, static_cast<size_t>(layout_.num_elems()) * sizeof(float));
    for (size_t i = 0; i < full.size(); ++i)
      for (const FlatRange& r : layout_.owned_of_param(i)) {
        const float* src = adamw.moment_data(full[i].name, r.begin, which == 1);
        if (src == nullptr)
          return Status(StatusCode::kInternal,
                        fmt::format("zero: no optimizer state for {}[{}:{}]", full[i].name, r.begin, r.end));
        be_.copy(flat + layout_.param_offset(i) + r.begin, src, static_cast<size_t>(r.size()) * sizeof(float));
      }
    NIB_RETURN_IF_ERROR(all_gather(flat));
    for (size_t i = 0; keep && i < full.size(); ++i) {
      Tensor t(DType::kF32, {full[i].numel});
      if (full[i].numel > 0)
        be_.copy_to_host(t.data<float>(), flat + layout_.param_offset(i), static_cast<size_t>(full[i].numel) * sizeof(float));
      (which == 0 ? moments[full[i].name].first : moments[full[i].name].second) = std::move(t);
    }
  }
  flat_moment_.reset();  // only checkpoints need it
  std::vector<io::NamedTensor> out;
  if (!keep) return out;
  Tensor step(DType::kI64, {1});
  step.data<int64_t>()[0] = adamw.step_count();
  out.push_back({"optimizer.step", step});
  for (auto& [name, mv] : moments) {
    out.push_back({"optimizer." + name + ".exp_avg", std::move(mv.first)});
    out.push_back({"optimizer." + name + ".exp_avg_sq", std::move(mv.second)});
  }
  return out;
}

}  // namespace nibble::train
