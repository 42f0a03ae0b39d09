// The inference-only engine model (issue #15 item 4): a model of inference storage keeps no
// gradients and no FP32 block linears, its weights arrive tensor by tensor, and the engine holds
// the same bits and generates the same tokens as the training-storage path for the same seed;
// the engine's memory by kind equals the packed-size formula plus the high-precision tensors and
// accounts for every byte the backend holds; the training-only entry points refuse it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/check.h"
#include "core/philox.h"
#include "model/config.h"
#include "rollout/engine.h"
#include "rollout/engine_test_util.h"

namespace nibble::rollout {
namespace {

using model::ParameterStorage;
using test::greedy_requests;
using test::mixed_moe_config;

model::ModelConfig config_file(const std::string& name) {
  auto cfg = model::load_model_config(std::string(NIBBLE_SOURCE_DIR) + "/configs/" + name);
  NIB_CHECK_MSG(cfg.is_ok(), "{}", cfg.status().message());
  return cfg.value();
}

std::unique_ptr<model::Model> make_model(const model::ModelConfig& cfg, backend::Backend& be, ParameterStorage s) {
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto m = model::Model::create(cfg, rc, &be, s);
  NIB_CHECK_MSG(m.is_ok(), "{}", m.status().message());
  return std::move(m).value();
}

// num_pages 0: the default (room for max_batch + 1 sequences over the whole context)
std::unique_ptr<Engine> make_engine(model::Model& m, PrecisionMode mode, int64_t num_pages = 0) {
  EngineOptions o;
  o.mode = mode;
  o.max_batch = 2;
  o.num_pages = num_pages;
  auto e = Engine::create(m, o);
  NIB_CHECK_MSG(e.is_ok(), "{}", e.status().message());
  return std::move(e).value();
}

std::vector<uint8_t> host_bytes(backend::Backend& be, const void* p, int64_t n) {
  std::vector<uint8_t> h(static_cast<size_t>(n));
  be.copy_to_host(h.data(), p, h.size());
  return h;
}

// Today's path (a training-storage model: init_weights, then the engine quantizes its master
// weights) against the new one (inference storage, weights drawn and quantized per tensor): every
// code, block scale and outer scale equal, the kept parameters equal, and the same greedy tokens
// and log-probs, in every mode, for the dense OLMo-2 and the mixed MoE model.
TEST(EngineMemory, PerTensorWeightsOfAnInferenceModelAreTheTrainingPathsBits) {
  const std::vector<model::ModelConfig> configs{mixed_moe_config(), test::dense_olmo_config()};
  backend::Backend& be = backend::cpu_backend();
  for (const model::ModelConfig& cfg : configs)
    for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
      SCOPED_TRACE(std::string(cfg.arch == model::Architecture::kOlmo2 ? "olmo2 " : "moe ") + precision_mode_name(mode));
      auto trained = make_model(cfg, be, ParameterStorage::kTraining);
      trained->init_weights(11);
      auto reference = make_engine(*trained, mode);
      auto lean = make_model(cfg, be, ParameterStorage::kInference);
      auto engine = make_engine(*lean, mode);
      ASSERT_TRUE(engine->init_random_weights(11).is_ok());
      if (mode != PrecisionMode::kBf16)
        for (const model::LinearInfo& info : lean->linear_infos()) {
          const backend::QuantizedTensor& a = reference->linears()->quantized_weight(info.id);
          const backend::QuantizedTensor& b = engine->linears()->quantized_weight(info.id);
          using backend::QuantizedTensor;
          const int64_t cb = QuantizedTensor::code_bytes(a.format, a.rows, a.cols);
          const int64_t sb = QuantizedTensor::scale_bytes(a.format, a.rows, a.cols);
          const int64_t ob = 4 * QuantizedTensor::outer_count(a.format, a.rows, a.cols);
          ASSERT_EQ(host_bytes(be, a.codes, cb), host_bytes(be, b.codes, cb)) << info.name;
          ASSERT_EQ(host_bytes(be, a.scales, sb), host_bytes(be, b.scales, sb)) << info.name;
          ASSERT_EQ(host_bytes(be, a.outer, ob), host_bytes(be, b.outer, ob)) << info.name;
        }
      for (size_t i = 0; i < lean->param_refs().size(); ++i) {
        const model::ParamRef<float>& p = lean->param_refs()[i];
        if (p.value == nullptr) continue;  // a block linear's member
        ASSERT_EQ(host_bytes(be, p.value, 4 * p.numel), host_bytes(be, trained->param_refs()[i].value, 4 * p.numel))
            << p.name;
      }
      const std::vector<Request> rs = greedy_requests(cfg.vocab_size);
      auto want = reference->generate(rs);
      auto got = engine->generate(rs);
      ASSERT_TRUE(want.is_ok() && got.is_ok());
      ASSERT_EQ(want->size(), got->size());
      for (size_t i = 0; i < want->size(); ++i) {
        EXPECT_EQ((*want)[i].tokens, (*got)[i].tokens);
        EXPECT_EQ((*want)[i].logprobs, (*got)[i].logprobs);  // the same bits: same function, same order
      }
    }
}

// The fast uniform init of the decode benchmark (Engine::WeightInit::kUniform): each block linear
// holds exactly what set_linear_weight makes of the documented draw, written here from its
// definition (element e of linear id: Philox word e%4 of block (stream 0x1417 + id, offset e/4),
// its top 24 bits u, value (2 u / 2^24 - 1) sqrt(3) sigma); the other tensors are the training
// init's; the draw has the normal's standard deviation sigma (a uniform of half-width sqrt(3) sigma
// has std sigma; the sample std of n >= 16 K elements is within 2% of it, the relative standard
// error being sqrt(0.2 / n) <= 0.35%: a ~6-sigma margin); a training-storage model refuses it.
TEST(EngineMemory, UniformInitIsTheDocumentedDrawQuantizedAsItArrives) {
  const model::ModelConfig cfg = mixed_moe_config();
  backend::Backend& be = backend::cpu_backend();
  auto lean = make_model(cfg, be, ParameterStorage::kInference);
  auto engine = make_engine(*lean, PrecisionMode::kW4A16);
  ASSERT_TRUE(engine->init_random_weights(5, Engine::WeightInit::kUniform).is_ok());
  auto lean2 = make_model(cfg, be, ParameterStorage::kInference);
  auto reference = make_engine(*lean2, PrecisionMode::kW4A16);
  ASSERT_TRUE(reference->init_random_weights(5).is_ok());  // the kept tensors: the training init's
  const double sigma = cfg.initializer_range;
  for (const model::LinearInfo& info : lean->linear_infos()) {
    const int64_t n = info.N * info.K;
    std::vector<float> w(static_cast<size_t>(n));
    double sum2 = 0;
    for (int64_t e = 0; e < n; ++e) {
      const double u = philox_uniform(5, 0x1417u + static_cast<uint64_t>(info.id), static_cast<uint64_t>(e));
      w[static_cast<size_t>(e)] = static_cast<float>((2 * u - 1) * static_cast<float>(std::sqrt(3.0) * sigma));
      sum2 += static_cast<double>(w[static_cast<size_t>(e)]) * w[static_cast<size_t>(e)];
    }
    if (n >= 16384) EXPECT_NEAR(std::sqrt(sum2 / static_cast<double>(n)), sigma, 0.02 * sigma) << info.name;
    ASSERT_TRUE(reference->set_linear_weight(info.id, w.data()).is_ok());
    const backend::QuantizedTensor& a = reference->linears()->quantized_weight(info.id);
    const backend::QuantizedTensor& b = engine->linears()->quantized_weight(info.id);
    using backend::QuantizedTensor;
    const int64_t cb = QuantizedTensor::code_bytes(a.format, a.rows, a.cols);
    const int64_t sb = QuantizedTensor::scale_bytes(a.format, a.rows, a.cols);
    ASSERT_EQ(host_bytes(be, a.codes, cb), host_bytes(be, b.codes, cb)) << info.name;
    ASSERT_EQ(host_bytes(be, a.scales, sb), host_bytes(be, b.scales, sb)) << info.name;
  }
  for (size_t i = 0; i < lean->param_refs().size(); ++i) {
    const model::ParamRef<float>& p = lean->param_refs()[i];
    if (p.value == nullptr) continue;
    ASSERT_EQ(host_bytes(be, p.value, 4 * p.numel), host_bytes(be, lean2->param_refs()[i].value, 4 * p.numel)) << p.name;
  }
  auto trained = make_model(cfg, be, ParameterStorage::kTraining);
  auto e_train = make_engine(*trained, PrecisionMode::kW4A16);
  const Status st = e_train->init_random_weights(5, Engine::WeightInit::kUniform);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("inference storage"), std::string::npos) << st.message();
}

