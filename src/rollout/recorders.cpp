// The rollout engine's R3 routing and TRACE guidance recorders (see recorders.h).
#include "rollout/recorders.h"

#include <algorithm>
#include <cstring>

#include "rollout/routing_record.h"

namespace nibble::rollout {

bool is_routed_expert(model::LinearKind kind) {
  return kind == model::LinearKind::kExpertGateUp || kind == model::LinearKind::kExpertDown;
}

std::optional<uint16_t> guidance_site(const model::LinearInfo& info) {
  switch (info.kind) {
    case model::LinearKind::kQkv: return kAttnInput;
    case model::LinearKind::kAttnOut: return kAttnOutputInput;
    case model::LinearKind::kGateUp: return kMlpInput;
    case model::LinearKind::kSharedGateUp: return kMlpInput;
    case model::LinearKind::kDown: return kMlpDownInput;
    case model::LinearKind::kSharedDown: return kSharedExpertDownInput;
    case model::LinearKind::kExpertGateUp:
      if (info.expert < 0) return std::nullopt;
      return routed_expert_site(info.expert, 0);
    case model::LinearKind::kExpertDown:
      if (info.expert < 0) return std::nullopt;
      return routed_expert_site(info.expert, 1);
  }
  return std::nullopt;
}

namespace {
// The step arena grows (doubling) up to this; a step that records more flushes it mid-step (one
// more copy) instead of growing it further.
constexpr int64_t kMaxArenaBytes = int64_t{256} << 20;

// Calls fn(sequence id) for every sample that row r belongs to.
template <typename Fn>
Status for_each_sample_of_row(const RecordedRows& rows, size_t r, Fn&& fn) {
  if (rows.samples[r] >= 0) return fn(recorded_sequence(rows.ids[r], rows.samples[r]));
  for (int64_t g = 0; g < rows.samples_of[r]; ++g) NIB_RETURN_IF_ERROR(fn(recorded_sequence(rows.ids[r], g)));
  return Status::ok();
}
}  // namespace

GuidanceRecorder::GuidanceRecorder(const RolloutRecorders& recorders, int64_t num_layers)
    : recorders_(recorders), layer_on_(static_cast<size_t>(num_layers), recorders.guidance_layers.empty()) {
  for (int64_t l : recorders.guidance_layers)
    if (l >= 0 && l < num_layers) layer_on_[static_cast<size_t>(l)] = true;
}

void GuidanceRecorder::on_quantized_activation(backend::Backend& be, const model::LinearInfo& info,
                                               const backend::QuantizedTensor& qx, int64_t M,
                                               const int32_t* token_of_row) {
  if (!status_.is_ok() || recorders_.guidance == nullptr) return;
  status_ = record(be, info, qx, M, token_of_row);
}

Status GuidanceRecorder::record(backend::Backend& be, const model::LinearInfo& info,
                                const backend::QuantizedTensor& qx, int64_t M, const int32_t* token_of_row) {
  const std::optional<uint16_t> site = guidance_site(info);
  if (!site || info.block < 0 || info.block >= static_cast<int>(layer_on_.size()) ||
      !layer_on_[static_cast<size_t>(info.block)])
    return Status::ok();
  const int64_t N = static_cast<int64_t>(rows_.positions.size());
  const bool routed = is_routed_expert(info.kind);
  if (!routed && M != N)
    return Status(StatusCode::kInternal,
                  fmt::format("guidance recorder: linear {} ran on {} rows, the step has {}", info.name, M, N));
  if (routed && token_of_row == nullptr)
    return Status(StatusCode::kInternal,
                  fmt::format("guidance recorder: routed expert linear {} ran without its tokens", info.name));
  const GuidanceMode mode = recorders_.guidance_mode;
  backend::QuantizedTensor q = qx;
  q.rows = M;
  if (qx.format == backend::QuantFormat::kNvfp4TwoLevel && be.supports(backend::Op::kTraceGuidedRows)) {
    // the records' payloads of all M rows made where the activation lives (mantissa bits there
    // for trace) into the step arena, a routed expert's tokens beside them; finish_step copies
    // the arena once
    if (M == 0) return Status::ok();
    return stage(be, Pending{info.name, info.block, *site, qx.cols, M, 0, -1, -1}, q, routed ? token_of_row : nullptr,
                 nullptr);
  }
  if (routed) {  // row r of the call is step row tokens_[r]
    tokens_.resize(static_cast<size_t>(M));
    be.copy_to_host(tokens_.data(), token_of_row, sizeof(int32_t) * static_cast<size_t>(M));
    for (int64_t r = 0; r < M; ++r)
      if (tokens_[static_cast<size_t>(r)] < 0 || tokens_[static_cast<size_t>(r)] >= N)
        return Status(StatusCode::kInternal, fmt::format("guidance recorder: linear {} row {} is token {}, the step has {}",
                                                         info.name, r, tokens_[static_cast<size_t>(r)], N));
  }
  RecordStore& store = *recorders_.guidance;
  RecordBatch batch;
  auto append_row = [&](int64_t r, std::vector<uint8_t>&& rec) -> Status {
    const auto n = static_cast<size_t>(routed ? tokens_[static_cast<size_t>(r)] : r);  // the step row
    const auto pos = static_cast<uint32_t>(rows_.positions[n]);
    const RecordKey key{0, pos, static_cast<uint16_t>(info.block), *site};
    return for_each_sample_of_row(rows_, n, [&](uint64_t seq) {
      RecordKey k = key;
      k.sequence = seq;
      batch.add(k, rec);
      return Status::ok();
    });
  };
  // other formats: the record reader works on host memory, a device activation is copied first
  if (be.device() != Device::kCPU) {
    const int64_t cb = backend::QuantizedTensor::code_bytes(qx.format, M, qx.cols);
    const int64_t sb = backend::QuantizedTensor::scale_bytes(qx.format, M, qx.cols);
    const int64_t no = backend::QuantizedTensor::outer_count(qx.format, M, qx.cols);
    codes_.resize(static_cast<size_t>(cb)), scales_.resize(static_cast<size_t>(sb)), outer_.resize(static_cast<size_t>(no));
    be.copy_to_host(codes_.data(), qx.codes, static_cast<size_t>(cb));
    be.copy_to_host(scales_.data(), qx.scales, static_cast<size_t>(sb));
    be.copy_to_host(outer_.data(), qx.outer, sizeof(float) * static_cast<size_t>(no));
    q.codes = codes_.data(), q.scales = scales_.data(), q.outer = outer_.data();
  }
  for (int64_t r = 0; r < M; ++r) {
    NIB_ASSIGN_OR_RETURN(std::vector<uint8_t> rec, extract_guidance(q, r, mode));
    NIB_RETURN_IF_ERROR(append_row(r, std::move(rec)));
  }
  return store.append_batch(std::move(batch));
}

Status GuidanceRecorder::stage(backend::Backend& be, Pending p, const backend::QuantizedTensor& q,
                               const int32_t* tokens, const int64_t* offsets) {
  const auto align8 = [](int64_t n) { return (n + 7) & ~int64_t{7}; };
  p.P = guidance_record_bytes(q.format, q.cols, recorders_.guidance_mode) - kGuidanceHeaderBytes;
  const int64_t need = align8(p.M * p.P) + (tokens != nullptr ? align8(4 * p.M) : 0) +
                       (offsets != nullptr ? 8 * (p.E + 1) : 0);
  if (arena_be_ != &be || arena_used_ + need > arena_.size()) {
    // full: the step so far goes to the host, then the arena doubles (up to the cap; ensure()
    // keeps no contents, and does nothing when it is large enough)
    NIB_RETURN_IF_ERROR(flush_pending());
    const int64_t doubled = arena_be_ == &be ? std::min(2 * arena_.size(), kMaxArenaBytes) : 0;
    arena_.ensure(be, std::max(need, doubled), "guidance recorder: step arena");
    arena_be_ = &be;
  }
  p.payload_at = arena_used_;
  be.guidance_payload_rows(arena_.data() + p.payload_at, q, guidance_kind(recorders_.guidance_mode));
  arena_used_ += align8(p.M * p.P);
  if (tokens != nullptr) {
    p.tokens_at = arena_used_;
    be.copy(arena_.data() + p.tokens_at, tokens, sizeof(int32_t) * static_cast<size_t>(p.M));
    arena_used_ += align8(4 * p.M);
  }
  if (offsets != nullptr) {
    p.offsets_at = arena_used_;
    be.copy(arena_.data() + p.offsets_at, offsets, sizeof(int64_t) * static_cast<size_t>(p.E + 1));
    arena_used_ += 8 * (p.E + 1);
  }
  pending_.push_back(std::move(p));
  return Status::ok();
}

bool GuidanceRecorder::observes_experts_grouped(backend::Backend& be) const {
  return be.supports(backend::Op::kTraceGuidedRows);
}

void GuidanceRecorder::on_quantized_activation_experts(backend::Backend& be, const model::LinearInfo* infos,
                                                       int64_t E, const backend::QuantizedTensor& qx, int64_t rows,
                                                       const int64_t* offsets, const int32_t* token_of_row) {
  if (!status_.is_ok() || recorders_.guidance == nullptr || E <= 0 || rows <= 0) return;
  const model::LinearInfo& info = infos[0];
  if (info.block < 0 || info.block >= static_cast<int>(layer_on_.size()) || !layer_on_[static_cast<size_t>(info.block)])
    return;
  if (!is_routed_expert(info.kind) || qx.format != backend::QuantFormat::kNvfp4TwoLevel || token_of_row == nullptr ||
      offsets == nullptr) {
    status_ = Status(StatusCode::kInternal,
                     fmt::format("guidance recorder: grouped call of {} is not of routed experts with two-level "
                                 "activations, tokens and offsets", info.name));
    return;
  }
  backend::QuantizedTensor q = qx;
  q.rows = rows;
  const int part = info.kind == model::LinearKind::kExpertGateUp ? 0 : 1;
  Pending p{info.name, info.block, routed_expert_site(0, part), qx.cols, rows, 0, -1, -1};
  p.E = E, p.part = part;
  status_ = stage(be, std::move(p), q, token_of_row, offsets);
}

Status GuidanceRecorder::finish_step() {
  if (status_.is_ok()) status_ = flush_pending();
  return status_;
}

Status GuidanceRecorder::flush_pending() {
  if (pending_.empty()) return Status::ok();
  arena_host_.resize(static_cast<size_t>(arena_used_));
  arena_be_->copy_to_host(arena_host_.data(), arena_.data(), arena_host_.size());
  std::vector<Pending> pending;
  pending.swap(pending_);
  arena_used_ = 0;
  RecordStore& store = *recorders_.guidance;
  const GuidanceMode mode = recorders_.guidance_mode;
  const int64_t N = static_cast<int64_t>(rows_.positions.size());
  RecordBatch batch;  // appended at once: one lock and one wake-up of the store's writer
  for (const Pending& p : pending) {
    if (p.M <= 0) continue;
    const uint8_t* payloads = arena_host_.data() + p.payload_at;  // (M, P), row r at r * P
    // one record buffer per call: the format, columns and payload size checked and the header
    // written once; each row's payload is copied into it
    NIB_ASSIGN_OR_RETURN(std::vector<uint8_t> rec,
                         guidance_record_from_payload(backend::QuantFormat::kNvfp4TwoLevel, p.cols, mode,
                                                      std::span<const uint8_t>(payloads, static_cast<size_t>(p.P))));
    const auto* tokens = p.tokens_at >= 0 ? reinterpret_cast<const int32_t*>(arena_host_.data() + p.tokens_at) : nullptr;
    // a grouped call: expert e's rows end at offsets[e + 1] (8-byte aligned in the arena)
    std::vector<int64_t> offsets;
    if (p.E > 0) {
      offsets.resize(static_cast<size_t>(p.E + 1));
      std::memcpy(offsets.data(), arena_host_.data() + p.offsets_at, offsets.size() * sizeof(int64_t));
      if (offsets[0] != 0 || offsets[static_cast<size_t>(p.E)] != p.M)
        return Status(StatusCode::kInternal, fmt::format("guidance recorder: grouped call of {} has offsets [{}, {}] "
                                                         "for {} rows", p.linear, offsets[0],
                                                         offsets[static_cast<size_t>(p.E)], p.M));
    }
    int64_t expert = 0;
    for (int64_t r = 0; r < p.M; ++r) {
      const int64_t n = tokens != nullptr ? tokens[r] : r;  // the step row
      if (n < 0 || n >= N)
        return Status(StatusCode::kInternal, fmt::format("guidance recorder: linear {} row {} is token {}, the step has {}",
                                                         p.linear, r, n, N));
      uint16_t site = p.site;
      if (p.E > 0) {
        while (expert < p.E && r >= offsets[static_cast<size_t>(expert + 1)]) ++expert;
        site = routed_expert_site(static_cast<int>(expert), p.part);
      }
      std::memcpy(rec.data() + kGuidanceHeaderBytes, payloads + r * p.P, static_cast<size_t>(p.P));
      const RecordKey key{0, static_cast<uint32_t>(rows_.positions[static_cast<size_t>(n)]),
                          static_cast<uint16_t>(p.block), site};
      NIB_RETURN_IF_ERROR(for_each_sample_of_row(rows_, static_cast<size_t>(n), [&](uint64_t seq) {
        RecordKey k = key;
        k.sequence = seq;
        batch.add(k, rec);
        return Status::ok();
      }));
    }
  }
  return store.append_batch(std::move(batch));
}

void GuidanceRecorder::on_kv_written(const PagedKvCache& cache, int64_t layer) {
  if (!status_.is_ok() || recorders_.guidance == nullptr) return;
  status_ = record_kv(cache, layer);
}

Status GuidanceRecorder::record_kv(const PagedKvCache& cache, int64_t layer) {
  if (layer < 0 || layer >= static_cast<int64_t>(layer_on_.size()) || !layer_on_[static_cast<size_t>(layer)])
    return Status::ok();
  const KvCacheConfig& c = cache.config();
  if (c.format != backend::KvPageFormat::kNvfp4)
    return Status(StatusCode::kInternal, fmt::format("guidance recorder: KV-cache sites need nvfp4 pages, the cache "
                                                     "holds {}", backend::kv_page_format_name(c.format)));
  const int64_t N = static_cast<int64_t>(rows_.positions.size()), tb = cache.token_bytes();
  RecordStore& store = *recorders_.guidance;
  RecordBatch batch;
  for (const bool values : {false, true}) {
    cache.read_batch_slots(layer, values, slots_);
    if (static_cast<int64_t>(slots_.size()) != N * tb)
      return Status(StatusCode::kInternal, fmt::format("guidance recorder: the cache's batch has {} rows, the step {}",
                                                       static_cast<int64_t>(slots_.size()) / tb, N));
    const uint16_t site = values ? kValueCache : kKeyCache;
    for (int64_t n = 0; n < N; ++n) {
      NIB_ASSIGN_OR_RETURN(std::vector<uint8_t> rec, kv_guidance_record(slots_.data() + n * tb, c.num_kv_heads,
                                                                        c.head_dim, recorders_.guidance_mode));
      const auto pos = static_cast<uint32_t>(rows_.positions[static_cast<size_t>(n)]);
      NIB_RETURN_IF_ERROR(for_each_sample_of_row(rows_, static_cast<size_t>(n), [&](uint64_t seq) {
        batch.add(RecordKey{seq, pos, static_cast<uint16_t>(layer), site}, rec);
        return Status::ok();
      }));
    }
  }
  return store.append_batch(std::move(batch));
}

Status record_routing_step(RecordStore& store, const RecordedRows& rows, const int32_t* expert_ids,
                           int64_t num_moe_layers, int64_t top_k, int64_t num_experts) {
  const int64_t N = static_cast<int64_t>(rows.positions.size());
  RecordBatch batch;
  for (int64_t m = 0; m < num_moe_layers; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const int32_t* ids = expert_ids + (m * N + n) * top_k;
      NIB_ASSIGN_OR_RETURN(std::vector<uint8_t> rec,
                           encode_routing(std::span<const int32_t>(ids, static_cast<size_t>(top_k)), num_experts));
      const auto pos = static_cast<uint32_t>(rows.positions[static_cast<size_t>(n)]);
      NIB_RETURN_IF_ERROR(for_each_sample_of_row(rows, static_cast<size_t>(n), [&](uint64_t seq) {
        batch.add(RecordKey{seq, pos, static_cast<uint16_t>(m), 0}, rec);
        return Status::ok();
      }));
    }
  return store.append_batch(std::move(batch));
}

}  // namespace nibble::rollout
