// GRPO advantages and the clipped, TIS-weighted policy loss with its logits gradient (see grpo.h).
#include "rl/grpo.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

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
// max and log-sum-exp of row / t
void row_lse(const float* row, int64_t V, double t, double& mx, double& lse) {
  mx = -INFINITY;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]) / t);
  double z = 0;
  for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(row[v]) / t - mx);
  lse = mx + std::log(z);
}
}  // namespace

TokenLogprob token_logprob_entropy(const float* row, int64_t V, int32_t target, double temperature) {
  double mx, lse;
  row_lse(row, V, temperature, mx, lse);
  TokenLogprob r;
  r.logp = static_cast<double>(row[target]) / temperature - lse;
  for (int64_t v = 0; v < V; ++v) {
    const double lp = static_cast<double>(row[v]) / temperature - lse;
    r.entropy -= std::exp(lp) * lp;
  }
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
  double clipped = 0, tis_cut = 0, kl_sum = 0;
  for (int64_t b = 0; b < B; ++b) {
    const double len = static_cast<double>(batch.response_len[static_cast<size_t>(b)]);
    // each token's weight in the aggregate mean
    const double norm = c.aggregation == Aggregation::kToken ? (total > 0 ? 1.0 / static_cast<double>(total) : 0.0)
                                                             : (len > 0 ? 1.0 / (len * static_cast<double>(seqs)) : 0.0);
    const double A = batch.advantage[static_cast<size_t>(b)];
    for (int64_t i = 0; i < T; ++i) {
      const int64_t n = b * T + i;
      float* row = logits + n * V;
      const int32_t target = batch.targets[static_cast<size_t>(n)];
      if (target < 0) {
        std::fill(row, row + V, 0.0f);
        continue;
      }
      double mx, lse;
      row_lse(row, V, t, mx, lse);
      const double logp = static_cast<double>(row[target]) / t - lse;
      const double rho = std::exp(logp - batch.logp_old[static_cast<size_t>(n)]);
      const double w = tis_weight(batch.logp_old[static_cast<size_t>(n)], batch.logp_rollout[static_cast<size_t>(n)],
                                  c.tis, c.tis_cap);
      tis_cut += w != std::exp(batch.logp_old[static_cast<size_t>(n)] - batch.logp_rollout[static_cast<size_t>(n)]) &&
                 c.tis != TisMode::kNone;
      const double rho_c = std::clamp(rho, 1.0 - c.clip_eps, 1.0 + c.clip_eps);
      const double unclipped = rho * A, clip_term = rho_c * A;
      // d/dlogp of -w min(ρA, clip(ρ)A): -w ρ A where the unclipped term is the min, else 0
      double dlogp = unclipped <= clip_term ? -w * unclipped : 0.0;
      clipped += unclipped > clip_term;
      double token_loss = -w * std::min(unclipped, clip_term);
      if (kl) {
        const double r = std::exp(batch.logp_ref[static_cast<size_t>(n)] - logp);  // π_ref / π_θ
        const double k3 = r - std::log(r) - 1.0;
        kl_sum += k3;
        token_loss += c.kl_coef * k3;
        dlogp += c.kl_coef * (1.0 - r);  // d k3 / d logp = -r + 1
      }
      st.loss += norm * token_loss;
      // dlogp/dz_v = (1[v == target] - p_v) / t
      const double g = norm * dlogp / t;
      for (int64_t v = 0; v < V; ++v) {
        const double p = std::exp(static_cast<double>(row[v]) / t - lse);
        row[v] = static_cast<float>(g * ((v == target ? 1.0 : 0.0) - p));
      }
      ++st.tokens;
    }
  }
  if (st.tokens > 0) {
    st.clip_fraction = clipped / static_cast<double>(st.tokens);
    st.tis_fraction = tis_cut / static_cast<double>(st.tokens);
    st.kl = kl_sum / static_cast<double>(st.tokens);
  }
  return st;
}

}  // namespace nibble::rl
