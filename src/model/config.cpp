// Parsing and validation of ModelConfig from HF config.json (see config.h). Each check returns
// a one-line invalid_argument naming the offending field.
#include "model/config.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "io/regular_file.h"

namespace nibble::model {

bool ModelConfig::is_moe_layer(int64_t layer) const {
  if (arch != Architecture::kQwen3Moe || num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

namespace {

Status get_int(const nlohmann::json& j, const char* field, int64_t& out, bool required) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required) return invalid_argument("model config: missing field '{}'", field);
    return Status::ok();
  }
  if (!it->is_number_integer()) return invalid_argument("model config: field '{}' must be an integer", field);
  out = it->get<int64_t>();
  return Status::ok();
}

Status get_double(const nlohmann::json& j, const char* field, double& out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return Status::ok();
  if (!it->is_number()) return invalid_argument("model config: field '{}' must be a number", field);
  out = it->get<double>();
  return Status::ok();
}

Status get_bool(const nlohmann::json& j, const char* field, bool& out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return Status::ok();
  if (!it->is_boolean()) return invalid_argument("model config: field '{}' must be true or false", field);
  out = it->get<bool>();
  return Status::ok();
}

Status positive(const char* field, int64_t v) {
  if (v <= 0) return invalid_argument("model config: field '{}' must be > 0 (got {})", field, v);
  return Status::ok();
}

}  // namespace

