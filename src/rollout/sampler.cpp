// Temperature / top-k / top-p sampling and the sampled token's log-probability (see sampler.h).
#include "rollout/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/parallel.h"
#include "core/softmax_f64.h"

namespace nibble::rollout {


int32_t sample_token(const float* logits, int64_t V, const SamplingParams& params, PhiloxStream* rng) {
  NIB_CHECK(V > 0);
  const double temperature = params.temperature;
  if (!(temperature > 0)) {
    return static_cast<int32_t>(softmax_first_argmax(logits, V));
  }
  const double mx = softmax_scaled_max(logits, V, temperature);
  std::vector<double> p(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) p[i] = softmax_term(logits, i, temperature, mx);
  const double z = softmax_lane_sum(p.data(), V);
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
  const double mx = softmax_scaled_max(logits, V, t);
  return softmax_log_prob(logits[token], t, mx, std::log(softmax_exp_sum(logits, V, t, mx)));
}

namespace {

// One id of the ranking sample_token sorts by: probability descending, then id ascending (what a
// stable sort of 0..V-1 by descending probability gives). p >= 0, so p's bits order as p does.
struct Ranked {
  uint64_t key;  // bits of p
  int32_t id;
};
bool ranks_before(const Ranked& a, const Ranked& b) { return a.key > b.key || (a.key == b.key && a.id < b.id); }

// Per-thread scratch of sample_with_logprob, kept between calls (a row's probabilities and its
// ranking are megabytes at a 100k vocabulary: no allocation and page faults per token).
struct Scratch {
  std::vector<double> p;             // (V) probabilities
  std::vector<Ranked> items, moved;  // (V) the ranking, the radix sort's other half
  std::vector<uint32_t> start;       // (6 x 2^11) radix digit counts
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// The ranking of V ids, sorted on demand: at(k) is sample_token's ids[k]. A request past the
// sorted prefix selects (nth_element) and sorts the next chunk, chunks growing 8x from 64; once a
// chunk would reach a quarter of V, all ids are sorted at once by a radix sort.
class Ranking {
 public:
  // whole: sort all ids at the first request (a nucleus expected to span the vocabulary)
  Ranking(const std::vector<double>& p, bool whole, Scratch& scratch)
      : p_(p), whole_(whole), items_(scratch.items), moved_(scratch.moved), start_(scratch.start) {
    fill();
  }
  int32_t at(int64_t k) {
    if (k >= sorted_) extend(k + 1);
    return items_[static_cast<size_t>(k)].id;
  }

