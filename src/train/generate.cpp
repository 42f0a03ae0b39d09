// Sampling loop and token sampler (see generate.h).
#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/softmax_f64.h"

namespace nibble::train {

int32_t sample_token(const float* logits, int64_t V, double temperature, double top_p, PhiloxStream* rng) {
  NIB_CHECK(V > 0);
  if (!(temperature > 0)) return static_cast<int32_t>(softmax_first_argmax(logits, V));
  // Softmax of logits / T in double, then the smallest set of most likely ids with mass >= top_p.
  // (core/softmax_f64.h: the terms and sums in the order every sampler of nibble shares)
  const double mx = softmax_scaled_max(logits, V, temperature);
  std::vector<double> p(V);
  for (int64_t i = 0; i < V; ++i) p[i] = softmax_term(logits, i, temperature, mx);
  const double z = softmax_lane_sum(p.data(), V);
  for (auto& v : p) v /= z;
  std::vector<int32_t> ids(V);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  const double cut = std::clamp(top_p, 1e-12, 1.0);
  double mass = 0;
  int64_t keep = 0;
  while (keep < V && (keep == 0 || mass < cut)) mass += p[ids[keep++]];
  double u = rng->next_uniform_double() * mass;
  for (int64_t k = 0; k < keep; ++k) {
    u -= p[ids[k]];
    if (u < 0) return ids[k];
  }
  return ids[keep - 1];
}

Status context_logits(std::vector<float>* out, model::Model* model, std::span<const int32_t> tokens) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  const auto& cfg = model->config();
  if (T < 1) return invalid_argument("empty context");
  if (T > cfg.max_position_embeddings)
    return invalid_argument("context of {} tokens exceeds max_position_embeddings {}", T, cfg.max_position_embeddings);
  for (int32_t t : tokens)
    if (t < 0 || t >= cfg.vocab_size) return invalid_argument("token id {} outside the vocabulary [0, {})", t, cfg.vocab_size);
  out->assign(static_cast<size_t>(T * cfg.vocab_size), 0.0f);
  model->forward_logits(out->data(), tokens.data(), 1, T);
  return Status::ok();
}

Result<std::vector<int32_t>> generate_tokens(model::Model* model, std::span<const int32_t> prompt,
                                             const SamplingOptions& options, const TokenCallback& on_token) {
  if (prompt.empty()) return invalid_argument("generate: empty prompt");
  if (options.max_new_tokens < 0) return invalid_argument("generate: max_new_tokens must be >= 0");
  if (!(options.top_p > 0 && options.top_p <= 1)) return invalid_argument("generate: top_p must be in (0, 1]");
  const int64_t V = model->config().vocab_size;
  const int64_t ctx_max = model->config().max_position_embeddings;
  std::vector<int32_t> seq(prompt.begin(), prompt.end());
  std::vector<int32_t> out;
  std::vector<float> logits;
  PhiloxStream rng(options.seed, kGenerateStream);
  for (int64_t n = 0; n < options.max_new_tokens; ++n) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(seq.size()), ctx_max);
    std::span<const int32_t> ctx(seq.data() + seq.size() - T, static_cast<size_t>(T));
    NIB_RETURN_IF_ERROR(context_logits(&logits, model, ctx));
    int32_t next = sample_token(logits.data() + (T - 1) * V, V, options.temperature, options.top_p, &rng);
    seq.push_back(next);
    out.push_back(next);
    if (on_token) NIB_RETURN_IF_ERROR(on_token(next));
    if (next == options.stop_id) break;
  }
  return out;
}

}  // namespace nibble::train
