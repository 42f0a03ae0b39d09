// Tests of the rollout engine on tiny OLMo-2 and Qwen3-MoE models (CPU): greedy decoding over the
// paged KV cache gives the tokens of the recompute-everything generation; sampled tokens' log-probs
// equal a teacher-forced training forward within a derived tolerance; mixed-length batches, prefix
// sharing and a cache too small for everything at once give each sequence's results alone; pages
// never leak; w4a16 weights are the trainer's quantizer bits; seeds reproduce and are independent
// of batch composition; bad inputs are one-line errors; the MoE routing hook sees the training
// forward's expert ids; with NVFP4 pages the training forward with the model's K/V step
// (Nvfp4KvQuantizer) gives the engine's log-probs, and that step runs in training forwards only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/bits.h"
#include "formats/quantize_cpu.h"
#include "model/config.h"
#include "model/tiny_olmo2_test_util.h"
#include "backend/profiling_backend.h"
#include "model/kv_quantizer.h"
#include "rollout/engine.h"

namespace nibble::rollout {
namespace {

using backend::KvPageFormat;

// Weights of std 0.3 (not the training init's 0.02) so the logits are spread and greedy argmaxes
// are not decided by rounding.
// On `be` (default the CPU; a profiling decorator in some tests below).
std::unique_ptr<model::Model> tiny_olmo(const std::string& recipe = "bf16", int64_t vocab = 48,
                                        backend::Backend& be = backend::cpu_backend()) {
  nlohmann::json j = model::test::tiny_olmo2_model_json(vocab);
  j["initializer_range"] = 0.3;
  auto cfg = model::parse_model_config(j);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().message();
  model::RecipeConfig rc;
  rc.name = recipe;
  auto m = model::Model::create(cfg.value(), rc, &be);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  m.value()->init_weights(7);
  return std::move(m).value();
}

std::unique_ptr<model::Model> tiny_moe() {
  nlohmann::json j = nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 40, "max_position_embeddings": 48, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [1],
    "initializer_range": 0.3})");
  auto cfg = model::parse_model_config(j);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().message();
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto m = model::Model::create(cfg.value(), rc);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  m.value()->init_weights(3);
  return std::move(m).value();
}

std::unique_ptr<Engine> make_engine(model::Model& m, EngineOptions o = {}) {
  auto e = Engine::create(m, o);
  EXPECT_TRUE(e.is_ok()) << e.status().message();
  return std::move(e).value();
}

std::vector<int32_t> prompt_of(int64_t n, int32_t salt, int64_t vocab = 48) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(static_cast<int32_t>((i * 7 + salt * 13 + 1) % vocab));
  return p;
}

// Today's generation: the whole context through the training forward for every token, argmax
// (lowest id on ties), as train::generate_tokens with temperature 0.
std::vector<int32_t> recompute_greedy(model::Model& m, std::vector<int32_t> seq, int64_t n) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> out;
  std::vector<float> logits;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t T = static_cast<int64_t>(seq.size());
    logits.resize(static_cast<size_t>(T * V));
    m.forward_logits(logits.data(), seq.data(), 1, T);
    const float* row = logits.data() + (T - 1) * V;
    int32_t best = 0;
    for (int32_t v = 1; v < V; ++v)
      if (row[v] > row[best]) best = v;
    seq.push_back(best);
    out.push_back(best);
  }
  return out;
}

// log_softmax(logits / t)[token] of every new token, teacher-forced through the training forward.
std::vector<double> teacher_forced_logprobs(model::Model& m, const std::vector<int32_t>& prompt,
                                            const std::vector<int32_t>& tokens, double t) {
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> seq(prompt);
  seq.insert(seq.end(), tokens.begin(), tokens.end() - 1);
  const int64_t T = static_cast<int64_t>(seq.size()), P = static_cast<int64_t>(prompt.size());
  std::vector<float> logits(static_cast<size_t>(T * V));
  m.forward_logits(logits.data(), seq.data(), 1, T);
  std::vector<double> lp;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const float* row = logits.data() + (P - 1 + static_cast<int64_t>(i)) * V;
    double mx = -INFINITY, z = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, row[v] / t);
    for (int64_t v = 0; v < V; ++v) z += std::exp(row[v] / t - mx);
    lp.push_back(row[tokens[i]] / t - mx - std::log(z));
  }
  return lp;
}

Request greedy_request(std::vector<int32_t> prompt, int64_t n) {
  Request r;
  r.prompt = std::move(prompt);
  r.params.sampling.temperature = 0;
  r.params.max_new_tokens = n;
  return r;
}

Request sampled_request(std::vector<int32_t> prompt, int64_t n, int64_t G, uint64_t seed, uint64_t id = 0) {
  Request r;
  r.prompt = std::move(prompt);
  r.params.sampling = SamplingParams{0.8, 0, 0.95};
  r.params.max_new_tokens = n;
  r.params.num_samples = G;
  r.params.seed = seed;
  r.id = id;
  return r;
}

