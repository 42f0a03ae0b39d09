// Forward and backward of the OLMo-2 and Qwen3-MoE transformers (see transformer.h), written
// out layer by layer over backend/cpu ops like llm.c's gpt2_forward/gpt2_backward. Activations
// live in one arena sized for (B,T) and reused across calls; backward scratch is shared by all
// layers. Shapes: N = B*T rows, C hidden, H/Hkv heads, D head dim, Nq = H*D, Nkv = Hkv*D,
// I dense MLP hidden, E experts, k top-k, Im expert hidden, Is shared-expert hidden, V vocab.
#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "backend/cpu/attention.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/moe.h"
#include "backend/cpu/nn_ops.h"
#include "core/check.h"
#include "core/philox.h"

namespace nibble::model {

namespace {

// One linear layer: a LinearRecipe for float models, plain GEMMs for the double model.
template <typename T>
struct LinearSlot {
  LinearInfo info;
  int64_t w_offset = 0;  // into the flat parameter / gradient buffers
  std::unique_ptr<LinearRecipe> recipe;
  const T* x = nullptr;  // double path: saved operands
  const T* w = nullptr;

  // y: (M,N); x: (M,K); w: (N,K)
  void forward(T* y, const T* xx, const T* ww, int64_t M, const LinearCall& call) {
    if constexpr (std::is_same_v<T, float>) {
      recipe->forward(y, xx, ww, M, info.N, info.K, call);
    } else {
      cpu::matmul_nt(y, xx, ww, M, info.N, info.K);
      x = xx;
      w = ww;
    }
  }
  // dx: (M,K) overwritten; dw: (N,K) +=; dy: (M,N)
  void backward(T* dx, T* dw, const T* dy, int64_t M, const LinearCall& call) {
    if constexpr (std::is_same_v<T, float>) {
      recipe->backward(dx, dw, dy, M, info.N, info.K, call);
    } else {
      cpu::matmul_nn(dx, dy, w, M, info.K, info.N);
      cpu::matmul_tn(dw, dy, x, info.N, info.K, M, true);
    }
  }
};

// Parameter offsets of one block (-1 where absent).
struct BlockParams {
  int64_t input_ln = -1;                  // qwen: input_layernorm (C)
  int64_t q_norm = -1, k_norm = -1;       // olmo: (Nq), (Nkv); qwen: (D), (D)
  int64_t post_attn_ln = -1;              // (C)
  int64_t post_ff_ln = -1;                // olmo: (C)
  int64_t router = -1;                    // qwen moe: mlp.gate (E,C)
  int lin_qkv = -1, lin_o = -1, lin_gate_up = -1, lin_down = -1;
  int lin_expert0 = -1;                   // expert e: gate_up = lin_expert0 + 2e, down = +1
  int lin_shared_gate_up = -1, lin_shared_down = -1;
  bool moe = false;
  int moe_index = -1;                     // index among MoE layers
};

// Saved activations of one block (pointers into the arena).
template <typename T>
struct BlockActs {
  T *ln1 = nullptr, *ln1_rstd = nullptr;           // qwen (N,C), (N)
  T *q_raw = nullptr, *k_raw = nullptr, *v = nullptr;  // (N,Nq), (N,Nkv), (N,Nkv)
  T *q_rstd = nullptr, *k_rstd = nullptr;          // olmo (N); qwen (N*H), (N*Hkv)
  T *q_rot = nullptr, *k_rot = nullptr;            // (N,Nq), (N,Nkv)
  T *att = nullptr;                                // (B,H,T,T)
  T *att_out = nullptr;                            // (N,Nq)
  T *o = nullptr, *o_rstd = nullptr;               // olmo (N,C), (N)
  T *h = nullptr;                                  // (N,C)
  T *ln2 = nullptr, *ln2_rstd = nullptr;           // qwen (N,C), (N)
  T *gu = nullptr, *act = nullptr;                 // dense (N,2I), (N,I)
  T *m = nullptr, *m_rstd = nullptr;               // olmo (N,C), (N)
  T *rlogits = nullptr, *probs = nullptr, *rlse = nullptr, *topk_w = nullptr;  // (N,E),(N,E),(N),(N,k)
  int32_t *topk_idx = nullptr, *row_of_slot = nullptr, *token_of_row = nullptr;  // (N,k),(N*k),(N*k)
  int64_t* offsets = nullptr;                      // (E+1)
  T *xe = nullptr, *gue = nullptr, *acte = nullptr, *ye = nullptr;  // (Nk,C),(Nk,2Im),(Nk,Im),(Nk,C)
  T *sgu = nullptr, *sact = nullptr;               // shared (N,2Is), (N,Is)
};

}  // namespace

template <typename T>
struct TransformerT<T>::Impl {
  std::vector<LinearSlot<T>> linears;
  std::vector<BlockParams> blocks;
  int64_t embed = -1, final_norm = -1, lm_head = -1;
  std::vector<T> rope_cos, rope_sin;  // (P, D/2)