Result<ModelConfig> parse_model_config(const nlohmann::json& j) {
  if (!j.is_object()) return invalid_argument("model config: expected a JSON object");
  ModelConfig c;
  std::string arch_name, model_type;
  if (auto it = j.find("architectures"); it != j.end()) {
    if (!it->is_array() || it->empty() || !(*it)[0].is_string())
      return invalid_argument("model config: field 'architectures' must be a non-empty list of strings");
    arch_name = (*it)[0].get<std::string>();
  }
  if (auto it = j.find("model_type"); it != j.end()) {
    if (!it->is_string()) return invalid_argument("model config: field 'model_type' must be a string");
    model_type = it->get<std::string>();
  }
  if (arch_name == "Olmo2ForCausalLM" || (arch_name.empty() && model_type == "olmo2")) {
    c.arch = Architecture::kOlmo2;
    c.rms_norm_eps = 1e-5;  // Olmo2Config default
  } else if (arch_name == "Qwen3MoeForCausalLM" || (arch_name.empty() && model_type == "qwen3_moe")) {
    c.arch = Architecture::kQwen3Moe;
    c.rms_norm_eps = 1e-6;  // Qwen3MoeConfig default
  } else if (arch_name.empty() && model_type.empty()) {
    return invalid_argument("model config: missing field 'architectures' (or 'model_type')");
  } else {
    return invalid_argument("model config: field 'architectures' names unsupported '{}' (supported: Olmo2ForCausalLM, Qwen3MoeForCausalLM)",
                            arch_name.empty() ? model_type : arch_name);
  }
  const bool moe = c.arch == Architecture::kQwen3Moe;

  NIB_RETURN_IF_ERROR(get_int(j, "hidden_size", c.hidden_size, true));
  NIB_RETURN_IF_ERROR(get_int(j, "num_hidden_layers", c.num_hidden_layers, true));
  NIB_RETURN_IF_ERROR(get_int(j, "num_attention_heads", c.num_attention_heads, true));
  NIB_RETURN_IF_ERROR(get_int(j, "vocab_size", c.vocab_size, true));
  NIB_RETURN_IF_ERROR(get_int(j, "intermediate_size", c.intermediate_size, !moe));
  c.num_key_value_heads = -1;
  NIB_RETURN_IF_ERROR(get_int(j, "num_key_value_heads", c.num_key_value_heads, false));
  c.max_position_embeddings = 4096;
  NIB_RETURN_IF_ERROR(get_int(j, "max_position_embeddings", c.max_position_embeddings, false));
  NIB_RETURN_IF_ERROR(get_double(j, "rms_norm_eps", c.rms_norm_eps));
  NIB_RETURN_IF_ERROR(get_double(j, "rope_theta", c.rope_theta));
  NIB_RETURN_IF_ERROR(get_bool(j, "tie_word_embeddings", c.tie_word_embeddings));
  NIB_RETURN_IF_ERROR(get_double(j, "initializer_range", c.initializer_range));
  NIB_RETURN_IF_ERROR(get_double(j, "router_z_loss_coef", c.router_z_loss_coef));
  NIB_RETURN_IF_ERROR(get_int(j, "bos_token_id", c.bos_token_id, false));
  NIB_RETURN_IF_ERROR(get_int(j, "eos_token_id", c.eos_token_id, false));
  NIB_RETURN_IF_ERROR(get_int(j, "pad_token_id", c.pad_token_id, false));

  NIB_RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  NIB_RETURN_IF_ERROR(positive("num_hidden_layers", c.num_hidden_layers));
  NIB_RETURN_IF_ERROR(positive("num_attention_heads", c.num_attention_heads));
  NIB_RETURN_IF_ERROR(positive("vocab_size", c.vocab_size));
  NIB_RETURN_IF_ERROR(positive("max_position_embeddings", c.max_position_embeddings));
  for (auto [field, v] : {std::pair{"bos_token_id", c.bos_token_id}, std::pair{"eos_token_id", c.eos_token_id},
                          std::pair{"pad_token_id", c.pad_token_id}})
    if (v < -1 || v >= c.vocab_size)
      return invalid_argument("model config: field '{}' ({}) must be a token id in [0, vocab_size {}) or null", field, v,
                              c.vocab_size);
  if (c.num_key_value_heads == -1) c.num_key_value_heads = c.num_attention_heads;
  NIB_RETURN_IF_ERROR(positive("num_key_value_heads", c.num_key_value_heads));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    return invalid_argument("model config: field 'num_key_value_heads' ({}) must divide num_attention_heads ({})",
                            c.num_key_value_heads, c.num_attention_heads);
  if (!(c.rms_norm_eps > 0)) return invalid_argument("model config: field 'rms_norm_eps' must be > 0");
  if (!(c.rope_theta > 0)) return invalid_argument("model config: field 'rope_theta' must be > 0");
  if (!(c.initializer_range > 0)) return invalid_argument("model config: field 'initializer_range' must be > 0");
  if (c.tie_word_embeddings)
    return unimplemented("model config: field 'tie_word_embeddings' = true is not supported (nibble models have an untied lm_head)");
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null())
    return unimplemented("model config: field 'rope_scaling' is not supported (must be null)");
  for (const char* f : {"attention_bias", "mlp_bias"}) {
    bool b = false;
    NIB_RETURN_IF_ERROR(get_bool(j, f, b));
    if (b) return unimplemented("model config: field '{}' = true is not supported (no biases)", f);
  }
  if (auto it = j.find("hidden_act"); it != j.end() && !(it->is_string() && it->get<std::string>() == "silu"))
    return unimplemented("model config: field 'hidden_act' must be \"silu\"");
  if (moe) {
    bool sliding = false;
    NIB_RETURN_IF_ERROR(get_bool(j, "use_sliding_window", sliding));
    if (sliding) return unimplemented("model config: field 'use_sliding_window' = true is not supported");
  }

  if (c.arch == Architecture::kOlmo2) {
    if (c.hidden_size % c.num_attention_heads != 0)
      return invalid_argument("model config: field 'num_attention_heads' ({}) must divide hidden_size ({})",
                              c.num_attention_heads, c.hidden_size);
    c.head_dim = c.hidden_size / c.num_attention_heads;
    NIB_RETURN_IF_ERROR(positive("intermediate_size", c.intermediate_size));
  } else {
    c.head_dim = -1;
    NIB_RETURN_IF_ERROR(get_int(j, "head_dim", c.head_dim, false));
    if (c.head_dim == -1) {
      if (c.hidden_size % c.num_attention_heads != 0)
        return invalid_argument("model config: field 'num_attention_heads' ({}) must divide hidden_size ({}) when head_dim is absent",
                                c.num_attention_heads, c.hidden_size);
      c.head_dim = c.hidden_size / c.num_attention_heads;
    }
    NIB_RETURN_IF_ERROR(get_int(j, "num_experts", c.num_experts, true));
    NIB_RETURN_IF_ERROR(get_int(j, "num_experts_per_tok", c.num_experts_per_tok, true));
    NIB_RETURN_IF_ERROR(get_int(j, "moe_intermediate_size", c.moe_intermediate_size, true));
    NIB_RETURN_IF_ERROR(get_bool(j, "norm_topk_prob", c.norm_topk_prob));
    NIB_RETURN_IF_ERROR(get_double(j, "router_aux_loss_coef", c.router_aux_loss_coef));
    NIB_RETURN_IF_ERROR(get_int(j, "decoder_sparse_step", c.decoder_sparse_step, false));
    NIB_RETURN_IF_ERROR(get_int(j, "shared_expert_intermediate_size", c.shared_expert_intermediate_size, false));
    if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
      if (!it->is_array()) return invalid_argument("model config: field 'mlp_only_layers' must be a list of layer indices");
      for (const auto& v : *it) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_hidden_layers)
          return invalid_argument("model config: field 'mlp_only_layers' holds a value that is not a layer index in [0, {})",
                                  c.num_hidden_layers);
        c.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
    NIB_RETURN_IF_ERROR(positive("head_dim", c.head_dim));
    NIB_RETURN_IF_ERROR(positive("num_experts", c.num_experts));
    NIB_RETURN_IF_ERROR(positive("num_experts_per_tok", c.num_experts_per_tok));
    NIB_RETURN_IF_ERROR(positive("moe_intermediate_size", c.moe_intermediate_size));
    NIB_RETURN_IF_ERROR(positive("decoder_sparse_step", c.decoder_sparse_step));
    if (c.num_experts_per_tok > c.num_experts)
      return invalid_argument("model config: field 'num_experts_per_tok' ({}) must be <= num_experts ({})",
                              c.num_experts_per_tok, c.num_experts);
    if (c.shared_expert_intermediate_size < 0)
      return invalid_argument("model config: field 'shared_expert_intermediate_size' must be >= 0");
    if (c.router_aux_loss_coef < 0) return invalid_argument("model config: field 'router_aux_loss_coef' must be >= 0");
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      if (!c.is_moe_layer(l) && c.intermediate_size <= 0)
        return invalid_argument("model config: field 'intermediate_size' must be > 0 (layer {} is a dense MLP layer)", l);
  }
  if (c.head_dim % 2 != 0) return invalid_argument("model config: head dimension {} must be even for RoPE", c.head_dim);
  if (c.router_z_loss_coef < 0) return invalid_argument("model config: field 'router_z_loss_coef' must be >= 0");
  return c;
}