// Tolerances. With the fp32 recipe, the engine's recipe mode and F32 pages, the engine and the
// training forward compute the same FP32 function and differ only in summation orders (GEMMs of
// another M, the paged attention's scalar loops against BLAS). A logit is a sum over C = 64
// products after 2 blocks; each reordered FP32 sum of n <= 128 terms moves its result by at most
// n u |terms| (u = 2^-24, 7.6e-6 relative), and the ~10 reordered ops per block compose to well
// under 1e-4 |logit| relative with logits |l| <= 8 here: |dl| <= 1e-3, and a log-prob moves by at
// most 2 max|dl| / t <= 2.5e-3 at t = 0.8.
// In the bf16 mode with BF16 pages against the bf16 recipe (whose training attention is BF16: the
// pages hold exactly the K/V it rounds to, and the paged op repeats its arithmetic), the
// differences are GEMM summation orders again, but a rounding step is no longer continuous: a
// linear's input element that differs in its last FP32 bits may round to the neighbouring BF16
// value (relative 2^-8 on that element). Even if every element moved so, the blocks carry ~2^-8
// |l| relative: |dl| <= 8 * 2^-8 * 0.6 (the norms' gain) ~ 0.02, |d logp| <= 2 |dl| / t = 0.05
// (measured here: ~1e-6, no element flips).
constexpr double kLogprobTolF32 = 2.5e-3;
constexpr double kLogprobTolBf16 = 0.05;

TEST(RolloutEngine, GreedyDecodeEqualsRecomputeGeneration) {
  auto m = tiny_olmo();
  for (KvPageFormat f : {KvPageFormat::kF32, KvPageFormat::kBf16}) {
    EngineOptions o;
    o.kv_format = f;
    o.page_size = 4;
    auto e = make_engine(*m, o);
    std::vector<Request> reqs{greedy_request(prompt_of(1, 1), 20), greedy_request(prompt_of(6, 2), 20),
                              greedy_request(prompt_of(13, 3), 30)};
    auto out = e->generate(reqs);
    ASSERT_TRUE(out.is_ok()) << out.status().message();
    ASSERT_EQ(out->size(), reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ((*out)[i].tokens, recompute_greedy(*m, reqs[i].prompt, reqs[i].params.max_new_tokens))
          << "request " << i << " pages " << backend::kv_page_format_name(f);
      EXPECT_EQ((*out)[i].finish, FinishReason::kLength);
    }
  }
}

TEST(RolloutEngine, LogprobsEqualTeacherForcedTrainingForward) {
  for (KvPageFormat f : {KvPageFormat::kF32, KvPageFormat::kBf16}) {
    // F32 pages: the fp32 recipe through the engine's recipe mode; BF16 pages: the bf16 recipe
    // against the engine's bf16 mode
    const bool exact = f == KvPageFormat::kF32;
    auto m = tiny_olmo(exact ? "fp32" : "bf16");
    EngineOptions o;
    o.kv_format = f;
    o.mode = exact ? PrecisionMode::kRecipe : PrecisionMode::kBf16;
    auto e = make_engine(*m, o);
    std::vector<Request> reqs{sampled_request(prompt_of(5, 4), 24, 2, 11), sampled_request(prompt_of(9, 5), 24, 1, 12)};
    auto out = e->generate(reqs);
    ASSERT_TRUE(out.is_ok()) << out.status().message();
    const double tol = exact ? kLogprobTolF32 : kLogprobTolBf16;
    double worst = 0;
    for (const Completion& c : *out) {
      ASSERT_EQ(c.tokens.size(), c.logprobs.size());
      auto ref = teacher_forced_logprobs(*m, reqs[c.request].prompt, c.tokens, 0.8);
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_LE(c.logprobs[i], 0.0);
        worst = std::max(worst, std::fabs(c.logprobs[i] - ref[i]));
        ASSERT_NEAR(c.logprobs[i], ref[i], tol) << "request " << c.request << " sample " << c.sample << " token " << i;
      }
    }
    std::printf("[ info ] %s pages: max |engine - teacher-forced| log-prob = %.3g (tolerance %.3g)\n",
                backend::kv_page_format_name(f), worst, tol);
  }
}

// NVFP4 pages: the training forward with the model's K/V step (model::Nvfp4KvQuantizer, RTN as
// the page codec) gives the engine's log-probs within the F32 tolerance above (the K/V it attends
// to are the pages' values; the rest is summation order), while without the step they differ by
// far more (the pages' K/V are the codec's, up to half an E2M1 grid step off each element).
TEST(RolloutEngine, Nvfp4PageLogprobsEqualTheTrainingForwardWithTheKvStep) {
  auto m = tiny_olmo("fp32");
  EngineOptions o;
  o.kv_format = KvPageFormat::kNvfp4;
  o.mode = PrecisionMode::kRecipe;
  auto e = make_engine(*m, o);
  std::vector<Request> reqs{sampled_request(prompt_of(5, 4), 24, 2, 11), sampled_request(prompt_of(9, 5), 24, 1, 12)};
  auto out = e->generate(reqs);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  auto worst_gap = [&]() {
    double worst = 0;
    for (const Completion& c : *out) {
      auto ref = teacher_forced_logprobs(*m, reqs[c.request].prompt, c.tokens, 0.8);
      for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::fabs(c.logprobs[i] - ref[i]));
    }
    return worst;
  };
  const double without = worst_gap();
  model::Nvfp4KvQuantizer kvq;
  m->set_kv_quantizer(&kvq);
  const double with = worst_gap();
  m->set_kv_quantizer(nullptr);
  std::printf("[ info ] nvfp4 pages: max |engine - teacher-forced| log-prob = %.3g with the K/V step, %.3g without\n",
              with, without);
  EXPECT_LE(with, kLogprobTolF32);
  EXPECT_GT(without, 10 * kLogprobTolF32);
}

