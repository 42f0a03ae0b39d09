// Writes small random OLMo-2 and Qwen3-MoE models with their logits for a cross-check against
// Hugging Face transformers (hf_logits_check.py loads the weights with from_pretrained and
// compares logits). Disabled by default: run with --gtest_also_run_disabled_tests and
// NIBBLE_HF_EXPORT_DIR=<dir>. Files per model: config.json (HF fields), weights.bin (all
// parameters, f32, in parameters() order), index.json [{name, shape, offset}], tokens.bin (B,T)
// i32, logits.bin (B,T,V) f32, meta.json {B, T, V}.
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "core/philox.h"
#include "model/transformer.h"

namespace nibble::model {
namespace {

void write_bytes(const std::string& path, const void* data, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  ASSERT_TRUE(f.good()) << path;
}

void export_model(const std::string& dir, const nlohmann::json& config_json) {
  auto cfg = parse_model_config(config_json);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  RecipeConfig rc;
  rc.name = "fp32";
  auto m = Model::create(*cfg, rc).value();
  m->init_weights(17);
  PhiloxStream rng(23, 5);
  for (auto& p : m->param_refs())
    for (int64_t i = 0; i < p.numel; ++i)
      p.value[i] = static_cast<float>(p.shape.size() == 1 ? 1.0 + 0.1 * rng.next_normal() : 0.15 * rng.next_normal());
  const int64_t B = 2, T = 16, V = cfg->vocab_size;
  std::vector<int32_t> tokens(B * T);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.next_below(V));
  std::vector<float> logits(B * T * V);
  m->forward_logits(logits.data(), tokens.data(), B, T);
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << cfg->to_json().dump(2);
  nlohmann::json index = nlohmann::json::array();
  for (auto& p : m->param_refs())
    index.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.value - m->flat_values()}});
  std::ofstream(dir + "/index.json") << index.dump(1);
  std::ofstream(dir + "/meta.json") << nlohmann::json{{"B", B}, {"T", T}, {"V", V}}.dump();
  write_bytes(dir + "/weights.bin", m->flat_values(), sizeof(float) * m->num_params());
  write_bytes(dir + "/tokens.bin", tokens.data(), sizeof(int32_t) * tokens.size());
  write_bytes(dir + "/logits.bin", logits.data(), sizeof(float) * logits.size());
}

TEST(HfExport, DISABLED_WriteModelsAndLogits) {
  const char* root = std::getenv("NIBBLE_HF_EXPORT_DIR");
  if (!root) GTEST_SKIP() << "set NIBBLE_HF_EXPORT_DIR";
  export_model(std::string(root) + "/olmo2", nlohmann::json::parse(R"({"architectures": ["Olmo2ForCausalLM"],
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 64, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-6})"));
  export_model(std::string(root) + "/qwen3moe", nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 97, "max_position_embeddings": 64,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": true, "mlp_only_layers": [1]})"));
  export_model(std::string(root) + "/qwen3moe_nonorm", nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "vocab_size": 97, "max_position_embeddings": 64,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_experts": 6, "num_experts_per_tok": 3,
    "moe_intermediate_size": 16, "norm_topk_prob": false})"));
}

}  // namespace
}  // namespace nibble::model
