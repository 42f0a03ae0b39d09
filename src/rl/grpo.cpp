// GRPO advantages and the clipped, TIS-weighted policy loss with its logits gradient (see grpo.h).
#include "rl/grpo.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/parallel.h"
#include "core/softmax_f64.h"

namespace nibble::rl {

Result<Aggregation> parse_aggregation(const std::string& s) {
  if (s == "token") return Aggregation::kToken;
  if (s == "sequence") return Aggregation::kSequence;
  return invalid_argument("unknown aggregation '{}' (token, sequence)", s);
}
Result<TisMode> parse_tis_mode(const std::string& s) {
  if (s == "none") return TisMode::kNone;
  if (s == "truncate") return TisMode::kTruncate;
  if (s == "mask") return TisMode::kMask;
  return invalid_argument("unknown tis mode '{}' (none, truncate, mask)", s);
}
const char* aggregation_name(Aggregation a) { return a == Aggregation::kToken ? "token" : "sequence"; }
const char* tis_mode_name(TisMode m) {
  return m == TisMode::kNone ? "none" : m == TisMode::kTruncate ? "truncate" : "mask";
}

std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t G, double eps) {
  NIB_CHECK(G > 0 && static_cast<int64_t>(rewards.size()) % G == 0);
  std::vector<double> a(rewards.size());
  for (size_t g0 = 0; g0 < rewards.size(); g0 += static_cast<size_t>(G)) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < G; ++i) mean += rewards[g0 + i];
    mean /= static_cast<double>(G);
    for (int64_t i = 0; i < G; ++i) var += (rewards[g0 + i] - mean) * (rewards[g0 + i] - mean);
    const double sd = std::sqrt(var / static_cast<double>(G));
    for (int64_t i = 0; i < G; ++i) a[g0 + i] = (rewards[g0 + i] - mean) / (sd + eps);
  }
  return a;
}

namespace {
// max and log-sum-exp of row / t (core/softmax_f64.h: the samplers' order, vectorized)
void row_lse(const float* row, int64_t V, double t, double& mx, double& lse) {
  mx = softmax_scaled_max(row, V, t);
  lse = mx + std::log(softmax_exp_sum(row, V, t, mx));
}
}  // namespace