// The K/V step runs once per layer of every training forward, on (B*T, Hkv*D) keys and values,
// and never in forward_decode (the cache quantizes there).
TEST(RolloutEngine, KvStepRunsInTrainingForwardsOnly) {
  struct Counter final : model::KvQuantizer {
    std::vector<int64_t> layers;
    int64_t rows = 0, heads = 0, dim = 0;
    void quantize(backend::Backend&, int64_t layer, float*, float*, int64_t N, int64_t Hkv, int64_t D) override {
      layers.push_back(layer), rows = N, heads = Hkv, dim = D;
    }
  } counter;
  auto m = tiny_olmo("fp32");
  m->set_kv_quantizer(&counter);
  const std::vector<int32_t> seq = prompt_of(12, 2);
  std::vector<float> logits(static_cast<size_t>(2 * 6 * m->config().vocab_size));
  m->forward_logits(logits.data(), seq.data(), 2, 6);
  EXPECT_EQ(counter.layers, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(counter.rows, 12);
  EXPECT_EQ(counter.heads, m->config().num_key_value_heads);
  EXPECT_EQ(counter.dim, m->config().head_dim);
  EngineOptions o;
  o.mode = PrecisionMode::kRecipe;
  auto e = make_engine(*m, o);
  ASSERT_TRUE(e->generate({greedy_request(prompt_of(4, 1), 3)}).is_ok());
  EXPECT_EQ(counter.layers.size(), 2u);
}

TEST(RolloutEngine, MixedLengthBatchGivesEachSequenceItsResultAlone) {
  auto m = tiny_olmo("fp32");
  // FP8 / NVFP4 pages: each position's scales come from that position alone, so a row's pages do
  // not depend on the batch either
  for (KvPageFormat f : {KvPageFormat::kF32, KvPageFormat::kFp8, KvPageFormat::kNvfp4}) {
    SCOPED_TRACE(backend::kv_page_format_name(f));
    EngineOptions o;
    o.mode = PrecisionMode::kRecipe;
    o.kv_format = f;
    o.page_size = 8;
    auto e = make_engine(*m, o);
    std::vector<Request> reqs{sampled_request(prompt_of(3, 6), 12, 1, 5, 0), sampled_request(prompt_of(17, 7), 20, 1, 5, 1),
                              sampled_request(prompt_of(9, 8), 6, 1, 5, 2)};
    auto batch = e->generate(reqs);
    ASSERT_TRUE(batch.is_ok()) << batch.status().message();
    EXPECT_GE(e->stats().peak_running, 3);
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto alone = e->generate({reqs[i]});
      ASSERT_TRUE(alone.is_ok());
      ASSERT_EQ((*alone)[0].tokens, (*batch)[i].tokens) << "request " << i;
      // Rows never share a reduction in the paged attention; the GEMMs of another M may sum in
      // another order (OpenBLAS kernels), hence the reordering tolerance above, not bit equality.
      for (size_t t = 0; t < (*alone)[0].logprobs.size(); ++t)
        ASSERT_NEAR((*alone)[0].logprobs[t], (*batch)[i].logprobs[t], kLogprobTolF32) << "request " << i;
    }
  }
}

TEST(RolloutEngine, PrefixSharingGivesTheResultsOfUnsharedPrompts) {
  auto m = tiny_olmo("fp32");
  std::vector<Request> reqs{sampled_request(prompt_of(11, 9), 16, 4, 21), sampled_request(prompt_of(6, 10), 10, 3, 22, 1)};
  // quantized pages: the copy-on-write copies the scales with the codes
  for (KvPageFormat f : {KvPageFormat::kF32, KvPageFormat::kFp8, KvPageFormat::kNvfp4}) {
    SCOPED_TRACE(backend::kv_page_format_name(f));
    std::vector<std::vector<Completion>> results;
    std::vector<int64_t> peak_pages;
    for (bool share : {true, false}) {
      EngineOptions o;
      o.mode = PrecisionMode::kRecipe;
      o.kv_format = f;
      o.page_size = 4;  // prompts end inside a page: the samples copy it on write
      o.share_prefix = share;
      auto e = make_engine(*m, o);
      auto out = e->generate(reqs);
      ASSERT_TRUE(out.is_ok()) << out.status().message();
      results.push_back(*out);
      peak_pages.push_back(e->stats().peak_pages_in_use);
      EXPECT_EQ(e->cache().free_pages(), e->cache().num_pages());
    }
    ASSERT_EQ(results[0].size(), 7u);
    for (size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_EQ(results[0][i].tokens, results[1][i].tokens) << "completion " << i;
      for (size_t t = 0; t < results[0][i].logprobs.size(); ++t)
        ASSERT_NEAR(results[0][i].logprobs[t], results[1][i].logprobs[t], kLogprobTolF32);
    }
    // the G samples of a group differ (own streams) and sharing holds fewer pages
    EXPECT_NE(results[0][0].tokens, results[0][1].tokens);
    EXPECT_LT(peak_pages[0], peak_pages[1]);
  }
}

