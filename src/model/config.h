// ModelConfig: the architecture of a nibble transformer, read from a Hugging Face `config.json`
// (field names of transformers' Olmo2Config and Qwen3MoeConfig), selected by architectures[0]
// or model_type: "Olmo2ForCausalLM"/"olmo2" (dense, norm-after blocks, full-width QK-norm) or
// "Qwen3MoeForCausalLM"/"qwen3_moe" (pre-norm, per-head QK-norm, sparse MoE MLPs).
// Missing or bad values give a Result error with one line naming the field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace nibble::model {

enum class Architecture { kOlmo2, kQwen3Moe };

struct ModelConfig {
  Architecture arch = Architecture::kOlmo2;
  int64_t hidden_size = 0;          // C
  int64_t intermediate_size = 0;    // dense SwiGLU hidden (OLMo-2; Qwen3-MoE dense layers)
  int64_t num_hidden_layers = 0;    // L
  int64_t num_attention_heads = 0;  // H
  int64_t num_key_value_heads = 0;  // Hkv (defaults to H)
  int64_t head_dim = 0;             // D (OLMo-2: C/H; Qwen3-MoE: `head_dim`, default C/H)
  int64_t vocab_size = 0;           // V
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;  // only false is supported (untied lm_head)
  double initializer_range = 0.02;
  int64_t bos_token_id = -1;  // -1 = null (written as null)
  int64_t eos_token_id = -1;
  int64_t pad_token_id = -1;
  // Qwen3-MoE
  int64_t num_experts = 0;           // E
  int64_t num_experts_per_tok = 0;   // k
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.001;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  int64_t shared_expert_intermediate_size = 0;  // nibble extension (0 = none), see docs/model.md
  double router_z_loss_coef = 0.0;              // nibble extension (ST-MoE router z-loss)

  std::string architecture_name() const { return arch == Architecture::kOlmo2 ? "Olmo2ForCausalLM" : "Qwen3MoeForCausalLM"; }
  std::string model_type() const { return arch == Architecture::kOlmo2 ? "olmo2" : "qwen3_moe"; }
  // transformers' rule: layer i is sparse iff i not in mlp_only_layers, num_experts > 0 and
  // (i + 1) % decoder_sparse_step == 0. Always false for OLMo-2.
  bool is_moe_layer(int64_t layer) const;
  int64_t q_width() const { return num_attention_heads * head_dim; }
  int64_t kv_width() const { return num_key_value_heads * head_dim; }

  // A JSON object with the HF field names (what a checkpoint's config.json holds).
  nlohmann::json to_json() const;
};

// Parses and validates a config.json object / text / file.
Result<ModelConfig> parse_model_config(const nlohmann::json& j);
Result<ModelConfig> parse_model_config_text(const std::string& text);
Result<ModelConfig> load_model_config(const std::string& path);

}  // namespace nibble::model