// Weights of the block linears in the mode's storage, by the format's size formula: codes N K / 2,
// E4M3 block scales N K / 16, FP32 outer scales 4 N ceil(K / 128) (two-level); BF16: 2 N K.
int64_t packed_formula(const model::Model& m, PrecisionMode mode) {
  int64_t b = 0;
  for (const model::LinearInfo& i : m.linear_infos())
    b += mode == PrecisionMode::kBf16 ? 2 * i.N * i.K : i.N * i.K / 2 + i.N * i.K / 16 + 4 * i.N * ((i.K + 127) / 128);
  return b;
}

// Elements of the parameters outside the block linears (embedding, norms, routers, lm_head),
// counted from the config.
int64_t high_precision_elements(const model::ModelConfig& c) {
  const bool olmo = c.arch == model::Architecture::kOlmo2;
  const int64_t C = c.hidden_size, L = c.num_hidden_layers;
  int64_t n = 2 * c.vocab_size * C + C;  // embedding, lm_head, final norm
  for (int64_t l = 0; l < L; ++l) {
    n += olmo ? c.q_width() + c.kv_width() + 2 * C : 2 * c.head_dim + 2 * C;  // QK norms, 2 layer norms
    if (c.is_moe_layer(l)) n += c.num_experts * C;                             // router
  }
  return n;
}