TEST(RolloutEngine, QuantizedKvPagesTakeTheirBytesAndNeedHeadDimsOf16ForNvfp4) {
  auto m = tiny_olmo();  // head dim 32
  for (KvPageFormat f : {KvPageFormat::kBf16, KvPageFormat::kFp8, KvPageFormat::kNvfp4}) {
    EngineOptions o;
    o.kv_format = f;
    o.page_size = 4;
    o.num_pages = 10;
    auto e = make_engine(*m, o);
    const model::ModelConfig& c = m->config();
    // per position and layer: BF16 2 bytes an element; FP8 1 + a 4-byte scale per kv head;
    // NVFP4 1/2 + 1/16 + a 4-byte scale per kv head (D 32 <= 128)
    const int64_t W = c.num_key_value_heads * c.head_dim, Hkv = c.num_key_value_heads;
    const int64_t token = f == KvPageFormat::kBf16 ? 2 * W : f == KvPageFormat::kFp8 ? W + 4 * Hkv : W / 2 + W / 16 + 4 * Hkv;
    EXPECT_EQ(e->cache().bytes(), 2 * c.num_hidden_layers * 10 * 4 * token) << backend::kv_page_format_name(f);
  }
  nlohmann::json j = model::test::tiny_olmo2_model_json(48);
  j["num_attention_heads"] = 8;  // head dim 8
  j["num_key_value_heads"] = 8;
  auto cfg = model::parse_model_config(j);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  model::RecipeConfig rc;
  auto small = model::Model::create(cfg.value(), rc);
  ASSERT_TRUE(small.is_ok()) << small.status().message();
  EngineOptions o;
  o.kv_format = KvPageFormat::kNvfp4;
  auto e = Engine::create(*small.value(), o);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("multiple of 16"), std::string::npos) << e.status().message();
  o.kv_format = KvPageFormat::kFp8;
  EXPECT_TRUE(Engine::create(*small.value(), o).is_ok());
}

TEST(RolloutEngine, FullCacheMakesRequestsWaitAndPagesNeverLeak) {
  auto m = tiny_olmo();
  std::vector<Request> reqs;
  for (int i = 0; i < 5; ++i) reqs.push_back(sampled_request(prompt_of(4 + 3 * i, 20 + i), 10, 2, 30, i));
  EngineOptions roomy;
  roomy.kv_format = KvPageFormat::kF32;
  roomy.page_size = 4;
  auto e1 = make_engine(*m, roomy);
  auto ref = e1->generate(reqs);
  ASSERT_TRUE(ref.is_ok()) << ref.status().message();
  EXPECT_EQ(e1->stats().waits, 0);
  // room for the largest request alone: the others wait until its pages come back
  EngineOptions tight = roomy;
  tight.num_pages = 12;
  auto e2 = make_engine(*m, tight);
  auto out = e2->generate(reqs);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  EXPECT_GT(e2->stats().waits, 0);
  EXPECT_LE(e2->stats().peak_pages_in_use, 12);
  EXPECT_EQ(e2->cache().free_pages(), 12);
  EXPECT_EQ(e2->cache().live_sequences(), 0);
  ASSERT_EQ(out->size(), ref->size());
  for (size_t i = 0; i < out->size(); ++i) EXPECT_EQ((*out)[i].tokens, (*ref)[i].tokens) << "completion " << i;
  // a request larger than the whole cache is an error up front, nothing generated
  EngineOptions tiny = roomy;
  tiny.num_pages = 3;
  auto e3 = make_engine(*m, tiny);
  auto bad = e3->generate(reqs);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("KV pages"), std::string::npos) << bad.status().message();
  EXPECT_EQ(e3->cache().free_pages(), 3);
  // a callback's error stops generation and still frees every page
  EngineCallbacks cb;
  int calls = 0;
  cb.on_token = [&](int64_t, int64_t, int32_t) { return ++calls == 7 ? io_error("stop here") : Status::ok(); };
  auto stopped = e1->generate(reqs, cb);
  ASSERT_FALSE(stopped.is_ok());
  EXPECT_EQ(e1->cache().free_pages(), e1->cache().num_pages());
  EXPECT_EQ(e1->cache().live_sequences(), 0);
}

TEST(RolloutEngine, StopIdsStopStringsAndContextEndSamples) {
  auto m = tiny_olmo();
  auto e = make_engine(*m);
  Request base = greedy_request(prompt_of(5, 1), 12);
  auto free_run = e->generate({base});
  ASSERT_TRUE(free_run.is_ok());
  const std::vector<int32_t> toks = (*free_run)[0].tokens;
  ASSERT_EQ(toks.size(), 12u);
  // a stop id ends the sample at its first occurrence, included
  Request with_eos = base;
  with_eos.params.stop_ids = {toks[4]};
  auto eos = e->generate({with_eos});
  ASSERT_TRUE(eos.is_ok());
  const size_t first = static_cast<size_t>(std::find(toks.begin(), toks.end(), toks[4]) - toks.begin());
  EXPECT_EQ((*eos)[0].tokens, std::vector<int32_t>(toks.begin(), toks.begin() + first + 1));
  EXPECT_EQ((*eos)[0].finish, FinishReason::kStopId);
  // a stop string over a detokenizer that spells each id as "<id>"
  EngineCallbacks cb;
  cb.detokenize = [](std::span<const int32_t> ids) -> Result<std::string> {
    std::string s;
    for (int32_t t : ids) {  // (appended piece by piece: GCC 12 warns falsely on "<" + std::string)
      s += '<';
      s += std::to_string(t);
      s += '>';
    }
    return s;
  };
  Request with_stop = base;
  with_stop.params.stop_strings = {"<" + std::to_string(toks[2]) + "><" + std::to_string(toks[3]) + ">"};
  auto stop = e->generate({with_stop}, cb);
  ASSERT_TRUE(stop.is_ok()) << stop.status().message();
  EXPECT_EQ((*stop)[0].finish, FinishReason::kStopString);
  EXPECT_LE((*stop)[0].tokens.size(), 4u);
  // the context (64) caps prompt + new tokens
  Request at_end = greedy_request(prompt_of(60, 2), 50);
  auto end = e->generate({at_end});
  ASSERT_TRUE(end.is_ok()) << end.status().message();
  EXPECT_EQ((*end)[0].tokens.size(), 4u);
  EXPECT_EQ((*end)[0].finish, FinishReason::kLength);
  Request full = greedy_request(prompt_of(64, 3), 5);
  auto none = e->generate({full});
  ASSERT_TRUE(none.is_ok()) << none.status().message();
  EXPECT_TRUE((*none)[0].tokens.empty());
}