  // arena state
  int64_t B = 0, Tn = 0;
  std::vector<T> arena;
  std::vector<int32_t> iarena;
  std::vector<int64_t> larena;
  std::vector<BlockActs<T>> acts;
  std::vector<T*> res;  // L+1 residual streams (N,C)
  T *qkv = nullptr, *mtmp = nullptr, *sy = nullptr, *xf = nullptr, *xf_rstd = nullptr, *logits = nullptr, *lse = nullptr,
    *tok_ce = nullptr;
  T *dres = nullptr, *dt1 = nullptr, *dt2 = nullptr, *dt3 = nullptr, *dqkv = nullptr, *dq = nullptr, *dk = nullptr,
    *dv = nullptr, *datt = nullptr, *dk2 = nullptr, *dgu = nullptr, *dact = nullptr, *dye = nullptr, *dxe = nullptr,
    *dgue = nullptr, *dacte = nullptr, *dtopk = nullptr, *drl = nullptr;
  // MoE statistics of the current forward (double sums over MoE layers)
  std::vector<double> load_count, load_prob;
  double router_lse2 = 0;
};

// ---- construction -------------------------------------------------------------------------------
template <typename T>
TransformerT<T>::TransformerT(const ModelConfig& config) : config_(config), impl_(new Impl) {}

template <typename T>
TransformerT<T>::~TransformerT() = default;

template <typename T>
Result<std::unique_ptr<TransformerT<T>>> TransformerT<T>::create(const ModelConfig& cfg, const RecipeConfig& recipe) {
  std::unique_ptr<TransformerT<T>> m(new TransformerT<T>(cfg));
  Impl& im = *m->impl_;
  const bool olmo = cfg.arch == Architecture::kOlmo2;
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, D = cfg.head_dim;
  const int64_t Nq = cfg.q_width(), Nkv = cfg.kv_width(), L = cfg.num_hidden_layers;

  int64_t offset = 0;
  auto add = [&](const std::string& name, Shape shape, bool wd) {
    int64_t n = shape_numel(shape);
    m->params_.push_back(ParamRef<T>{name, shape, nullptr, nullptr, n, wd});
    int64_t at = offset;
    offset += n;
    return at;
  };
  auto add_linear = [&](const std::string& name, LinearKind kind, int block, int expert, int64_t N, int64_t K,
                        int64_t w_offset) {
    LinearSlot<T> s;
    s.info = LinearInfo{static_cast<int>(im.linears.size()), name, kind, block, static_cast<int>(L), expert, N, K};
    s.w_offset = w_offset;
    im.linears.push_back(std::move(s));
    return static_cast<int>(im.linears.size() - 1);
  };

  im.embed = add("model.embed_tokens.weight", {V, C}, /*wd=*/false);
  for (int64_t l = 0; l < L; ++l) {
    BlockParams bp;
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (!olmo) bp.input_ln = add(p + "input_layernorm.weight", {C}, true);
    int64_t q = add(p + "self_attn.q_proj.weight", {Nq, C}, true);
    add(p + "self_attn.k_proj.weight", {Nkv, C}, true);
    add(p + "self_attn.v_proj.weight", {Nkv, C}, true);
    int64_t o = add(p + "self_attn.o_proj.weight", {C, Nq}, true);
    bp.lin_qkv = add_linear(p + "self_attn.qkv_proj", LinearKind::kQkv, (int)l, -1, Nq + 2 * Nkv, C, q);
    bp.lin_o = add_linear(p + "self_attn.o_proj", LinearKind::kAttnOut, (int)l, -1, C, Nq, o);
    bp.q_norm = add(p + "self_attn.q_norm.weight", {olmo ? Nq : D}, true);
    bp.k_norm = add(p + "self_attn.k_norm.weight", {olmo ? Nkv : D}, true);
    bp.post_attn_ln = add(p + "post_attention_layernorm.weight", {C}, true);
    bp.moe = cfg.is_moe_layer(l);
    if (bp.moe) {
      const int64_t E = cfg.num_experts, Im = cfg.moe_intermediate_size;
      bp.moe_index = static_cast<int>(m->num_moe_layers_++);
      bp.router = add(p + "mlp.gate.weight", {E, C}, true);
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
        int64_t g = add(ep + "gate_proj.weight", {Im, C}, true);
        add(ep + "up_proj.weight", {Im, C}, true);
        int64_t d = add(ep + "down_proj.weight", {C, Im}, true);
        int id = add_linear(ep + "gate_up_proj", LinearKind::kExpertGateUp, (int)l, (int)e, 2 * Im, C, g);
        add_linear(ep + "down_proj", LinearKind::kExpertDown, (int)l, (int)e, C, Im, d);
        if (e == 0) bp.lin_expert0 = id;
      }
      if (cfg.shared_expert_intermediate_size > 0) {
        const int64_t Is = cfg.shared_expert_intermediate_size;
        const std::string sp = p + "mlp.shared_expert.";
        int64_t g = add(sp + "gate_proj.weight", {Is, C}, true);
        add(sp + "up_proj.weight", {Is, C}, true);
        int64_t d = add(sp + "down_proj.weight", {C, Is}, true);
        bp.lin_shared_gate_up = add_linear(sp + "gate_up_proj", LinearKind::kSharedGateUp, (int)l, -1, 2 * Is, C, g);
        bp.lin_shared_down = add_linear(sp + "down_proj", LinearKind::kSharedDown, (int)l, -1, C, Is, d);
      }
    } else {
      const int64_t I = cfg.intermediate_size;
      int64_t g = add(p + "mlp.gate_proj.weight", {I, C}, true);
      add(p + "mlp.up_proj.weight", {I, C}, true);
      int64_t d = add(p + "mlp.down_proj.weight", {C, I}, true);
      bp.lin_gate_up = add_linear(p + "mlp.gate_up_proj", LinearKind::kGateUp, (int)l, -1, 2 * I, C, g);
      bp.lin_down = add_linear(p + "mlp.down_proj", LinearKind::kDown, (int)l, -1, C, I, d);
    }
    if (olmo) bp.post_ff_ln = add(p + "post_feedforward_layernorm.weight", {C}, true);
    im.blocks.push_back(bp);
  }
  im.final_norm = add("model.norm.weight", {C}, true);
  im.lm_head = add("lm_head.weight", {V, C}, true);

