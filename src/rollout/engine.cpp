// The rollout engine's scheduler and generation loop (see engine.h).
#include "rollout/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"
#include "core/philox.h"
#include "core/softmax_f64.h"
#include "backend/graph_capture.h"
#include "rollout/quantized_weights.h"

namespace nibble::rollout {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A step's forward with the backend's GEMMs batch-invariant (Backend::set_batch_invariant): each
// row's logits are those it gets alone, whatever else is in the step. Off again when it ends.
class BatchInvariantGemms {
 public:
  explicit BatchInvariantGemms(backend::Backend& be) : be_(be) { be_.set_batch_invariant(true); }
  ~BatchInvariantGemms() { be_.set_batch_invariant(false); }
  BatchInvariantGemms(const BatchInvariantGemms&) = delete;
  BatchInvariantGemms& operator=(const BatchInvariantGemms&) = delete;

 private:
  backend::Backend& be_;
};
}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStopId: return "eos";
    case FinishReason::kLength: return "length";
    case FinishReason::kStopString: return "stop";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "?";
}

Result<std::unique_ptr<Engine>> Engine::create(model::Model& model, const EngineOptions& options) {
  const model::ModelConfig& cfg = model.config();
  EngineOptions o = options;
  if (o.page_size <= 0) return invalid_argument("rollout: page size must be positive (got {})", o.page_size);
  if (o.max_batch <= 0) return invalid_argument("rollout: max batch must be positive (got {})", o.max_batch);
  if (o.num_pages < 0 || o.max_step_tokens < 0)
    return invalid_argument("rollout: page count and step tokens must be >= 0 (0: automatic)");
  const int64_t ctx = cfg.max_position_embeddings;
  const int64_t ctx_pages = (ctx + o.page_size - 1) / o.page_size;
  // enough for a request of max_batch samples over the whole context (see worst_case_pages)
  if (o.num_pages == 0) o.num_pages = (o.max_batch + 1) * (ctx_pages + 1);
  if (o.max_step_tokens == 0) o.max_step_tokens = std::max(ctx, o.max_batch);
  if (o.max_step_tokens < o.max_batch)
    return invalid_argument("rollout: step tokens ({}) must be at least the max batch ({})", o.max_step_tokens,
                            o.max_batch);
  if (model.storage() == model::ParameterStorage::kInference && o.mode == PrecisionMode::kRecipe)
    return invalid_argument("rollout: a model of inference storage has no recipe weights (mode bf16, w4a16 or w4a4)");
  std::unique_ptr<QuantizedLinears> linears;
  if (o.mode != PrecisionMode::kRecipe) {
    NIB_ASSIGN_OR_RETURN(linears, QuantizedLinears::create(model, o.mode, o.recipe_name));
  }
  std::string graphs_off;
  // decode graphs (decode_graph.h): where they cannot run, every step is eager and graphs_off_ says why
  // NIBBLE_CUDA_GRAPHS=off|on overrides the option for every engine (kEagerLayout, a test mode, stays)
  if (const char* env = std::getenv("NIBBLE_CUDA_GRAPHS"); env != nullptr && o.decode_graphs != DecodeGraphMode::kEagerLayout) {
    const std::string v(env);
    if (v == "off" || v == "0") o.decode_graphs = DecodeGraphMode::kOff;
    if (v == "on" || v == "1") o.decode_graphs = DecodeGraphMode::kOn;
  }
  if (o.decode_graphs == DecodeGraphMode::kOff) {
    graphs_off = std::getenv("NIBBLE_CUDA_GRAPHS") != nullptr ? "NIBBLE_CUDA_GRAPHS=off"
                                                                : "turned off (--no-cuda-graphs)";
  } else if (o.mode == PrecisionMode::kRecipe) {
    graphs_off = "the recipe mode runs the model's own recipes";
  } else if (model.num_moe_layers() > 0 && !linears->runs_experts_grouped(model.backend())) {
    graphs_off = "MoE layers walk their experts with host offsets";  // (the TE formats: per-expert scales)
  } else if (o.decode_graph_padding && o.mode == PrecisionMode::kW4A4 && o.recipe_name == "nvfp4-nvidia") {
    graphs_off = "padding rows would enter w4a4's per-tensor activation scale (nvfp4-nvidia)";
  } else if (o.decode_graphs == DecodeGraphMode::kOn && backend::graph_capture(model.backend()) == nullptr) {
    graphs_off = fmt::format("backend '{}' cannot capture graphs", model.backend().name());
  }
  std::unique_ptr<Engine> e(new Engine(model, o));
  e->graphs_off_ = graphs_off;
  EngineOptions::DeviceGreedy dg = o.device_greedy;
  if (const char* env = std::getenv("NIBBLE_DEVICE_GREEDY"); env != nullptr) {
    const std::string v(env);
    if (v == "on" || v == "1") dg = EngineOptions::DeviceGreedy::kOn;
    if (v == "off" || v == "0") dg = EngineOptions::DeviceGreedy::kOff;
  }
  e->device_greedy_ = !o.reference_sampler && model.backend().supports(backend::Op::kGreedyRows) &&
                      (dg == EngineOptions::DeviceGreedy::kOn ||
                       (dg == EngineOptions::DeviceGreedy::kAuto && model.backend().device() != Device::kCPU));
  const bool graphs = e->graphs_off_.empty();
  KvCacheConfig kc;
  kc.num_layers = cfg.num_hidden_layers;
  kc.num_heads = cfg.num_attention_heads;
  kc.num_kv_heads = cfg.num_key_value_heads;
  kc.head_dim = cfg.head_dim;
  kc.page_size = o.page_size;
  kc.num_pages = o.num_pages;
  kc.format = o.kv_format;
  kc.attention = model.attention_precision();
  kc.graph_rows = graphs ? o.max_batch : 0;
  kc.max_context = ctx;
  NIB_ASSIGN_OR_RETURN(e->cache_, PagedKvCache::create(model.backend(), kc));
  if (graphs) {
    NIB_ASSIGN_OR_RETURN(e->graphs_, DecodeGraphs::create(model, o.decode_graphs, o.max_batch, o.decode_graph_padding));
  }
  for (size_t i = 0; i < model.param_refs().size(); ++i)
    if (model.param_refs()[i].name == "lm_head.weight" && model.param_refs()[i].value == nullptr)
      e->lm_head_index_ = static_cast<int64_t>(i);  // inference storage, BF16 lm_head: ours alone
  if (o.mode != PrecisionMode::kRecipe) {
    e->linears_ = std::move(linears);
    e->snapshot_lm_head();
  }
  if (e->lm_head_held())  // allocated now, so memory() counts it from the start
    e->lm_head_bits_.ensure(model.backend(), model.param_refs()[static_cast<size_t>(e->lm_head_index_)].numel,
                            "rollout lm_head BF16 weight");
  return e;
}

