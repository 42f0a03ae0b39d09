// The rollout engine's decode benchmark (see decode_bench.h).
#include "rollout/decode_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/philox.h"
#include "rollout/engine.h"

namespace nibble::rollout {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bytes of linear `info`'s weight in `mode`'s storage.
double linear_bytes(const model::LinearInfo& info, PrecisionMode mode) {
  const double nk = static_cast<double>(info.N) * static_cast<double>(info.K);
  if (mode == PrecisionMode::kBf16 || mode == PrecisionMode::kRecipe) return 2 * nk;
  return nk / 2 + nk / 16 + 4.0 * static_cast<double>(info.N) * static_cast<double>((info.K + 127) / 128);
}

}  // namespace

double measure_copy_bandwidth(backend::Backend& be, int64_t bytes, int repeats) {
  backend::Buffer<uint8_t> src, dst;
  uint8_t* s = src.ensure(be, bytes, "bandwidth source");
  uint8_t* d = dst.ensure(be, bytes, "bandwidth destination");
  be.fill_zero(s, static_cast<size_t>(bytes));
  be.copy(d, s, static_cast<size_t>(bytes));  // warm-up
  be.synchronize();
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    be.copy(d, s, static_cast<size_t>(bytes));
    be.synchronize();
    best = std::min(best, seconds_since(t0));
  }
  return 2.0 * static_cast<double>(bytes) / best;
}

