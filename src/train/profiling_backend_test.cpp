// Tests of the profiling Backend decorator (backend/profiling_backend.h) and of
// `bench train --profile`: training steps through it equal steps on the wrapped backend bit for bit
// (every recipe, dense and MoE: an op it failed to forward would change them), the op counts of
// one tiny step are exactly those the model's layer sequence implies, disabled it records nothing,
// and the report's rows, categories and shares add up.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/profiling_backend.h"
#include "core/parallel.h"
#include "core/philox.h"
#include "model/transformer.h"
#include "train/optimizer.h"
#include "train/train_bench.h"

namespace nibble::train {
namespace {

using backend::ProfiledOp;

// configs/<file> with 2 blocks and vocabulary 512.
model::ModelConfig load_config(const char* file) {
  std::ifstream in(std::string(NIBBLE_SOURCE_DIR) + "/configs/" + file);
  EXPECT_TRUE(in.good()) << file;
  auto c = model::parse_model_config(nlohmann::json::parse(in));
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  model::ModelConfig cfg = c.value();
  cfg.vocab_size = 512;
  cfg.num_hidden_layers = 2;
  return cfg;
}

model::RecipeConfig recipe(const std::string& name) {
  auto r = model::parse_recipe_config(nlohmann::json(name));
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.value();
}

struct StepOut {
  double loss = 0, norm = 0;
  std::vector<float> values, grads;
};

// One optimizer step (zero_grad, forward_backward with z-loss, global-norm clip, AdamW) of a
// model built on `be`, on fixed random tokens B x T. `profile`: enabled for forward_backward,
// the clip and AdamW only (not for building the model or reading results back).
StepOut one_step(backend::Backend& be, const model::ModelConfig& cfg, const model::RecipeConfig& rc,
                 int64_t chunk_rows = 0, backend::ProfilingBackend* profile = nullptr, int64_t B = 2, int64_t T = 32) {
  auto created = model::Model::create(cfg, rc, &be);
  EXPECT_TRUE(created.is_ok()) << created.status().message();
  auto m = std::move(created).value();
  m->init_weights(21);
  m->set_lm_head_chunk_rows(chunk_rows);
  AdamW opt(AdamWConfig{}, &be);
  std::vector<ParamView> views;
  for (auto& p : m->param_refs()) views.push_back({p.name, p.value, p.grad, p.numel, p.weight_decay});
  PhiloxStream rng(8, 3);
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    tok[i] = static_cast<int32_t>(rng.next_below(cfg.vocab_size));
    tgt[i] = i % 7 == 6 ? -100 : static_cast<int32_t>(rng.next_below(cfg.vocab_size));
  }
  m->set_step(0, 77);
  m->zero_grad();
  StepOut out;
  if (profile) profile->set_enabled(true);
  out.loss = m->forward_backward(tok.data(), tgt.data(), B, T, model::LossOptions{1e-4}).loss;
  GradNorm gn = global_grad_norm(views, 1.0, 1.0f, be);
  out.norm = gn.norm;
  EXPECT_TRUE(opt.step(views, 1e-3, gn.clip_scale).is_ok());
  if (profile) profile->set_enabled(false);
  out.values.resize(m->num_params());
  out.grads.resize(m->num_params());
  m->download_parameters(out.values.data());
  m->download_gradients(out.grads.data());
  return out;
}

int64_t total_count(const backend::ProfilingBackend& p) {
  int64_t n = 0;
  for (size_t i = 0; i < static_cast<size_t>(ProfiledOp::kCount); ++i) n += p.timing(static_cast<ProfiledOp>(i)).count;
  return n;
}

TEST(ProfilingBackend, StepsThroughItEqualStepsOnTheWrappedBackend) {
  set_num_threads(1);
  auto cpu = backend::make_backend("cpu");
  ASSERT_TRUE(cpu.is_ok()) << cpu.status().message();
  backend::ProfilingBackend prof(*cpu.value());
  for (const char* file : {"tiny-dense.json", "tiny-moe.json"}) {
    const model::ModelConfig cfg = load_config(file);
    for (const char* name : {"fp32", "bf16", "nvfp4-nvidia", "tetrajet-v2"}) {
      SCOPED_TRACE(std::string(file) + " " + name);
      prof.reset_timings();
      const StepOut a = one_step(*cpu.value(), cfg, recipe(name), 0, nullptr, 2, 16);
      const StepOut b = one_step(prof, cfg, recipe(name), 0, &prof, 2, 16);
      EXPECT_TRUE(std::isfinite(a.loss));
      EXPECT_EQ(0, std::memcmp(&a.loss, &b.loss, sizeof(double)));
      EXPECT_EQ(0, std::memcmp(&a.norm, &b.norm, sizeof(double)));
      ASSERT_EQ(a.values.size(), b.values.size());
      EXPECT_EQ(0, std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float)));
      // and the ops went through the profiler
      EXPECT_GT(prof.timing(ProfiledOp::kMatmulNt).count + prof.timing(ProfiledOp::kMatmulBf16Nt).count, 0);
      EXPECT_EQ(prof.timing(ProfiledOp::kAdamwUpdateMulti).count, 1);  // all parameters in one call
      // MoE experts: one grouped GEMM per product and MoE layer part (not a per-expert loop) for
      // every recipe but fp32; the FP4 recipes' wgrad through the per-expert blocks form
      const std::string recipe_name = name;
      const int64_t grouped = prof.timing(ProfiledOp::kGroupedMatmulBf16Nt).count;
      const int64_t blocks = prof.timing(ProfiledOp::kGroupedMatmulBf16NtBlocks).count;
      if (cfg.num_experts > 0 && recipe_name != "fp32") {
        EXPECT_GT(grouped, 0);
        EXPECT_EQ(blocks > 0, recipe_name == "nvfp4-nvidia" || recipe_name == "tetrajet-v2");
      } else {
        EXPECT_EQ(grouped + blocks, 0);
      }
    }
  }
}

