// The reductions of a softmax over one row of f32 logits, in double, in one fixed order shared by
// every sampler (rollout/sampler.cpp, train/generate.cpp: so the reference and the engine's
// sampler give the same bits) that also vectorizes: kSoftmaxLanes interleaved partial results
// (lane j takes i = j mod kSoftmaxLanes in index order) combined pairwise at the end, and exp_f64
// for the terms (core/exp_f64.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/exp_f64.h"

namespace nibble {

inline constexpr int64_t kSoftmaxLanes = 8;

inline double softmax_combine_lanes(const double* s) {
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// max_i logits[i] / t; a NaN logit is never the maximum (max is exact: the lanes change nothing).
inline double softmax_scaled_max(const float* logits, int64_t V, double t) {
  double m[kSoftmaxLanes];
  for (double& v : m) v = -INFINITY;
  int64_t i = 0;
  for (; i + kSoftmaxLanes <= V; i += kSoftmaxLanes)
    for (int64_t j = 0; j < kSoftmaxLanes; ++j) m[j] = std::max(m[j], static_cast<double>(logits[i + j]) / t);
  for (int64_t j = 0; i + j < V; ++j) m[j] = std::max(m[j], static_cast<double>(logits[i + j]) / t);
  double mx = m[0];
  for (int64_t j = 1; j < kSoftmaxLanes; ++j) mx = std::max(mx, m[j]);
  return mx;
}

// sum_i e[i] in the lanes' order. e: (V) f64.
inline double softmax_lane_sum(const double* e, int64_t V) {
  double s[kSoftmaxLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kSoftmaxLanes <= V; i += kSoftmaxLanes)
    for (int64_t j = 0; j < kSoftmaxLanes; ++j) s[j] += e[i + j];
  for (int64_t j = 0; i + j < V; ++j) s[j] += e[i + j];
  return softmax_combine_lanes(s);
}

// e^(logits[i] / t - mx), the terms softmax_exp_sum adds.
inline double softmax_term(const float* logits, int64_t i, double t, double mx) {
  return exp_f64(static_cast<double>(logits[i]) / t - mx);
}

// sum_i softmax_term(i) in the lanes' order without keeping the terms: softmax_lane_sum of them.
inline double softmax_exp_sum(const float* logits, int64_t V, double t, double mx) {
  double s[kSoftmaxLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kSoftmaxLanes <= V; i += kSoftmaxLanes)
    for (int64_t j = 0; j < kSoftmaxLanes; ++j) s[j] += softmax_term(logits, i + j, t, mx);
  for (int64_t j = 0; i + j < V; ++j) s[j] += softmax_term(logits, i + j, t, mx);
  return softmax_combine_lanes(s);
}

// The greedy token: the first index of the largest logit, scanned in order (a NaN is never larger;
// a NaN at index 0 stays the token). logits: (V) f32, V >= 1.
inline int64_t softmax_first_argmax(const float* logits, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

// log p of a token under softmax(logits / t): its logit (as double), the scaled max mx and
// log_z = log(sum of the softmax terms). Every sampler's log-prob, and the one the rollout engine
// forms from Backend::greedy_rows' sums (t = 1): one expression, so one rounding sequence.
inline double softmax_log_prob(double logit, double t, double mx, double log_z) { return logit / t - mx - log_z; }

}  // namespace nibble