// The engine's memory by kind, on a fresh CPU backend that counts every allocation: the packed
// weights are the formula's bytes exactly (Buffers allocate what they are asked), the
// high-precision weights are the FP32 tensors outside the block linears but the lm_head, plus
// the lm_head's BF16 bits (its only copy: the model keeps no FP32 lm_head), no gradient and no
// master byte exists, and the kinds add up to every byte
// the backend holds (up to its 64-byte rounding), before and after a generation grows the
// workspace. tiny-moe runs a
// generation; olmo2-70m (a mid-size config, 25 M FP32 block-linear weights that an inference
// model never allocates) is checked right after creation, without weights (no generation: a
// waiting linear is an error). The training-storage model of tiny-moe reports its master
// weights and gradients (4 bytes per element each) under the same accounting.
TEST(EngineMemory, BytesByKindFollowTheFormulaAndCoverTheBackend) {
  for (const std::string file : {"tiny-moe.json", "olmo2-70m.json"})
    for (PrecisionMode mode : {PrecisionMode::kW4A16, PrecisionMode::kBf16}) {
      SCOPED_TRACE(file + " " + precision_mode_name(mode));
      const model::ModelConfig cfg = config_file(file);
      const bool small = file == "tiny-moe.json";
      auto be = backend::make_backend("cpu").value();
      auto m = make_model(cfg, *be, ParameterStorage::kInference);
      auto e = make_engine(*m, mode, /*num_pages=*/64);
      const int64_t V = cfg.vocab_size, C = cfg.hidden_size;
      auto check = [&]() {
        const EngineMemory mem = e->memory();
        EXPECT_EQ(mem.packed_weights, packed_formula(*m, mode));
        EXPECT_EQ(mem.high_precision_weights, 4 * (high_precision_elements(cfg) - V * C) + 2 * V * C);
        EXPECT_TRUE(e->lm_head_held());
        EXPECT_EQ(m->find_param("lm_head.weight")->value, nullptr);
        EXPECT_EQ(mem.master_weights, 0);
        EXPECT_EQ(mem.gradients, 0);
        EXPECT_EQ(m->gradient_bytes(), 0);
        EXPECT_GT(mem.kv_pages, 0);
        // the CPU backend rounds each allocation up to 64 bytes: it holds the kinds' sum plus
        // less than 64 bytes per buffer (at most 3 per linear: codes, scales, outer; ~40 others)
        const int64_t held = be->memory_stats().in_use_bytes;
        EXPECT_GE(held, mem.total());
        EXPECT_LT(held - mem.total(), 64 * (3 * static_cast<int64_t>(m->linear_infos().size()) + 40));
      };
      check();
      for (const model::LinearInfo& info : m->linear_infos()) EXPECT_EQ(m->linear_weight(info.id), nullptr);
      if (!small) continue;
      ASSERT_TRUE(e->init_random_weights(5).is_ok());
      auto out = e->generate(greedy_requests(V));

      ASSERT_TRUE(out.is_ok()) << out.status().message();
      EXPECT_GT(e->memory().workspace, 0);
      check();
    }
  // the training path: the same packed weights, plus master weights and gradients
  const model::ModelConfig cfg = config_file("tiny-moe.json");
  auto be = backend::make_backend("cpu").value();
  auto m = make_model(cfg, *be, ParameterStorage::kTraining);
  auto e = make_engine(*m, PrecisionMode::kW4A16);
  int64_t linear_elements = 0;
  for (const model::LinearInfo& i : m->linear_infos()) linear_elements += i.N * i.K;
  const EngineMemory mem = e->memory();
  EXPECT_EQ(mem.packed_weights, packed_formula(*m, PrecisionMode::kW4A16));
  EXPECT_EQ(mem.master_weights, 4 * linear_elements);
  EXPECT_EQ(mem.gradients, 4 * (linear_elements + high_precision_elements(cfg)));
  EXPECT_GE(be->memory_stats().in_use_bytes, mem.total());
  EXPECT_LT(be->memory_stats().in_use_bytes - mem.total(), 64 * (3 * static_cast<int64_t>(m->linear_infos().size()) + 40));
}