  m->num_params_ = offset;
  m->value_storage_ = std::make_shared<Storage>(static_cast<size_t>(offset) * sizeof(T), Device::kCPU);
  m->grad_storage_ = std::make_shared<Storage>(static_cast<size_t>(offset) * sizeof(T), Device::kCPU);
  m->values_ = static_cast<T*>(m->value_storage_->data());
  m->grads_ = static_cast<T*>(m->grad_storage_->data());
  int64_t at = 0;
  for (auto& pr : m->params_) {
    pr.value = m->values_ + at;
    pr.grad = m->grads_ + at;
    at += pr.numel;
  }
  for (auto& s : im.linears) {
    m->linear_infos_.push_back(s.info);
    if constexpr (std::is_same_v<T, float>) {
      NIB_ASSIGN_OR_RETURN(s.recipe, make_linear_recipe(recipe, s.info));
      NIB_CHECK(s.recipe != nullptr);
    }
  }
  im.rope_cos.resize(cfg.max_position_embeddings * (D / 2));
  im.rope_sin.resize(cfg.max_position_embeddings * (D / 2));
  cpu::rope_table(im.rope_cos.data(), im.rope_sin.data(), cfg.max_position_embeddings, D, cfg.rope_theta);
  return m;
}

template <typename T>
void TransformerT<T>::init_weights(uint64_t seed) {
  const double std = config_.initializer_range;
  for (size_t i = 0; i < params_.size(); ++i) {
    ParamRef<T>& p = params_[i];
    if (p.shape.size() == 1) {
      for (int64_t j = 0; j < p.numel; ++j) p.value[j] = T(1);
      continue;
    }
    PhiloxStream rng(seed, i);
    for (int64_t j = 0; j < p.numel; ++j) {
      double z;
      do z = rng.next_normal();
      while (std::fabs(z) > 3.0);
      p.value[j] = static_cast<T>(z * std);
    }
  }
}

template <typename T>
void TransformerT<T>::zero_grad() {
  std::memset(grads_, 0, static_cast<size_t>(num_params_) * sizeof(T));
}

template <typename T>
ParamRef<T>* TransformerT<T>::find_param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

template <typename T>
LinearRecipe* TransformerT<T>::linear_recipe(int id) {
  NIB_CHECK(id >= 0 && id < (int)impl_->linears.size());
  return impl_->linears[id].recipe.get();
}

template <typename T>
T* TransformerT<T>::linear_weight(int id) {
  NIB_CHECK(id >= 0 && id < (int)impl_->linears.size());
  return values_ + impl_->linears[id].w_offset;
}

template <typename T>
std::vector<Parameter> TransformerT<T>::parameters() {
  std::vector<Parameter> out;
  if constexpr (std::is_same_v<T, float>) {
    for (auto& p : params_) {
      size_t off = static_cast<size_t>(p.value - values_) * sizeof(T);
      out.push_back(Parameter{p.name, Tensor(value_storage_, off, DType::kF32, p.shape),
                              Tensor(grad_storage_, off, DType::kF32, p.shape), p.weight_decay});
    }
  } else {
    NIB_CHECK_MSG(false, "parameters(): Tensor views exist for float models only; use param_refs()");
  }
  return out;
}

