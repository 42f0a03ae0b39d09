// Tests of the recipe-state checkpoint glue: a tiny model trained with tetrajet-v2 + outliers
// exports its outlier selections as "recipe.<linear>.outliers.*" tensors; a fresh model that
// imports them uses the same channels and computes the same loss and gradients bit for bit;
// unknown recipe tensors are errors.
#include "train/outcontrol.h"

#include <cstring>

#include <gtest/gtest.h>

#include "core/parallel.h"
#include "core/philox.h"
#include "model/config.h"

namespace nibble::train {
namespace {

TEST(OutControlState, ExportImportRoundTripThroughTheModel) {
  // One thread: results do not depend on the thread count (parallel.h), and on a shared 2-core
  // machine OpenMP's spinning workers make these small per-op regions 10x slower, not faster.
  set_num_threads(1);
  auto cfg = model::load_model_config(std::string(NIBBLE_SOURCE_DIR) + "/configs/tiny-dense.json").value();
  cfg.vocab_size = 256;
  cfg.num_hidden_layers = 2;
  nlohmann::json j = {{"name", "tetrajet-v2"},
                      {"outcontrol", {{"outliers", {{"fraction", 0.1}, {"round_to", 32}, {"calibration_start", 1},
                                                    {"calibration_end", 1}}}}}};
  auto rc = model::parse_recipe_config(j).value();
  auto a = model::Model::create(cfg, rc).value();
  auto b = model::Model::create(cfg, rc).value();
  a->init_weights(1);
  b->init_weights(1);
  const int64_t B = 2, T = 64;
  std::vector<int32_t> tok(B * T), tgt(B * T);
  PhiloxStream r(9, 0);
  for (auto& t : tok) t = static_cast<int32_t>(r.next_u32() % 256);
  for (int64_t i = 0; i < B * T; ++i) tgt[i] = i % T == T - 1 ? -100 : tok[i + 1];
  a->set_step(1, 5);
  a->forward_backward(tok.data(), tgt.data(), B, T);  // calibration step
  EXPECT_TRUE(outlier_selections(*a).empty());
  a->set_step(2, 5);
  a->zero_grad();
  auto la = a->forward_backward(tok.data(), tgt.data(), B, T);  // selects, then uses MXFP8 channels
  auto sel = outlier_selections(*a);
  ASSERT_EQ(sel.size(), 8u);  // 4 linears x 2 blocks
  for (auto& [name, ch] : sel) EXPECT_EQ(ch.size(), name.find("down_proj") != std::string::npos ? 64u : 32u) << name;
  auto st = export_recipe_state(*a);
  ASSERT_TRUE(import_recipe_state(*b, st).is_ok());
  EXPECT_EQ(outlier_selections(*b), sel);
  // SR streams derive from (step, layer, micro_step): advance b's forward counter to a's (one
  // eval forward) so the two calls draw the same noise
  b->set_step(0, 5);
  b->forward_loss(tok.data(), tgt.data(), B, T);
  b->set_step(2, 5);
  b->zero_grad();
  auto lb = b->forward_backward(tok.data(), tgt.data(), B, T);
  EXPECT_EQ(la.loss, lb.loss);
  EXPECT_EQ(0, std::memcmp(a->flat_grads(), b->flat_grads(), sizeof(float) * a->num_params()));
  st.push_back(io::NamedTensor{"recipe.model.layers.9.mlp.down_proj.outliers.selected", Tensor(DType::kI64, Shape{1})});
  EXPECT_FALSE(import_recipe_state(*b, st).is_ok());
}

}  // namespace
}  // namespace nibble::train