// The op counts of one step of the tiny dense OLMo-2 (L = 2 blocks, bf16 recipe), N = 2 x 32 = 64
// rows in lm_head chunks of 24 rows (nc = 3 chunks), P parameter tensors, derived from the layer
// sequence (transformer.cpp) and the bf16 recipe (linear.cpp):
//  - 4 linears per block (qkv, o, gate_up, down): a forward matmul_bf16_nt and a backward
//    matmul_bf16_nn + matmul_bf16_tn each, x and w forward and dy backward to BF16 bits
//    (3 to_bf16_bits);
//  - lm_head (BF16 operands): W and xf to BF16 bits once, per chunk matmul_bf16_nt, the fused CE
//    (its sums left in backend memory), dlogits to BF16 bits, matmul_bf16_nn, matmul_bf16_tn; the
//    chunks' CE sums read back once (one copy_to_host);
//  - OLMo-2 norms: q, k, post-attention, post-feed-forward per block + the final norm, forward
//    and backward; RoPE on q and k; 3 copy_2d for the QKV split forward, 3 for the merge backward;
//    2 residual add_inplace forward and 2 backward per block;
//  - the host tokens and targets copied in; one sum_squares_chunks_multi and one adamw_update_multi
//    for all P tensors.
// (zero_grad, building the model and reading results back happen outside the profiled region.)
TEST(ProfilingBackend, OpCountsOfATinyStepAreExact) {
  set_num_threads(1);
  const model::ModelConfig cfg = load_config("tiny-dense.json");
  ASSERT_EQ(cfg.arch, model::Architecture::kOlmo2);
  auto cpu = backend::make_backend("cpu");
  ASSERT_TRUE(cpu.is_ok());
  backend::ProfilingBackend prof(*cpu.value());
  // disabled: forwarded, nothing recorded
  one_step(prof, cfg, recipe("bf16"), 24);
  EXPECT_EQ(total_count(prof), 0);

  const int64_t L = cfg.num_hidden_layers, nc = 3;
  auto created = model::Model::create(cfg, recipe("bf16"));
  ASSERT_TRUE(created.is_ok());
  const int64_t P = static_cast<int64_t>(created.value()->param_refs().size());
  std::vector<std::pair<ProfiledOp, int64_t>> expected = {
      {ProfiledOp::kMatmulBf16Nt, 4 * L + nc},
      {ProfiledOp::kMatmulBf16Nn, 4 * L + nc},
      {ProfiledOp::kMatmulBf16Tn, 4 * L + nc},
      {ProfiledOp::kToBf16Bits, 3 * 4 * L + 2 + nc},
      {ProfiledOp::kCrossEntropyForwardBackwardSums, nc},
      {ProfiledOp::kCopyToHost, 1},  // the chunks' cross-entropy sums, read once
      {ProfiledOp::kRmsnormForward, 4 * L + 1},
      {ProfiledOp::kRmsnormBackward, 4 * L + 1},
      {ProfiledOp::kAttentionForward, L},
      {ProfiledOp::kAttentionBackward, L},
      {ProfiledOp::kRopeForward, 2 * L},
      {ProfiledOp::kRopeBackward, 2 * L},
      {ProfiledOp::kSwigluForward, L},
      {ProfiledOp::kSwigluBackward, L},
      {ProfiledOp::kEmbeddingForward, 1},
      {ProfiledOp::kEmbeddingBackward, 1},
      {ProfiledOp::kCopy2d, 6 * L},
      {ProfiledOp::kAddInplace, 4 * L},
      {ProfiledOp::kCopyToDevice, 2},
      {ProfiledOp::kSumSquaresChunksMulti, 1},
      {ProfiledOp::kAdamwUpdateMulti, 1},
      {ProfiledOp::kFillZero, 2 * P},  // AdamW's first step zeroes its m and v per tensor
  };
  for (int rep = 0; rep < 2; ++rep) {  // the same counts every time
    prof.reset_timings();
    one_step(prof, cfg, recipe("bf16"), 24, &prof);
    int64_t listed = 0;
    for (auto [op, n] : expected) {
      EXPECT_EQ(prof.timing(op).count, n) << backend::profiled_op_name(op);
      listed += prof.timing(op).count;
    }
    EXPECT_EQ(total_count(prof), listed);  // and no op of another kind
  }
}