TEST(RolloutEngine, W4A16WeightsAreTheTrainerQuantizerBits) {
  auto m = tiny_olmo("tetrajet-v2");
  EngineOptions o;
  o.mode = PrecisionMode::kW4A16;
  o.recipe_name = "tetrajet-v2";
  auto e = make_engine(*m, o);
  ASSERT_EQ(e->linears()->weight_format(), backend::QuantFormat::kNvfp4TwoLevel);
  for (const model::LinearInfo& info : m->linear_infos()) {
    const int64_t N = info.N, K = info.K;
    // the recipe's forward operand: the master weight rounded to BF16, two-level RTN along K
    std::vector<float> wb(static_cast<size_t>(N * K));
    const float* w = m->linear_weight(info.id);
    for (int64_t i = 0; i < N * K; ++i) wb[i] = round_to_bf16(w[i]);
    std::vector<uint8_t> codes(N * K / 2), inner(N * K / 16);
    std::vector<float> outer(N * ((K + 127) / 128));
    formats::nvfp4_2level_quantize_cpu(codes.data(), inner.data(), outer.data(), wb.data(), N, K, nullptr);
    const backend::QuantizedTensor& q = e->linears()->quantized_weight(info.id);
    ASSERT_EQ(std::memcmp(q.codes, codes.data(), codes.size()), 0) << info.name;
    ASSERT_EQ(std::memcmp(q.scales, inner.data(), inner.size()), 0) << info.name;
    ASSERT_EQ(std::memcmp(q.outer, outer.data(), outer.size() * sizeof(float)), 0) << info.name;
  }
  // the modes change the numbers: greedy w4a16 / w4a4 log-probs differ from bf16's
  std::vector<std::vector<double>> lps;
  for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
    EngineOptions mo = o;
    mo.mode = mode;
    auto em = make_engine(*m, mo);
    auto out = em->generate({greedy_request(prompt_of(7, 4), 6)});
    ASSERT_TRUE(out.is_ok()) << out.status().message();
    lps.push_back((*out)[0].logprobs);
  }
  EXPECT_NE(lps[0], lps[1]);
  EXPECT_NE(lps[1], lps[2]);
}

