// Test helper (rollout tests only): the small MoE and dense configs and the greedy requests the
// inference-storage tests (engine_memory_test.cpp, checkpoint_weights_test.cpp) share.
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "model/config.h"
#include "rollout/engine.h"

namespace nibble::rollout::test {

// A Qwen3-MoE model with a dense layer (mlp_only_layers) and a shared expert: every kind of
// block linear and the shared activation set holding both MLP kinds. std 0.3 weights spread
// the logits so greedy argmaxes are not decided by rounding.
inline model::ModelConfig mixed_moe_config() {
  nlohmann::json j = nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 40, "max_position_embeddings": 48, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [1],
    "shared_expert_intermediate_size": 32, "initializer_range": 0.3})");
  auto cfg = model::parse_model_config(j);
  NIB_CHECK_MSG(cfg.is_ok(), "{}", cfg.status().message());
  return cfg.value();
}

// A dense OLMo-2 of 2 layers (hidden 64), std 0.3 weights as above.
inline model::ModelConfig dense_olmo_config() {
  nlohmann::json j = nlohmann::json::parse(R"({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 48, "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "initializer_range": 0.3})");
  auto cfg = model::parse_model_config(j);
  NIB_CHECK_MSG(cfg.is_ok(), "{}", cfg.status().message());
  return cfg.value();
}

// `count` greedy requests (ids 0..count-1) of 5, 8, 11, ... tokens below `vocab`, 6 new tokens each.
inline std::vector<Request> greedy_requests(int64_t vocab, size_t count = 2) {
  std::vector<Request> rs(count);
  for (size_t i = 0; i < rs.size(); ++i) {
    for (int64_t t = 0; t < 5 + 3 * static_cast<int64_t>(i); ++t)
      rs[i].prompt.push_back(static_cast<int32_t>((t * 7 + 13 * static_cast<int64_t>(i) + 1) % vocab));
    rs[i].params.sampling.temperature = 0;
    rs[i].params.max_new_tokens = 6;
    rs[i].id = i;
  }
  return rs;
}

}  // namespace nibble::rollout::test