// ---- forward / backward -----------------------------------------------------------------------
template <typename T>
LossParts TransformerT<T>::forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t Tn,
                                            const LossOptions& options, const RoutingIO& routing) {
  NIB_CHECK(targets != nullptr);
  return run(tokens, targets, B, Tn, options, routing, /*backward=*/true, nullptr, nullptr);
}

template <typename T>
LossParts TransformerT<T>::forward_backward_custom(const int32_t* tokens, int64_t B, int64_t Tn,
                                                   const LogitsLossFn& loss_fn, const LossOptions& options,
                                                   const RoutingIO& routing) {
  return run(tokens, nullptr, B, Tn, options, routing, /*backward=*/true, nullptr, nullptr, &loss_fn);
}

template <typename T>
LossParts TransformerT<T>::forward_loss(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t Tn,
                                        const LossOptions& options, const RoutingIO& routing, T* token_ce) {
  NIB_CHECK(targets != nullptr);
  return run(tokens, targets, B, Tn, options, routing, /*backward=*/false, nullptr, token_ce);
}

template <typename T>
void TransformerT<T>::forward_logits(T* logits, const int32_t* tokens, int64_t B, int64_t Tn,
                                     const RoutingIO& routing) {
  NIB_CHECK(logits != nullptr);
  run(tokens, nullptr, B, Tn, LossOptions{}, routing, /*backward=*/false, logits, nullptr);
}

