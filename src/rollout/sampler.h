// Token sampling for the rollout engine: temperature, then top-k, then top-p (nucleus) over the
// softmax of logits / temperature computed in double, one uniform per sampled token from the
// sequence's own Philox stream (so a seed gives the same tokens whatever else is in the batch).
// With top_k off this is exactly train::sample_token (the draw u * kept mass over the ids sorted
// by probability, stable). token_logprob is the trainer's transform (03-rl-and-trace.md §4):
// log_softmax(logits / temperature)[token], unfiltered by top-k/top-p.
#pragma once

#include <cstdint>

#include "core/philox.h"

namespace nibble::rollout {

struct SamplingParams {
  double temperature = 1.0;  // <= 0: greedy (argmax, lowest id on ties; no draw)
  int64_t top_k = 0;         // keep the k most likely ids; 0 = off
  double top_p = 1.0;        // nucleus mass in (0, 1]; 1 = off
};

// One token from logits: (V) f32.
int32_t sample_token(const float* logits, int64_t V, const SamplingParams& params, PhiloxStream* rng);

// log p(token) under softmax(logits / t) in double, t = temperature (t <= 0, greedy: t = 1, the
// model's own distribution). logits: (V) f32.
double token_logprob(const float* logits, int64_t V, int32_t token, double temperature);

}  // namespace nibble::rollout
