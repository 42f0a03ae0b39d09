// Tests of the chunked lm_head + cross-entropy (transformer.h, docs/training.md "lm_head"): the
// chunk size rule; losses, per-token CE and gradients that do not depend on the chunk size (1
// row, 7 rows, all rows) beyond the derived FP32 summation-order bound; the loss against the
// unchunked formula computed on the host from forward_logits; a training step that never holds
// (N,V) logits; and the lm_head precision rule (BF16 operands except for the fp32 recipe).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "core/bits.h"
#include "core/philox.h"
#include "model/tiny_olmo2_test_util.h"
#include "model/transformer.h"

namespace nibble::model {
namespace {

constexpr double kU = 0x1p-24;  // FP32 unit roundoff

// A tiny OLMo-2 with hidden C = 16 and the given vocabulary.
ModelConfig dense_config(int64_t vocab) {
  auto c = parse_model_config(nlohmann::json::parse(R"({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 11, "max_position_embeddings": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5})"));
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  ModelConfig cfg = c.value();
  cfg.vocab_size = vocab;
  return cfg;
}

std::unique_ptr<Model> build(const ModelConfig& cfg, const std::string& recipe,
                             backend::Backend* be = &backend::cpu_backend()) {
  RecipeConfig rc;
  rc.name = recipe;
  auto m = Model::create(cfg, rc, be);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  auto model = std::move(m).value();
  // 0.3-std weights (not the 0.02 init) so the logits and their gradients are O(1)
  std::vector<float> host(static_cast<size_t>(model->num_params()));
  PhiloxStream rng(5, 1);
  for (auto& p : model->param_refs())
    for (int64_t i = 0; i < p.numel; ++i)
      host[p.value - model->flat_values() + i] =
          static_cast<float>(p.shape.size() == 1 ? 1.0 + 0.1 * rng.next_normal() : 0.3 * rng.next_normal());
  model->upload_parameters(host.data());
  return model;
}

struct Batch {
  int64_t B = 2, Tn = 9;
  std::vector<int32_t> tokens, targets;
};
Batch make_batch(int64_t V, int64_t B = 2, int64_t Tn = 9) {
  Batch b;
  b.B = B;
  b.Tn = Tn;
  PhiloxStream rng(3, 4);
  for (int64_t i = 0; i < B * Tn; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng.next_below(V)));
    b.targets.push_back(i % 5 == 4 ? -100 : static_cast<int32_t>(rng.next_below(V)));
  }
  return b;
}

TEST(LmHead, ChunkRowsFollowTheByteBudget) {
  // OLMo-2 at batch 16 x 4096: 256 MiB / (50304 x 4 B) = 1334.07 rows, rounded down to 1280 (10 x 128).
  EXPECT_EQ(lm_head_chunk_rows(65536, 50304), 1280);
  EXPECT_LE(1280 * 50304 * 4, kLmHeadChunkBytes);
  // fewer rows than a chunk: one chunk of all rows
  EXPECT_EQ(lm_head_chunk_rows(100, 50304), 100);
  // a budget below 128 rows still gives 128 (the GEMM tile granularity), never 0
  EXPECT_EQ(lm_head_chunk_rows(1000, 50304, 1024), 128);
  // 1 MiB over V = 1000: 262.1 rows -> 256
  EXPECT_EQ(lm_head_chunk_rows(100000, 1000, 1 << 20), 256);
}