TEST(ProfilingBackend, ReportRowsCategoriesAndSharesAddUp) {
  set_num_threads(1);
  const model::ModelConfig cfg = load_config("tiny-moe.json");
  auto cpu = backend::make_backend("cpu");
  ASSERT_TRUE(cpu.is_ok());
  backend::ProfilingBackend prof(*cpu.value());
  one_step(prof, cfg, recipe("nvfp4-nvidia"), 0, &prof);
  const double step_s = 2.0;  // any step time longer than the ops' sum
  const backend::StepProfile p = backend::make_step_profile(prof, step_s);
  EXPECT_DOUBLE_EQ(p.step_ms, 2000.0);
  int64_t op_count = 0, cat_count = 0;
  double op_ms = 0, cat_ms = 0;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const auto& r = p.ops[i];
    op_count += r.count;
    op_ms += r.ms;
    EXPECT_GT(r.count, 0);
    EXPECT_NEAR(r.share, r.ms / p.step_ms, 1e-15);
    if (i > 0) {
      EXPECT_GE(p.ops[i - 1].ms, r.ms);
    }
  }
  for (const auto& r : p.categories) cat_count += r.count, cat_ms += r.ms;
  EXPECT_EQ(op_count, total_count(prof));
  EXPECT_EQ(cat_count, op_count);
  EXPECT_NEAR(op_ms, p.op_ms, 1e-9 * p.op_ms);
  EXPECT_NEAR(cat_ms, p.op_ms, 1e-9 * p.op_ms);
  EXPECT_GT(p.op_ms, 0);
  // the MoE step uses the MoE, quantize, GEMM, attention, norm, CE and optimizer categories
  std::vector<std::string> cats;
  for (const auto& r : p.categories) cats.push_back(r.name);
  for (const char* c : {"GEMM", "attention", "norm", "cross-entropy", "quantize", "optimizer", "elementwise", "MoE",
                        "copies"})
    EXPECT_NE(std::find(cats.begin(), cats.end(), c), cats.end()) << c;
  const std::string text = backend::format_step_profile(p, "test");
  EXPECT_NE(text.find("synchronised"), std::string::npos);
  for (const auto& r : p.ops) EXPECT_NE(text.find(r.name), std::string::npos) << r.name;
  EXPECT_NE(text.find("moe_router_forward"), std::string::npos);
}

TEST(ProfilingBackend, BenchTrainProfilesOneExtraStep) {
  set_num_threads(1);
  const model::ModelConfig cfg = load_config("tiny-dense.json");
  auto cpu = backend::make_backend("cpu");
  ASSERT_TRUE(cpu.is_ok());
  TrainBenchOptions o;
  o.batch = 2;
  o.seq_len = 16;
  o.warmup_steps = 0;
  o.timed_steps = 1;
  o.profile = true;
  auto r = bench_train_step(*cpu.value(), cfg, recipe("bf16"), o);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_TRUE(r.value().profiled);
  const backend::StepProfile& p = r.value().profile;
  EXPECT_GT(p.step_ms, 0);
  EXPECT_LE(p.op_ms, p.step_ms);
  // the profiled step is one step: one embedding forward, one CE chunk (32 rows < 128)
  int64_t emb = -1, ce = -1;
  for (const auto& row : p.ops) {
    if (row.name == "embedding_forward") emb = row.count;
    if (row.name == "cross_entropy_forward_backward_sums") ce = row.count;
  }
  EXPECT_EQ(emb, 1);
  EXPECT_EQ(ce, 1);
  o.profile = false;
  auto plain = bench_train_step(*cpu.value(), cfg, recipe("bf16"), o);
  ASSERT_TRUE(plain.is_ok());
  EXPECT_FALSE(plain.value().profiled);
  EXPECT_EQ(plain.value().first_loss, r.value().first_loss);  // the profiler changes no result
}

}  // namespace
}  // namespace nibble::train