void Engine::snapshot_lm_head() {
  if (lm_head_held()) return;  // the bits are the only copy: they change through set_lm_head_weight
  lm_head_snapshot_ = false;
  if (!linears_ || !model_->lm_head_bf16()) return;
  for (const auto& p : model_->param_refs())
    if (p.name == "lm_head.weight") {
      backend::Backend& be = model_->backend();
      be.to_bf16_bits(lm_head_bits_.ensure(be, p.numel, "rollout lm_head BF16 weight"), p.value, p.numel);
      lm_head_snapshot_ = true;
    }
}

void Engine::upload_lm_head(const void* w, bool bf16) {
  const int64_t n = model_->param_refs()[static_cast<size_t>(lm_head_index_)].numel;
  backend::Backend& be = model_->backend();
  uint16_t* dst = lm_head_bits_.ensure(be, n, "rollout lm_head BF16 weight");
  if (bf16) {
    be.copy_to_device(dst, w, static_cast<size_t>(n) * sizeof(uint16_t));
  } else {  // f32_to_bf16_bits is the function Backend::to_bf16_bits runs (CPU and CUDA)
    constexpr int64_t kSlice = int64_t{1} << 20;
    std::vector<uint16_t> bits(static_cast<size_t>(std::min(n, kSlice)));
    const float* f = static_cast<const float*>(w);
    for (int64_t at = 0; at < n; at += kSlice) {
      const int64_t k = std::min(kSlice, n - at);
      parallel_for(k, 4096, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) bits[static_cast<size_t>(i)] = f32_to_bf16_bits(f[at + i]);
      });
      be.copy_to_device(dst + at, bits.data(), static_cast<size_t>(k) * sizeof(uint16_t));
    }
  }
  lm_head_snapshot_ = true;
}

Status Engine::set_lm_head_weight(const float* w) {
  if (!lm_head_held())
    return invalid_argument("rollout: the model keeps its own lm_head (training storage, or the fp32 recipe's FP32 "
                            "lm_head): write its parameter");
  upload_lm_head(w, /*bf16=*/false);
  return Status::ok();
}

Status Engine::refresh_weights() {
  if (model_->storage() == model::ParameterStorage::kInference)
    return invalid_argument("rollout: the model keeps no master weights to re-quantize (inference storage: "
                            "set_linear_weight per tensor)");
  if (options_.mode != PrecisionMode::kRecipe) {
    NIB_ASSIGN_OR_RETURN(linears_, QuantizedLinears::create(*model_, options_.mode, options_.recipe_name));
    snapshot_lm_head();
  }
  return Status::ok();
}

Status Engine::set_linear_weight(int id, const float* w) {
  if (!linears_) return invalid_argument("linear weights: the recipe mode runs the model's own recipes");
  return linears_->set_weight(id, w, QuantizedLinears::Memory::kHost);
}

namespace {
// WeightInit::kUniform's values of one block linear (see engine.h): n elements from 4-word
// Philox blocks, in parallel ranges of whole blocks.
void fill_uniform_linear(float* w, int64_t n, int linear_id, uint64_t seed, double sigma) {
  const PhiloxRoundKeys keys = philox_round_keys(seed);
  const float half_width = static_cast<float>(std::sqrt(3.0) * sigma);
  const uint64_t stream = 0x1417u + static_cast<uint64_t>(linear_id);
  const int64_t blocks = (n + 3) / 4;
  parallel_for(blocks, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Philox4x32 r = philox4x32_10(philox_counter(stream, static_cast<uint64_t>(b)), keys);
      for (int64_t j = 0; j < 4 && 4 * b + j < n; ++j) {
        w[4 * b + j] = (2.0f * u32_to_uniform(r.v[j]) - 1.0f) * half_width;
      }
    }
  });
}
}  // namespace

