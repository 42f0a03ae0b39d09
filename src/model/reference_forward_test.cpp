// An independent, scalar, token-by-token forward pass written straight from transformers'
// modeling_olmo2.py and modeling_qwen3_moe.py (eager attention, repeat_kv, rotate_half RoPE,
// Olmo2 norm-after blocks with full-width q/k norm, Qwen3-MoE pre-norm blocks with per-head
// q/k norm and the SparseMoeBlock's softmax -> top-k -> renormalise -> weighted expert sum),
// reading weights by their HF names. The model's logits must agree with it: this pins the
// wiring (order of norms, residuals, heads, routing) that gradient checks cannot see.
#include <cmath>
#include <map>

#include <gtest/gtest.h>

#include "core/philox.h"
#include "model/transformer.h"

namespace nibble::model {
namespace {

using Vec = std::vector<double>;

struct Ref {
  ModelF64& m;
  const ModelConfig& c;
  const double* w(const std::string& name) {
    auto* p = m.find_param(name);
    EXPECT_NE(p, nullptr) << name;
    return p->value;
  }
  // nn.Linear without bias: out[o] = sum_i W[o,i] x[i]
  Vec linear(const Vec& x, const std::string& name, int64_t out) {
    const double* W = w(name);
    Vec y(out, 0.0);
    for (int64_t o = 0; o < out; ++o)
      for (size_t i = 0; i < x.size(); ++i) y[o] += W[o * x.size() + i] * x[i];
    return y;
  }
  Vec rmsnorm(const Vec& x, const double* weight) {
    double var = 0;
    for (double v : x) var += v * v;
    var /= x.size();
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = weight[i] * (x[i] / std::sqrt(var + c.rms_norm_eps));
    return y;
  }
  // apply_rotary_pos_emb on one head vector: x * cos + rotate_half(x) * sin, cos = cat(freqs, freqs)
  void rope(double* x, int64_t pos) {
    const int64_t D = c.head_dim, half = D / 2;
    Vec out(D);
    for (int64_t j = 0; j < D; ++j) {
      double inv_freq = 1.0 / std::pow(c.rope_theta, double(2 * (j % half)) / D);
      double ang = pos * inv_freq;
      double rot = j < half ? -x[j + half] : x[j - half];
      out[j] = x[j] * std::cos(ang) + rot * std::sin(ang);
    }
    for (int64_t j = 0; j < D; ++j) x[j] = out[j];
  }
  Vec silu_mlp(const Vec& x, const std::string& prefix, int64_t hidden) {
    Vec g = linear(x, prefix + "gate_proj.weight", hidden), u = linear(x, prefix + "up_proj.weight", hidden);
    for (int64_t i = 0; i < hidden; ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    return linear(g, prefix + "down_proj.weight", c.hidden_size);
  }

  // logits (T,V) of one sequence
  std::vector<Vec> forward(const std::vector<int32_t>& tokens) {
    const int64_t T = tokens.size(), C = c.hidden_size, H = c.num_attention_heads, Hkv = c.num_key_value_heads;
    const int64_t D = c.head_dim, rep = H / Hkv;
    const bool olmo = c.arch == Architecture::kOlmo2;
    std::vector<Vec> x(T);
    for (int64_t t = 0; t < T; ++t) x[t] = Vec(w("model.embed_tokens.weight") + tokens[t] * C, w("model.embed_tokens.weight") + (tokens[t] + 1) * C);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      std::vector<Vec> q(T), k(T), v(T);
      for (int64_t t = 0; t < T; ++t) {
        Vec in = olmo ? x[t] : rmsnorm(x[t], w(p + "input_layernorm.weight"));
        q[t] = linear(in, p + "self_attn.q_proj.weight", H * D);
        k[t] = linear(in, p + "self_attn.k_proj.weight", Hkv * D);
        v[t] = linear(in, p + "self_attn.v_proj.weight", Hkv * D);
        if (olmo) {  // Olmo2: q_norm over the whole projection
          q[t] = rmsnorm(q[t], w(p + "self_attn.q_norm.weight"));
          k[t] = rmsnorm(k[t], w(p + "self_attn.k_norm.weight"));
        } else {     // Qwen3: q_norm per head (view(..., -1, head_dim))
          for (int64_t h = 0; h < H; ++h) {
            Vec hv(q[t].begin() + h * D, q[t].begin() + (h + 1) * D);
            hv = rmsnorm(hv, w(p + "self_attn.q_norm.weight"));
            std::copy(hv.begin(), hv.end(), q[t].begin() + h * D);
          }
          for (int64_t h = 0; h < Hkv; ++h) {
            Vec hv(k[t].begin() + h * D, k[t].begin() + (h + 1) * D);
            hv = rmsnorm(hv, w(p + "self_attn.k_norm.weight"));
            std::copy(hv.begin(), hv.end(), k[t].begin() + h * D);
          }
        }
        for (int64_t h = 0; h < H; ++h) rope(q[t].data() + h * D, t);
        for (int64_t h = 0; h < Hkv; ++h) rope(k[t].data() + h * D, t);
      }
      std::vector<Vec> nx(T);
      for (int64_t t = 0; t < T; ++t) {
        Vec att(H * D, 0.0);
        for (int64_t h = 0; h < H; ++h) {
          int64_t hk = h / rep;  // repeat_kv
          Vec s(t + 1);
          double mx = -1e300, z = 0;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            double d = 0;
            for (int64_t i = 0; i < D; ++i) d += q[t][h * D + i] * k[t2][hk * D + i];
            s[t2] = d / std::sqrt(double(D));
            mx = std::max(mx, s[t2]);
          }
          for (auto& e : s) z += (e = std::exp(e - mx));
          for (int64_t t2 = 0; t2 <= t; ++t2)
            for (int64_t i = 0; i < D; ++i) att[h * D + i] += s[t2] / z * v[t2][hk * D + i];
        }
        Vec o = linear(att, p + "self_attn.o_proj.weight", C);
        Vec h(C), out(C);
        if (olmo) {
          Vec on = rmsnorm(o, w(p + "post_attention_layernorm.weight"));
          for (int64_t i = 0; i < C; ++i) h[i] = x[t][i] + on[i];
          Vec mlp = silu_mlp(h, p + "mlp.", c.intermediate_size);
          Vec mn = rmsnorm(mlp, w(p + "post_feedforward_layernorm.weight"));
          for (int64_t i = 0; i < C; ++i) out[i] = h[i] + mn[i];
        } else {
          for (int64_t i = 0; i < C; ++i) h[i] = x[t][i] + o[i];
          Vec hn = rmsnorm(h, w(p + "post_attention_layernorm.weight"));
          Vec mlp(C, 0.0);
          if (c.is_moe_layer(l)) {
            Vec logits = linear(hn, p + "mlp.gate.weight", c.num_experts);
            double mx = *std::max_element(logits.begin(), logits.end()), z = 0;
            Vec prob(c.num_experts);
            for (int64_t e = 0; e < c.num_experts; ++e) z += (prob[e] = std::exp(logits[e] - mx));
            for (auto& pe : prob) pe /= z;
            std::vector<int64_t> order(c.num_experts);
            for (int64_t e = 0; e < c.num_experts; ++e) order[e] = e;
            std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return prob[a] > prob[b]; });
            double sel = 0;
            for (int64_t j = 0; j < c.num_experts_per_tok; ++j) sel += prob[order[j]];
            for (int64_t j = 0; j < c.num_experts_per_tok; ++j) {
              double gate = c.norm_topk_prob ? prob[order[j]] / sel : prob[order[j]];
              Vec y = silu_mlp(hn, p + "mlp.experts." + std::to_string(order[j]) + ".", c.moe_intermediate_size);
              for (int64_t i = 0; i < C; ++i) mlp[i] += gate * y[i];
            }
          } else {
            mlp = silu_mlp(hn, p + "mlp.", c.intermediate_size);
          }
          for (int64_t i = 0; i < C; ++i) out[i] = h[i] + mlp[i];
        }
        nx[t] = out;
      }
      x = nx;
    }
    std::vector<Vec> logits(T);
    for (int64_t t = 0; t < T; ++t) logits[t] = linear(rmsnorm(x[t], w("model.norm.weight")), "lm_head.weight", c.vocab_size);
    return logits;
  }
};

