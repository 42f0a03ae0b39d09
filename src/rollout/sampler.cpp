// Temperature / top-k / top-p sampling and the sampled token's log-probability (see sampler.h).
#include "rollout/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"

namespace nibble::rollout {

int32_t sample_token(const float* logits, int64_t V, const SamplingParams& params, PhiloxStream* rng) {
  NIB_CHECK(V > 0);
  const double temperature = params.temperature;
  if (!(temperature > 0)) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  }
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, static_cast<double>(logits[i]) / temperature);
  std::vector<double> p(static_cast<size_t>(V));
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += (p[i] = std::exp(static_cast<double>(logits[i]) / temperature - mx));
  for (auto& v : p) v /= z;
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  int64_t n = V;
  if (params.top_k > 0 && params.top_k < V) {
    // top-k first, renormalized (as transformers' TopK then TopP warpers)
    n = params.top_k;
    double s = 0;
    for (int64_t k = 0; k < n; ++k) s += p[ids[k]];
    for (int64_t k = 0; k < n; ++k) p[ids[k]] /= s;
  }
  const double cut = std::clamp(params.top_p, 1e-12, 1.0);
  double mass = 0;
  int64_t keep = 0;
  while (keep < n && (keep == 0 || mass < cut)) mass += p[ids[keep++]];
  double u = rng->next_uniform_double() * mass;
  for (int64_t k = 0; k < keep; ++k) {
    u -= p[ids[k]];
    if (u < 0) return ids[k];
  }
  return ids[keep - 1];
}

double token_logprob(const float* logits, int64_t V, int32_t token, double temperature) {
  NIB_CHECK(V > 0 && token >= 0 && token < V);
  const double t = temperature > 0 ? temperature : 1.0;
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, static_cast<double>(logits[i]) / t);
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += std::exp(static_cast<double>(logits[i]) / t - mx);
  return static_cast<double>(logits[token]) / t - mx - std::log(z);
}

}  // namespace nibble::rollout