Status Engine::init_random_weights(uint64_t seed, WeightInit init) {
  if (init == WeightInit::kUniform) {
    if (!linears_) return invalid_argument("uniform weight init: the recipe mode runs the model's own recipes");
    if (model_->storage() == model::ParameterStorage::kTraining)
      return invalid_argument("uniform weight init: only for a model of inference storage");
  }
  if (model_->storage() == model::ParameterStorage::kTraining) {
    model_->init_weights(seed);
    return refresh_weights();
  }
  model_->init_weights(seed);  // the kept parameters, a tensor at a time
  if (lm_head_held()) {
    const size_t i = static_cast<size_t>(lm_head_index_);
    std::vector<float> w(static_cast<size_t>(model_->param_refs()[i].numel));
    model_->init_parameter(w.data(), i, seed);
    NIB_RETURN_IF_ERROR(set_lm_head_weight(w.data()));
  }
  if (init == WeightInit::kUniform) {
    std::vector<float> host;
    for (const model::LinearInfo& info : model_->linear_infos()) {
      host.resize(static_cast<size_t>(info.N * info.K));
      fill_uniform_linear(host.data(), info.N * info.K, info.id, seed, model_->config().initializer_range);
      NIB_RETURN_IF_ERROR(set_linear_weight(info.id, host.data()));
    }
    snapshot_lm_head();
    return Status::ok();
  }
  // the block linears in groups of one per thread: each thread draws one linear's members (their
  // own Philox streams, as init_weights), then the group is quantized in order
  const std::vector<model::LinearInfo>& infos = model_->linear_infos();
  const size_t group = static_cast<size_t>(std::max(1, num_threads()));
  std::vector<std::vector<float>> host(group);
  for (size_t first = 0; first < infos.size(); first += group) {
    const size_t n = std::min(group, infos.size() - first);
    parallel_for(static_cast<int64_t>(n), 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        const model::LinearInfo& info = infos[first + static_cast<size_t>(j)];
        std::vector<float>& h = host[static_cast<size_t>(j)];
        h.resize(static_cast<size_t>(info.N * info.K));
        const auto [p0, count] = model_->linear_params(info.id);
        float* at = h.data();
        for (size_t i = p0; i < p0 + count; ++i) {
          model_->init_parameter(at, i, seed);
          at += model_->param_refs()[i].numel;
        }
      }
    });
    for (size_t j = 0; j < n; ++j) NIB_RETURN_IF_ERROR(set_linear_weight(infos[first + j].id, host[j].data()));
  }
  snapshot_lm_head();
  return Status::ok();
}

std::string Engine::decode_graphs_status() const {
  if (!graphs_) return "off: " + graphs_off_;
  if (!graphs_->active()) return "off: " + graphs_->failure();
  return std::string(decode_graph_mode_name(graphs_->mode())) + (graphs_->padded() ? " (padded)" : "");
}

EngineMemory Engine::memory() const {
  EngineMemory m;
  if (model_->storage() == model::ParameterStorage::kTraining)
    for (const model::LinearInfo& info : model_->linear_infos())
      m.master_weights += static_cast<int64_t>(sizeof(float)) * info.N * info.K;
  m.high_precision_weights = model_->value_bytes() - m.master_weights + 2 * lm_head_bits_.size();
  m.gradients = model_->gradient_bytes();
  m.packed_weights = linears_ ? linears_->storage_bytes() : 0;
  m.kv_pages = cache_->bytes();
  m.workspace = model_->workspace_bytes() + (linears_ ? linears_->workspace_bytes() : 0) + cache_->table_bytes() +
                (graphs_ ? graphs_->workspace_bytes() : 0);
  return m;
}

Status Engine::receive_quantized_weights(const std::vector<backend::QuantizedTensor>& per_linear) {
  if (!linears_) return invalid_argument("quantized weights: the recipe mode runs the model's own recipes");
  NIB_RETURN_IF_ERROR(linears_->set_quantized_weights(per_linear, QuantizedLinears::Memory::kBackend));
  snapshot_lm_head();  // the rest of the weights are the model's own, as they are now
  return Status::ok();
}

Status Engine::load_quantized_weights(const std::string& path) {
  if (!linears_) return invalid_argument("quantized weights: the recipe mode runs the model's own recipes");
  if (linears_->mode() == PrecisionMode::kBf16)
    return invalid_argument("quantized weights: the bf16 mode keeps BF16 weights (use w4a16 or w4a4)");
  if (linears_->weight_format() != backend::QuantFormat::kNvfp4TwoLevel)
    return invalid_argument("quantized weights: the file holds {} weights, this engine's are {}",
                            backend::quant_format_name(backend::QuantFormat::kNvfp4TwoLevel),
                            backend::quant_format_name(linears_->weight_format()));
  NIB_RETURN_IF_ERROR(read_quantized_linears(path, *model_, [&](int id, const backend::QuantizedTensor& w) {
    return linears_->set_quantized_weight(id, w, QuantizedLinears::Memory::kHost);
  }));
  snapshot_lm_head();
  return Status::ok();
}

namespace {
int64_t max_new_of(const Request& r, int64_t ctx) {
  return std::min<int64_t>(r.params.max_new_tokens, ctx - static_cast<int64_t>(r.prompt.size()));
}
}  // namespace

