// The rollout engine on the device backend against the CPU (issue #15 §6): the same tiny OLMo-2
// weights on both, greedy decoding in the bf16 mode with BF16, FP8 or NVFP4 KV pages gives the
// same tokens and log-probs within the tolerance derived in engine_test.cpp (the backends sum
// GEMMs and the paged attention in other orders, and a BF16 rounding of an activation may fall on
// the other side); the w4a16 weights are the same bits (the quantizers are bit-exact across
// backends); every page comes back. Sampled decoding may differ where the two backends' logits
// straddle a sampling boundary, and the 4-bit modes where an activation or output rounds
// differently; both only through those summation-order differences. Skips without a device
// (NIBBLE_ENGINE_TEST_DEVICE=cpu runs the cases CPU against CPU in a CPU-only build too). Also the
// inference-only model (issue #15 item 4) on the device against the CPU training path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/tiny_olmo2_test_util.h"
#include "rollout/engine.h"

#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace nibble::rollout {
namespace {

std::unique_ptr<backend::Backend> make_device_backend(std::string* why) {
  if (const char* kind = std::getenv("NIBBLE_ENGINE_TEST_DEVICE"); kind && std::string(kind) == "cpu")
    return backend::make_backend("cpu").value();
#ifdef NIBBLE_HAVE_CUDA
  cuda::register_cuda_backend();
  auto r = backend::make_backend("cuda");
  if (r.is_ok()) return std::move(r).value();
  *why = "no CUDA device: " + r.status().message();
#else
  *why = "built without the CUDA backend (NIBBLE_CUDA=OFF)";
#endif
  return nullptr;
}

// The tiny model of engine_test.cpp (std 0.3 weights) on backend `be`, weights copied from `from`
// when given.
model::ModelConfig tiny_config() {
  nlohmann::json j = model::test::tiny_olmo2_model_json(48);
  j["initializer_range"] = 0.3;
  auto cfg = model::parse_model_config(j);
  EXPECT_TRUE(cfg.is_ok());
  return cfg.value();
}

std::unique_ptr<model::Model> tiny_olmo(backend::Backend* be, model::Model* from = nullptr) {
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto m = model::Model::create(tiny_config(), rc, be);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  if (from) {
    std::vector<float> host(static_cast<size_t>(from->num_params()));
    from->download_parameters(host.data());
    m.value()->upload_parameters(host.data());
  } else {
    m.value()->init_weights(7);
  }
  return std::move(m).value();
}

std::vector<Request> greedy_requests() {
  std::vector<Request> reqs;
  for (int i = 0; i < 3; ++i) {
    Request r;
    for (int t = 0; t < 3 + 5 * i; ++t) r.prompt.push_back(static_cast<int32_t>((t * 7 + i * 13 + 1) % 48));
    r.params.sampling.temperature = 0;
    r.params.max_new_tokens = 24;
    r.id = static_cast<uint64_t>(i);
    reqs.push_back(std::move(r));
  }
  return reqs;
}

// Greedy decoding with options `o` on the CPU model and the device model (same weights): the same
// tokens, log-probs within the bf16 tolerance of engine_test.cpp, every device page back.
void expect_same_greedy_tokens(model::Model& cpu_model, model::Model& dev_model, const EngineOptions& o) {
  auto ce = Engine::create(cpu_model, o);
  auto de = Engine::create(dev_model, o);
  ASSERT_TRUE(ce.is_ok()) << ce.status().message();
  ASSERT_TRUE(de.is_ok()) << de.status().message();
  auto c = (*ce)->generate(greedy_requests());
  auto d = (*de)->generate(greedy_requests());
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  ASSERT_TRUE(d.is_ok()) << d.status().message();
  ASSERT_EQ(c->size(), d->size());
  for (size_t i = 0; i < c->size(); ++i) {
    EXPECT_EQ((*c)[i].tokens, (*d)[i].tokens) << "request " << i << " on " << dev_model.backend().name();
    for (size_t t = 0; t < std::min((*c)[i].logprobs.size(), (*d)[i].logprobs.size()); ++t)
      EXPECT_NEAR((*c)[i].logprobs[t], (*d)[i].logprobs[t], 0.05) << "request " << i << " token " << t;
  }
  EXPECT_EQ((*de)->cache().free_pages(), (*de)->cache().num_pages());
}

// Every quantized weight of the device engine `de` (on `dev`) equals the CPU engine's bit for bit.
void expect_same_weight_bits(const Engine& ce, const Engine& de, backend::Backend& dev, const model::Model& m) {
  for (const model::LinearInfo& info : m.linear_infos()) {
    const backend::QuantizedTensor& a = ce.linears()->quantized_weight(info.id);
    const backend::QuantizedTensor& b = de.linears()->quantized_weight(info.id);
    const int64_t cb = backend::QuantizedTensor::code_bytes(a.format, a.rows, a.cols);
    const int64_t sb = backend::QuantizedTensor::scale_bytes(a.format, a.rows, a.cols);
    const int64_t ob = backend::QuantizedTensor::outer_count(a.format, a.rows, a.cols);
    std::vector<uint8_t> codes(cb), scales(sb);
    std::vector<float> outer(ob);
    dev.copy_to_host(codes.data(), b.codes, cb);
    dev.copy_to_host(scales.data(), b.scales, sb);
    dev.copy_to_host(outer.data(), b.outer, ob * sizeof(float));
    ASSERT_EQ(std::memcmp(codes.data(), a.codes, cb), 0) << info.name;
    ASSERT_EQ(std::memcmp(scales.data(), a.scales, sb), 0) << info.name;
    ASSERT_EQ(std::memcmp(outer.data(), a.outer, ob * sizeof(float)), 0) << info.name;
  }
}

TEST(RolloutEngineDevice, GreedyBf16TokensMatchTheCpu) {
  std::string why;
  auto dev = make_device_backend(&why);
  if (!dev) GTEST_SKIP() << why;
  auto cpu_model = tiny_olmo(&backend::cpu_backend());
  auto dev_model = tiny_olmo(dev.get(), cpu_model.get());
  EngineOptions o;
  o.mode = PrecisionMode::kBf16;
  o.page_size = 8;
  expect_same_greedy_tokens(*cpu_model, *dev_model, o);
}

// FP8 / NVFP4 pages: both backends quantize with the same codec (kv_page_codec.h, bit-exact in the
// op suite), so the pages differ only where a K/V element's FP32 value (different GEMM orders)
// crosses a rounding boundary of the format; the greedy tokens agree wherever the logits do, and
// the log-probs within the bf16 tolerance (a flipped code moves a score by about the format's step,
// rare at these sizes). Also the w4a16 mode, whose decode steps take the packed-weight GEMM.
TEST(RolloutEngineDevice, GreedyTokensWithQuantizedKvPagesMatchTheCpu) {
  std::string why;
  auto dev = make_device_backend(&why);
  if (!dev) GTEST_SKIP() << why;
  auto cpu_model = tiny_olmo(&backend::cpu_backend());
  auto dev_model = tiny_olmo(dev.get(), cpu_model.get());
  for (backend::KvPageFormat f : {backend::KvPageFormat::kFp8, backend::KvPageFormat::kNvfp4})
    for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16}) {
      SCOPED_TRACE(std::string(backend::kv_page_format_name(f)) + " " + precision_mode_name(mode));
      EngineOptions o;
      o.mode = mode;
      o.recipe_name = "tetrajet-v2";
      o.kv_format = f;
      o.page_size = 8;
      expect_same_greedy_tokens(*cpu_model, *dev_model, o);
    }
}