// The trainer hand-over (RL weight sync): an engine on other weights receives a trainer's
// quantizer output (the backend quantizer on the BF16 master weights, as the recipes' forward) and
// then holds, bit for bit, what an engine created on the trainer's weights holds, and generates
// the same tokens and log-probs.
TEST(RolloutEngine, QuantizedWeightsHandedOverEqualQuantizingInTheEngine) {
  auto trainer = tiny_olmo("tetrajet-v2");
  nlohmann::json j = model::test::tiny_olmo2_model_json(48);
  j["initializer_range"] = 0.3;
  model::RecipeConfig rc;
  rc.name = "tetrajet-v2";
  auto other = model::Model::create(model::parse_model_config(j).value(), rc).value();
  other->init_weights(8);  // other weights; the non-linear parameters (norms, embeddings) copied below
  std::vector<float> params(static_cast<size_t>(trainer->num_params()));
  trainer->download_parameters(params.data());
  std::vector<float> scrambled = params;
  for (const model::LinearInfo& info : trainer->linear_infos()) {
    const int64_t off = trainer->linear_weight(info.id) - trainer->flat_values();
    for (int64_t i = 0; i < info.N * info.K; ++i) scrambled[off + i] = -0.5f * params[off + i] + 0.01f;
  }
  other->upload_parameters(scrambled.data());
  for (PrecisionMode mode : {PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
    EngineOptions o;
    o.mode = mode;
    o.recipe_name = "tetrajet-v2";
    auto reference = make_engine(*trainer, o);
    auto receiver = make_engine(*other, o);
    // the trainer side: its backend quantizer on each linear's BF16 weight, in backend memory
    backend::Backend& be = trainer->backend();
    std::vector<std::unique_ptr<backend::QuantizedBuffer>> bufs;
    std::vector<backend::QuantizedTensor> handed;
    backend::Buffer<float> wb;
    for (const model::LinearInfo& info : trainer->linear_infos()) {
      float* w16 = wb.ensure(be, info.N * info.K, "test bf16 weight");
      be.round_to_bf16(w16, trainer->linear_weight(info.id), info.N * info.K);
      bufs.push_back(std::make_unique<backend::QuantizedBuffer>());
      handed.push_back(bufs.back()->view(be, backend::QuantFormat::kNvfp4TwoLevel, info.N, info.K));
      be.quantize(handed.back(), w16);
    }
    auto before = receiver->generate({greedy_request(prompt_of(7, 4), 12)});
    ASSERT_TRUE(receiver->receive_quantized_weights(handed).is_ok());
    for (const model::LinearInfo& info : trainer->linear_infos()) {
      const backend::QuantizedTensor& a = reference->linears()->quantized_weight(info.id);
      const backend::QuantizedTensor& b = receiver->linears()->quantized_weight(info.id);
      ASSERT_EQ(std::memcmp(a.codes, b.codes, info.N * info.K / 2), 0) << info.name;
      ASSERT_EQ(std::memcmp(a.scales, b.scales, info.N * info.K / 16), 0) << info.name;
      ASSERT_EQ(std::memcmp(a.outer, b.outer, info.N * ((info.K + 127) / 128) * sizeof(float)), 0) << info.name;
    }
    std::vector<Request> reqs{greedy_request(prompt_of(7, 4), 12), sampled_request(prompt_of(5, 3), 10, 2, 17)};
    auto want = reference->generate(reqs);
    auto got = receiver->generate(reqs);
    ASSERT_TRUE(want.is_ok() && got.is_ok());
    for (size_t i = 0; i < want->size(); ++i) {
      EXPECT_EQ((*want)[i].tokens, (*got)[i].tokens) << "completion " << i;
      EXPECT_EQ((*want)[i].logprobs, (*got)[i].logprobs) << "completion " << i;  // same weights, same code path
    }
    ASSERT_TRUE(before.is_ok());
    EXPECT_NE((*before)[0].logprobs, (*got)[0].logprobs);  // the hand-over changed the weights
    // mismatches are errors that change nothing
    std::vector<backend::QuantizedTensor> short_list(handed.begin(), handed.end() - 1);
    EXPECT_FALSE(receiver->receive_quantized_weights(short_list).is_ok());
    std::vector<backend::QuantizedTensor> wrong = handed;
    wrong[0].rows -= 1;
    auto st = receiver->receive_quantized_weights(wrong);
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find(trainer->linear_infos()[0].name), std::string::npos) << st.message();
    wrong = handed;
    wrong[1].format = backend::QuantFormat::kNvfp4Te2d;
    EXPECT_FALSE(receiver->receive_quantized_weights(wrong).is_ok());
  }
  EngineOptions bf;
  bf.mode = PrecisionMode::kBf16;
  auto e = make_engine(*other, bf);
  EXPECT_FALSE(e->receive_quantized_weights({}).is_ok());
}

TEST(RolloutEngine, SamplingIsReproduciblePerSeedAndIndependentOfTheBatch) {
  auto m = tiny_olmo();
  auto e = make_engine(*m);
  Request a = sampled_request(prompt_of(6, 11), 16, 2, 99, 7);
  auto once = e->generate({a});
  auto twice = e->generate({a});
  ASSERT_TRUE(once.is_ok() && twice.is_ok());
  EXPECT_EQ((*once)[0].tokens, (*twice)[0].tokens);
  EXPECT_EQ((*once)[1].tokens, (*twice)[1].tokens);
  // among other requests (before and after it in the batch), request id 7 draws the same tokens
  auto crowd = e->generate({sampled_request(prompt_of(9, 12), 12, 3, 99, 1), a, sampled_request(prompt_of(2, 13), 8, 1, 5, 2)});
  ASSERT_TRUE(crowd.is_ok());
  EXPECT_EQ((*crowd)[3].request, 1);
  EXPECT_EQ((*crowd)[3].tokens, (*once)[0].tokens);
  EXPECT_EQ((*crowd)[4].tokens, (*once)[1].tokens);
  // another seed draws other tokens
  Request b = a;
  b.params.seed = 100;
  auto other = e->generate({b});
  ASSERT_TRUE(other.is_ok());
  EXPECT_NE((*other)[0].tokens, (*once)[0].tokens);
}

// The engine's sampler (sample_with_logprob over the rows in parallel) gives the reference
// sampler's tokens and log-probs bit for bit in a mixed batch: greedy, top-k, top-p, top-p 1,
// samples sharing a prompt's row; vocabulary 300 so the ranking is sorted in chunks and whole.
TEST(RolloutEngine, EngineSamplerEqualsTheReferenceSampler) {
  auto m = tiny_olmo("bf16", 300);
  std::vector<Request> reqs;
  const SamplingParams kinds[] = {{0.0, 0, 1.0}, {0.8, 0, 0.95}, {1.0, 0, 1.0}, {1.3, 20, 0.9}, {2.0, 0, 0.3}};
  for (int k = 0; k < 5; ++k) {
    Request r = sampled_request(prompt_of(3 + k, k, 300), 10, 1 + k % 3, 40 + k, static_cast<uint64_t>(k));
    r.params.sampling = kinds[k];
    reqs.push_back(r);
  }
  EngineOptions fast, reference;
  reference.reference_sampler = true;
  auto a = make_engine(*m, fast)->generate(reqs);
  auto b = make_engine(*m, reference)->generate(reqs);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  ASSERT_EQ(a->size(), b->size());
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_EQ((*a)[i].tokens, (*b)[i].tokens) << "completion " << i;
    EXPECT_EQ((*a)[i].logprobs, (*b)[i].logprobs) << "completion " << i;  // exact: the same doubles
  }
}