// The rule, and its effect: with BF16 operands the logits do not change when lm_head.weight is
// replaced by its BF16 rounding (the GEMM rounds it anyway), bit for bit; with fp32 they do.
TEST(LmHead, PrecisionRuleBf16OperandsExceptFp32) {
  auto parsed = parse_model_config(test::tiny_olmo2_model_json(40));  // widths the 4-bit recipes accept
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().message();
  const ModelConfig cfg = parsed.value();
  RecipeConfig rc;
  auto d = ModelF64::create(cfg, rc);
  ASSERT_TRUE(d.is_ok());
  EXPECT_FALSE(d.value()->lm_head_bf16());
  const Batch b = make_batch(cfg.vocab_size, 1, 8);
  for (const char* r : {"fp32", "bf16", "nvfp4-nvidia", "tetrajet-v2"}) {
    SCOPED_TRACE(r);
    auto m = build(cfg, r);
    const bool bf16 = std::string(r) != "fp32";
    EXPECT_EQ(m->lm_head_bf16(), bf16);
    const size_t n_logits = b.tokens.size() * static_cast<size_t>(cfg.vocab_size);
    std::vector<float> before(n_logits), after(n_logits), host(static_cast<size_t>(m->num_params()));
    m->forward_logits(before.data(), b.tokens.data(), b.B, b.Tn);
    m->download_parameters(host.data());
    const ParamRef<float>* w = m->find_param("lm_head.weight");
    ASSERT_NE(w, nullptr);
    int64_t changed = 0;
    for (int64_t i = 0; i < w->numel; ++i) {
      float& x = host[w->value - m->flat_values() + i];
      changed += round_to_bf16(x) != x;
      x = round_to_bf16(x);
    }
    ASSERT_GT(changed, 0);
    m->upload_parameters(host.data());
    m->forward_logits(after.data(), b.tokens.data(), b.B, b.Tn);
    const bool same = std::memcmp(before.data(), after.data(), n_logits * sizeof(float)) == 0;
    EXPECT_EQ(same, bf16);
  }
}

struct StepResult {
  LossParts lp;
  std::vector<float> grads, token_ce;
  LossParts eval;
};

StepResult run_step(Model& m, const Batch& b, int64_t chunk_rows) {
  m.set_lm_head_chunk_rows(chunk_rows);
  StepResult r;
  m.zero_grad();
  r.lp = m.forward_backward(b.tokens.data(), b.targets.data(), b.B, b.Tn, LossOptions{1e-2});
  r.grads.resize(static_cast<size_t>(m.num_params()));
  m.download_gradients(r.grads.data());
  r.token_ce.assign(b.tokens.size(), -1.f);
  r.eval = m.forward_loss(b.tokens.data(), b.targets.data(), b.B, b.Tn, LossOptions{1e-2}, {}, r.token_ce.data());
  return r;
}

