// GRPO with truncated importance sampling (../shared/spec/03-rl-and-trace.md §4): group-normalised
// advantages, the clipped policy-gradient loss per response token, token- (DAPO) or
// sequence-level (original GRPO) aggregation, optional k3 KL to a frozen reference, and the TIS
// weight sg(min(π_old_train / π_rollout, C)) or its masked variant (tokens whose ratio is
// outside [1/C, C] dropped). The objective is a per-token weighted log-prob loss on the logits,
// handed to model::Model::forward_backward_custom (which runs it on the host for every backend;
// the pretraining cross-entropy path is untouched). Log-probs use log_softmax(logits / T), the
// rollout engine's transform.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace nibble::rl {

enum class Aggregation { kToken, kSequence };
enum class TisMode { kNone, kTruncate, kMask };
Result<Aggregation> parse_aggregation(const std::string& s);  // "token" | "sequence"
Result<TisMode> parse_tis_mode(const std::string& s);         // "none" | "truncate" | "mask"
const char* aggregation_name(Aggregation a);
const char* tis_mode_name(TisMode m);

struct GrpoConfig {
  double clip_eps = 0.2;        // ρ clipped to [1 - ε, 1 + ε]
  Aggregation aggregation = Aggregation::kToken;
  double kl_coef = 0.0;         // > 0: + β k3(π_ref ‖ π_θ) per token
  TisMode tis = TisMode::kTruncate;
  double tis_cap = 5.0;         // C
  double temperature = 1.0;     // of the logits, as sampled
  double adv_eps = 1e-6;        // A = (R - mean) / (std + eps)
};

// Advantages of B = groups * G rewards, group by group (population std, as GRPO).
std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t G, double eps);

// Per-row log-prob of `target` and entropy under log_softmax(row / t): row (V) f32.
struct TokenLogprob {
  double logp = 0, entropy = 0;
};
TokenLogprob token_logprob_entropy(const float* row, int64_t V, int32_t target, double temperature);

// One batch of (B, T) token rows: row b*T + t predicts targets[b*T+t] (< 0: not a response token).
struct PolicyBatch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> targets;       // (B*T)
  std::vector<double> advantage;      // (B) per sequence
  std::vector<double> logp_rollout;   // (B*T) the engine's log-probs (response tokens)
  std::vector<double> logp_old;       // (B*T) the trainer's before this step's update
  std::vector<double> logp_ref;       // (B*T) the reference model's, or empty (no KL)
  std::vector<int64_t> response_len;  // (B) response tokens of each sequence
};

// TIS weight of one token (0 where the masked variant drops it).
double tis_weight(double logp_old, double logp_rollout, TisMode mode, double cap);

struct PolicyLossStats {
  double loss = 0;
  double clip_fraction = 0;   // response tokens whose ratio was clipped
  double tis_fraction = 0;    // response tokens whose TIS weight was truncated or masked
  double kl = 0;              // mean k3(π_ref ‖ π_θ) over response tokens (0 without a reference)
  int64_t tokens = 0;
};

// The loss of `batch` on logits (B*T, V) f32 (host), overwriting them with dL/dlogits.
PolicyLossStats policy_loss_and_grad(float* logits_to_dlogits, const PolicyBatch& batch, int64_t V,
                                     const GrpoConfig& config);

}  // namespace nibble::rl