 private:
  void fill() {  // in id order
    items_.resize(p_.size());
    for (size_t i = 0; i < p_.size(); ++i) items_[i] = Ranked{std::bit_cast<uint64_t>(p_[i]), static_cast<int32_t>(i)};
  }
  void extend(int64_t m) {
    const int64_t n = static_cast<int64_t>(items_.size());
    int64_t want = std::max<int64_t>({m, 8 * sorted_, 64});
    if (whole_ || 4 * want >= n) {
      if (sorted_ > 0) fill();  // the radix sort's ties keep the entry order: ids ascending
      radix_sort();
      sorted_ = n;
      return;
    }
    const auto first = items_.begin() + sorted_, mid = items_.begin() + want;
    std::nth_element(first, mid, items_.end(), ranks_before);  // [first, mid): the next in order
    std::sort(first, mid, ranks_before);
    sorted_ = want;
  }
  // items_ (in id order) by descending key: LSD radix, 11-bit digits of ~key (6 passes, the digit
  // counts of all passes taken in one read), stable, so equal keys keep ascending ids:
  // ranks_before's order. A digit all keys share skips its pass.
  void radix_sort() {
    constexpr int kBits = 11, kPasses = 6;
    constexpr size_t kRadix = size_t{1} << kBits;
    const size_t n = items_.size();
    moved_.resize(n);
    start_.assign(kPasses * kRadix, 0);
    auto digit = [](const Ranked& r, int pass) { return static_cast<size_t>((~r.key >> (kBits * pass)) & (kRadix - 1)); };
    for (const Ranked& r : items_)
      for (int pass = 0; pass < kPasses; ++pass) ++start_[pass * kRadix + digit(r, pass)];
    for (int pass = 0; pass < kPasses; ++pass) {
      uint32_t* start = start_.data() + pass * kRadix;
      if (start[digit(items_[0], pass)] == n) continue;
      uint32_t sum = 0;
      for (size_t d = 0; d < kRadix; ++d) sum += std::exchange(start[d], sum);
      for (const Ranked& r : items_) moved_[start[digit(r, pass)]++] = r;
      items_.swap(moved_);
    }
  }
  const std::vector<double>& p_;  // read only before the caller changes p (top-k renormalizes the
                                  // k first, all sorted by the first loop over them)
  bool whole_ = false;
  std::vector<Ranked>& items_;  // the scratch's
  std::vector<Ranked>& moved_;
  std::vector<uint32_t>& start_;
  int64_t sorted_ = 0;
};

// e[i] = exp(logits[i] / t - mx) for i < V (the threads share the range when `split`); returns
// their sum in the lanes' order, as sample_token and token_logprob add them. e: (V) f64.
double exponentials(double* e, const float* logits, int64_t V, double t, double mx, bool split) {
  auto run = [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) e[i] = softmax_term(logits, i, t, mx);
  };
  if (split)
    parallel_for(V, 8192, run);
  else
    run(0, V);
  return softmax_lane_sum(e, V);
}

}  // namespace

SampledToken sample_with_logprob(const float* logits, int64_t V, const SamplingParams& params, PhiloxStream* rng,
                                 bool split_row) {
  NIB_CHECK(V > 0);
  const double temperature = params.temperature;
  // the softmax of logits / t as token_logprob computes it (t = 1 when greedy; t = temperature,
  // sample_token's divisor, otherwise)
  const double t = temperature > 0 ? temperature : 1.0;
  const double mx = softmax_scaled_max(logits, V, t);
  SampledToken out;
  if (!(temperature > 0) && !split_row) {  // greedy on one thread: token_logprob's loop, no row kept
    out.token = static_cast<int32_t>(softmax_first_argmax(logits, V));
    out.logprob = softmax_log_prob(logits[out.token], t, mx, std::log(softmax_exp_sum(logits, V, t, mx)));
    return out;
  }
  Scratch& scr = scratch();
  std::vector<double>& p = scr.p;
  p.resize(static_cast<size_t>(V));
  const double z = exponentials(p.data(), logits, V, t, mx, split_row);
  const double log_z = std::log(z);
  if (!(temperature > 0)) {  // greedy: sample_token's argmax, no draw
    out.token = static_cast<int32_t>(softmax_first_argmax(logits, V));
    out.logprob = softmax_log_prob(logits[out.token], t, mx, log_z);
    return out;
  }
  // from here on sample_token's steps, with ids[k] read from the lazily sorted ranking
  for (auto& v : p) v /= z;
  const double cut = std::clamp(params.top_p, 1e-12, 1.0);
  const bool top_k = params.top_k > 0 && params.top_k < V;
  // top-p 1 without top-k: the kept mass reaches 1 only near the end of the ranking (or never)
  Ranking ids(p, !top_k && cut >= 1.0, scr);
  int64_t n = V;
  if (top_k) {
    n = params.top_k;
    double s = 0;
    for (int64_t k = 0; k < n; ++k) s += p[ids.at(k)];
    for (int64_t k = 0; k < n; ++k) p[ids.at(k)] /= s;
  }
  double mass = 0;
  int64_t keep = 0;
  while (keep < n && (keep == 0 || mass < cut)) mass += p[ids.at(keep++)];
  double u = rng->next_uniform_double() * mass;
  out.token = ids.at(keep - 1);
  for (int64_t k = 0; k < keep; ++k) {
    u -= p[ids.at(k)];
    if (u < 0) {
      out.token = ids.at(k);
      break;
    }
  }
  out.logprob = softmax_log_prob(logits[out.token], t, mx, log_z);
  return out;
}

}  // namespace nibble::rollout
