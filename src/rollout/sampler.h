// Token sampling for the rollout engine: temperature, then top-k, then top-p (nucleus) over the
// softmax of logits / temperature computed in double, one uniform per sampled token from the
// sequence's own Philox stream (so a seed gives the same tokens whatever else is in the batch).
// With top_k off this is exactly train::sample_token (the draw u * kept mass over the ids sorted
// by probability, stable). token_logprob is the trainer's transform (03-rl-and-trace.md §4):
// log_softmax(logits / temperature)[token], unfiltered by top-k/top-p. sample_with_logprob is
// what the engine runs: both in one pass, the same bits, without sorting the whole vocabulary
// (docs/benchmarks.md "Decode: host time").
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

// sample_token and token_logprob of its token, bit for bit (same draw, kept set, token and
// log-prob), computing the softmax once and ordering ids only as far as the draw needs: top-k by
// selection; the top-p prefix and the draw's walk by sorting successive chunks of the ranking
// (a radix sort of all ids when the nucleus is expected to span the vocabulary: top-p 1 without
// top-k, or reaches a quarter of it). split_row: the row's exponentials are computed over the
// threads (for a step of fewer rows than threads); the sums keep core/softmax_f64.h's order. logits: (V) f32.
struct SampledToken {
  int32_t token = 0;
  double logprob = 0;
};
SampledToken sample_with_logprob(const float* logits, int64_t V, const SamplingParams& params, PhiloxStream* rng,
                                 bool split_row = false);

}  // namespace nibble::rollout