// Chunk sizes 1, 7 and all rows (N = 18: 18, 3 and 1 chunks) give the same losses and gradients.
// Tolerances: the forward up to the final norm does not depend on the chunking. Per chunk only
// the row count M of the three lm_head GEMMs changes, which may change a GEMM's summation order
// (BLAS kernels depend on M), and dW_lm is summed over rows in FP32 chunk by chunk instead of in
// one GEMM. Any two orders of a length-K FP32 sum differ by at most 2 gamma_K sum|terms|,
// gamma_K = K u; the longest reduction is over K = max(V, N, C) = 300 terms: 2 gamma = 3.6e-5.
// That relative perturbation of dxf and dW_lm passes through the backward of 2 blocks at 0.3-std
// weights, which may amplify it by a small factor: each parameter tensor is allowed 4 x 2 gamma_K
// of its largest gradient (measured: at most 0.023 x 2 gamma_K). The losses and per-token CE move
// with the logits (FP32 order over C terms, below 2 gamma_V relative) and by the double sums'
// order (1e-16): allowed 2 gamma_K relative. A wrong chunk offset or a dropped chunk moves
// them by O(1).
void check_chunk_independence(const std::string& recipe) {
  SCOPED_TRACE(recipe);
  const int64_t V = 300;
  const ModelConfig cfg = dense_config(V);
  auto m = build(cfg, recipe);
  const Batch b = make_batch(V);
  const int64_t N = b.B * b.Tn;
  const double two_gamma = 2.0 * static_cast<double>(std::max({V, N, cfg.hidden_size})) * kU;
  const StepResult all = run_step(*m, b, 0);
  EXPECT_TRUE(std::isfinite(all.lp.loss));
  EXPECT_GT(all.lp.z_loss, 0);
  EXPECT_EQ(all.lp.n_tokens, 15);  // 18 rows, every fifth ignored
  for (int64_t chunk : {int64_t{1}, int64_t{7}}) {
    SCOPED_TRACE(chunk);
    const StepResult c = run_step(*m, b, chunk);
    EXPECT_EQ(c.lp.n_tokens, all.lp.n_tokens);
    EXPECT_NEAR(c.lp.loss, all.lp.loss, two_gamma * std::fabs(all.lp.loss));
    EXPECT_NEAR(c.lp.ce, all.lp.ce, two_gamma * std::fabs(all.lp.ce));
    EXPECT_NEAR(c.lp.z_loss, all.lp.z_loss, two_gamma * std::fabs(all.lp.z_loss));
    EXPECT_NEAR(c.eval.loss, all.eval.loss, two_gamma * std::fabs(all.eval.loss));
    // the eval loss is the training loss (same parameters, same batch)
    EXPECT_NEAR(c.eval.loss, c.lp.loss, two_gamma * std::fabs(c.lp.loss));
    for (int64_t n = 0; n < N; ++n) {
      if (b.targets[n] < 0) {
        EXPECT_EQ(c.token_ce[n], 0.f) << n;
      } else {
        EXPECT_NEAR(c.token_ce[n], all.token_ce[n], two_gamma * std::fabs(all.token_ce[n]) + 1e-6) << n;
      }
    }
    for (const auto& p : m->param_refs()) {
      const size_t at = static_cast<size_t>(p.grad - m->flat_grads());
      double gmax = 0, dmax = 0;
      for (int64_t i = 0; i < p.numel; ++i) {
        gmax = std::max(gmax, std::fabs(static_cast<double>(all.grads[at + i])));
        dmax = std::max(dmax, std::fabs(static_cast<double>(c.grads[at + i]) - all.grads[at + i]));
      }
      EXPECT_GT(gmax, 0) << p.name;
      EXPECT_LE(dmax, 4 * two_gamma * gmax) << p.name;
    }
  }
}

TEST(LmHead, ChunkSizeDoesNotChangeResultsFp32) { check_chunk_independence("fp32"); }
TEST(LmHead, ChunkSizeDoesNotChangeResultsBf16Head) { check_chunk_independence("bf16"); }

