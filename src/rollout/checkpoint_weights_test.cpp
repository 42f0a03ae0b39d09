// A checkpoint's model.safetensors loaded tensor by tensor into an engine whose model keeps
// inference storage (checkpoint_weights.h) against today's path (the training model holding the
// file's values, the engine quantizing its master weights): the same greedy and sampled tokens
// and log-probs, bit for bit, in every mode, for a dense OLMo-2 and a MoE model with a dense
// layer and a shared expert, F32 and BF16 files, two-level and TE NVFP4 layouts; no gradient
// or master byte, no FP32 lm_head, and while loading the backend never holds more than the
// final weights plus one linear's scratch. Bad files are one-line errors that change nothing.
#include "rollout/checkpoint_weights.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/bits.h"
#include "core/check.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "rollout/engine_test_util.h"

namespace nibble::rollout {
namespace {

namespace fs = std::filesystem;

model::ModelConfig moe_config() { return test::mixed_moe_config(); }
model::ModelConfig dense_config() { return test::dense_olmo_config(); }

model::RecipeConfig recipe(const std::string& name) {
  model::RecipeConfig rc;
  rc.name = name;
  return rc;
}

class CheckpointWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nibble_ckpt_weights_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

// A training model of `cfg` with init_weights(seed), its values rounded to BF16 when bf16 (what
// loading a BF16 file gives), and its parameters written to `path` (F32 or BF16, HF names; a
// checkpoint's model.safetensors). `skip`: a tensor left out; `extra`: one more tensor.
std::unique_ptr<model::Model> write_model_file(const std::string& path, const model::ModelConfig& cfg,
                                               const model::RecipeConfig& rc, uint64_t seed, bool bf16,
                                               const std::string& skip = "", bool extra = false) {
  auto m = model::Model::create(cfg, rc).value();
  m->init_weights(seed);
  std::vector<io::NamedTensor> tensors;
  for (model::Parameter& p : m->parameters()) {
    float* v = p.value.data<float>();
    if (bf16)
      for (int64_t i = 0; i < p.value.numel(); ++i) v[i] = round_to_bf16(v[i]);
    if (p.name == skip) continue;
    if (!bf16) {
      tensors.push_back({p.name, p.value});
      continue;
    }
    Tensor b(DType::kBF16, p.value.shape());
    for (int64_t i = 0; i < p.value.numel(); ++i) b.data<uint16_t>()[i] = f32_to_bf16_bits(v[i]);
    tensors.push_back({p.name, b});
  }
  if (extra) tensors.push_back({"model.unused.weight", Tensor(DType::kF32, Shape{4})});
  NIB_CHECK(io::write_safetensors(path, tensors).is_ok());
  return m;
}

EngineOptions options(PrecisionMode mode) {
  EngineOptions o;
  o.mode = mode;
  o.max_batch = 4;
  return o;
}

// Two greedy prompts of different lengths and one sampled prompt with G = 2.
std::vector<Request> requests(int64_t vocab) {
  std::vector<Request> rs = test::greedy_requests(vocab, 3);
  rs[2].params.sampling = SamplingParams{0.9, 0, 0.95};
  rs[2].params.seed = 17;
  rs[2].params.num_samples = 2;
  return rs;
}

void expect_same_generation(Engine& want_engine, Engine& got_engine, int64_t vocab) {
  auto want = want_engine.generate(requests(vocab));
  auto got = got_engine.generate(requests(vocab));
  ASSERT_TRUE(want.is_ok()) << want.status().message();
  ASSERT_TRUE(got.is_ok()) << got.status().message();
  ASSERT_EQ(want->size(), got->size());
  for (size_t i = 0; i < want->size(); ++i) {
    EXPECT_EQ((*want)[i].tokens, (*got)[i].tokens) << "completion " << i;
    EXPECT_EQ((*want)[i].logprobs, (*got)[i].logprobs) << "completion " << i;  // same function, same order
  }
}

TEST_F(CheckpointWeights, InferenceEngineEqualsTheTrainingModelPathInEveryMode) {
  struct Case {
    model::ModelConfig cfg;
    std::string recipe, layout;
    bool bf16;
  };
  // tetrajet-v2: two-level NVFP4 (1x16 + 1x128); nvfp4-nvidia: TE 16x16 weight tiles
  const std::vector<Case> cases{{dense_config(), "tetrajet-v2", "tetrajet-v2", true},
                                {moe_config(), "nvfp4-nvidia", "nvfp4-nvidia", false},
                                {moe_config(), "bf16", "bf16", true}};
  for (const Case& c : cases) {
    const std::string file = at(c.recipe + ".safetensors");
    auto trained = write_model_file(file, c.cfg, recipe(c.recipe), 5, c.bf16);
    const int64_t VC = c.cfg.vocab_size * c.cfg.hidden_size;
    for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
      SCOPED_TRACE(c.recipe + (c.bf16 ? " BF16 file " : " F32 file ") + precision_mode_name(mode));
      EngineOptions o = options(mode);
      o.recipe_name = weight_layout_recipe(*trained);
      EXPECT_EQ(o.recipe_name, c.layout);
      auto reference = Engine::create(*trained, o).value();
      o.recipe_name = "overwritten";
      auto ie = load_inference_engine(c.cfg, recipe(c.recipe), file, o, backend::cpu_backend());
      ASSERT_TRUE(ie.is_ok()) << ie.status().message();
      EXPECT_EQ(ie->engine->options().recipe_name, c.layout);
      EXPECT_EQ(ie->model->storage(), model::ParameterStorage::kInference);
      expect_same_generation(*reference, *ie->engine, c.cfg.vocab_size);
      const EngineMemory mem = ie->engine->memory(), ref = reference->memory();
      EXPECT_EQ(mem.master_weights, 0);
      EXPECT_EQ(mem.gradients, 0);
      EXPECT_GT(ref.master_weights, 0);
      EXPECT_EQ(mem.packed_weights, ref.packed_weights);
      EXPECT_EQ(mem.high_precision_weights, ref.high_precision_weights - 4 * VC);  // no FP32 lm_head
    }
  }
  // the recipe mode runs the training model's own recipes
  auto recipe_mode = load_inference_engine(dense_config(), recipe("bf16"), at("tetrajet-v2.safetensors"),
                                           options(PrecisionMode::kRecipe), backend::cpu_backend());
  EXPECT_FALSE(recipe_mode.is_ok());
}

// Weights arrive one tensor at a time on the device side too: loading adds to the engine's
// final memory at most one FP32 linear being uploaded and its BF16-rounded copy (2 x 4 N K of
// the largest linear), never the model's FP32 weights (a fresh CPU backend counts every byte).
TEST_F(CheckpointWeights, LoadingHoldsOneLinearOfScratch) {
  const model::ModelConfig cfg = moe_config();
  write_model_file(at("m.safetensors"), cfg, recipe("bf16"), 5, /*bf16=*/false);
  auto be = backend::make_backend("cpu").value();
  auto m = model::Model::create(cfg, recipe("bf16"), be.get(), model::ParameterStorage::kInference).value();
  auto e = Engine::create(*m, options(PrecisionMode::kW4A16)).value();
  const int64_t before = be->memory_stats().in_use_bytes;
  be->reset_peak_memory();
  ASSERT_TRUE(e->load_weights(at("m.safetensors")).is_ok());
  int64_t largest = 0, all = 0;
  for (const model::LinearInfo& i : m->linear_infos()) largest = std::max(largest, i.N * i.K), all += i.N * i.K;
  EXPECT_LE(be->memory_stats().peak_bytes - before, 2 * 4 * largest + 128);  // (64-byte rounding of two buffers)
  EXPECT_LT(2 * 4 * largest, 4 * all / 4);  // the bound is far from the linears' FP32 bytes
}

// Bad files, each a one-line kDataLoss naming the file (and the tensor) that leaves a loaded
// engine as it was: every file but the truncated one holds other weights (seed 9) in all the
// tensors it has, so a loader that wrote anything before failing would change the tokens.
TEST_F(CheckpointWeights, BadFilesAreOneLineErrorsThatChangeNothing) {
  const model::ModelConfig cfg = moe_config();
  auto trained = write_model_file(at("good.safetensors"), cfg, recipe("bf16"), 5, false);
  const std::string last_member = "model.layers.2.mlp.shared_expert.down_proj.weight";
  struct Bad {
    std::string file, skip, names;  // names: the tensor the message must name ("" none)
    bool extra = false;
  };
  const std::vector<Bad> bad{{"no_member.safetensors", last_member, last_member},
                             {"no_norm.safetensors", "model.norm.weight", "model.norm.weight"},
                             {"no_head.safetensors", "lm_head.weight", "lm_head.weight"},
                             {"extra.safetensors", "", "", true},
                             {"truncated.safetensors", "", ""}};
  for (const Bad& b : bad) write_model_file(at(b.file), cfg, recipe("bf16"), 9, false, b.skip, b.extra);
  {  // a tensor of the wrong shape (the config does not match), and one of an unreadable dtype
    auto m9 = model::Model::create(cfg, recipe("bf16")).value();
    std::vector<io::NamedTensor> shape, dtype;
    for (model::Parameter& p : m9->parameters()) {
      const bool o = p.name == "model.layers.1.self_attn.o_proj.weight";
      shape.push_back({p.name, o ? Tensor(DType::kF32, Shape{p.value.dim(1), p.value.dim(0)}) : p.value});
      dtype.push_back({p.name, o ? Tensor(DType::kI32, p.value.shape()) : p.value});
    }
    ASSERT_TRUE(io::write_safetensors(at("shape.safetensors"), shape).is_ok());
    ASSERT_TRUE(io::write_safetensors(at("dtype.safetensors"), dtype).is_ok());
  }
  fs::resize_file(at("truncated.safetensors"), fs::file_size(at("truncated.safetensors")) - 100);
  for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A4}) {
    EngineOptions o = options(mode);
    auto reference = Engine::create(*trained, o).value();
    auto ie = load_inference_engine(cfg, recipe("bf16"), at("good.safetensors"), o, backend::cpu_backend());
    ASSERT_TRUE(ie.is_ok()) << ie.status().message();
    std::vector<std::pair<std::string, std::string>> files;  // (file, tensor named)
    for (const Bad& b : bad) files.push_back({b.file, b.names});
    files.push_back({"shape.safetensors", "model.layers.1.self_attn.o_proj.weight"});
    files.push_back({"dtype.safetensors", "model.layers.1.self_attn.o_proj.weight"});
    files.push_back({"missing.safetensors", ""});
    for (const auto& named : files) {
      const std::string& file = named.first;
      const std::string& tensor = named.second;
      SCOPED_TRACE(file + " " + precision_mode_name(mode));
      const Status s = ie->engine->load_weights(at(file));
      ASSERT_FALSE(s.is_ok());
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.message();
      EXPECT_EQ(s.message().find('\n'), std::string::npos) << s.message();
      EXPECT_NE(s.message().find(at(file)), std::string::npos) << s.message();
      if (!tensor.empty()) {
        EXPECT_NE(s.message().find(tensor), std::string::npos) << s.message();
      }
    }
    expect_same_generation(*reference, *ie->engine, cfg.vocab_size);
  }
}

}  // namespace
}  // namespace nibble::rollout