TokenLogprob token_logprob_entropy(const float* row, int64_t V, int32_t target, double temperature) {
  double mx, lse;
  row_lse(row, V, temperature, mx, lse);
  TokenLogprob r;
  r.logp = static_cast<double>(row[target]) / temperature - lse;
  // entropy = -sum p lp, summed in softmax_f64.h's lanes
  double s[kSoftmaxLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  auto term = [&](int64_t v) {
    const double lp = static_cast<double>(row[v]) / temperature - lse;
    return exp_f64(lp) * lp;
  };
  int64_t v = 0;
  for (; v + kSoftmaxLanes <= V; v += kSoftmaxLanes)
    for (int64_t j = 0; j < kSoftmaxLanes; ++j) s[j] += term(v + j);
  for (int64_t j = 0; v + j < V; ++j) s[j] += term(v + j);
  r.entropy = -softmax_combine_lanes(s);
  return r;
}

double tis_weight(double logp_old, double logp_rollout, TisMode mode, double cap) {
  if (mode == TisMode::kNone) return 1.0;
  const double ratio = std::exp(logp_old - logp_rollout);
  if (mode == TisMode::kTruncate) return std::min(ratio, cap);
  return ratio > cap || ratio < 1.0 / cap ? 0.0 : ratio;
}

PolicyLossStats policy_loss_and_grad(float* logits, const PolicyBatch& batch, int64_t V, const GrpoConfig& c) {
  const int64_t B = batch.B, T = batch.T;
  const double t = c.temperature;
  const bool kl = c.kl_coef > 0 && !batch.logp_ref.empty();
  PolicyLossStats st;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += batch.response_len[static_cast<size_t>(b)];
  int64_t seqs = 0;
  for (int64_t b = 0; b < B; ++b) seqs += batch.response_len[static_cast<size_t>(b)] > 0;
  // Each token row is independent: its loss terms and its logits gradient are computed over the
  // threads (each row's softmax vectorized), then the sums are taken in token order as before.
  struct TokenTerms {
    double loss = 0, k3 = 0;
    bool clipped = false, tis_cut = false;
  };
  std::vector<TokenTerms> terms(static_cast<size_t>(B * T));
  parallel_for(B * T, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t b = n / T;
      float* row = logits + n * V;
      const int32_t target = batch.targets[static_cast<size_t>(n)];
      if (target < 0) {
        std::fill(row, row + V, 0.0f);
        continue;
      }
      const double len = static_cast<double>(batch.response_len[static_cast<size_t>(b)]);
      // each token's weight in the aggregate mean
      const double norm = c.aggregation == Aggregation::kToken
                              ? (total > 0 ? 1.0 / static_cast<double>(total) : 0.0)
                              : (len > 0 ? 1.0 / (len * static_cast<double>(seqs)) : 0.0);
      const double A = batch.advantage[static_cast<size_t>(b)];
      TokenTerms& tt = terms[static_cast<size_t>(n)];
      double mx, lse;
      row_lse(row, V, t, mx, lse);
      const double logp = static_cast<double>(row[target]) / t - lse;
      const double rho = std::exp(logp - batch.logp_old[static_cast<size_t>(n)]);
      const double w = tis_weight(batch.logp_old[static_cast<size_t>(n)], batch.logp_rollout[static_cast<size_t>(n)],
                                  c.tis, c.tis_cap);
      tt.tis_cut = w != std::exp(batch.logp_old[static_cast<size_t>(n)] - batch.logp_rollout[static_cast<size_t>(n)]) &&
                   c.tis != TisMode::kNone;
      const double rho_c = std::clamp(rho, 1.0 - c.clip_eps, 1.0 + c.clip_eps);
      const double unclipped = rho * A, clip_term = rho_c * A;
      // d/dlogp of -w min(ρA, clip(ρ)A): -w ρ A where the unclipped term is the min, else 0
      double dlogp = unclipped <= clip_term ? -w * unclipped : 0.0;
      tt.clipped = unclipped > clip_term;
      double token_loss = -w * std::min(unclipped, clip_term);
      if (kl) {
        const double r = std::exp(batch.logp_ref[static_cast<size_t>(n)] - logp);  // π_ref / π_θ
        tt.k3 = r - std::log(r) - 1.0;
        token_loss += c.kl_coef * tt.k3;
        dlogp += c.kl_coef * (1.0 - r);  // d k3 / d logp = -r + 1
      }
      tt.loss = norm * token_loss;
      // dlogp/dz_v = (1[v == target] - p_v) / t
      const double g = norm * dlogp / t;
      const double p_target = softmax_term(row, target, t, lse);  // before the row is overwritten
      for (int64_t v = 0; v < V; ++v) row[v] = static_cast<float>(g * (0.0 - softmax_term(row, v, t, lse)));
      row[target] = static_cast<float>(g * (1.0 - p_target));
    }
  });
  double clipped = 0, tis_cut = 0, kl_sum = 0;
  for (int64_t n = 0; n < B * T; ++n) {
    if (batch.targets[static_cast<size_t>(n)] < 0) continue;
    const TokenTerms& tt = terms[static_cast<size_t>(n)];
    st.loss += tt.loss;
    clipped += tt.clipped, tis_cut += tt.tis_cut, kl_sum += tt.k3;
    ++st.tokens;
  }
  if (st.tokens > 0) {
    st.clip_fraction = clipped / static_cast<double>(st.tokens);
    st.tis_fraction = tis_cut / static_cast<double>(st.tokens);
    st.kl = kl_sum / static_cast<double>(st.tokens);
  }
  return st;
}

}  // namespace nibble::rl