// Per tensor, also on the device side: while the weights arrive, the backend holds the engine's
// final memory plus at most one FP32 tensor being uploaded and its BF16-rounded copy (2 x 4 N K
// of the largest linear), never the model's FP32 weights. The inference model's activations are
// one layer's set shared by all layers and two residual streams, without backward scratch: for
// tiny-moe's 4 layers less than a third of the training model's for the same generation.
TEST(EngineMemory, WeightsArriveWithOneTensorOfScratchAndLayersShareActivations) {
  const model::ModelConfig cfg = config_file("tiny-moe.json");
  auto be = backend::make_backend("cpu").value();
  auto m = make_model(cfg, *be, ParameterStorage::kInference);
  auto e = make_engine(*m, PrecisionMode::kW4A16);
  const int64_t before = be->memory_stats().in_use_bytes;
  be->reset_peak_memory();
  ASSERT_TRUE(e->init_random_weights(5).is_ok());
  int64_t largest = 0, all = 0;
  for (const model::LinearInfo& i : m->linear_infos()) largest = std::max(largest, i.N * i.K), all += i.N * i.K;
  // (64-byte rounding of the two scratch buffers aside)
  EXPECT_LE(be->memory_stats().in_use_bytes - before, 2 * 4 * largest + 128);
  EXPECT_LE(be->memory_stats().peak_bytes - before, 2 * 4 * largest + 128);
  EXPECT_LT(2 * 4 * largest, 4 * all / 8);  // the bound above is far from the whole model's

  auto trained = make_model(cfg, backend::cpu_backend(), ParameterStorage::kTraining);
  trained->init_weights(5);
  auto e_train = make_engine(*trained, PrecisionMode::kW4A16);
  ASSERT_TRUE(e->generate(greedy_requests(cfg.vocab_size)).is_ok());
  ASSERT_TRUE(e_train->generate(greedy_requests(cfg.vocab_size)).is_ok());
  EXPECT_GT(m->activation_bytes(), 0);
  EXPECT_LT(3 * m->activation_bytes(), trained->activation_bytes());
}

// What an inference model refuses: the training and eval entry points (one-line CheckErrors),
// the recipe mode, re-quantizing master weights it does not have, generating before every weight
// arrived (the error names the linear, then the lm_head), a weight for a linear that does not
// exist.
TEST(EngineMemory, InferenceModelRefusesWhatNeedsMasterWeights) {
  const model::ModelConfig cfg = mixed_moe_config();
  auto m = make_model(cfg, backend::cpu_backend(), ParameterStorage::kInference);
  std::vector<int32_t> tokens{1, 2, 3, 4}, targets{2, 3, 4, 5};
  EXPECT_THROW(m->forward_backward(tokens.data(), targets.data(), 1, 4), CheckError);
  EXPECT_THROW(m->forward_loss(tokens.data(), targets.data(), 1, 4), CheckError);
  EXPECT_THROW(m->zero_grad(), CheckError);
  std::vector<float> host(static_cast<size_t>(m->num_params()));
  EXPECT_THROW(m->download_parameters(host.data()), CheckError);
  EngineOptions recipe;
  recipe.mode = PrecisionMode::kRecipe;
  EXPECT_FALSE(Engine::create(*m, recipe).is_ok());
  auto e = make_engine(*m, PrecisionMode::kW4A16);
  EXPECT_FALSE(e->refresh_weights().is_ok());
  auto early = e->generate(greedy_requests(cfg.vocab_size));
  ASSERT_FALSE(early.is_ok());
  EXPECT_NE(early.status().message().find(m->linear_infos()[0].name), std::string::npos) << early.status().message();
  const model::LinearInfo& last = m->linear_infos().back();
  std::vector<float> w(static_cast<size_t>(last.N * last.K), 0.25f);
  EXPECT_FALSE(e->set_linear_weight(static_cast<int>(m->linear_infos().size()), w.data()).is_ok());
  // all but the last linear: still refused, naming the last one
  for (const model::LinearInfo& info : m->linear_infos()) {
    if (info.id == last.id) continue;
    std::vector<float> wi(static_cast<size_t>(info.N * info.K), 0.25f);
    ASSERT_TRUE(e->set_linear_weight(info.id, wi.data()).is_ok());
  }
  auto still = e->generate(greedy_requests(cfg.vocab_size));
  ASSERT_FALSE(still.is_ok());
  EXPECT_NE(still.status().message().find(last.name), std::string::npos) << still.status().message();
  ASSERT_TRUE(e->set_linear_weight(last.id, w.data()).is_ok());
  auto no_head = e->generate(greedy_requests(cfg.vocab_size));  // the lm_head's BF16 bits are still missing
  ASSERT_FALSE(no_head.is_ok());
  EXPECT_NE(no_head.status().message().find("lm_head"), std::string::npos) << no_head.status().message();
  std::vector<float> head(static_cast<size_t>(cfg.vocab_size * cfg.hidden_size), 0.125f);
  ASSERT_TRUE(e->set_lm_head_weight(head.data()).is_ok());
  EXPECT_TRUE(e->generate(greedy_requests(cfg.vocab_size)).is_ok());
}