Result<ModelConfig> parse_model_config_text(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("model config: not valid JSON");
  return parse_model_config(j);
}

Result<ModelConfig> load_model_config(const std::string& path) {
  auto text = io::read_regular_file(path, "model config");
  if (!text) return text.status();
  auto r = parse_model_config_text(*text);
  if (!r.is_ok()) return Status(r.status().code(), r.status().message() + " (in " + path + ")");
  return r;
}

nlohmann::json ModelConfig::to_json() const {
  nlohmann::json j;
  j["architectures"] = {architecture_name()};
  j["model_type"] = model_type();
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["rope_scaling"] = nullptr;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["torch_dtype"] = "float32";
  auto id_or_null = [](int64_t v) { return v >= 0 ? nlohmann::json(v) : nlohmann::json(nullptr); };
  j["bos_token_id"] = id_or_null(bos_token_id);
  j["eos_token_id"] = id_or_null(eos_token_id);
  j["pad_token_id"] = id_or_null(pad_token_id);
  if (arch == Architecture::kQwen3Moe) {
    j["head_dim"] = head_dim;
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
    j["use_sliding_window"] = false;
    j["output_router_logits"] = router_aux_loss_coef > 0;
    if (shared_expert_intermediate_size > 0) j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
  }
  if (router_z_loss_coef > 0) j["router_z_loss_coef"] = router_z_loss_coef;
  return j;
}

}  // namespace nibble::model