void check_against_reference(const nlohmann::json& j) {
  auto cfg = parse_model_config(j);
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  RecipeConfig rc;
  rc.name = "fp32";
  auto m = ModelF64::create(*cfg, rc).value();
  m->init_weights(3);
  PhiloxStream rng(11, 4);
  for (auto& p : m->param_refs())
    for (int64_t i = 0; i < p.numel; ++i) p.value[i] = p.shape.size() == 1 ? 1.0 + 0.2 * rng.next_normal() : 0.4 * rng.next_normal();
  const int64_t B = 2, T = 6, V = cfg->vocab_size;
  std::vector<int32_t> tokens(B * T);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.next_below(V));
  std::vector<double> logits(B * T * V);
  m->forward_logits(logits.data(), tokens.data(), B, T);
  Ref ref{*m, *cfg};
  for (int64_t b = 0; b < B; ++b) {
    auto r = ref.forward(std::vector<int32_t>(tokens.begin() + b * T, tokens.begin() + (b + 1) * T));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t v = 0; v < V; ++v)
        // The model's RoPE angles are computed in binary32 as transformers does (relative error
        // <= 2^-23 of angles <= T = 6), the reference's in double: q/k perturbed by ~1e-6 relative,
        // logits of size <= ~20 by < 1e-4. Wiring errors are O(1).
        EXPECT_NEAR(logits[(b * T + t) * V + v], r[t][v], 1e-4) << "b=" << b << " t=" << t << " v=" << v;
  }
}

TEST(ReferenceForward, Olmo2MatchesTransformersStructure) {
  check_against_reference(nlohmann::json::parse(R"({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 13, "max_position_embeddings": 16, "rope_theta": 500000.0, "rms_norm_eps": 1e-6})"));
}

TEST(ReferenceForward, Qwen3MoeMatchesTransformersStructure) {
  for (bool norm : {true, false}) {
    auto j = nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16,
      "intermediate_size": 20, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 6, "vocab_size": 13, "max_position_embeddings": 16, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
      "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [1]})");
    j["norm_topk_prob"] = norm;
    check_against_reference(j);
  }
}

}  // namespace
}  // namespace nibble::model