// Pages a request can hold at its largest: with prefix sharing the prompt's pages once plus, per
// sample, its own pages past the prompt's last full page and one copy-on-write page; without,
// G whole sequences. Positions written: prompt + new tokens - 1 (the last token is never fed).
int64_t Engine::worst_case_pages(const Request& r) const {
  const int64_t ps = options_.page_size, P = static_cast<int64_t>(r.prompt.size());
  const int64_t n = max_new_of(r, model_->config().max_position_embeddings), G = r.params.num_samples;
  if (n <= 0) return 0;
  const int64_t total = (P + n + ps - 1) / ps;
  if (!options_.share_prefix || G == 1) return G * total;
  return (P + ps - 1) / ps + G * (total - P / ps + 1);
}

Status Engine::validate(const std::vector<Request>& requests) const {
  const model::ModelConfig& cfg = model_->config();
  const int64_t ctx = cfg.max_position_embeddings;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    const GenerationParams& g = r.params;
    if (r.prompt.empty()) return invalid_argument("request {}: empty prompt", i);
    if (static_cast<int64_t>(r.prompt.size()) > ctx)
      return invalid_argument("request {}: prompt of {} tokens is longer than the model's context of {} tokens", i,
                              r.prompt.size(), ctx);
    for (int32_t t : r.prompt)
      if (t < 0 || t >= cfg.vocab_size)
        return invalid_argument("request {}: token id {} outside the vocabulary [0, {})", i, t, cfg.vocab_size);
    if (g.num_samples < 1 || g.num_samples > options_.max_batch)
      return invalid_argument("request {}: {} samples, must be in [1, max batch {}]", i, g.num_samples,
                              options_.max_batch);
    if (g.num_samples >= (1 << 16) || r.id >= (1u << 16))
      return invalid_argument("request {}: id {} and samples {} must be below 65536", i, r.id, g.num_samples);
    if (g.max_new_tokens < 0) return invalid_argument("request {}: max new tokens must be >= 0", i);
    if (!std::isfinite(g.sampling.temperature) || g.sampling.temperature < 0)
      return invalid_argument("request {}: temperature must be finite and >= 0", i);
    if (!(g.sampling.top_p > 0 && g.sampling.top_p <= 1)) return invalid_argument("request {}: top_p must be in (0, 1]", i);
    if (g.sampling.top_k < 0) return invalid_argument("request {}: top_k must be >= 0", i);
    for (const std::string& s : g.stop_strings)
      if (s.empty()) return invalid_argument("request {}: empty stop string", i);
    const int64_t need = worst_case_pages(r);
    if (need > options_.num_pages)
      return invalid_argument("request {}: needs up to {} KV pages, the cache has {} (raise the page count or lower "
                              "max new tokens / samples)", i, need, options_.num_pages);
  }
  return Status::ok();
}