Status bench_decode(backend::Backend& device_be, const model::ModelConfig& config, const DecodeBenchOptions& o,
                    const std::vector<int64_t>& batches, const DecodeBenchSink& on_result) {
  if (batches.empty() || o.prompt < 1 || o.new_tokens < 2)
    return invalid_argument("bench decode: batch and prompt must be >= 1 and new tokens >= 2");
  for (int64_t b : batches)
    if (b < 1) return invalid_argument("bench decode: batch and prompt must be >= 1 and new tokens >= 2");
  if (o.prompt + o.new_tokens > config.max_position_embeddings)
    return invalid_argument("bench decode: prompt {} + new {} exceeds the context of {} positions", o.prompt,
                            o.new_tokens, config.max_position_embeddings);
  // profiled: the model and engine run on a decorator that forwards plainly until enabled
  backend::ProfilingBackend profiler(device_be);
  backend::Backend& be = o.profile ? static_cast<backend::Backend&>(profiler) : device_be;
  model::RecipeConfig rc;
  rc.name = "bf16";
  be.synchronize();
  be.reset_peak_memory();
  // one model and engine for every batch, sized for the largest
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  const auto t_init = std::chrono::steady_clock::now();
  NIB_ASSIGN_OR_RETURN(auto m, model::Model::create(config, rc, &be, o.storage));
  EngineOptions eo;
  eo.mode = o.mode;
  eo.kv_format = o.kv_format;
  eo.max_batch = max_batch;
  eo.page_size = 16;
  const int64_t per_seq = (o.prompt + o.new_tokens + eo.page_size - 1) / eo.page_size + 1;
  eo.num_pages = max_batch * per_seq + 1;
  eo.max_step_tokens = std::max<int64_t>(max_batch, std::min<int64_t>(8192, max_batch * o.prompt));
  eo.share_prefix = false;
  eo.reference_sampler = o.reference_sampler;
  eo.decode_graphs = o.cuda_graphs ? DecodeGraphMode::kOn : DecodeGraphMode::kOff;
  eo.decode_graph_padding = o.graph_padding;
  NIB_ASSIGN_OR_RETURN(auto engine, Engine::create(*m, eo));
  NIB_RETURN_IF_ERROR(engine->init_random_weights(o.seed, o.init));
  be.synchronize();
  const double init_seconds = seconds_since(t_init);
  for (const int64_t batch : batches) {
    std::vector<Request> reqs(static_cast<size_t>(batch));
    PhiloxStream rng(o.seed, 0xBE7C);
    for (int64_t b = 0; b < batch; ++b) {
      Request& r = reqs[b];
      r.id = static_cast<uint64_t>(b);
      for (int64_t t = 0; t < o.prompt; ++t)
        r.prompt.push_back(static_cast<int32_t>(rng.next_u32() % config.vocab_size));
      r.params.sampling.temperature = o.temperature;  // no stop ids: every sequence runs all new tokens
      r.params.sampling.top_p = o.top_p;
    }
    auto timed = [&](int64_t new_tokens) -> Result<double> {
      for (Request& r : reqs) r.params.max_new_tokens = new_tokens;
      const auto t0 = std::chrono::steady_clock::now();
      NIB_ASSIGN_OR_RETURN(auto out, engine->generate(reqs));
      (void)out;
      be.synchronize();
      return seconds_since(t0);
    };
    NIB_RETURN_IF_ERROR(timed(2).status());  // warm-up (allocations, kernels)
    DecodeBenchResult res;
    res.batch = batch;
    res.init_seconds = init_seconds;
    NIB_ASSIGN_OR_RETURN(res.prefill_seconds, timed(1));
    const EngineStats first = engine->stats();
    NIB_ASSIGN_OR_RETURN(double total, timed(o.new_tokens));
    const EngineStats all = engine->stats();
    const double per_step_ms = 1e3 / static_cast<double>(o.new_tokens - 1);
    res.host_forward_ms = (all.forward_seconds - first.forward_seconds) * per_step_ms;
    res.host_sample_ms = (all.sample_seconds - first.sample_seconds) * per_step_ms;
    res.host_metadata_ms = (all.metadata_seconds - first.metadata_seconds) * per_step_ms;
    res.host_step_ms = (all.total_seconds - first.total_seconds) * per_step_ms;
    res.decode_seconds = std::max(total - res.prefill_seconds, 1e-9);
    res.decode_tokens_per_s = static_cast<double>(batch * (o.new_tokens - 1)) / res.decode_seconds;
    res.cuda_graphs = engine->decode_graphs_status();
    res.graph_replays = all.graph_replays;
    res.graph_captures = all.graph_captures;
    res.device_greedy_steps = all.device_greedy_steps;
    if (o.profile) {
      // One profiled run, split where the batch's first tokens are sampled: the op timings and the
      // clock then are the prefill's (all prompt chunks + the first token), the rest is the decode
      // steps'. Both are cumulative in one run, so the decode part is never negative (two separate
      // runs' difference was, at times, for tiny models).
      for (Request& r : reqs) r.params.max_new_tokens = o.new_tokens;
      int64_t tokens_seen = 0;
      double prefill_s = 0;
      backend::OpTimings prefill{};
      EngineCallbacks split;
      profiler.reset_timings();
      profiler.set_enabled(true);
      const auto t0 = std::chrono::steady_clock::now();
      split.on_token = [&](int64_t, int64_t, int32_t) -> Status {
        if (++tokens_seen == batch) {  // every sequence's first token: the prefill step is done
          be.synchronize();
          prefill_s = seconds_since(t0);
          prefill = profiler.timings();
        }
        return Status::ok();
      };
      NIB_ASSIGN_OR_RETURN(auto out, engine->generate(reqs, split));
      (void)out;
      be.synchronize();
      const double full_s = seconds_since(t0);
      const backend::OpTimings full = profiler.timings();
      profiler.set_enabled(false);
      const int64_t steps = o.new_tokens - 1;
      res.profiled = true;
      res.prefill_profile = backend::make_step_profile(prefill, prefill_s);
      res.decode_step_profile = backend::make_step_profile(backend::per_step_difference(full, prefill, steps),
                                                           (full_s - prefill_s) / static_cast<double>(steps));
    }
    // bytes one decode step must read: the block linears (MoE: the experts the batch routes to, in
    // expectation E (1 - (1 - k/E)^batch) of E per layer), the lm_head in BF16, the KV pages of
    // the average context
    const double E = static_cast<double>(std::max<int64_t>(config.num_experts, 1));
    const double k = static_cast<double>(std::max<int64_t>(config.num_experts_per_tok, 1));
    const double expert_share =
        config.num_experts > 0 ? std::min(1.0, (1.0 - std::pow(1.0 - k / E, static_cast<double>(batch)))) : 1.0;
    double weights = 0;
    for (const model::LinearInfo& info : m->linear_infos())
      weights += linear_bytes(info, o.mode) * (info.expert >= 0 ? expert_share : 1.0);
    weights += 2.0 * static_cast<double>(config.vocab_size) * static_cast<double>(config.hidden_size);
    res.weight_bytes = static_cast<int64_t>(weights);
    res.kv_bytes_per_token =
        2 * config.num_hidden_layers * backend::kv_token_bytes(o.kv_format, config.num_key_value_heads, config.head_dim);
    const double avg_context = static_cast<double>(o.prompt) + static_cast<double>(o.new_tokens) / 2;
    res.bytes_per_step =
        weights + static_cast<double>(batch) * avg_context * static_cast<double>(res.kv_bytes_per_token);
    res.memory = engine->memory();
    res.peak_bytes = be.memory_stats().peak_bytes;
    res.copy_bytes_per_s = measure_copy_bandwidth(device_be, o.copy_bytes, 5);
    res.bound_tokens_per_s = static_cast<double>(batch) * res.copy_bytes_per_s / res.bytes_per_step;
    res.fraction_of_bound = res.decode_tokens_per_s / res.bound_tokens_per_s;
    NIB_RETURN_IF_ERROR(on_result(res));
  }
  return Status::ok();
}

}  // namespace nibble::rollout
