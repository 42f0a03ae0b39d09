// Tests of ModelConfig parsing: the shipped configs/ parse with the spec's sizes (parameter counts
// of the OLMo-2 70M/150M/370M table), and bad or missing values give one-line errors that name
// the field. Also RecipeConfig parsing (switches of 02-pretraining-recipes.md).
#include "model/config.h"

#include <gtest/gtest.h>

#include "model/linear.h"

namespace nibble::model {
namespace {

std::string config_path(const std::string& name) { return std::string(NIBBLE_SOURCE_DIR) + "/configs/" + name; }

// Non-embedding + embedding parameter count of an OLMo-2 config (q,k,v,o + gate,up,down + 4 norm
// vectors per layer; embed + lm_head + final norm).
int64_t olmo2_params(const ModelConfig& c) {
  int64_t C = c.hidden_size, I = c.intermediate_size;
  int64_t per_layer = C * c.q_width() + 2 * C * c.kv_width() + c.q_width() * C + 3 * C * I + c.q_width() +
                      c.kv_width() + 2 * C;
  return c.num_hidden_layers * per_layer + 2 * c.vocab_size * C + C;
}

TEST(ModelConfig, ShippedOlmo2ConfigsMatchTheSpecTable) {
  struct Row { const char* file; int64_t C, L, H, I; double approx_params; };
  for (Row r : {Row{"olmo2-70m.json", 512, 8, 8, 1024, 72e6}, Row{"olmo2-150m.json", 768, 12, 12, 1536, 148e6},
                Row{"olmo2-370m.json", 1024, 16, 16, 4096, 371e6}}) {
    auto c = load_model_config(config_path(r.file));
    ASSERT_TRUE(c.is_ok()) << r.file << ": " << c.status().message();
    EXPECT_EQ(c->arch, Architecture::kOlmo2);
    EXPECT_EQ(c->hidden_size, r.C);
    EXPECT_EQ(c->num_hidden_layers, r.L);
    EXPECT_EQ(c->num_attention_heads, r.H);
    EXPECT_EQ(c->head_dim, 64);
    EXPECT_EQ(c->intermediate_size, r.I);
    EXPECT_EQ(c->rope_theta, 500000.0);
    EXPECT_FALSE(c->tie_word_embeddings);
    EXPECT_NEAR(static_cast<double>(olmo2_params(*c)), r.approx_params, 0.01 * r.approx_params) << r.file;
  }
}

TEST(ModelConfig, TinyConfigsParse) {
  auto d = load_model_config(config_path("tiny-dense.json"));
  ASSERT_TRUE(d.is_ok()) << d.status().message();
  EXPECT_EQ(d->arch, Architecture::kOlmo2);
  int64_t n = olmo2_params(*d);
  EXPECT_GT(n, 1000000);
  EXPECT_LT(n, 2000000);
  auto m = load_model_config(config_path("tiny-moe.json"));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  EXPECT_EQ(m->arch, Architecture::kQwen3Moe);
  EXPECT_EQ(m->num_experts, 8);
  EXPECT_EQ(m->num_experts_per_tok, 2);
  EXPECT_TRUE(m->norm_topk_prob);
  EXPECT_EQ(m->head_dim, 32);
  for (int l = 0; l < 4; ++l) EXPECT_TRUE(m->is_moe_layer(l));
  // round trip through to_json
  auto again = parse_model_config(m->to_json());
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again->to_json(), m->to_json());
}

nlohmann::json olmo_base() {
  return nlohmann::json::parse(R"({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100})");
}

void expect_error_naming(const nlohmann::json& j, const std::string& field) {
  auto r = parse_model_config(j);
  ASSERT_FALSE(r.is_ok()) << "expected an error naming " << field;
  EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
  EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
}

TEST(ModelConfig, ErrorsNameTheField) {
  ASSERT_TRUE(parse_model_config(olmo_base()).is_ok());
  auto j = olmo_base();
  j.erase("hidden_size");
  expect_error_naming(j, "'hidden_size'");
  j = olmo_base();
  j["intermediate_size"] = -5;
  expect_error_naming(j, "'intermediate_size'");
  j = olmo_base();
  j["num_attention_heads"] = 5;  // 64 % 5 != 0
  expect_error_naming(j, "'num_attention_heads'");
  j = olmo_base();
  j["num_key_value_heads"] = 3;  // 4 % 3 != 0
  expect_error_naming(j, "'num_key_value_heads'");
  j = olmo_base();
  j["vocab_size"] = "big";
  expect_error_naming(j, "'vocab_size'");
  j = olmo_base();
  j["architectures"] = {"LlamaForCausalLM"};
  expect_error_naming(j, "'architectures'");
  j = olmo_base();
  j["tie_word_embeddings"] = true;
  expect_error_naming(j, "'tie_word_embeddings'");
  j = olmo_base();
  j["rms_norm_eps"] = 0;
  expect_error_naming(j, "'rms_norm_eps'");
  auto q = nlohmann::json::parse(R"({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32})");
  auto ok = parse_model_config(q);
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  EXPECT_EQ(ok->head_dim, 16);
  auto q2 = q;
  q2.erase("num_experts");
  expect_error_naming(q2, "'num_experts'");
  q2 = q;
  q2["num_experts_per_tok"] = 5;
  expect_error_naming(q2, "'num_experts_per_tok'");
  q2 = q;
  q2["mlp_only_layers"] = {1};  // a dense layer needs intermediate_size
  expect_error_naming(q2, "'intermediate_size'");
  q2 = q;
  q2["mlp_only_layers"] = {7};
  expect_error_naming(q2, "'mlp_only_layers'");
  j = olmo_base();
  j["eos_token_id"] = 100;  // == vocab_size
  expect_error_naming(j, "'eos_token_id'");
  j = olmo_base();
  j["eos_token_id"] = 3;
  j["bos_token_id"] = nullptr;
  ASSERT_TRUE(parse_model_config(j).is_ok());
  EXPECT_EQ(parse_model_config(j)->eos_token_id, 3);
  EXPECT_TRUE(parse_model_config(j)->to_json()["bos_token_id"].is_null());
  EXPECT_FALSE(parse_model_config_text("{not json").is_ok());
  EXPECT_FALSE(load_model_config("/nonexistent/config.json").is_ok());
}

TEST(RecipeConfig, ParsesSwitchesAndRejectsTypos) {
  auto j = nlohmann::json::parse(R"({"name": "tetrajet-v2", "alignment": false, "sr": true,
    "outcontrol": {"rht": false, "outliers": {"fraction": 0.05, "calibration_start": 10, "calibration_end": 20}},
    "oscireset": {"threshold": 6, "window": 40, "period": 100, "start_fraction": 0.6, "variant": "tracked"}})");
  auto r = parse_recipe_config(j);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->name, "tetrajet-v2");
  EXPECT_FALSE(r->alignment);
  EXPECT_FALSE(r->rht);
  EXPECT_TRUE(r->outliers.enabled);
  EXPECT_EQ(r->outliers.fraction, 0.05);
  EXPECT_EQ(r->outliers.calibration_end, 20);
  EXPECT_TRUE(r->oscireset.enabled);
  EXPECT_EQ(r->oscireset.window, 40);
  EXPECT_EQ(r->oscireset.variant, "tracked");
  auto round = parse_recipe_config(r->to_json());
  ASSERT_TRUE(round.is_ok()) << round.status().message();
  EXPECT_EQ(round->to_json(), r->to_json());

  auto s = parse_recipe_config(nlohmann::json("bf16"));
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s->name, "bf16");
  auto n = parse_recipe_config(nlohmann::json::parse(R"({"name": "nvfp4-nvidia", "bf16_last_blocks": 2})"));
  ASSERT_TRUE(n.is_ok());
  EXPECT_EQ(n->bf16_last_blocks, 2);

  auto typo = parse_recipe_config(nlohmann::json::parse(R"({"name": "bf16", "oscireset": {"treshold": 8}})"));
  ASSERT_FALSE(typo.is_ok());
  EXPECT_NE(typo.status().message().find("oscireset.treshold"), std::string::npos) << typo.status().message();
  auto bad = parse_recipe_config(nlohmann::json::parse(R"({"name": "x", "oscireset": {"period": 10, "window": 50}})"));
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("oscireset.period"), std::string::npos);
}

}  // namespace
}  // namespace nibble::model