TEST(RolloutEngine, BadInputsAreOneLineErrors) {
  auto m = tiny_olmo();
  auto e = make_engine(*m);
  auto check = [&](const Request& r, const std::string& needle) {
    auto out = e->generate({greedy_request(prompt_of(3, 1), 2), r});
    ASSERT_FALSE(out.is_ok()) << needle;
    const std::string msg = out.status().message();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_EQ(e->cache().free_pages(), e->cache().num_pages());
  };
  check(greedy_request({}, 4), "request 1: empty prompt");
  check(greedy_request(prompt_of(65, 1), 4), "longer than the model's context of 64");
  check(greedy_request({3, 48}, 4), "outside the vocabulary");
  Request many = greedy_request(prompt_of(3, 1), 2);
  many.params.num_samples = 17;
  check(many, "17 samples");
  Request top_p = sampled_request(prompt_of(3, 1), 2, 1, 0);
  top_p.params.sampling.top_p = 0;
  check(top_p, "top_p");
  auto mode = parse_precision_mode("fp8");
  ASSERT_FALSE(mode.is_ok());
  EXPECT_EQ(mode.status().message(), "unknown precision mode 'fp8' (recipe, bf16, w4a16, w4a4)");
}

TEST(RolloutEngine, MoeGreedyDecodeAndRoutingHook) {
  auto m = tiny_moe();
  auto e = make_engine(*m);
  const std::vector<int32_t> prompt = prompt_of(7, 3, 40);
  // the routing hook sees the prompt rows of the prefill step: the training forward's expert ids
  std::vector<int32_t> first_step;
  int64_t first_rows = -1;
  EngineCallbacks cb;
  cb.on_routing = [&](const RoutingStep& s) {
    if (first_rows < 0) {
      first_rows = static_cast<int64_t>(s.positions.size());
      first_step.assign(s.expert_ids, s.expert_ids + m->num_moe_layers() * first_rows * 2);
    }
    return Status::ok();
  };
  auto out = e->generate({greedy_request(prompt, 10)}, cb);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  EXPECT_EQ((*out)[0].tokens, recompute_greedy(*m, prompt, 10));
  ASSERT_EQ(first_rows, 7);
  std::vector<int32_t> rec(static_cast<size_t>(m->num_moe_layers() * 7 * 2));
  std::vector<float> logits(7 * 40);
  m->forward_logits(logits.data(), prompt.data(), 1, 7, model::RoutingIO{nullptr, rec.data()});
  EXPECT_EQ(first_step, rec);
}

// The engine's decode ops go through a decorating backend (bench train --profile's): the same
// tokens as on the plain CPU backend, and the paged KV-cache ops are forwarded and counted.
TEST(RolloutEngine, DecodeThroughTheProfilingBackendIsForwardedAndCounted) {
  backend::ProfilingBackend profiler(backend::cpu_backend());
  profiler.set_enabled(true);
  auto profiled = tiny_olmo("bf16", 48, profiler);
  auto plain = tiny_olmo();
  std::vector<Request> reqs{greedy_request(prompt_of(5, 1), 12), greedy_request(prompt_of(9, 2), 12)};
  auto a = make_engine(*plain)->generate(reqs);
  auto b = make_engine(*profiled)->generate(reqs);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ((*a)[i].tokens, (*b)[i].tokens) << "request " << i;
  EXPECT_GT(profiler.timing(backend::ProfiledOp::kPagedAttention).count, 0);
  EXPECT_GT(profiler.timing(backend::ProfiledOp::kKvCacheWrite).count, 0);
}

// The bf16 mode converts no weight during decoding: per forward, to_bf16_bits runs once per
// block linear (its activation) and once for the lm_head input, never for a weight (the block
// linears and the lm_head are BF16 bits made with the engine). Refreshing after a weight change
// gives a fresh engine's results, the lm_head included (a stale snapshot would keep the old tokens).
TEST(RolloutEngine, Bf16ModeConvertsNoWeightPerStepAndRefreshesTheLmHead) {
  backend::ProfilingBackend profiler(backend::cpu_backend());
  auto m = tiny_olmo("bf16", 48, profiler);
  EngineOptions o;
  o.mode = PrecisionMode::kBf16;
  auto e = make_engine(*m, o);
  std::vector<Request> reqs{greedy_request(prompt_of(5, 1), 12), greedy_request(prompt_of(9, 2), 12)};
  profiler.set_enabled(true);
  auto before = e->generate(reqs);
  profiler.set_enabled(false);
  ASSERT_TRUE(before.is_ok()) << before.status().message();
  const int64_t linears = static_cast<int64_t>(m->linear_infos().size());
  EXPECT_EQ(profiler.timing(backend::ProfiledOp::kToBf16Bits).count, e->stats().steps * (linears + 1));
  EXPECT_EQ(profiler.timing(backend::ProfiledOp::kMatmulNt).count, 0);  // every GEMM on BF16 bits

  // negate the lm_head: greedy tokens change; refresh_weights must carry it into the snapshot
  for (const auto& p : m->param_refs())
    if (p.name == "lm_head.weight") {
      std::vector<float> w(static_cast<size_t>(p.numel));
      profiler.copy_to_host(w.data(), p.value, w.size() * sizeof(float));
      for (float& v : w) v = -v;
      profiler.copy_to_device(p.value, w.data(), w.size() * sizeof(float));
    }
  ASSERT_TRUE(e->refresh_weights().is_ok());
  auto refreshed = e->generate(reqs);
  auto fresh = make_engine(*m, o)->generate(reqs);
  ASSERT_TRUE(refreshed.is_ok() && fresh.is_ok());
  bool changed = false;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ((*refreshed)[i].tokens, (*fresh)[i].tokens) << "request " << i;
    EXPECT_EQ((*refreshed)[i].logprobs, (*fresh)[i].logprobs) << "request " << i;
    changed |= (*refreshed)[i].tokens != (*before)[i].tokens;
  }
  EXPECT_TRUE(changed) << "negating the lm_head changed no greedy token: the test shows nothing";
}