// The loss of forward_loss (chunks of 7 rows) against the unchunked formula on the host:
// logits (N,V) from forward_logits (one GEMM over all rows), then in double
// ce_n = lse_n - logit_{n,t_n}, loss = mean ce + z_coef mean lse^2 over valid rows.
// Tolerance: the two logits differ only by GEMM summation order over C = 16 terms:
// |dlogit| <= 2 gamma_C sum_c |x_c w_vc| <= 2 C u ||x|| ||w_v|| with ||x|| = sqrt(C) max|gain|
// (RMS-normalised rows) and ||w_v|| the largest lm_head row norm; lse and the target logit move by
// at most that, so |dce| <= 2 |dlogit| and |dz| <= 2 |lse| |dlse|; plus float rounding of
// the per-token ce before the double sum (u |ce|).
TEST(LmHead, LossEqualsTheUnchunkedFormula) {
  for (const char* recipe : {"fp32", "bf16"}) {
    SCOPED_TRACE(recipe);
    const int64_t V = 300;
    const ModelConfig cfg = dense_config(V);
    const int64_t C = cfg.hidden_size;
    auto m = build(cfg, recipe);
    const Batch b = make_batch(V);
    const int64_t N = b.B * b.Tn;
    std::vector<float> logits(static_cast<size_t>(N * V));
    m->forward_logits(logits.data(), b.tokens.data(), b.B, b.Tn);
    const double z_coef = 1e-2;
    double ce_sum = 0, z_sum = 0, max_lse = 0;
    int64_t n_valid = 0;
    for (int64_t n = 0; n < N; ++n) {
      if (b.targets[n] < 0) continue;
      const float* l = logits.data() + n * V;
      double mx = -std::numeric_limits<double>::infinity(), s = 0;
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(l[v]));
      for (int64_t v = 0; v < V; ++v) s += std::exp(l[v] - mx);
      const double lse = mx + std::log(s);
      ce_sum += lse - l[b.targets[n]];
      z_sum += lse * lse;
      max_lse = std::max(max_lse, std::fabs(lse));
      ++n_valid;
    }
    const double ce = ce_sum / n_valid, z = z_sum / n_valid;
    // the bound's inputs: the final norm's gains and the lm_head row norms
    std::vector<float> host(static_cast<size_t>(m->num_params()));
    m->download_parameters(host.data());
    double max_gain = 0, max_row = 0;
    for (const auto& p : m->param_refs()) {
      const float* v = host.data() + (p.value - m->flat_values());
      if (p.name == "model.norm.weight")
        for (int64_t i = 0; i < p.numel; ++i) max_gain = std::max(max_gain, std::fabs(static_cast<double>(v[i])));
      if (p.name == "lm_head.weight")
        for (int64_t r = 0; r < V; ++r) {
          double s = 0;
          for (int64_t c = 0; c < C; ++c) s += static_cast<double>(v[r * C + c]) * v[r * C + c];
          max_row = std::max(max_row, std::sqrt(s));
        }
    }
    const double dlogit = 2.0 * C * kU * std::sqrt(static_cast<double>(C)) * max_gain * max_row;
    m->set_lm_head_chunk_rows(7);
    const LossParts lp = m->forward_loss(b.tokens.data(), b.targets.data(), b.B, b.Tn, LossOptions{z_coef});
    EXPECT_EQ(lp.n_tokens, n_valid);
    EXPECT_NEAR(lp.ce, ce, 2 * dlogit + kU * std::fabs(ce)) << "bound on logits " << dlogit;
    EXPECT_NEAR(lp.z_loss, z, 2 * max_lse * dlogit + kU * z);
    EXPECT_NEAR(lp.loss, ce + z_coef * z, 2 * dlogit * (1 + z_coef * 2 * max_lse) + kU * (ce + z_coef * z));
  }
}

// A training step at N = 64 rows over V = 4096 with chunks of 8 rows raises the backend's peak
// memory by less than the (N,V) FP32 logits (1 MiB) it used to hold; everything else the step
// allocates (activations of 2 blocks at C = 16, the 8-row chunk, the BF16 lm_head weight copy)
// is below 0.6 MiB.
TEST(LmHead, TrainingStepDoesNotHoldAllLogits) {
  auto be = backend::make_backend("cpu");
  ASSERT_TRUE(be.is_ok()) << be.status().message();
  const int64_t V = 4096;
  const ModelConfig cfg = dense_config(V);
  auto m = build(cfg, "bf16", be.value().get());
  const Batch b = make_batch(V, 4, 16);
  const int64_t N = b.B * b.Tn;
  const int64_t before = be.value()->memory_stats().in_use_bytes;
  ASSERT_GE(before, 0);
  be.value()->reset_peak_memory();
  m->set_lm_head_chunk_rows(8);
  m->zero_grad();
  const LossParts lp = m->forward_backward(b.tokens.data(), b.targets.data(), b.B, b.Tn, LossOptions{1e-4});
  EXPECT_TRUE(std::isfinite(lp.loss));
  const int64_t grown = be.value()->memory_stats().peak_bytes - before;
  EXPECT_GT(grown, 0);
  EXPECT_LT(grown, N * V * static_cast<int64_t>(sizeof(float))) << "the step allocated " << grown << " bytes";
}

}  // namespace
}  // namespace nibble::model
