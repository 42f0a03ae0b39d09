// The RL weight sync and the in-process rollout worker (rollout_worker.h): snapshots of the
// trainer's policy (quantized block linears + FP32 rest, host), their checkpoint form, and a
// worker that applies a named version to its own model copy and generates on a thread.
#include "rl/rollout_worker.h"

#include <algorithm>
#include <cstring>

#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"
#include "rollout/precision.h"

namespace nibble::rl {

using backend::QuantizedTensor;
using rollout::PrecisionMode;

namespace {

bool four_bit(PrecisionMode m) { return m == PrecisionMode::kW4A16 || m == PrecisionMode::kW4A4; }

backend::QuantFormat weight_format_for(const std::string& recipe_name) {
  // as QuantizedLinears::create picks it
  return recipe_name == "nvfp4-nvidia" ? backend::QuantFormat::kNvfp4Te2d : backend::QuantFormat::kNvfp4TwoLevel;
}

Tensor host_bytes(backend::Backend& be, const void* src, int64_t n) {
  Tensor t(DType::kU8, {n});
  be.copy_to_host(t.raw(), src, static_cast<size_t>(n));
  return t;
}

}  // namespace

int64_t PolicyWeights::bytes() const {
  if (packed) return packed->layout.payload_bytes;
  int64_t n = static_cast<int64_t>(rest.nbytes());
  for (const auto* v : {&codes, &scales, &outer, &bf16})
    for (const Tensor& t : *v) n += static_cast<int64_t>(t.nbytes());
  return n;
}

void PolicyWeights::append_named(std::vector<io::NamedTensor>& out) const {
  if (packed) return unpack_policy(*packed, version).append_named(out);
  const std::string p = "policy.v" + std::to_string(version) + ".";
  for (size_t i = 0; i < codes.size(); ++i) {
    out.push_back({p + std::to_string(i) + ".codes", codes[i]});
    out.push_back({p + std::to_string(i) + ".scales", scales[i]});
    out.push_back({p + std::to_string(i) + ".outer", outer[i]});
  }
  for (size_t i = 0; i < bf16.size(); ++i) out.push_back({p + std::to_string(i) + ".bf16", bf16[i]});
  out.push_back({p + "rest", rest});
}

std::vector<ParamSegment> rest_segments(model::Model& m) {
  // covered[i]: flat parameter i is part of a block linear's (N,K) weight
  std::vector<uint8_t> covered(static_cast<size_t>(m.num_params()), 0);
  for (const model::LinearInfo& info : m.linear_infos()) {
    const int64_t off = m.linear_weight(info.id) - m.flat_values();
    NIB_CHECK(off >= 0 && off + info.N * info.K <= m.num_params());
    std::fill(covered.begin() + off, covered.begin() + off + info.N * info.K, uint8_t{1});
  }
  std::vector<ParamSegment> segs;
  for (int64_t i = 0; i < m.num_params();) {
    if (covered[static_cast<size_t>(i)]) {
      ++i;
      continue;
    }
    ParamSegment s{i, 0};
    while (i < m.num_params() && !covered[static_cast<size_t>(i)]) ++i, ++s.count;
    segs.push_back(s);
  }
  return segs;
}

Result<PolicyWeights> snapshot_policy(model::Model& trainer, PrecisionMode mode, const std::string& recipe_name,
                                      int64_t version) {
  NIB_CHECK_MSG(mode != PrecisionMode::kRecipe, "snapshot_policy: the recipe mode has no weight sync");
  backend::Backend& be = trainer.backend();
  PolicyWeights w;
  w.version = version, w.mode = mode, w.format = weight_format_for(recipe_name);
  if (four_bit(mode)) {
    NIB_ASSIGN_OR_RETURN(std::unique_ptr<rollout::QuantizedLinears> q,
                         rollout::QuantizedLinears::create(trainer, mode, recipe_name));
    for (const model::LinearInfo& info : trainer.linear_infos()) {
      const QuantizedTensor& qt = q->quantized_weight(info.id);
      w.codes.push_back(host_bytes(be, qt.codes, QuantizedTensor::code_bytes(qt.format, info.N, info.K)));
      w.scales.push_back(host_bytes(be, qt.scales, QuantizedTensor::scale_bytes(qt.format, info.N, info.K)));
      Tensor outer(DType::kF32, {QuantizedTensor::outer_count(qt.format, info.N, info.K)});
      be.copy_to_host(outer.raw(), qt.outer, outer.nbytes());
      w.outer.push_back(std::move(outer));
    }
  } else {
    std::vector<float> host;
    for (const model::LinearInfo& info : trainer.linear_infos()) {
      host.resize(static_cast<size_t>(info.N * info.K));
      be.copy_to_host(host.data(), trainer.linear_weight(info.id), host.size() * 4);
      Tensor t(DType::kBF16, {info.N, info.K});
      uint16_t* b = t.data<uint16_t>();
      for (size_t i = 0; i < host.size(); ++i) b[i] = f32_to_bf16_bits(host[i]);  // the bf16 mode's rounding
      w.bf16.push_back(std::move(t));
    }
  }
  const std::vector<ParamSegment> segs = rest_segments(trainer);
  int64_t r = 0;
  for (const ParamSegment& s : segs) r += s.count;
  w.rest = Tensor(DType::kF32, {r});
  float* dst = w.rest.data<float>();
  for (const ParamSegment& s : segs) {
    be.copy_to_host(dst, trainer.flat_values() + s.offset, static_cast<size_t>(s.count) * 4);
    dst += s.count;
  }
  return w;
}

// ---- the packed form ---------------------------------------------------------------------------------

PolicyLayout policy_layout(model::Model& m, PrecisionMode mode, const std::string& recipe_name) {
  PolicyLayout l;
  l.mode = mode, l.format = weight_format_for(recipe_name);
  auto place = [&](int64_t bytes) {
    PolicyLayout::Part part{l.total_bytes, bytes};
    l.total_bytes += (bytes + PolicyLayout::kPackedAlign - 1) / PolicyLayout::kPackedAlign * PolicyLayout::kPackedAlign;
    l.payload_bytes += bytes;
    return part;
  };
  for (const model::LinearInfo& info : m.linear_infos()) {
    if (four_bit(mode)) {
      l.codes.push_back(place(QuantizedTensor::code_bytes(l.format, info.N, info.K)));
      l.scales.push_back(place(QuantizedTensor::scale_bytes(l.format, info.N, info.K)));
      l.outer.push_back(place(4 * QuantizedTensor::outer_count(l.format, info.N, info.K)));
    } else {
      l.weights.push_back(place(2 * info.N * info.K));
    }
  }
  int64_t r = 0;
  for (const ParamSegment& seg : rest_segments(m)) r += seg.count;
  l.rest = place(4 * r);
  return l;
}

Result<std::shared_ptr<PackedPolicy>> allocate_packed(backend::Backend& be, const PolicyLayout& layout) {
  auto p = std::make_shared<PackedPolicy>();
  p->layout = layout, p->backend = &be;
  try {
    p->data.ensure(be, layout.total_bytes, "rl policy version (packed)");
  } catch (const backend::AllocationError& e) {
    return Status(StatusCode::kInternal, e.what());
  }
  return p;
}

Result<std::shared_ptr<PackedPolicy>> pack_policy(model::Model& trainer, PrecisionMode mode,
                                                  const std::string& recipe_name) {
  NIB_CHECK_MSG(mode != PrecisionMode::kRecipe, "pack_policy: the recipe mode has no weight sync");
  backend::Backend& be = trainer.backend();
  NIB_ASSIGN_OR_RETURN(std::shared_ptr<PackedPolicy> p, allocate_packed(be, policy_layout(trainer, mode, recipe_name)));
  const PolicyLayout& l = p->layout;
  uint8_t* base = p->data.data();
  const std::vector<model::LinearInfo>& infos = trainer.linear_infos();
  if (four_bit(mode)) {
    NIB_ASSIGN_OR_RETURN(std::unique_ptr<rollout::QuantizedLinears> q,
                         rollout::QuantizedLinears::create(trainer, mode, recipe_name));
    for (size_t i = 0; i < infos.size(); ++i) {
      const QuantizedTensor& qt = q->quantized_weight(infos[i].id);
      be.copy(base + l.codes[i].offset, qt.codes, static_cast<size_t>(l.codes[i].bytes));
      be.copy(base + l.scales[i].offset, qt.scales, static_cast<size_t>(l.scales[i].bytes));
      be.copy(base + l.outer[i].offset, qt.outer, static_cast<size_t>(l.outer[i].bytes));
    }
  } else {
    for (size_t i = 0; i < infos.size(); ++i)  // the bf16 mode's rounding: the host form's bits
      be.to_bf16_bits(reinterpret_cast<uint16_t*>(base + l.weights[i].offset), trainer.linear_weight(infos[i].id),
                      infos[i].N * infos[i].K);
  }
  auto* rest = reinterpret_cast<float*>(base + l.rest.offset);
  for (const ParamSegment& seg : rest_segments(trainer)) {
    be.copy(rest, trainer.flat_values() + seg.offset, static_cast<size_t>(seg.count) * 4);
    rest += seg.count;
  }
  return p;
}

Status pack_host_policy(const PolicyWeights& w, PackedPolicy& out) {
  const PolicyLayout& l = out.layout;
  backend::Backend& be = *out.backend;
  uint8_t* base = out.data.data();
  if (w.mode != l.mode || w.format != l.format)
    return invalid_argument("rl policy version {}: {} weights, the packed layout is for {}", w.version,
                            rollout::precision_mode_name(w.mode), rollout::precision_mode_name(l.mode));
  auto put = [&](const PolicyLayout::Part& part, const Tensor& t, const char* what, size_t i) -> Status {
    if (static_cast<int64_t>(t.nbytes()) != part.bytes)
      return invalid_argument("rl policy version {}: linear {} {} holds {} bytes, the layout {}", w.version, i, what,
                              t.nbytes(), part.bytes);
    be.copy_to_device(base + part.offset, t.raw(), t.nbytes());
    return Status::ok();
  };
  const size_t n = four_bit(l.mode) ? l.codes.size() : l.weights.size();
  if ((four_bit(l.mode) ? w.codes.size() : w.bf16.size()) != n)
    return invalid_argument("rl policy version {}: {} linears, the layout {}", w.version,
                            four_bit(l.mode) ? w.codes.size() : w.bf16.size(), n);
  for (size_t i = 0; i < n; ++i) {
    if (four_bit(l.mode)) {
      NIB_RETURN_IF_ERROR(put(l.codes[i], w.codes[i], "codes", i));
      NIB_RETURN_IF_ERROR(put(l.scales[i], w.scales[i], "scales", i));
      NIB_RETURN_IF_ERROR(put(l.outer[i], w.outer[i], "outer scales", i));
    } else {
      NIB_RETURN_IF_ERROR(put(l.weights[i], w.bf16[i], "BF16 weight", i));
    }
  }
  return put(l.rest, w.rest, "rest", n);
}

PolicyWeights unpack_policy(const PackedPolicy& p, int64_t version) {
  const PolicyLayout& l = p.layout;
  backend::Backend& be = *p.backend;
  const uint8_t* base = p.data.data();
  PolicyWeights w;
  w.version = version, w.mode = l.mode, w.format = l.format;
  auto take = [&](const PolicyLayout::Part& part, DType dt) {
    Tensor t(dt, {part.bytes / static_cast<int64_t>(dtype_size(dt))});
    be.copy_to_host(t.raw(), base + part.offset, static_cast<size_t>(part.bytes));
    return t;
  };
  for (size_t i = 0; i < l.codes.size(); ++i) {
    w.codes.push_back(take(l.codes[i], DType::kU8));
    w.scales.push_back(take(l.scales[i], DType::kU8));
    w.outer.push_back(take(l.outer[i], DType::kF32));
  }
  for (const PolicyLayout::Part& part : l.weights) w.bf16.push_back(take(part, DType::kBF16));
  w.rest = take(l.rest, DType::kF32);
  return w;
}

Result<std::vector<PolicyWeights>> policies_from_named(const std::vector<io::NamedTensor>& tensors,
                                                       model::Model& model, PrecisionMode mode,
                                                       const std::string& recipe_name) {
  std::map<std::string, const Tensor*> by_name;
  std::map<int64_t, bool> versions;
  for (const io::NamedTensor& nt : tensors) {
    by_name[nt.name] = &nt.tensor;
    int64_t v = 0;
    if (std::sscanf(nt.name.c_str(), "policy.v%ld.", &v) == 1) versions[v] = true;
  }
  int64_t rest_count = 0;
  for (const ParamSegment& s : rest_segments(model)) rest_count += s.count;
  const backend::QuantFormat fmt = weight_format_for(recipe_name);
  auto take = [&](const std::string& name, DType dt, int64_t numel) -> Result<Tensor> {
    auto it = by_name.find(name);
    if (it == by_name.end()) return data_loss("rollout policies: '{}' is missing", name);
    const Tensor& t = *it->second;
    if (t.dtype() != dt || t.numel() != numel)
      return data_loss("rollout policies: '{}' has the wrong dtype or size ({} elements, {} expected)", name,
                       t.numel(), numel);
    return t;
  };
  std::vector<PolicyWeights> out;
  for (const auto& [v, unused] : versions) {
    (void)unused;
    PolicyWeights w;
    w.version = v, w.mode = mode, w.format = fmt;
    const std::string p = "policy.v" + std::to_string(v) + ".";
    for (const model::LinearInfo& info : model.linear_infos()) {
      const std::string q = p + std::to_string(info.id) + ".";
      if (four_bit(mode)) {
        NIB_ASSIGN_OR_RETURN(Tensor c, take(q + "codes", DType::kU8, QuantizedTensor::code_bytes(fmt, info.N, info.K)));
        NIB_ASSIGN_OR_RETURN(Tensor s, take(q + "scales", DType::kU8, QuantizedTensor::scale_bytes(fmt, info.N, info.K)));
        NIB_ASSIGN_OR_RETURN(Tensor o, take(q + "outer", DType::kF32, QuantizedTensor::outer_count(fmt, info.N, info.K)));
        w.codes.push_back(c), w.scales.push_back(s), w.outer.push_back(o);
      } else {
        NIB_ASSIGN_OR_RETURN(Tensor b, take(q + "bf16", DType::kBF16, info.N * info.K));
        w.bf16.push_back(b);
      }
    }
    NIB_ASSIGN_OR_RETURN(w.rest, take(p + "rest", DType::kF32, rest_count));
    out.push_back(std::move(w));
  }
  return out;
}

Status open_record_stores(RolloutBatch& batch, const std::string& guidance_spill_dir) {
  rollout::RecordStoreOptions so;
  so.name = "routing store";
  NIB_ASSIGN_OR_RETURN(batch.routing, rollout::RecordStore::open(so));
  so.name = "guidance store";
  so.spill_dir = guidance_spill_dir;
  NIB_ASSIGN_OR_RETURN(batch.guidance, rollout::RecordStore::open(so));
  return Status::ok();
}

// ---- ThreadRolloutWorker ----------------------------------------------------------------------------

Result<std::unique_ptr<ThreadRolloutWorker>> ThreadRolloutWorker::create(const model::ModelConfig& config,
                                                                         const model::RecipeConfig& recipe,
                                                                         backend::Backend* backend,
                                                                         const rollout::EngineOptions& engine_options) {
  NIB_CHECK(backend != nullptr);
  if (engine_options.mode == PrecisionMode::kRecipe)
    return invalid_argument("rollout worker: the recipe mode has no weight sync (use bf16, w4a16 or w4a4)");
  std::unique_ptr<ThreadRolloutWorker> w(new ThreadRolloutWorker);
  NIB_ASSIGN_OR_RETURN(w->model_, model::Model::create(config, recipe, backend));
  NIB_ASSIGN_OR_RETURN(w->engine_, rollout::Engine::create(*w->model_, engine_options));
  w->rest_ = rest_segments(*w->model_);
  return w;
}

ThreadRolloutWorker::~ThreadRolloutWorker() {
  if (thread_.joinable()) thread_.join();
}

Status ThreadRolloutWorker::send(std::shared_ptr<const PolicyWeights> weights) {
  NIB_CHECK(weights != nullptr);
  if (weights->mode != engine_->options().mode)
    return invalid_argument("rollout worker: policy version {} is for the {} mode, the engine runs {}",
                            weights->version, rollout::precision_mode_name(weights->mode),
                            rollout::precision_mode_name(engine_->options().mode));
  versions_[weights->version] = std::move(weights);  // main thread only; the job holds its own reference
  return Status::ok();
}

Status ThreadRolloutWorker::apply_packed(const PolicyWeights& w) {
  backend::Backend& be = model_->backend();
  const PackedPolicy& p = *w.packed;
  const PolicyLayout& l = p.layout;
  const std::vector<model::LinearInfo>& infos = model_->linear_infos();
  if (p.backend != &be)
    return invalid_argument("rollout worker: packed version {} lives in another backend's memory", w.version);
  const PolicyLayout mine = policy_layout(*model_, w.mode, engine_->options().recipe_name);
  if (l.total_bytes != mine.total_bytes || l.format != mine.format)
    return invalid_argument("rollout worker: packed version {} is laid out for another model ({} bytes, this one {})",
                            w.version, l.total_bytes, mine.total_bytes);
  uint8_t* base = p.data.data();  // backend memory, read only
  // the rest first: the engine reads the model's own weights (lm_head, ...) when it takes the linears
  const auto* src = reinterpret_cast<const float*>(base + l.rest.offset);
  for (const ParamSegment& seg : rest_) {
    be.copy(model_->flat_values() + seg.offset, src, static_cast<size_t>(seg.count) * 4);
    src += seg.count;
  }
  if (four_bit(w.mode)) {
    std::vector<QuantizedTensor> views;
    for (size_t i = 0; i < infos.size(); ++i) {
      QuantizedTensor q;
      q.format = l.format, q.rows = infos[i].N, q.cols = infos[i].K;
      q.codes = base + l.codes[i].offset, q.scales = base + l.scales[i].offset;
      q.outer = reinterpret_cast<float*>(base + l.outer[i].offset);
      views.push_back(q);
    }
    NIB_RETURN_IF_ERROR(engine_->receive_quantized_weights(views));
  } else {
    for (size_t i = 0; i < infos.size(); ++i)  // BF16 bits widened: the master weights' bits as the host form's
      be.from_bf16_bits(model_->linear_weight(infos[i].id), reinterpret_cast<const uint16_t*>(base + l.weights[i].offset),
                        infos[i].N * infos[i].K);
    NIB_RETURN_IF_ERROR(engine_->refresh_weights());
  }
  applied_version_ = w.version;
  return Status::ok();
}

Status ThreadRolloutWorker::apply(const PolicyWeights& w) {
  if (w.packed) return apply_packed(w);
  backend::Backend& be = model_->backend();
  const std::vector<model::LinearInfo>& infos = model_->linear_infos();
  // the rest first: the engine reads the model's own weights (lm_head, ...) when it takes the linears
  const float* src = w.rest.data<float>();
  for (const ParamSegment& s : rest_) {
    be.copy_to_device(model_->flat_values() + s.offset, src, static_cast<size_t>(s.count) * 4);
    src += s.count;
  }
  if (four_bit(w.mode)) {
    if (w.codes.size() != infos.size())
      return invalid_argument("rollout worker: version {} holds {} linears, the model has {}", w.version,
                              w.codes.size(), infos.size());
    // host -> this backend's staging buffers, which the engine copies from (backend memory)
    staging_.resize(infos.size());
    std::vector<QuantizedTensor> views;
    for (size_t i = 0; i < infos.size(); ++i) {
      if (w.codes[i].nbytes() != static_cast<size_t>(QuantizedTensor::code_bytes(w.format, infos[i].N, infos[i].K)))
        return invalid_argument("rollout worker: version {} linear {} has the wrong size", w.version, infos[i].name);
      QuantizedTensor q = staging_[i].view(be, w.format, infos[i].N, infos[i].K);
      be.copy_to_device(q.codes, w.codes[i].raw(), w.codes[i].nbytes());
      be.copy_to_device(q.scales, w.scales[i].raw(), w.scales[i].nbytes());
      be.copy_to_device(q.outer, w.outer[i].raw(), w.outer[i].nbytes());
      views.push_back(q);
    }
    NIB_RETURN_IF_ERROR(engine_->receive_quantized_weights(views));
  } else {
    if (w.bf16.size() != infos.size())
      return invalid_argument("rollout worker: version {} holds {} linears, the model has {}", w.version,
                              w.bf16.size(), infos.size());
    std::vector<float> host;
    for (size_t i = 0; i < infos.size(); ++i) {
      const uint16_t* b = w.bf16[i].data<uint16_t>();
      host.resize(static_cast<size_t>(infos[i].N * infos[i].K));
      for (size_t k = 0; k < host.size(); ++k) host[k] = bf16_bits_to_f32(b[k]);
      be.copy_to_device(model_->linear_weight(infos[i].id), host.data(), host.size() * 4);
    }
  }
  // the bf16 mode rounds the master weights just written (bf16 values: the same bits)
  if (!four_bit(w.mode)) NIB_RETURN_IF_ERROR(engine_->refresh_weights());
  applied_version_ = w.version;
  return Status::ok();
}

Result<RolloutBatch> ThreadRolloutWorker::run_job(const RolloutJob& job, std::shared_ptr<const PolicyWeights> w,
                                                  int threads) {
  set_num_threads(threads);  // a new thread starts from OpenMP's default, not the caller's setting
  RolloutBatch out;
  out.step = job.step;
  if (applied_version_ != w->version) NIB_RETURN_IF_ERROR(apply(*w));
  out.version = applied_version_;  // the version id the weights carried
  out.requests = job.requests;
  out.began = std::chrono::steady_clock::now();
  NIB_RETURN_IF_ERROR(open_record_stores(out, job.guidance_spill_dir));
  rollout::RolloutRecorders rec;
  if (job.record_routing) rec.routing = out.routing.get();
  if (job.record_guidance) {
    rec.guidance = out.guidance.get();
    rec.guidance_mode = job.guidance_mode;
    rec.guidance_layers = job.guidance_layers;
  }
  rollout::EngineCallbacks cb;
  cb.recorders = &rec;
  NIB_ASSIGN_OR_RETURN(out.completions, engine_->generate(job.requests, cb));
  NIB_RETURN_IF_ERROR(out.guidance->flush());
  NIB_RETURN_IF_ERROR(out.routing->flush());
  out.generated_tokens = engine_->stats().generated_tokens;
  out.ended = std::chrono::steady_clock::now();
  return out;
}

Status ThreadRolloutWorker::start(RolloutJob job) {
  NIB_CHECK_MSG(!running_, "rollout worker: start() while a job runs (call finish() first)");
  auto it = versions_.find(job.version);
  if (it == versions_.end())
    return invalid_argument("rollout worker: policy version {} was never sent (step {})", job.version, job.step);
  std::shared_ptr<const PolicyWeights> w = it->second;
  versions_.erase(versions_.begin(), it);  // older versions are not asked for again
  running_ = true;
  const int threads = num_threads();
  thread_ = std::thread([this, job = std::move(job), w, threads]() {
    Result<RolloutBatch> r = run_job(job, w, threads);
    if (r.is_ok()) {
      job_batch_ = std::move(r).value();
      job_status_ = Status::ok();
    } else {
      job_status_ = r.status();
    }
  });
  return Status::ok();
}

Result<RolloutBatch> ThreadRolloutWorker::finish() {
  NIB_CHECK_MSG(running_, "rollout worker: finish() without a started job");
  thread_.join();
  running_ = false;
  if (!job_status_.is_ok()) return job_status_;
  return std::move(job_batch_);
}

}  // namespace nibble::rl