template <typename T>
LossParts TransformerT<T>::run(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t Tn,
                               const LossOptions& options, const RoutingIO& routing, bool backward, T* logits_out,
                               T* token_ce, const LogitsLossFn* custom_loss) {
  const ModelConfig& cfg = config_;
  Impl& im = *impl_;
  const bool olmo = cfg.arch == Architecture::kOlmo2;
  const int64_t N = B * Tn, C = cfg.hidden_size, V = cfg.vocab_size, L = cfg.num_hidden_layers;
  const int64_t H = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads, D = cfg.head_dim;
  const int64_t Nq = H * D, Nkv = Hkv * D, Nqkv = Nq + 2 * Nkv;
  const int64_t I = cfg.intermediate_size, E = cfg.num_experts, K = cfg.num_experts_per_tok;
  const int64_t Im = cfg.moe_intermediate_size, Is = cfg.shared_expert_intermediate_size, Nk = N * K;
  const double eps = cfg.rms_norm_eps;
  NIB_CHECK_MSG(B > 0 && Tn > 0, "empty batch");
  NIB_CHECK_MSG(Tn <= cfg.max_position_embeddings, "sequence length {} > max_position_embeddings {}", Tn,
                cfg.max_position_embeddings);
  auto W = [&](int64_t off) { return values_ + off; };
  auto G = [&](int64_t off) { return grads_ + off; };

  // ---- arena for (B,T) ----
  if (im.B != B || im.Tn != Tn) {
    std::vector<std::pair<T**, int64_t>> req;
    std::vector<std::pair<int32_t**, int64_t>> ireq;
    std::vector<std::pair<int64_t**, int64_t>> lreq;
    auto need = [&](T*& p, int64_t n) { req.push_back({&p, n}); };
    im.acts.assign(L, BlockActs<T>{});
    im.res.assign(L + 1, nullptr);
    for (int64_t l = 0; l <= L; ++l) need(im.res[l], N * C);
    int64_t max_hidden = 0;
    bool any_moe = false;
    for (int64_t l = 0; l < L; ++l) {
      BlockActs<T>& a = im.acts[l];
      const BlockParams& bp = im.blocks[l];
      if (!olmo) { need(a.ln1, N * C); need(a.ln1_rstd, N); }
      need(a.q_raw, N * Nq); need(a.k_raw, N * Nkv); need(a.v, N * Nkv);
      need(a.q_rstd, olmo ? N : N * H); need(a.k_rstd, olmo ? N : N * Hkv);
      need(a.q_rot, N * Nq); need(a.k_rot, N * Nkv);
      need(a.att, B * H * Tn * Tn); need(a.att_out, N * Nq);
      if (olmo) { need(a.o, N * C); need(a.o_rstd, N); }
      need(a.h, N * C);
      if (!olmo) { need(a.ln2, N * C); need(a.ln2_rstd, N); }
      if (olmo) { need(a.m, N * C); need(a.m_rstd, N); }
      if (bp.moe) {
        any_moe = true;
        need(a.rlogits, N * E); need(a.probs, N * E); need(a.rlse, N); need(a.topk_w, N * K);
        ireq.push_back({&a.topk_idx, N * K}); ireq.push_back({&a.row_of_slot, Nk}); ireq.push_back({&a.token_of_row, Nk});
        lreq.push_back({&a.offsets, E + 1});
        need(a.xe, Nk * C); need(a.gue, Nk * 2 * Im); need(a.acte, Nk * Im); need(a.ye, Nk * C);
        if (Is > 0) { need(a.sgu, N * 2 * Is); need(a.sact, N * Is); max_hidden = std::max(max_hidden, Is); }
      } else {
        need(a.gu, N * 2 * I); need(a.act, N * I);
        max_hidden = std::max(max_hidden, I);
      }
    }
    need(im.qkv, N * Nqkv); need(im.mtmp, N * C); need(im.sy, N * C);
    need(im.xf, N * C); need(im.xf_rstd, N); need(im.logits, N * V); need(im.lse, N); need(im.tok_ce, N);
    need(im.dres, N * C); need(im.dt1, N * C); need(im.dt2, N * C); need(im.dt3, N * C);
    need(im.dqkv, N * Nqkv); need(im.dq, N * Nq); need(im.dk, N * Nkv); need(im.dv, N * Nkv);
    need(im.datt, N * Nq); need(im.dk2, N * Nkv);
    need(im.dgu, N * 2 * max_hidden); need(im.dact, N * max_hidden);
    if (any_moe) {
      need(im.dye, Nk * C); need(im.dxe, Nk * C); need(im.dgue, Nk * 2 * Im); need(im.dacte, Nk * Im);
      need(im.dtopk, N * K); need(im.drl, N * E);
    }
    auto round16 = [](int64_t n) { return (n + 15) / 16 * 16; };
    int64_t total = 0, itotal = 0, ltotal = 0;
    for (auto& r : req) total += round16(r.second);
    for (auto& r : ireq) itotal += r.second;
    for (auto& r : lreq) ltotal += r.second;
    // Grow only: a smaller (B,T) (eval, generation) reuses the memory of a larger one. Every
    // buffer is fully written before it is read, so stale contents never leak into results.
    if (im.arena.size() < static_cast<size_t>(total)) im.arena.resize(static_cast<size_t>(total));
    if (im.iarena.size() < static_cast<size_t>(itotal)) im.iarena.resize(static_cast<size_t>(itotal));
    if (im.larena.size() < static_cast<size_t>(ltotal)) im.larena.resize(static_cast<size_t>(ltotal));
    int64_t at = 0;
    for (auto& r : req) { *r.first = im.arena.data() + at; at += round16(r.second); }
    at = 0;
    for (auto& r : ireq) { *r.first = im.iarena.data() + at; at += r.second; }
    at = 0;
    for (auto& r : lreq) { *r.first = im.larena.data() + at; at += r.second; }
    im.B = B;
    im.Tn = Tn;
  }

  const int64_t call_id = micro_step_++;
  auto call = [&](const LinearSlot<T>& s) {
    return LinearCall{step_, seed_, s.info.id, call_id, backward};
  };
  const T* cosp = im.rope_cos.data();
  const T* sinp = im.rope_sin.data();
  const int64_t Lm = num_moe_layers_;
  im.load_count.assign(E > 0 ? E : 0, 0.0);
  im.load_prob.assign(E > 0 ? E : 0, 0.0);
  im.router_lse2 = 0;

  // ---- MLP forward: m (N,C) = MLP(x (N,C)) ----
  auto mlp_forward = [&](T* m, const T* x, int64_t l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    if (!bp.moe) {
      auto& gu = im.linears[bp.lin_gate_up];
      auto& dn = im.linears[bp.lin_down];
      gu.forward(a.gu, x, W(gu.w_offset), N, call(gu));
      cpu::swiglu_forward(a.act, a.gu, N, I);
      dn.forward(m, a.act, W(dn.w_offset), N, call(dn));
      return;
    }
    cpu::matmul_nt(a.rlogits, x, W(bp.router), N, E, C);  // router in full precision
    const int32_t* forced = routing.forced ? routing.forced + bp.moe_index * Nk : nullptr;
    cpu::moe_router_forward(a.probs, a.rlse, a.topk_idx, a.topk_w, a.rlogits, forced, N, E, K, cfg.norm_topk_prob);
    if (routing.record) std::memcpy(routing.record + bp.moe_index * Nk, a.topk_idx, sizeof(int32_t) * Nk);
    cpu::moe_accumulate_load(im.load_count.data(), im.load_prob.data(), a.probs, a.topk_idx, N, E, K);
    for (int64_t n = 0; n < N; ++n) im.router_lse2 += static_cast<double>(a.rlse[n]) * a.rlse[n];
    cpu::moe_dispatch_plan(a.offsets, a.row_of_slot, a.token_of_row, a.topk_idx, N, E, K);
    cpu::moe_gather(a.xe, x, a.token_of_row, Nk, C);
    for (int64_t e = 0; e < E; ++e) {
      int64_t r0 = a.offsets[e], rows = a.offsets[e + 1] - r0;
      if (rows == 0) continue;  // no call: quantized recipes never see empty GEMMs
      auto& gu = im.linears[bp.lin_expert0 + 2 * e];
      auto& dn = im.linears[bp.lin_expert0 + 2 * e + 1];
      gu.forward(a.gue + r0 * 2 * Im, a.xe + r0 * C, W(gu.w_offset), rows, call(gu));
      cpu::swiglu_forward(a.acte + r0 * Im, a.gue + r0 * 2 * Im, rows, Im);
      dn.forward(a.ye + r0 * C, a.acte + r0 * Im, W(dn.w_offset), rows, call(dn));
    }
    cpu::moe_combine(m, a.ye, a.topk_w, a.row_of_slot, N, K, C);
    if (Is > 0) {
      auto& gu = im.linears[bp.lin_shared_gate_up];
      auto& dn = im.linears[bp.lin_shared_down];
      gu.forward(a.sgu, x, W(gu.w_offset), N, call(gu));
      cpu::swiglu_forward(a.sact, a.sgu, N, Is);
      dn.forward(im.sy, a.sact, W(dn.w_offset), N, call(dn));
      cpu::add_inplace(m, im.sy, N * C);
    }
  };

  // ---- forward ----
  cpu::embedding_forward(im.res[0], tokens, W(im.embed), N, V, C);
  for (int64_t l = 0; l < L; ++l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    const T* x = im.res[l];
    T* out = im.res[l + 1];
    const T* attn_in = x;
    if (!olmo) {
      cpu::rmsnorm_forward(a.ln1, a.ln1_rstd, x, W(bp.input_ln), N, C, eps);
      attn_in = a.ln1;
    }
    auto& lq = im.linears[bp.lin_qkv];
    lq.forward(im.qkv, attn_in, W(lq.w_offset), N, call(lq));
    for (int64_t n = 0; n < N; ++n) {  // split the fused (N, Nq|Nkv|Nkv) rows
      std::memcpy(a.q_raw + n * Nq, im.qkv + n * Nqkv, sizeof(T) * Nq);
      std::memcpy(a.k_raw + n * Nkv, im.qkv + n * Nqkv + Nq, sizeof(T) * Nkv);
      std::memcpy(a.v + n * Nkv, im.qkv + n * Nqkv + Nq + Nkv, sizeof(T) * Nkv);
    }
    // QK-norm: OLMo-2 over the full width (rows N), Qwen3 per head (rows N*H of width D)
    if (olmo) {
      cpu::rmsnorm_forward(a.q_rot, a.q_rstd, a.q_raw, W(bp.q_norm), N, Nq, eps);
      cpu::rmsnorm_forward(a.k_rot, a.k_rstd, a.k_raw, W(bp.k_norm), N, Nkv, eps);
    } else {
      cpu::rmsnorm_forward(a.q_rot, a.q_rstd, a.q_raw, W(bp.q_norm), N * H, D, eps);
      cpu::rmsnorm_forward(a.k_rot, a.k_rstd, a.k_raw, W(bp.k_norm), N * Hkv, D, eps);
    }
    cpu::rope_forward(a.q_rot, a.q_rot, cosp, sinp, nullptr, B, Tn, H, D);
    cpu::rope_forward(a.k_rot, a.k_rot, cosp, sinp, nullptr, B, Tn, Hkv, D);
    cpu::attention_forward(a.att_out, a.att, a.q_rot, a.k_rot, a.v, B, Tn, H, Hkv, D);
    auto& lo = im.linears[bp.lin_o];
    if (olmo) {
      lo.forward(a.o, a.att_out, W(lo.w_offset), N, call(lo));
      cpu::rmsnorm_forward(a.h, a.o_rstd, a.o, W(bp.post_attn_ln), N, C, eps);
      cpu::add_inplace(a.h, x, N * C);                      // h = x + RMSNorm(Attn(x))
      mlp_forward(a.m, a.h, l);
      cpu::rmsnorm_forward(out, a.m_rstd, a.m, W(bp.post_ff_ln), N, C, eps);
      cpu::add_inplace(out, a.h, N * C);                    // out = h + RMSNorm(MLP(h))
    } else {
      lo.forward(im.mtmp, a.att_out, W(lo.w_offset), N, call(lo));
      cpu::add(a.h, x, im.mtmp, N * C);                     // h = x + Attn(RMSNorm(x))
      cpu::rmsnorm_forward(a.ln2, a.ln2_rstd, a.h, W(bp.post_attn_ln), N, C, eps);
      mlp_forward(im.mtmp, a.ln2, l);
      cpu::add(out, a.h, im.mtmp, N * C);                   // out = h + MLP(RMSNorm(h))
    }
  }
  cpu::rmsnorm_forward(im.xf, im.xf_rstd, im.res[L], W(im.final_norm), N, C, eps);
  if (logits_out) {
    cpu::matmul_nt(logits_out, im.xf, W(im.lm_head), N, V, C);
    return LossParts{};
  }
  cpu::matmul_nt(im.logits, im.xf, W(im.lm_head), N, V, C);

  // ---- loss ----
  // After this block im.logits holds dL/dlogits when backward is set (the fused CE op and the
  // custom loss both work in place).
  LossParts lp;
  if (custom_loss) {
    lp.ce = (*custom_loss)(im.logits, N, V);
  } else {
    cpu::CrossEntropySums sums;
    if (backward) {
      int64_t n_valid = 0;
      for (int64_t n = 0; n < N; ++n) n_valid += targets[n] >= 0;
      const double inv = n_valid > 0 ? 1.0 / static_cast<double>(n_valid) : 0.0;
      sums = cpu::cross_entropy_forward_backward(im.logits, im.lse, token_ce ? token_ce : im.tok_ce, im.logits,
                                                 targets, N, V, inv, options.z_loss_coef * inv);
    } else {
      sums = cpu::cross_entropy_forward(im.lse, token_ce, im.logits, targets, N, V);
    }
    lp.n_tokens = sums.n_valid;
    const double inv_n = sums.n_valid > 0 ? 1.0 / static_cast<double>(sums.n_valid) : 0.0;
    lp.ce = sums.ce_sum * inv_n;
    lp.z_loss = sums.z_sum * inv_n;
  }
  const double aux_coef = options.router_aux_loss_coef >= 0 ? options.router_aux_loss_coef : cfg.router_aux_loss_coef;
  const double rz_coef = options.router_z_loss_coef >= 0 ? options.router_z_loss_coef : cfg.router_z_loss_coef;
  std::vector<double> f(E > 0 ? E : 0, 0.0);
  if (Lm > 0) {
    const double denom = static_cast<double>(Lm) * static_cast<double>(N);
    for (int64_t e = 0; e < E; ++e) {
      f[e] = im.load_count[e] / denom;
      lp.aux_loss += f[e] * (im.load_prob[e] / denom);
    }
    lp.aux_loss *= static_cast<double>(E);
    lp.router_z_loss = im.router_lse2 / denom;
  }
  lp.loss = lp.ce + options.z_loss_coef * lp.z_loss + aux_coef * lp.aux_loss + rz_coef * lp.router_z_loss;
  if (!backward) return lp;

  // ---- backward ----
  std::vector<T> aux_extra(E > 0 ? E : 0, T(0));
  double router_z_scale = 0;
  if (Lm > 0) {
    const double denom = static_cast<double>(Lm) * static_cast<double>(N);
    for (int64_t e = 0; e < E; ++e) aux_extra[e] = static_cast<T>(aux_coef * static_cast<double>(E) * f[e] / denom);
    router_z_scale = rz_coef / denom;
  }
  T* dlogits = im.logits;  // written in place by the loss above
  cpu::matmul_nn(im.dt1, dlogits, W(im.lm_head), N, C, V);               // dxf (N,C)
  cpu::matmul_tn(G(im.lm_head), dlogits, im.xf, V, C, N, true);          // dW_lm (V,C)
  cpu::rmsnorm_backward(im.dres, G(im.final_norm), im.dt1, im.res[L], W(im.final_norm), im.xf_rstd, N, C);

  // dx (N,C) = d MLP(x) / dx applied to dm (N,C)
  auto mlp_backward = [&](T* dx, const T* dm, const T* x, int64_t l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    if (!bp.moe) {
      auto& gu = im.linears[bp.lin_gate_up];
      auto& dn = im.linears[bp.lin_down];
      dn.backward(im.dact, G(dn.w_offset), dm, N, call(dn));
      cpu::swiglu_backward(im.dgu, im.dact, a.gu, N, I);
      gu.backward(dx, G(gu.w_offset), im.dgu, N, call(gu));
      return;
    }
    cpu::moe_combine_backward(im.dye, im.dtopk, dm, a.ye, a.topk_w, a.row_of_slot, N, K, C);
    for (int64_t e = 0; e < E; ++e) {
      int64_t r0 = a.offsets[e], rows = a.offsets[e + 1] - r0;
      if (rows == 0) continue;
      auto& gu = im.linears[bp.lin_expert0 + 2 * e];
      auto& dn = im.linears[bp.lin_expert0 + 2 * e + 1];
      dn.backward(im.dacte + r0 * Im, G(dn.w_offset), im.dye + r0 * C, rows, call(dn));
      cpu::swiglu_backward(im.dgue + r0 * 2 * Im, im.dacte + r0 * Im, a.gue + r0 * 2 * Im, rows, Im);
      gu.backward(im.dxe + r0 * C, G(gu.w_offset), im.dgue + r0 * 2 * Im, rows, call(gu));
    }
    cpu::moe_gather_backward(dx, im.dxe, a.row_of_slot, N, K, C);
    const bool renorm = cfg.norm_topk_prob || routing.forced != nullptr;
    cpu::moe_router_backward(im.drl, im.dtopk, a.probs, a.rlse, a.topk_idx, a.topk_w, aux_extra.data(),
                             router_z_scale, N, E, K, renorm);
    cpu::matmul_nn(dx, im.drl, W(bp.router), N, C, E, /*accumulate=*/true);  // dx += drl (N,E) . Wg (E,C)
    cpu::matmul_tn(G(bp.router), im.drl, x, E, C, N, true);                 // dWg += drl^T . x
    if (Is > 0) {
      auto& gu = im.linears[bp.lin_shared_gate_up];
      auto& dn = im.linears[bp.lin_shared_down];
      dn.backward(im.dact, G(dn.w_offset), dm, N, call(dn));
      cpu::swiglu_backward(im.dgu, im.dact, a.sgu, N, Is);
      gu.backward(im.dt3, G(gu.w_offset), im.dgu, N, call(gu));
      cpu::add_inplace(dx, im.dt3, N * C);
    }
  };

  // datt (N,Nq) -> dqkv (N,Nqkv): attention, RoPE and QK-norm backward
  auto attention_block_backward = [&](int64_t l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    cpu::attention_backward(im.dq, im.dk, im.dv, im.datt, a.att, a.q_rot, a.k_rot, a.v, B, Tn, H, Hkv, D);
    cpu::rope_backward(im.dq, im.dq, cosp, sinp, nullptr, B, Tn, H, D);
    cpu::rope_backward(im.dk, im.dk, cosp, sinp, nullptr, B, Tn, Hkv, D);
    T* dq_raw = im.datt;  // datt is dead now: reuse it
    if (olmo) {
      cpu::rmsnorm_backward(dq_raw, G(bp.q_norm), im.dq, a.q_raw, W(bp.q_norm), a.q_rstd, N, Nq);
      cpu::rmsnorm_backward(im.dk2, G(bp.k_norm), im.dk, a.k_raw, W(bp.k_norm), a.k_rstd, N, Nkv);
    } else {
      cpu::rmsnorm_backward(dq_raw, G(bp.q_norm), im.dq, a.q_raw, W(bp.q_norm), a.q_rstd, N * H, D);
      cpu::rmsnorm_backward(im.dk2, G(bp.k_norm), im.dk, a.k_raw, W(bp.k_norm), a.k_rstd, N * Hkv, D);
    }
    for (int64_t n = 0; n < N; ++n) {
      std::memcpy(im.dqkv + n * Nqkv, dq_raw + n * Nq, sizeof(T) * Nq);
      std::memcpy(im.dqkv + n * Nqkv + Nq, im.dk2 + n * Nkv, sizeof(T) * Nkv);
      std::memcpy(im.dqkv + n * Nqkv + Nq + Nkv, im.dv + n * Nkv, sizeof(T) * Nkv);
    }
  };

  for (int64_t l = L - 1; l >= 0; --l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    auto& lq = im.linears[bp.lin_qkv];
    auto& lo = im.linears[bp.lin_o];
    // im.dres holds dL/d(out of block l)
    if (olmo) {
      cpu::rmsnorm_backward(im.dt1, G(bp.post_ff_ln), im.dres, a.m, W(bp.post_ff_ln), a.m_rstd, N, C);  // dm
      mlp_backward(im.dt2, im.dt1, a.h, l);
      cpu::add_inplace(im.dres, im.dt2, N * C);                                                            // dh
      cpu::rmsnorm_backward(im.dt1, G(bp.post_attn_ln), im.dres, a.o, W(bp.post_attn_ln), a.o_rstd, N, C);  // do
      lo.backward(im.datt, G(lo.w_offset), im.dt1, N, call(lo));
      attention_block_backward(l);
      lq.backward(im.dt1, G(lq.w_offset), im.dqkv, N, call(lq));
      cpu::add_inplace(im.dres, im.dt1, N * C);                                                            // dx
    } else {
      mlp_backward(im.dt1, im.dres, a.ln2, l);                                                             // dln2
      cpu::rmsnorm_backward(im.dt2, G(bp.post_attn_ln), im.dt1, a.h, W(bp.post_attn_ln), a.ln2_rstd, N, C);
      cpu::add_inplace(im.dres, im.dt2, N * C);                                                            // dh
      lo.backward(im.datt, G(lo.w_offset), im.dres, N, call(lo));
      attention_block_backward(l);
      lq.backward(im.dt1, G(lq.w_offset), im.dqkv, N, call(lq));                                           // dln1
      cpu::rmsnorm_backward(im.dt2, G(bp.input_ln), im.dt1, im.res[l], W(bp.input_ln), a.ln1_rstd, N, C);
      cpu::add_inplace(im.dres, im.dt2, N * C);                                                            // dx
    }
  }
  cpu::embedding_backward(G(im.embed), im.dres, tokens, N, V, C);
  return lp;
}

template class TransformerT<float>;
template class TransformerT<double>;

}  // namespace nibble::model