// Serving: requests handed over by EngineCallbacks::admit while others run give each its result
// alone (same seed and id: same tokens), completions come only through on_finish, and an empty
// answer while idle ends generate().
TEST(RolloutEngine, AdmitHandsOverRequestsWhileOthersRun) {
  auto m = tiny_olmo();
  auto e = make_engine(*m);
  const Request a = sampled_request(prompt_of(5, 21), 20, 2, 11, 3), b = greedy_request(prompt_of(9, 22), 12);
  auto alone_a = e->generate({a});
  auto alone_b = e->generate({b});
  ASSERT_TRUE(alone_a.is_ok() && alone_b.is_ok());
  int calls = 0, idle_calls = 0;
  bool b_joined_while_running = false;
  std::vector<Completion> finished;
  EngineCallbacks cb;
  cb.admit = [&](bool idle) -> Result<std::vector<Request>> {
    ++calls;
    idle_calls += idle;
    if (calls == 1) return std::vector<Request>{a};
    if (calls == 4) {
      b_joined_while_running = !idle;
      return std::vector<Request>{b};
    }
    return std::vector<Request>{};
  };
  cb.on_finish = [&](const Completion& c) {
    finished.push_back(c);
    return Status::ok();
  };
  auto out = e->generate({}, cb);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  EXPECT_TRUE(out->empty());
  EXPECT_TRUE(b_joined_while_running);
  EXPECT_EQ(idle_calls, 2);  // the first call and the last
  EXPECT_EQ(e->stats().peak_running, 3);
  ASSERT_EQ(finished.size(), 3u);
  for (const Completion& c : finished) {
    const Completion& alone = c.request == 0 ? (*alone_a)[static_cast<size_t>(c.sample)] : (*alone_b)[0];
    EXPECT_EQ(c.tokens, alone.tokens) << "request " << c.request << " sample " << c.sample;
  }
  EXPECT_EQ(e->cache().free_pages(), e->cache().num_pages());
  // a bad request handed over is the same one-line error as one given up front
  cb.admit = [&](bool) -> Result<std::vector<Request>> { return std::vector<Request>{greedy_request({}, 3)}; };
  auto bad = e->generate({}, cb);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("empty prompt"), std::string::npos) << bad.status().message();
}

// EngineCallbacks::cancelled stops a request's samples before the next step, while its prompt is
// being prefilled or while it decodes, freeing their pages; the others go on unchanged.
TEST(RolloutEngine, CancelledRequestsStopAtTheNextStep) {
  auto m = tiny_olmo();
  EngineOptions o;
  o.max_step_tokens = 16;  // request 1's 40-token prompt takes 3 steps to prefill
  auto e = make_engine(*m, o);
  const std::vector<Request> reqs{sampled_request(prompt_of(4, 31), 30, 2, 5, 0), greedy_request(prompt_of(40, 32), 10),
                                  greedy_request(prompt_of(7, 33), 15)};
  auto alone = e->generate({reqs[2]});
  ASSERT_TRUE(alone.is_ok());
  std::vector<int64_t> tokens_of(3, 0);
  EngineCallbacks cb;
  cb.on_token = [&](int64_t r, int64_t, int32_t) {
    ++tokens_of[static_cast<size_t>(r)];
    return Status::ok();
  };
  int64_t asked_about_0 = 0;  // once per step while prefilling, then once per sample and step
  cb.cancelled = [&](int64_t r) {
    if (r == 0) ++asked_about_0;
    return (r == 0 && tokens_of[0] >= 6) || (r == 1 && asked_about_0 >= 2);  // request 1: at its 3rd step
  };
  auto out = e->generate(reqs, cb);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  ASSERT_EQ(out->size(), 4u);
  for (int s = 0; s < 2; ++s) {  // both samples of request 0 cancelled after 3 tokens each (6 in all)
    EXPECT_EQ((*out)[static_cast<size_t>(s)].finish, FinishReason::kCancelled);
    EXPECT_EQ((*out)[static_cast<size_t>(s)].tokens.size(), 3u);
  }
  EXPECT_EQ((*out)[2].finish, FinishReason::kCancelled);  // during its prefill: no token
  EXPECT_TRUE((*out)[2].tokens.empty());
  EXPECT_EQ((*out)[3].tokens, (*alone)[0].tokens);
  EXPECT_EQ((*out)[3].finish, FinishReason::kLength);
  EXPECT_EQ(e->cache().free_pages(), e->cache().num_pages());
  EXPECT_STREQ(finish_reason_name(FinishReason::kCancelled), "cancelled");
}

}  // namespace
}  // namespace nibble::rollout