TEST(RolloutEngineDevice, W4A16WeightsAreTheSameBitsAsOnTheCpu) {
  std::string why;
  auto dev = make_device_backend(&why);
  if (!dev) GTEST_SKIP() << why;
  auto cpu_model = tiny_olmo(&backend::cpu_backend());
  auto dev_model = tiny_olmo(dev.get(), cpu_model.get());
  EngineOptions o;
  o.mode = PrecisionMode::kW4A16;
  o.recipe_name = "tetrajet-v2";
  auto ce = Engine::create(*cpu_model, o);
  auto de = Engine::create(*dev_model, o);
  ASSERT_TRUE(ce.is_ok() && de.is_ok());
  expect_same_weight_bits(**ce, **de, *dev, *cpu_model);
  auto d = (*de)->generate(greedy_requests());
  ASSERT_TRUE(d.is_ok()) << d.status().message();
  EXPECT_EQ((*de)->cache().free_pages(), (*de)->cache().num_pages());
}

// The inference-only model on the device (issue #15 item 4): no gradients, no FP32 block
// linears; the weights drawn per tensor on the host and quantized on the device are the CPU
// training path's bits (init_weights, then quantizing the master weights), the greedy w4a16
// tokens match within engine_test.cpp's bf16 tolerance, the memory by kind has no master or
// gradient bytes and does not exceed what the device backend holds.
TEST(RolloutEngineDevice, InferenceStorageWeightsPerTensorAreTheCpuTrainingPathsBits) {
  std::string why;
  auto dev = make_device_backend(&why);
  if (!dev) GTEST_SKIP() << why;
  auto cpu_model = tiny_olmo(&backend::cpu_backend());  // init_weights(7)
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto lean = model::Model::create(tiny_config(), rc, dev.get(), model::ParameterStorage::kInference);
  ASSERT_TRUE(lean.is_ok()) << lean.status().message();
  EngineOptions o;
  o.mode = PrecisionMode::kW4A16;
  o.recipe_name = "tetrajet-v2";
  o.page_size = 8;
  auto ce = Engine::create(*cpu_model, o);
  auto de = Engine::create(**lean, o);
  ASSERT_TRUE(ce.is_ok() && de.is_ok());
  ASSERT_TRUE((*de)->init_random_weights(7).is_ok());
  expect_same_weight_bits(**ce, **de, *dev, *cpu_model);
  auto c = (*ce)->generate(greedy_requests());
  auto d = (*de)->generate(greedy_requests());
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  ASSERT_TRUE(d.is_ok()) << d.status().message();
  for (size_t i = 0; i < c->size(); ++i) {
    EXPECT_EQ((*c)[i].tokens, (*d)[i].tokens) << "request " << i;
    for (size_t t = 0; t < std::min((*c)[i].logprobs.size(), (*d)[i].logprobs.size()); ++t)
      EXPECT_NEAR((*c)[i].logprobs[t], (*d)[i].logprobs[t], 0.05) << "request " << i << " token " << t;
  }
  EXPECT_EQ((*de)->cache().free_pages(), (*de)->cache().num_pages());
  const EngineMemory mem = (*de)->memory();
  EXPECT_EQ(mem.master_weights, 0);
  EXPECT_EQ(mem.gradients, 0);
  EXPECT_EQ(mem.packed_weights, (*de)->linears()->weight_bytes());
  const int64_t held = dev->memory_stats().in_use_bytes;
  if (held >= 0) {
    EXPECT_LE(mem.total(), held);
  }
}

}  // namespace
}  // namespace nibble::rollout