// The lm_head's copies: an inference model whose lm_head runs on BF16 operands (every recipe but
// fp32) keeps no FP32 lm_head and the engine holds its BF16 bits alone, made from a weight as the
// snapshot of a training model's lm_head is (the same bits: the same greedy tokens and log-probs,
// which the per-tensor test above also checks through init_random_weights). The fp32 recipe's
// lm_head GEMM reads FP32 operands, so there the model keeps the FP32 weight (written as any
// kept parameter), the engine holds no bits and set_lm_head_weight is refused. A training model
// keeps both (its lm_head changes with training; the snapshot is refreshed with the weights).
TEST(EngineMemory, LmHeadIsKeptOnlyAsTheBitsItsGemmReads) {
  const model::ModelConfig cfg = mixed_moe_config();
  const int64_t VC = cfg.vocab_size * cfg.hidden_size;
  std::vector<float> head(static_cast<size_t>(VC));
  for (int64_t i = 0; i < VC; ++i) head[static_cast<size_t>(i)] = 0.3f * std::sin(0.37f * static_cast<float>(i)) + 1e-4f;
  auto trained = make_model(cfg, backend::cpu_backend(), ParameterStorage::kTraining);
  trained->init_weights(3);
  std::memcpy(trained->find_param("lm_head.weight")->value, head.data(), head.size() * sizeof(float));
  auto reference = make_engine(*trained, PrecisionMode::kBf16);  // snapshots the FP32 lm_head
  EXPECT_FALSE(reference->lm_head_held());
  EXPECT_FALSE(reference->set_lm_head_weight(head.data()).is_ok());
  auto lean = make_model(cfg, backend::cpu_backend(), ParameterStorage::kInference);
  auto engine = make_engine(*lean, PrecisionMode::kBf16);
  ASSERT_TRUE(engine->init_random_weights(3).is_ok());  // then the lm_head replaced
  ASSERT_TRUE(engine->set_lm_head_weight(head.data()).is_ok());
  EXPECT_EQ(lean->find_param("lm_head.weight")->value, nullptr);
  const EngineMemory mem = engine->memory();
  EXPECT_EQ(mem.high_precision_weights + 4 * VC, reference->memory().high_precision_weights);  // FP32 copy gone
  auto want = reference->generate(greedy_requests(cfg.vocab_size));
  auto got = engine->generate(greedy_requests(cfg.vocab_size));
  ASSERT_TRUE(want.is_ok() && got.is_ok());
  for (size_t i = 0; i < want->size(); ++i) {
    EXPECT_EQ((*want)[i].tokens, (*got)[i].tokens);
    EXPECT_EQ((*want)[i].logprobs, (*got)[i].logprobs);
  }
  model::RecipeConfig fp32;
  fp32.name = "fp32";
  auto m32 = model::Model::create(cfg, fp32, &backend::cpu_backend(), ParameterStorage::kInference).value();
  EXPECT_NE(m32->find_param("lm_head.weight")->value, nullptr);
  auto e32 = make_engine(*m32, PrecisionMode::kBf16);
  EXPECT_FALSE(e32->lm_head_held());
  EXPECT_FALSE(e32->set_lm_head_weight(head.data()).is_ok());
  EXPECT_EQ(e32->memory().high_precision_weights, 4 * high_precision_elements(cfg));  // no BF16 copy
  ASSERT_TRUE(e32->init_random_weights(3).is_ok());
  EXPECT_TRUE(e32->generate(greedy_requests(cfg.vocab_size)).is_ok());
}

}  // namespace
}  // namespace nibble::rollout
