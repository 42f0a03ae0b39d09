// Weights received already quantized from a checkpoint (issue #15 §2): `nibble quantize --format
// nvfp4-2level` (the built binary) of a model's weights, loaded by the rollout engine
// (Engine::load_quantized_weights), gives bit for bit the weights the engine makes by quantizing
// the same BF16 weights itself (fused q|k|v and gate|up stacked from their HF members), and the
// same tokens and log-probs, also in an engine whose model keeps no master weights (inference
// storage, read linear by linear); files of another format, layout or rounding, or not quantized
// at all, are one-line errors that change nothing.
#include <cstring>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/bits.h"
#include "model/config.h"
#include "model/tiny_olmo2_test_util.h"
#include "rollout/checkpoint_weights.h"
#include "rollout/engine.h"
#include "tools/cli_test_util.h"

namespace nibble::tools::test {
namespace {

// A tiny OLMo-2 whose linears all have in-features of multiples of 128 (what the tool quantizes),
// master weights holding BF16 values (the engine quantizes the BF16 weight).
std::unique_ptr<model::Model> model_128(uint64_t seed) {
  nlohmann::json j = model::test::tiny_olmo2_model_json(48);
  j["hidden_size"] = 128;
  j["intermediate_size"] = 256;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = 2;
  j["initializer_range"] = 0.3;
  model::RecipeConfig rc;
  rc.name = "tetrajet-v2";
  auto m = model::Model::create(model::parse_model_config(j).value(), rc).value();
  m->init_weights(seed);
  std::vector<float> p(static_cast<size_t>(m->num_params()));
  m->download_parameters(p.data());
  for (float& x : p) x = round_to_bf16(x);
  m->upload_parameters(p.data());
  return m;
}

// An inference-storage model (no master weights) holding `from`'s parameters outside the block
// linears but the lm_head (the engine holds its BF16 bits), copied one tensor at a time.
std::unique_ptr<model::Model> lean_copy(model::Model& from) {
  model::RecipeConfig rc;
  rc.name = "tetrajet-v2";
  auto m = model::Model::create(from.config(), rc, &backend::cpu_backend(), model::ParameterStorage::kInference).value();
  for (size_t i = 0; i < m->param_refs().size(); ++i) {
    const model::ParamRef<float>& p = m->param_refs()[i];
    if (p.value != nullptr) std::memcpy(p.value, from.param_refs()[i].value, static_cast<size_t>(p.numel) * 4);
  }
  return m;
}

std::vector<io::NamedTensor> parameters_of(model::Model& m) {
  std::vector<io::NamedTensor> out;
  for (model::Parameter& p : m.parameters()) out.push_back({p.name, p.value});
  return out;
}

TEST(QuantizedWeightsFile, NibbleQuantizeOutputEqualsTheEnginesOwnQuantization) {
  ScratchDir dir("quantized_weights");
  auto trained = model_128(7);
  ASSERT_TRUE(io::write_safetensors(dir / "model.safetensors", parameters_of(*trained)).is_ok());
  RunResult q = run_nibble(dir.path, "quantize '" + (dir / "model.safetensors") + "' '" + (dir / "q.safetensors") +
                                         "' --format nvfp4-2level");
  ASSERT_EQ(q.code, 0) << q.err;
  auto other = model_128(8);  // other weights: the file's must replace them
  std::vector<float> keep(static_cast<size_t>(trained->num_params()));
  trained->download_parameters(keep.data());
  std::vector<float> mixed = keep;
  std::vector<float> theirs(static_cast<size_t>(other->num_params()));
  other->download_parameters(theirs.data());
  for (const model::LinearInfo& info : trained->linear_infos()) {
    const int64_t off = trained->linear_weight(info.id) - trained->flat_values();
    std::copy(theirs.begin() + off, theirs.begin() + off + info.N * info.K, mixed.begin() + off);
  }
  other->upload_parameters(mixed.data());  // norms and embeddings as `trained`, linears not
  for (rollout::PrecisionMode mode : {rollout::PrecisionMode::kW4A16, rollout::PrecisionMode::kW4A4}) {
    rollout::EngineOptions o;
    o.mode = mode;
    o.recipe_name = "tetrajet-v2";
    auto own = rollout::Engine::create(*trained, o).value();
    auto loaded = rollout::Engine::create(*other, o).value();
    auto st = loaded->load_quantized_weights(dir / "q.safetensors");
    ASSERT_TRUE(st.is_ok()) << st.message();
    // also into an engine whose model has no master weights (inference storage): linear by linear
    auto lean_model = lean_copy(*trained);
    auto lean = rollout::Engine::create(*lean_model, o).value();
    st = lean->load_quantized_weights(dir / "q.safetensors");
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_TRUE(lean->set_lm_head_weight(trained->find_param("lm_head.weight")->value).is_ok());  // its BF16 bits
    for (const rollout::Engine* e : {loaded.get(), lean.get()})
      for (const model::LinearInfo& info : trained->linear_infos()) {
        const backend::QuantizedTensor& a = own->linears()->quantized_weight(info.id);
        const backend::QuantizedTensor& b = e->linears()->quantized_weight(info.id);
        ASSERT_EQ(std::memcmp(a.codes, b.codes, info.N * info.K / 2), 0) << info.name;
        ASSERT_EQ(std::memcmp(a.scales, b.scales, info.N * info.K / 16), 0) << info.name;
        ASSERT_EQ(std::memcmp(a.outer, b.outer, info.N * info.K / 128 * sizeof(float)), 0) << info.name;
      }
    rollout::Request r;
    r.prompt = {3, 14, 15, 9, 26, 5};
    r.params.sampling.temperature = 0;
    r.params.max_new_tokens = 10;
    auto want = own->generate({r});
    for (rollout::Engine* e : {loaded.get(), lean.get()}) {
      auto got = e->generate({r});
      ASSERT_TRUE(want.is_ok() && got.is_ok());
      EXPECT_EQ((*want)[0].tokens, (*got)[0].tokens);
      EXPECT_EQ((*want)[0].logprobs, (*got)[0].logprobs);
    }
  }
  // other formats, the unquantized file, a missing file: one-line errors
  RunResult te = run_nibble(dir.path, "quantize '" + (dir / "model.safetensors") + "' '" + (dir / "te.safetensors") +
                                          "' --format nvfp4");
  ASSERT_EQ(te.code, 0) << te.err;
  RunResult sr = run_nibble(dir.path, "quantize '" + (dir / "model.safetensors") + "' '" + (dir / "sr.safetensors") +
                                          "' --format nvfp4-2level --rounding sr --seed 3");
  ASSERT_EQ(sr.code, 0) << sr.err;
  rollout::EngineOptions o;
  o.mode = rollout::PrecisionMode::kW4A16;
  auto e = rollout::Engine::create(*other, o).value();
  for (const std::string f : {"te.safetensors", "sr.safetensors", "model.safetensors", "missing.safetensors"}) {
    auto bad = e->load_quantized_weights(dir / f);
    ASSERT_FALSE(bad.is_ok()) << f;
    EXPECT_EQ(bad.message().find('\n'), std::string::npos) << bad.message();
    EXPECT_NE(bad.message().find(f), std::string::npos) << bad.message();
  }
  rollout::EngineOptions bf;
  bf.mode = rollout::PrecisionMode::kBf16;
  EXPECT_FALSE(rollout::Engine::create(*other, bf).value()->load_quantized_weights(dir / "q.safetensors").is_ok());
}

// A checkpoint whose model.safetensors is a `nibble quantize --format nvfp4-2level` output (the
// parameters outside the block linears kept with --skip) loads into an inference-storage engine
// (rollout::load_inference_engine, what generate and serve run) with the file's codes and scales
// taken as they are: the bits and the greedy and sampled tokens and log-probs of the engine that
// quantizes the same BF16 weights itself, and no upload scratch (a re-quantizing load uploads
// each FP32 weight into one; the plain file's load does). A file whose other parameters are
// quantized too, and the bf16 mode, are one-line errors.
TEST(QuantizedWeightsFile, PackedCheckpointLoadsIntoAnInferenceEngineWithoutRequantizing) {
  ScratchDir dir("quantized_checkpoint");
  auto trained = model_128(7);
  ASSERT_TRUE(io::write_safetensors(dir / "model.safetensors", parameters_of(*trained)).is_ok());
  const std::string quantize = "quantize '" + (dir / "model.safetensors") + "' '";
  RunResult q = run_nibble(dir.path, quantize + (dir / "packed.safetensors") +
                                         "' --format nvfp4-2level --skip 'norm|embed|lm_head'");
  ASSERT_EQ(q.code, 0) << q.err;
  RunResult all = run_nibble(dir.path, quantize + (dir / "all.safetensors") + "' --format nvfp4-2level");
  ASSERT_EQ(all.code, 0) << all.err;
  model::RecipeConfig rc;
  rc.name = "tetrajet-v2";
  std::vector<rollout::Request> rs(2);
  rs[0].prompt = {3, 14, 15, 9, 26, 5};
  rs[0].params.sampling.temperature = 0;
  rs[0].params.max_new_tokens = 10;
  rs[1] = rs[0];
  rs[1].id = 1;
  rs[1].params.sampling = rollout::SamplingParams{0.9, 0, 0.95};
  rs[1].params.num_samples = 2;
  rs[1].params.seed = 4;
  for (rollout::PrecisionMode mode : {rollout::PrecisionMode::kW4A16, rollout::PrecisionMode::kW4A4}) {
    SCOPED_TRACE(rollout::precision_mode_name(mode));
    rollout::EngineOptions o;
    o.mode = mode;
    o.recipe_name = "tetrajet-v2";
    auto own = rollout::Engine::create(*trained, o).value();
    auto packed = rollout::load_inference_engine(trained->config(), rc, dir / "packed.safetensors", o,
                                                 backend::cpu_backend());
    ASSERT_TRUE(packed.is_ok()) << packed.status().message();
    EXPECT_EQ(packed->engine->linears()->workspace_bytes(), 0);  // nothing uploaded to quantize
    auto plain = rollout::load_inference_engine(trained->config(), rc, dir / "model.safetensors", o,
                                                backend::cpu_backend());
    ASSERT_TRUE(plain.is_ok()) << plain.status().message();
    EXPECT_GT(plain->engine->linears()->workspace_bytes(), 0);
    for (const model::LinearInfo& info : trained->linear_infos()) {
      const backend::QuantizedTensor& a = own->linears()->quantized_weight(info.id);
      const backend::QuantizedTensor& b = packed->engine->linears()->quantized_weight(info.id);
      ASSERT_EQ(std::memcmp(a.codes, b.codes, info.N * info.K / 2), 0) << info.name;
      ASSERT_EQ(std::memcmp(a.scales, b.scales, info.N * info.K / 16), 0) << info.name;
      ASSERT_EQ(std::memcmp(a.outer, b.outer, info.N * info.K / 128 * sizeof(float)), 0) << info.name;
    }
    auto want = own->generate(rs);
    auto got = packed->engine->generate(rs);
    ASSERT_TRUE(want.is_ok() && got.is_ok());
    ASSERT_EQ(want->size(), got->size());
    for (size_t i = 0; i < want->size(); ++i) {
      EXPECT_EQ((*want)[i].tokens, (*got)[i].tokens);
      EXPECT_EQ((*want)[i].logprobs, (*got)[i].logprobs);
    }
    auto quantized_all = rollout::load_inference_engine(trained->config(), rc, dir / "all.safetensors", o,
                                                        backend::cpu_backend());
    ASSERT_FALSE(quantized_all.is_ok());
    const std::string msg = quantized_all.status().message();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.embed_tokens.weight' is quantized"), std::string::npos) << msg;
  }
  rollout::EngineOptions bf;
  bf.mode = rollout::PrecisionMode::kBf16;
  auto as_bf16 = rollout::load_inference_engine(trained->config(), rc, dir / "packed.safetensors", bf,
                                                backend::cpu_backend());
  ASSERT_FALSE(as_bf16.is_ok());
  EXPECT_NE(as_bf16.status().message().find("bf16 mode"), std::string::npos) << as_bf16.status().message();
}

}  // namespace
}  // namespace nibble::tools::test