Result<std::vector<Completion>> Engine::generate(const std::vector<Request>& given,
                                                 const EngineCallbacks& callbacks) {
  if (linears_ && !linears_->weights_ready())
    return invalid_argument("rollout: linear {} has no weight yet (the weights arrive per tensor)",
                               model_->linear_infos()[static_cast<size_t>(linears_->first_waiting())].name);
  if (lm_head_held() && !lm_head_snapshot_)
    return invalid_argument("rollout: the lm_head has no weight yet (the weights arrive per tensor)");
  NIB_RETURN_IF_ERROR(validate(given));
  // given, then what callbacks.admit hands over (a deque: references stay valid as it grows)
  std::deque<Request> requests(given.begin(), given.end());
  stats_ = EngineStats{};
  const auto t_generate = Clock::now();
  struct TotalTime {  // stats_.total_seconds, however generate() returns
    EngineStats& stats;
    Clock::time_point t0;
    ~TotalTime() { stats.total_seconds = seconds_since(t0); }
  } total_time{stats_, t_generate};
  auto check_stops = [&](const std::vector<Request>& rs) -> Status {
    for (const Request& r : rs)
      if (!r.params.stop_strings.empty() && !callbacks.detokenize)
        return invalid_argument("rollout: stop strings need a detokenizer");
    return Status::ok();
  };
  NIB_RETURN_IF_ERROR(check_stops(given));
  const RolloutRecorders* recorders = callbacks.recorders;
  std::unique_ptr<GuidanceRecorder> guidance;
  if (recorders != nullptr && recorders->guidance != nullptr) {
    if (options_.mode != PrecisionMode::kW4A4)
      return invalid_argument("rollout: guidance recording needs the w4a4 mode (the engine runs {})",
                              precision_mode_name(options_.mode));
    guidance = std::make_unique<GuidanceRecorder>(*recorders, model_->config().num_hidden_layers);
  }
  // the observers are this call's: detach them whatever way generate() returns. With NVFP4 pages
  // the recorder also reads back each layer's K and V slots (the kKeyCache / kValueCache sites).
  const bool record_kv = guidance && options_.kv_format == backend::KvPageFormat::kNvfp4;
  struct DetachObserver {
    QuantizedLinears* linears;
    PagedKvCache* cache;
    ~DetachObserver() {
      if (linears != nullptr) linears->set_observer(nullptr);
      if (cache != nullptr) cache->set_write_observer(nullptr);
    }
  } detach_observer{guidance ? linears_.get() : nullptr, record_kv ? cache_.get() : nullptr};
  if (guidance) linears_->set_observer(guidance.get());
  if (record_kv) cache_->set_write_observer(guidance.get());
  const model::ModelConfig& cfg = model_->config();
  const int64_t V = cfg.vocab_size, ctx = cfg.max_position_embeddings;
  const int64_t Lm = model_->num_moe_layers(), topk = cfg.num_experts_per_tok;
  using SeqId = PagedKvCache::SeqId;

  struct Sample {
    int64_t request = 0, index = 0;
    SeqId seq = -1;
    PhiloxStream rng;
    Completion out;
    int32_t pending = -1;  // sampled, not yet fed
    bool done = false;
  };
  // A prompt being prefilled: its own sequence, handed to (or forked for) its samples when done.
  struct Prefill {
    int64_t request = 0;
    SeqId seq = -1;
    int64_t fed = 0;
    std::vector<size_t> samples;  // indices into `samples`
  };
  std::vector<Sample> samples;
  std::vector<Prefill> prefills;
  std::deque<int64_t> waiting;
  for (size_t i = 0; i < requests.size(); ++i) waiting.push_back(static_cast<int64_t>(i));
  // Whatever happens (a callback's error, an exception), no sequence stays in the cache.
  struct ReleaseOnExit {
    PagedKvCache& cache;
    std::vector<Sample>& samples;
    std::vector<Prefill>& prefills;
    ~ReleaseOnExit() {
      for (Sample& s : samples)
        if (s.seq >= 0) cache.release(s.seq);
      for (Prefill& p : prefills)
        if (p.seq >= 0) cache.release(p.seq);
    }
  } release_on_exit{*cache_, samples, prefills};
  std::vector<int64_t> reserved(requests.size(), 0), remaining(requests.size(), 0);
  std::vector<std::vector<Completion>> done_by_request(requests.size());
  int64_t budget_used = 0, running = 0;

  // Records token `drawn` (sampled for sample s by draw_tokens); true when s stops.
  auto take_token = [&](Sample& s, const SampledToken& drawn) -> Result<bool> {
    const GenerationParams& g = requests[s.request].params;
    const int32_t tok = drawn.token;
    s.out.tokens.push_back(tok);
    s.out.logprobs.push_back(drawn.logprob);
    ++stats_.generated_tokens;
    if (callbacks.on_token) NIB_RETURN_IF_ERROR(callbacks.on_token(s.request, s.index, tok));
    if (std::find(g.stop_ids.begin(), g.stop_ids.end(), tok) != g.stop_ids.end()) {
      s.out.finish = FinishReason::kStopId;
      return true;
    }
    if (!g.stop_strings.empty()) {
      NIB_ASSIGN_OR_RETURN(std::string text, callbacks.detokenize(s.out.tokens));
      for (const std::string& stop : g.stop_strings)
        if (text.find(stop) != std::string::npos) {
          s.out.finish = FinishReason::kStopString;
          return true;
        }
    }
    if (static_cast<int64_t>(s.out.tokens.size()) >= max_new_of(requests[s.request], ctx)) {
      s.out.finish = FinishReason::kLength;
      return true;
    }
    s.pending = tok;
    return false;
  };
  auto finish = [&](Sample& s) -> Status {
    s.done = true;
    if (s.seq >= 0) cache_->release(s.seq);
    s.seq = -1;
    --running;
    if (callbacks.on_finish) NIB_RETURN_IF_ERROR(callbacks.on_finish(s.out));
    if (!callbacks.admit) done_by_request[s.request].push_back(std::move(s.out));
    if (--remaining[s.request] == 0) {
      budget_used -= reserved[s.request];
      if (callbacks.admit) requests[s.request].prompt = {};
    }
    return Status::ok();
  };

  // This step's draws: the token and log-prob of samples[draw_sample[j]] from logits row
  // draw_row[j] (V). Each draw reads only its row and its own sample's Philox stream, so the rows
  // are drawn in parallel (the same tokens as one after the other) before take_token records them
  // in order.
  std::vector<size_t> draw_sample;
  std::vector<const float*> draw_row;
  std::vector<int64_t> draw_logit;    // the logit row (of logit_rows) of each draw
  std::vector<uint8_t> greedy_host;   // a device greedy step's tokens and sums, copied back
  std::vector<SampledToken> drawn;
  auto draw_tokens = [&] {
    const auto t0 = Clock::now();
    drawn.resize(draw_sample.size());
    if (options_.reference_sampler) {
      for (size_t j = 0; j < drawn.size(); ++j) {
        Sample& s = samples[draw_sample[j]];
        const SamplingParams& sp = requests[s.request].params.sampling;
        drawn[j].token = sample_token(draw_row[j], V, sp, &s.rng);
        drawn[j].logprob = token_logprob(draw_row[j], V, drawn[j].token, sp.temperature);
      }
    } else {
      // rows over the threads; fewer rows than threads: one row after the other, each split
      const int64_t rows = static_cast<int64_t>(draw_sample.size());
      const bool split_rows = rows < num_threads();
      auto draw = [&](int64_t j) {
        Sample& s = samples[draw_sample[j]];
        drawn[j] = sample_with_logprob(draw_row[j], V, requests[s.request].params.sampling, &s.rng, split_rows);
      };
      if (split_rows)
        for (int64_t j = 0; j < rows; ++j) draw(j);
      else
        parallel_for(rows, 1, [&](int64_t b, int64_t e) {
          for (int64_t j = b; j < e; ++j) draw(j);
        });
    }
    stats_.sample_seconds += seconds_since(t0);
  };
  // Greedy draws from logits left in backend memory: each logit row's token and softmax sums by
  // Backend::greedy_rows, one copy back; the log-prob is sample_with_logprob's greedy formula on
  // the same sums (the same bits).
  auto draw_greedy_on_device = [&](const float* logits_dev, int64_t rows) {
    const auto t0 = Clock::now();
    backend::Backend& be = model_->backend();
    const int64_t tok_bytes = (4 * rows + 7) / 8 * 8, bytes = tok_bytes + 24 * rows;
    uint8_t* out = greedy_out_.ensure(be, bytes, "rollout greedy tokens");
    be.greedy_rows(reinterpret_cast<int32_t*>(out), reinterpret_cast<double*>(out + tok_bytes), logits_dev, rows, V);
    greedy_host.resize(static_cast<size_t>(bytes));
    be.copy_to_host(greedy_host.data(), out, static_cast<size_t>(bytes));
    drawn.resize(draw_sample.size());
    for (size_t j = 0; j < drawn.size(); ++j) {
      const int64_t row = draw_logit[j];
      int32_t tok;
      double st[3];
      std::memcpy(&tok, greedy_host.data() + 4 * row, sizeof tok);
      std::memcpy(st, greedy_host.data() + tok_bytes + 24 * row, sizeof st);
      drawn[j].token = tok;
      drawn[j].logprob = softmax_log_prob(st[0], 1.0, st[1], std::log(st[2]));  // the greedy sampler's, t = 1
    }
    stats_.sample_seconds += seconds_since(t0);
  };
  std::vector<float> logits;
  std::vector<SeqId> row_seq;
  std::vector<int32_t> row_pos, row_tok, routing, logit_rows;
  std::vector<int64_t> row_req, row_sample, row_samples_of;
  std::vector<uint64_t> row_id;
  while (true) {
    // ---- requests arriving while running (serving) ----
    if (callbacks.admit) {
      NIB_ASSIGN_OR_RETURN(std::vector<Request> more, callbacks.admit(waiting.empty() && running == 0));
      NIB_RETURN_IF_ERROR(validate(more));
      NIB_RETURN_IF_ERROR(check_stops(more));
      for (Request& r : more) {
        waiting.push_back(static_cast<int64_t>(requests.size()));
        requests.push_back(std::move(r));
      }
      reserved.resize(requests.size(), 0), remaining.resize(requests.size(), 0);
      done_by_request.resize(requests.size());
    }
    if (waiting.empty() && running == 0) break;
    // ---- admit waiting requests (in order) while the batch and the cache have room ----
    while (!waiting.empty()) {
      const int64_t r = waiting.front();
      const Request& req = requests[r];
      const int64_t G = req.params.num_samples, need = worst_case_pages(req);
      if (running + G > options_.max_batch || budget_used + need > options_.num_pages) {
        ++stats_.waits;
        break;
      }
      waiting.pop_front();
      reserved[r] = need;
      remaining[r] = G;
      budget_used += need;
      running += G;
      const bool share = options_.share_prefix;
      for (int64_t g = 0; g < G; ++g) {
        Sample s;
        s.request = r;
        s.index = g;
        s.rng = PhiloxStream(req.params.seed, sample_stream(req.id, static_cast<uint64_t>(g)));
        s.out.request = r;
        s.out.sample = g;
        samples.push_back(std::move(s));
        if (!share || g == 0) prefills.push_back(Prefill{r, cache_->add_sequence(), 0, {}});
        prefills.back().samples.push_back(samples.size() - 1);
      }
      stats_.prompt_tokens += static_cast<int64_t>(req.prompt.size()) * (share ? 1 : G);
      if (max_new_of(req, ctx) <= 0) {  // nothing to generate: done without a forward
        const size_t first = prefills.size() - (share ? 1 : static_cast<size_t>(G));
        for (size_t p = first; p < prefills.size(); ++p) {
          cache_->release(prefills[p].seq);
          prefills[p].seq = -1;
          for (size_t si : prefills[p].samples) NIB_RETURN_IF_ERROR(finish(samples[si]));
        }
        prefills.resize(first);
      }
    }
    // ---- cancelled requests stop here (prompts being prefilled, then decoding samples) ----
    if (callbacks.cancelled) {
      for (size_t p = prefills.size(); p-- > 0;) {
        if (!callbacks.cancelled(prefills[p].request)) continue;
        cache_->release(prefills[p].seq);
        const std::vector<size_t> of = std::move(prefills[p].samples);
        prefills.erase(prefills.begin() + static_cast<std::ptrdiff_t>(p));
        for (size_t si : of) {
          samples[si].out.finish = FinishReason::kCancelled;
          NIB_RETURN_IF_ERROR(finish(samples[si]));
        }
      }
      for (Sample& s : samples)
        if (!s.done && s.seq >= 0 && callbacks.cancelled(s.request)) {
          s.out.finish = FinishReason::kCancelled;
          NIB_RETURN_IF_ERROR(finish(s));
        }
    }
    stats_.peak_running = std::max(stats_.peak_running, running);
    if (running == 0) continue;  // all cancelled, or nothing left: back to admit / the loop's end

    // ---- this step's rows: one per decoding sample, then prompt chunks ----
    row_seq.clear(), row_pos.clear(), row_tok.clear(), row_req.clear(), row_sample.clear();
    std::vector<size_t> decode_rows;  // sample index of each decode row
    for (size_t i = 0; i < samples.size(); ++i) {
      Sample& s = samples[i];
      if (s.done || s.pending < 0) continue;
      NIB_RETURN_IF_ERROR(cache_->grow(s.seq, 1));
      row_seq.push_back(s.seq);
      row_pos.push_back(static_cast<int32_t>(cache_->length(s.seq)));
      row_tok.push_back(s.pending);
      row_req.push_back(s.request);
      row_sample.push_back(s.index);
      decode_rows.push_back(i);
    }
    struct Chunk {
      size_t prefill;
      int64_t first_row, rows;
      int64_t logit = -1;  // its last row's index among the logit rows (a chunk that ends its prompt)
    };
    std::vector<Chunk> chunks;
    int64_t budget = options_.max_step_tokens - static_cast<int64_t>(row_seq.size());
    for (size_t p = 0; p < prefills.size() && budget > 0; ++p) {
      Prefill& pf = prefills[p];
      const std::vector<int32_t>& prompt = requests[pf.request].prompt;
      const int64_t n = std::min<int64_t>(budget, static_cast<int64_t>(prompt.size()) - pf.fed);
      NIB_RETURN_IF_ERROR(cache_->grow(pf.seq, n));
      chunks.push_back(Chunk{p, static_cast<int64_t>(row_seq.size()), n});
      for (int64_t j = 0; j < n; ++j) {
        row_seq.push_back(pf.seq);
        row_pos.push_back(static_cast<int32_t>(pf.fed + j));
        row_tok.push_back(prompt[pf.fed + j]);
        row_req.push_back(pf.request);
        row_sample.push_back(pf.samples.size() == 1 ? samples[pf.samples[0]].index : -1);
      }
      budget -= n;
    }
    const int64_t N = static_cast<int64_t>(row_seq.size());
    NIB_CHECK(N > 0);
    // logits only where a token is sampled: every decode row, the last row of a finished prompt
    logit_rows.clear();
    for (size_t d = 0; d < decode_rows.size(); ++d) logit_rows.push_back(static_cast<int32_t>(d));
    for (Chunk& c : chunks)
      if (prefills[c.prefill].fed + c.rows == static_cast<int64_t>(requests[prefills[c.prefill].request].prompt.size())) {
        c.logit = static_cast<int64_t>(logit_rows.size());
        logit_rows.push_back(static_cast<int32_t>(c.first_row + c.rows - 1));
      }

    // ---- one forward over all rows (a decode-only step through a graph: decode_graph.h) ----
    const bool record_routing = recorders != nullptr && recorders->routing != nullptr && Lm > 0;
    const bool record = (callbacks.on_routing || record_routing) && Lm > 0;
    const bool graph_step = graphs_ && graphs_->active() && chunks.empty() && !guidance && !record;
    // every draw of the step greedy: sampled where the logits are, only tokens and sums come back
    bool greedy_step = device_greedy_ && !logit_rows.empty();
    for (size_t d = 0; greedy_step && d < decode_rows.size(); ++d)
      greedy_step = !(requests[samples[decode_rows[d]].request].params.sampling.temperature > 0);
    for (const Chunk& c : chunks)
      if (greedy_step && c.logit >= 0)
        greedy_step = !(requests[prefills[c.prefill].request].params.sampling.temperature > 0);
    const auto t_meta = Clock::now();
    if (graph_step)
      NIB_RETURN_IF_ERROR(cache_->begin_padded_batch(row_seq, row_pos, graphs_->rows_for(N)));
    else
      NIB_RETURN_IF_ERROR(cache_->begin_batch(row_seq, row_pos));
    stats_.metadata_seconds += seconds_since(t_meta);
    stats_.peak_pages_in_use = std::max(stats_.peak_pages_in_use, cache_->num_pages() - cache_->free_pages());
    if (!greedy_step) logits.resize(std::max<size_t>(logit_rows.size(), 1) * static_cast<size_t>(V));
    const float* logits_dev = nullptr;  // a greedy step's logits (backend memory)
    model::DecodeBatch batch;
    batch.tokens = row_tok.data();
    batch.positions = row_pos.data();
    batch.N = N;
    batch.kv = cache_.get();
    batch.linears = linears_.get();
    batch.lm_head_bf16 = lm_head_snapshot_ ? lm_head_bits_.data() : nullptr;
    static const int32_t kNoRow = 0;  // a step of unfinished prompt chunks only: no logits at all
    batch.logit_rows = logit_rows.empty() ? &kNoRow : logit_rows.data();
    batch.num_logit_rows = static_cast<int64_t>(logit_rows.size());
    RecordedRows rec_rows;
    if (record_routing || guidance) {
      row_id.clear(), row_samples_of.clear();
      for (int64_t r : row_req) {
        row_id.push_back(requests[r].id);
        row_samples_of.push_back(requests[r].params.num_samples);
      }
      rec_rows = RecordedRows{row_id, row_sample, row_samples_of, row_pos};
      if (guidance) guidance->set_rows(rec_rows);
    }
    if (record) {
      routing.assign(static_cast<size_t>(Lm * N * topk), -1);
      batch.routing_record = routing.data();
    }
    const auto t_forward = Clock::now();
    std::optional<BatchInvariantGemms> invariant(std::in_place, model_->backend());
    if (graph_step) {
      const int64_t replays = graphs_->replays(), captures = graphs_->captures(), pad = graphs_->padding_rows();
      graphs_->step(greedy_step ? nullptr : logits.data(), batch, row_tok, row_pos, cache_->table_stride());
      if (greedy_step) {
        logits_dev = graphs_->device_logits();
        model_->backend().synchronize();  // as the eager greedy step below
      }
      ++stats_.graph_steps;
      stats_.graph_replays += graphs_->replays() - replays;
      stats_.graph_captures += graphs_->captures() - captures;
      stats_.padding_rows += graphs_->padding_rows() - pad;
    } else if (greedy_step) {
      batch.logits_device = greedy_logits_.ensure(model_->backend(), static_cast<int64_t>(logit_rows.size()) * V,
                                                  "rollout greedy logits");
      model_->forward_decode(nullptr, batch);
      logits_dev = batch.logits_device;
      model_->backend().synchronize();  // the forward's time stays forward time (the copy back would wait anyway)
    } else {
      model_->forward_decode(logits.data(), batch);
    }
    invariant.reset();
    stats_.forward_seconds += seconds_since(t_forward);
    cache_->finish_batch();
    ++stats_.steps;
    if (guidance) NIB_RETURN_IF_ERROR(guidance->finish_step());  // the step's records, one copy
    if (record_routing)
      NIB_RETURN_IF_ERROR(record_routing_step(*recorders->routing, rec_rows, routing.data(), Lm, topk, cfg.num_experts));
    if (record && callbacks.on_routing) {
      RoutingStep rs{row_req, row_sample, row_pos, routing.data()};
      NIB_RETURN_IF_ERROR(callbacks.on_routing(rs));
    }

    // ---- sample: decode rows, then prompts whose last chunk ran (all drawn at once, then
    // recorded in this order) ----
    draw_sample.clear(), draw_row.clear(), draw_logit.clear();
    for (size_t d = 0; d < decode_rows.size(); ++d) {
      draw_sample.push_back(decode_rows[d]);
      draw_logit.push_back(static_cast<int64_t>(d));
    }
    for (const Chunk& c : chunks)
      if (c.logit >= 0)
        for (size_t si : prefills[c.prefill].samples) {
          draw_sample.push_back(si);
          draw_logit.push_back(c.logit);  // the last prompt position
        }
    if (greedy_step) {
      draw_greedy_on_device(logits_dev, static_cast<int64_t>(logit_rows.size()));
      ++stats_.device_greedy_steps;
    } else {
      for (int64_t row : draw_logit) draw_row.push_back(logits.data() + row * V);
      draw_tokens();
    }
    size_t next_draw = 0;
    for (size_t d = 0; d < decode_rows.size(); ++d) {
      Sample& s = samples[decode_rows[d]];
      NIB_ASSIGN_OR_RETURN(bool stop, take_token(s, drawn[next_draw++]));
      if (stop) NIB_RETURN_IF_ERROR(finish(s));
    }
    std::vector<size_t> finished_prefills;
    for (const Chunk& c : chunks) {
      Prefill& pf = prefills[c.prefill];
      pf.fed += c.rows;
      if (pf.fed < static_cast<int64_t>(requests[pf.request].prompt.size())) continue;
      NIB_CHECK(c.logit >= 0);
      for (size_t si : pf.samples) samples[si].seq = pf.samples.size() == 1 ? pf.seq : cache_->fork(pf.seq);
      if (pf.samples.size() > 1) cache_->release(pf.seq);
      pf.seq = -1;  // handed to the samples
      for (size_t si : pf.samples) {
        NIB_ASSIGN_OR_RETURN(bool stop, take_token(samples[si], drawn[next_draw++]));
        if (stop) NIB_RETURN_IF_ERROR(finish(samples[si]));
      }
      finished_prefills.push_back(c.prefill);
    }
    NIB_CHECK(next_draw == drawn.size());
    for (auto it = finished_prefills.rbegin(); it != finished_prefills.rend(); ++it)
      prefills.erase(prefills.begin() + static_cast<std::ptrdiff_t>(*it));
    // drop finished samples from the front (indices of live samples stay valid: only a prefix goes)
    size_t dead = 0;
    while (dead < samples.size() && samples[dead].done) ++dead;
    if (dead > 0) {
      samples.erase(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(dead));
      for (Prefill& pf : prefills)
        for (size_t& si : pf.samples) si -= dead;
    }
  }
  NIB_CHECK_MSG(cache_->live_sequences() == 0, "rollout: {} sequences left in the cache", cache_->live_sequences());
  std::vector<Completion> out;
  for (auto& v : done_by_request) {
    std::sort(v.begin(), v.end(), [](const Completion& a, const Completion& b) { return a.sample < b.sample; });
    for (Completion& c : v) out.push_back(std::move(c));
  }
  return out;
}

}  // namespace nibble::rollout
