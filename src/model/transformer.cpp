// Forward and backward of the OLMo-2 and Qwen3-MoE transformers (see transformer.h), written
// out once, layer by layer, over the ops of backend::Backend like llm.c's gpt2_forward /
// gpt2_backward (the double model runs the same code over CpuOpsF64, the same method names on
// the templated cpu:: functions). Activations live in one backend-memory arena sized for (B,T)
// and reused across calls (grow-only); backward scratch is shared by all layers. Shapes: N = B*T rows, C hidden, H/Hkv heads, D head dim, Nq = H*D, Nkv = Hkv*D,
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
#include "core/parallel.h"
#include "core/philox.h"

namespace nibble::model {

namespace {

// The double model's ops: the Backend's method names (those the layer code calls) forwarding to
// the templated cpu:: functions, non-virtual. Memory of the double model is host memory from
// backend::cpu_backend(). Gradient checks only.
struct CpuOpsF64 {
  using T = double;
  void matmul_nt(T* y, const T* x, const T* w, int64_t M, int64_t N, int64_t K, bool acc = false, bool = false) {
    cpu::matmul_nt(y, x, w, M, N, K, acc);
  }
  void matmul_nn(T* y, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool acc = false, bool = false) {
    cpu::matmul_nn(y, a, b, M, N, K, acc);
  }
  void matmul_tn(T* y, const T* a, const T* b, int64_t M, int64_t N, int64_t K, bool acc = false, bool = false) {
    cpu::matmul_tn(y, a, b, M, N, K, acc);
  }
  void embedding_forward(T* out, const int32_t* tokens, const T* wte, int64_t N, int64_t V, int64_t C) {
    cpu::embedding_forward(out, tokens, wte, N, V, C);
  }
  void embedding_backward(T* dwte, const T* dout, const int32_t* tokens, int64_t N, int64_t V, int64_t C) {
    cpu::embedding_backward(dwte, dout, tokens, N, V, C);
  }
  void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int64_t R, int64_t C, double eps) {
    cpu::rmsnorm_forward(out, rstd, x, w, R, C, eps);
  }
  void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int64_t R, int64_t C) {
    cpu::rmsnorm_backward(dx, dw, dout, x, w, rstd, R, C);
  }
  void rope_forward(T* out, const T* x, const T* cos, const T* sin, const int32_t* pos, int64_t B, int64_t Tn,
                    int64_t H, int64_t D) {
    cpu::rope_forward(out, x, cos, sin, pos, B, Tn, H, D);
  }
  void rope_backward(T* dx, const T* dout, const T* cos, const T* sin, const int32_t* pos, int64_t B, int64_t Tn,
                     int64_t H, int64_t D) {
    cpu::rope_backward(dx, dout, cos, sin, pos, B, Tn, H, D);
  }
  void swiglu_forward(T* out, const T* gu, int64_t N, int64_t I) { cpu::swiglu_forward(out, gu, N, I); }
  void swiglu_backward(T* dgu, const T* dout, const T* gu, int64_t N, int64_t I) {
    cpu::swiglu_backward(dgu, dout, gu, N, I);
  }
  // The double model's attention is exact whatever precision the float model asks for.
  void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, int64_t B, int64_t Tn, int64_t H,
                         int64_t Hkv, int64_t D, backend::AttentionPrecision) {
    cpu::attention_forward(out, lse, q, k, v, B, Tn, H, Hkv, D);
  }
  void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* lse, const T* q, const T* k,
                          const T* v, int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                          backend::AttentionPrecision) {
    cpu::attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D);
  }
  // sums (4) <- {ce_sum, z_sum, n_valid, 0} (backend.h's cross_entropy_*_sums; host memory here)
  static void store(double* sums, const cpu::CrossEntropySums& s) {
    sums[0] = s.ce_sum, sums[1] = s.z_sum, sums[2] = static_cast<double>(s.n_valid), sums[3] = 0.0;
  }
  void cross_entropy_forward_sums(double* sums, T* lse, T* token_ce, const T* logits, const int32_t* targets,
                                  int64_t N, int64_t V) {
    store(sums, cpu::cross_entropy_forward(lse, token_ce, logits, targets, N, V));
  }
  void cross_entropy_forward_backward_sums(double* sums, T* dlogits, T* lse, T* token_ce, const T* logits,
                                           const int32_t* targets, int64_t N, int64_t V, double ce_scale,
                                           double z_scale) {
    store(sums, cpu::cross_entropy_forward_backward(dlogits, lse, token_ce, logits, targets, N, V, ce_scale, z_scale));
  }
  void add_inplace(T* y, const T* x, int64_t n) { cpu::add_inplace(y, x, n); }
  void add(T* y, const T* a, const T* b, int64_t n) { cpu::add(y, a, b, n); }
  void copy_2d(T* dst, int64_t dst_ld, const T* src, int64_t src_ld, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dst_ld, src + r * src_ld, sizeof(T) * cols);
  }
  void moe_router_forward(T* probs, T* lse, int32_t* topk_idx, T* topk_w, const T* logits, const int32_t* forced,
                          int64_t N, int64_t E, int64_t k, bool norm_topk_prob) {
    cpu::moe_router_forward(probs, lse, topk_idx, topk_w, logits, forced, N, E, k, norm_topk_prob);
  }
  void moe_router_backward(T* dlogits, const T* dtopk_w, const T* probs, const T* lse, const int32_t* topk_idx,
                           const T* topk_w, const T* dprobs_extra, double z_scale, int64_t N, int64_t E, int64_t k,
                           bool renormalized) {
    cpu::moe_router_backward(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, dprobs_extra, z_scale, N, E, k,
                             renormalized);
  }
  void moe_dispatch_plan(int64_t* offsets_host, int32_t* row_of_slot, int32_t* token_of_row, const int32_t* topk_idx,
                         int64_t N, int64_t E, int64_t k) {
    cpu::moe_dispatch_plan(offsets_host, row_of_slot, token_of_row, topk_idx, N, E, k);
  }
  void moe_gather(T* xe, const T* x, const int32_t* token_of_row, int64_t rows, int64_t C) {
    cpu::moe_gather(xe, x, token_of_row, rows, C);
  }
  void moe_gather_backward(T* dx, const T* dxe, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) {
    cpu::moe_gather_backward(dx, dxe, row_of_slot, N, k, C);
  }
  void moe_combine(T* out, const T* ye, const T* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k,
                   int64_t C) {
    cpu::moe_combine(out, ye, topk_w, row_of_slot, N, k, C);
  }
  void moe_combine_backward(T* dye, T* dtopk_w, const T* dout, const T* ye, const T* topk_w,
                            const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) {
    cpu::moe_combine_backward(dye, dtopk_w, dout, ye, topk_w, row_of_slot, N, k, C);
  }
  double moe_accumulate_load(double* count_host, double* prob_sum_host, const T* probs, const T* lse,
                             const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
    cpu::moe_accumulate_load(count_host, prob_sum_host, probs, topk_idx, N, E, k);
    double lse2 = 0;
    for (int64_t n = 0; n < N; ++n) lse2 += lse[n] * lse[n];
    return lse2;
  }
};

// The ops of a T model: the Backend for float, CpuOpsF64 for double.
template <typename T>
using OpsOf = std::conditional_t<std::is_same_v<T, float>, backend::Backend, CpuOpsF64>;

// One linear layer: a LinearRecipe for float models, plain GEMMs for the double model.
template <typename T>
struct LinearSlot {
  LinearInfo info;
  int64_t w_offset = 0;  // into the flat parameter / gradient buffers (-1: not kept, kInference)
  size_t first_param = 0, num_params = 0;  // its members in param_refs(): [first, first + num)
  std::unique_ptr<LinearRecipe> recipe;
  const T* x = nullptr;  // double path: saved operands
  const T* w = nullptr;
  LinearOverride* decode_override = nullptr;  // set for the duration of a forward_decode call

  // y: (M,N); x: (M,K); w: (N,K)
  void forward(OpsOf<T>& ops, T* y, const T* xx, const T* ww, int64_t M, const LinearCall& call) {
    if constexpr (std::is_same_v<T, float>) {
      if (decode_override != nullptr) return decode_override->forward(ops, y, xx, ww, M, info, call);
      recipe->forward(ops, y, xx, ww, M, info.N, info.K, call);
    } else {
      ops.matmul_nt(y, xx, ww, M, info.N, info.K);
      x = xx;
      w = ww;
    }
  }
  // dx: (M,K) overwritten; dw: (N,K) +=; dy: (M,N)
  void backward(OpsOf<T>& ops, T* dx, T* dw, const T* dy, int64_t M, const LinearCall& call) {
    if constexpr (std::is_same_v<T, float>) {
      recipe->backward(ops, dx, dw, dy, M, info.N, info.K, call);
    } else {
      ops.matmul_nn(dx, dy, w, M, info.K, info.N);
      ops.matmul_tn(dw, dy, x, info.N, info.K, M, true);
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
  int64_t first = -1;                     // flat offset of the block's first parameter
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
  T *lse = nullptr;                                // (B,H,T) attention log-sum-exp
  T *att_out = nullptr;                            // (N,Nq)
  T *o = nullptr, *o_rstd = nullptr;               // olmo (N,C), (N)
  T *h = nullptr;                                  // (N,C)
  T *ln2 = nullptr, *ln2_rstd = nullptr;           // qwen (N,C), (N)
  T *gu = nullptr, *act = nullptr;                 // dense (N,2I), (N,I)
  T *m = nullptr, *m_rstd = nullptr;               // olmo (N,C), (N)
  T *rlogits = nullptr, *probs = nullptr, *rlse = nullptr, *topk_w = nullptr;  // (N,E),(N,E),(N),(N,k)
  int32_t *topk_idx = nullptr, *row_of_slot = nullptr, *token_of_row = nullptr;  // (N,k),(N*k),(N*k)
  int64_t* offsets = nullptr;                      // (E+1) host (per-expert loop)
  int64_t* offsets_dev = nullptr;                  // (E+1) backend memory (grouped experts)
  bool experts_grouped = false;                    // this forward ran the experts grouped
  T *xe = nullptr, *gue = nullptr, *acte = nullptr, *ye = nullptr;  // (Nk,C),(Nk,2Im),(Nk,Im),(Nk,C)
  T *sgu = nullptr, *sact = nullptr;               // shared (N,2Is), (N,Is)
};

}  // namespace

void LinearOverride::forward_experts(backend::Backend&, float*, const float*, int64_t, const LinearInfo* infos,
                                     int64_t, const int64_t*, const int32_t*, const LinearCall&) {
  NIB_CHECK_MSG(false, "LinearOverride: forward_experts of {} called but not implemented",
                infos != nullptr ? infos[0].name : std::string("?"));
}

template <typename T>
struct TransformerT<T>::Impl {
  backend::Backend* mem = nullptr;  // owns the model's memory (the CPU backend for double)
  OpsOf<T>* ops = nullptr;          // runs the ops (== mem for float)
  CpuOpsF64 ops_f64;
  // Attention is not quantized by any recipe: BF16 (tensor cores on CUDA) for every recipe but
  // "fp32", which keeps FP32 attention (docs/architecture.md, issue #13).
  backend::AttentionPrecision attention_precision = backend::AttentionPrecision::kFp32;
  std::vector<LinearSlot<T>> linears;
  LinearWorkspace linear_ws;  // the recipes' transient scratch, shared by all linears (issue #13)
  std::vector<BlockParams> blocks;
  int64_t embed = -1, final_norm = -1, lm_head = -1;
  // lm_head (docs/training.md "lm_head"): BF16 operands for every recipe except fp32 (float only);
  // rows per logits chunk (0: lm_head_chunk_rows()).
  bool lm_head_bf16 = false;
  int64_t lm_chunk_rows = 0;
  // lm_head_bf16 only (float): BF16 bits of W (V,C) and xf (N,C), made once per forward, and of one
  // chunk's dL/dlogits (chunk rows, V), the operands of matmul_bf16_* (no per-GEMM conversions).
  backend::Buffer<uint16_t> lm_w_bits, lm_xf_bits, lm_dlogits_bits;
  backend::Buffer<T> logits_chunk;  // (chunk rows, V) logits, then dL/dlogits, of one chunk
  backend::Buffer<double> ce_chunk_sums;  // (chunks, 4) each chunk's cross-entropy sums (backend memory)
  std::vector<double> ce_chunk_sums_host;  // (chunks, 4) the same, read once per step
  backend::Buffer<T> logits_full;   // (N,V) only for forward_logits and a custom logits loss
  std::shared_ptr<backend::Buffer<T>> values, grads;  // (num_params) each, backend memory
  backend::Buffer<T> rope_cos, rope_sin;              // (P, D/2)

  // arena state (backend memory except larena, the host expert offsets)
  int64_t B = 0, Tn = 0;
  backend::Buffer<T> arena;
  backend::Buffer<int32_t> iarena;
  backend::Buffer<int64_t> offsets_dev;  // (Lm, E+1) expert offsets of the grouped experts
  // one ExpertGroup's recipes and calls (E each), refilled per call
  std::vector<LinearRecipe*> group_recipes;
  std::vector<LinearCall> group_calls;
  // a decode override's grouped experts: the E infos of each layer part, by the part's first
  // expert linear (made once: infos do not change)
  std::vector<std::vector<LinearInfo>> group_infos;
  std::vector<int64_t> larena;
  int32_t *tokens = nullptr, *targets = nullptr, *forced = nullptr;  // (N), (N), (Lm,N,k) copies of the host inputs
  int32_t* routing_out = nullptr;  // (Lm,N,k) the expert ids a RoutingIO::record asks for, read back once
  int32_t* positions = nullptr;                                       // (N) decode: each row's position
  const DecodeBatch* decode = nullptr;                                // set during forward_decode
  T* aux_extra = nullptr;                                             // (E) aux-loss dL/dprobs
  std::vector<BlockActs<T>> acts;
  std::vector<T*> res;  // L+1 residual streams (N,C)
  T *qkv = nullptr, *mtmp = nullptr, *sy = nullptr, *xf = nullptr, *xf_rstd = nullptr, *lse = nullptr,
    *tok_ce = nullptr;
  T *dres = nullptr, *dt1 = nullptr, *dt2 = nullptr, *dt3 = nullptr, *dqkv = nullptr, *dq = nullptr, *dk = nullptr,
    *dv = nullptr, *datt = nullptr, *dk2 = nullptr, *dgu = nullptr, *dact = nullptr, *dye = nullptr, *dxe = nullptr,
    *dgue = nullptr, *dacte = nullptr, *dtopk = nullptr, *drl = nullptr;
  // MoE statistics of the current forward (double sums over MoE layers)
  std::vector<double> load_count, load_prob, load_frac;  // (E) host
  double router_lse2 = 0;
  std::vector<T> aux_host, logits_host;  // (E); (N,V) for a custom loss on the host
};

// ---- construction -------------------------------------------------------------------------------
template <typename T>
TransformerT<T>::TransformerT(const ModelConfig& config) : config_(config), impl_(new Impl) {}

template <typename T>
TransformerT<T>::~TransformerT() = default;

template <typename T>
Result<std::unique_ptr<TransformerT<T>>> TransformerT<T>::create(const ModelConfig& cfg, const RecipeConfig& recipe,
                                                                  backend::Backend* be, ParameterStorage storage) {
  std::unique_ptr<TransformerT<T>> m(new TransformerT<T>(cfg));
  Impl& im = *m->impl_;
  NIB_CHECK_MSG((std::is_same_v<T, float> || storage == ParameterStorage::kTraining),
                "model: inference storage is for float models");
  m->storage_ = storage;
  const bool inference = storage == ParameterStorage::kInference;
  if constexpr (std::is_same_v<T, float>) {
    NIB_CHECK_MSG(be != nullptr, "model: no backend");
    im.mem = be;
    im.ops = be;
    im.lm_head_bf16 = recipe.name != "fp32";
  } else {
    im.mem = &backend::cpu_backend();  // the double model runs on the CPU whatever `be` is
    im.ops = &im.ops_f64;
  }
  m->be_ = im.mem;
  im.attention_precision =
      recipe.name == "fp32" ? backend::AttentionPrecision::kFp32 : backend::AttentionPrecision::kBf16;
  const bool olmo = cfg.arch == Architecture::kOlmo2;
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, D = cfg.head_dim;
  const int64_t Nq = cfg.q_width(), Nkv = cfg.kv_width(), L = cfg.num_hidden_layers;

  // offset: flat elements of the parameters kept (all, or for kInference all but the block
  // linears' members and a BF16 lm_head: held_elsewhere); kept[i]: parameter i has its values in
  // the flat buffer
  int64_t offset = 0, logical = 0;
  std::vector<bool> kept;
  auto add = [&](const std::string& name, Shape shape, bool wd, bool held_elsewhere = false) -> int64_t {
    int64_t n = shape_numel(shape);
    m->params_.push_back(ParamRef<T>{name, shape, nullptr, nullptr, n, wd});
    logical += n;
    kept.push_back(!(inference && held_elsewhere));
    if (!kept.back()) return -1;
    int64_t at = offset;
    offset += n;
    return at;
  };
  // linear over the members params_[num_members back from the end, ...), the first at w_offset
  auto add_linear = [&](const std::string& name, LinearKind kind, int block, int expert, int64_t N, int64_t K,
                        int64_t w_offset, size_t first_param, size_t num_members) {
    LinearSlot<T> s;
    s.info = LinearInfo{static_cast<int>(im.linears.size()), name, kind, block, static_cast<int>(L), expert, N, K};
    s.w_offset = w_offset;
    s.first_param = first_param;
    s.num_params = num_members;
    im.linears.push_back(std::move(s));
    return static_cast<int>(im.linears.size() - 1);
  };

  im.embed = add("model.embed_tokens.weight", {V, C}, /*wd=*/false);
  for (int64_t l = 0; l < L; ++l) {
    BlockParams bp;
    bp.first = offset;
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (!olmo) bp.input_ln = add(p + "input_layernorm.weight", {C}, true);
    const size_t qi = m->params_.size();
    int64_t q = add(p + "self_attn.q_proj.weight", {Nq, C}, true, true);
    add(p + "self_attn.k_proj.weight", {Nkv, C}, true, true);
    add(p + "self_attn.v_proj.weight", {Nkv, C}, true, true);
    int64_t o = add(p + "self_attn.o_proj.weight", {C, Nq}, true, true);
    bp.lin_qkv = add_linear(p + "self_attn.qkv_proj", LinearKind::kQkv, (int)l, -1, Nq + 2 * Nkv, C, q, qi, 3);
    bp.lin_o = add_linear(p + "self_attn.o_proj", LinearKind::kAttnOut, (int)l, -1, C, Nq, o, qi + 3, 1);
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
        const size_t gi = m->params_.size();
        int64_t g = add(ep + "gate_proj.weight", {Im, C}, true, true);
        add(ep + "up_proj.weight", {Im, C}, true, true);
        int64_t d = add(ep + "down_proj.weight", {C, Im}, true, true);
        int id = add_linear(ep + "gate_up_proj", LinearKind::kExpertGateUp, (int)l, (int)e, 2 * Im, C, g, gi, 2);
        add_linear(ep + "down_proj", LinearKind::kExpertDown, (int)l, (int)e, C, Im, d, gi + 2, 1);
        if (e == 0) bp.lin_expert0 = id;
      }
      if (cfg.shared_expert_intermediate_size > 0) {
        const int64_t Is = cfg.shared_expert_intermediate_size;
        const std::string sp = p + "mlp.shared_expert.";
        const size_t gi = m->params_.size();
        int64_t g = add(sp + "gate_proj.weight", {Is, C}, true, true);
        add(sp + "up_proj.weight", {Is, C}, true, true);
        int64_t d = add(sp + "down_proj.weight", {C, Is}, true, true);
        bp.lin_shared_gate_up =
            add_linear(sp + "gate_up_proj", LinearKind::kSharedGateUp, (int)l, -1, 2 * Is, C, g, gi, 2);
        bp.lin_shared_down = add_linear(sp + "down_proj", LinearKind::kSharedDown, (int)l, -1, C, Is, d, gi + 2, 1);
      }
    } else {
      const int64_t I = cfg.intermediate_size;
      const size_t gi = m->params_.size();
      int64_t g = add(p + "mlp.gate_proj.weight", {I, C}, true, true);
      add(p + "mlp.up_proj.weight", {I, C}, true, true);
      int64_t d = add(p + "mlp.down_proj.weight", {C, I}, true, true);
      bp.lin_gate_up = add_linear(p + "mlp.gate_up_proj", LinearKind::kGateUp, (int)l, -1, 2 * I, C, g, gi, 2);
      bp.lin_down = add_linear(p + "mlp.down_proj", LinearKind::kDown, (int)l, -1, C, I, d, gi + 2, 1);
    }
    if (olmo) bp.post_ff_ln = add(p + "post_feedforward_layernorm.weight", {C}, true);
    im.blocks.push_back(bp);
  }
  im.final_norm = add("model.norm.weight", {C}, true);
  // kInference with a BF16 lm_head: its GEMM reads only the BF16 bits the decode caller holds
  // (DecodeBatch::lm_head_bf16), so the FP32 weight is not kept either
  im.lm_head = add("lm_head.weight", {V, C}, true, /*held_elsewhere=*/im.lm_head_bf16);

  m->num_params_ = logical;
  backend::Backend& mem = *im.mem;
  const size_t bytes = static_cast<size_t>(offset) * sizeof(T);
  im.values = std::make_shared<backend::Buffer<T>>();
  m->values_ = im.values->ensure(mem, offset, "model parameters");
  mem.fill_zero(m->values_, bytes);
  // Tensor views of backend memory; the storages keep the buffers alive.
  m->value_storage_ = std::make_shared<Storage>(m->values_, bytes, mem.device(), im.values);
  if (!inference) {
    im.grads = std::make_shared<backend::Buffer<T>>();
    m->grads_ = im.grads->ensure(mem, offset, "model gradients");
    mem.fill_zero(m->grads_, bytes);
    m->grad_storage_ = std::make_shared<Storage>(m->grads_, bytes, mem.device(), im.grads);
  }
  int64_t at = 0;
  for (size_t i = 0; i < m->params_.size(); ++i) {
    ParamRef<T>& pr = m->params_[i];
    if (!kept[i]) continue;  // value and grad stay null
    pr.value = m->values_ + at;
    pr.grad = inference ? nullptr : m->grads_ + at;
    at += pr.numel;
  }
  for (auto& s : im.linears) {
    m->linear_infos_.push_back(s.info);
    if constexpr (std::is_same_v<T, float>) {
      NIB_ASSIGN_OR_RETURN(s.recipe, make_linear_recipe(recipe, s.info));
      NIB_CHECK(s.recipe != nullptr);
    }
  }
  const int64_t rope_n = cfg.max_position_embeddings * (D / 2);
  std::vector<T> cos_h(static_cast<size_t>(rope_n)), sin_h(static_cast<size_t>(rope_n));
  cpu::rope_table(cos_h.data(), sin_h.data(), cfg.max_position_embeddings, D, cfg.rope_theta);
  mem.copy_to_device(im.rope_cos.ensure(mem, rope_n, "RoPE table"), cos_h.data(), cos_h.size() * sizeof(T));
  mem.copy_to_device(im.rope_sin.ensure(mem, rope_n, "RoPE table"), sin_h.data(), sin_h.size() * sizeof(T));
  return m;
}

// Candidate c of a matrix parameter's truncated normal is Philox block c of its stream: the four
// words PhiloxStream(seed, index)::next_normal draws for it (two 53-bit uniforms: u1 from words 0
// and 1, u2 from words 2 and 3), computed once per block with the seed's round keys kept. A
// candidate is accepted when |z| <= 3, and element j is the j-th accepted candidate: the values
// of the sequential draw, bit for bit. A large parameter (the embedding, the lm_head) is drawn in
// rounds of contiguous candidate ranges in parallel, each range's accepted values then appended in
// order.
template <typename T>
void TransformerT<T>::init_parameter(T* v, size_t index, uint64_t seed) const {
  NIB_CHECK(index < params_.size());
  const ParamRef<T>& p = params_[index];
  const int64_t n = p.numel;
  if (p.shape.size() == 1) {
    for (int64_t j = 0; j < n; ++j) v[j] = T(1);
    return;
  }
  const double std = config_.initializer_range;
  const PhiloxRoundKeys keys = philox_round_keys(seed);
  // the candidate's value, false where it is rejected
  auto candidate = [&](uint64_t c, T* out) {
    const Philox4x32 r = philox4x32_10(philox_counter(index, c), keys);
    double u1 = static_cast<double>(((uint64_t{r.v[0]} << 32) | r.v[1]) >> 11) * 0x1.0p-53;
    const double u2 = static_cast<double>(((uint64_t{r.v[2]} << 32) | r.v[3]) >> 11) * 0x1.0p-53;
    if (u1 < 1e-300) u1 = 1e-300;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925286766559 * u2);
    if (std::fabs(z) > 3.0) return false;
    *out = static_cast<T>(z * std);
    return true;
  };
  constexpr int64_t kRange = int64_t{1} << 16;  // candidates per parallel range
  const int64_t ranges = 4 * static_cast<int64_t>(num_threads());
  int64_t filled = 0;
  uint64_t next = 0;
  if (n < 4 * kRange || ranges <= 4) {
    while (filled < n)
      if (candidate(next++, v + filled)) ++filled;
    return;
  }
  std::vector<std::vector<T>> accepted(static_cast<size_t>(ranges));
  while (filled < n) {
    parallel_for(ranges, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        std::vector<T>& a = accepted[static_cast<size_t>(t)];
        a.resize(static_cast<size_t>(kRange));
        int64_t k = 0;
        const uint64_t c0 = next + static_cast<uint64_t>(t * kRange);
        for (int64_t i = 0; i < kRange; ++i) k += candidate(c0 + static_cast<uint64_t>(i), a.data() + k) ? 1 : 0;
        a.resize(static_cast<size_t>(k));
      }
    });
    for (const std::vector<T>& a : accepted) {
      const int64_t take = std::min<int64_t>(static_cast<int64_t>(a.size()), n - filled);
      std::copy(a.begin(), a.begin() + take, v + filled);
      filled += take;
    }
    next += static_cast<uint64_t>(ranges * kRange);
  }
}

template <typename T>
void TransformerT<T>::init_weights(uint64_t seed) {
  if (storage_ == ParameterStorage::kInference) {  // the kept parameters, one tensor at a time
    std::vector<T> host;
    for (size_t i = 0; i < params_.size(); ++i) {
      const ParamRef<T>& p = params_[i];
      if (p.value == nullptr) continue;
      host.resize(static_cast<size_t>(p.numel));
      init_parameter(host.data(), i, seed);
      be_->copy_to_device(p.value, host.data(), host.size() * sizeof(T));
    }
    return;
  }
  std::vector<T> host(static_cast<size_t>(num_params_));
  for (size_t i = 0; i < params_.size(); ++i) init_parameter(host.data() + (params_[i].value - values_), i, seed);
  upload_parameters(host.data());
}

// The training-storage entry points name themselves when called on an inference model.
#define NIB_REQUIRE_TRAINING_STORAGE(what) \
  NIB_CHECK_MSG(storage_ == ParameterStorage::kTraining, "{}: the model keeps inference storage only", what)

template <typename T>
void TransformerT<T>::zero_grad() {
  NIB_REQUIRE_TRAINING_STORAGE("zero_grad");
  be_->fill_zero(grads_, static_cast<size_t>(num_params_) * sizeof(T));
}

template <typename T>
void TransformerT<T>::download_parameters(T* host) const {
  NIB_REQUIRE_TRAINING_STORAGE("download_parameters");
  be_->copy_to_host(host, values_, static_cast<size_t>(num_params_) * sizeof(T));
}

template <typename T>
void TransformerT<T>::upload_parameters(const T* host) {
  NIB_REQUIRE_TRAINING_STORAGE("upload_parameters");
  be_->copy_to_device(values_, host, static_cast<size_t>(num_params_) * sizeof(T));
}

template <typename T>
void TransformerT<T>::download_gradients(T* host) const {
  NIB_REQUIRE_TRAINING_STORAGE("download_gradients");
  be_->copy_to_host(host, grads_, static_cast<size_t>(num_params_) * sizeof(T));
}

template <typename T>
void TransformerT<T>::upload_gradients(const T* host) {
  NIB_REQUIRE_TRAINING_STORAGE("upload_gradients");
  be_->copy_to_device(grads_, host, static_cast<size_t>(num_params_) * sizeof(T));
}

template <typename T>
ParamRef<T>* TransformerT<T>::find_param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

int64_t lm_head_chunk_rows(int64_t N, int64_t V, int64_t budget_bytes) {
  NIB_CHECK(N > 0 && V > 0 && budget_bytes > 0);
  const int64_t fit = budget_bytes / (V * static_cast<int64_t>(sizeof(float)));
  return std::min(N, std::max<int64_t>(128, fit / 128 * 128));
}

template <typename T>
void TransformerT<T>::set_lm_head_chunk_rows(int64_t rows) {
  NIB_CHECK_MSG(rows >= 0, "lm_head chunk rows {} < 0", rows);
  impl_->lm_chunk_rows = rows;
}

template <typename T>
bool TransformerT<T>::lm_head_bf16() const {
  return impl_->lm_head_bf16;
}

template <typename T>
backend::AttentionPrecision TransformerT<T>::attention_precision() const {
  return impl_->attention_precision;
}

template <typename T>
LinearRecipe* TransformerT<T>::linear_recipe(int id) {
  NIB_CHECK(id >= 0 && id < (int)impl_->linears.size());
  return impl_->linears[id].recipe.get();
}

template <typename T>
T* TransformerT<T>::linear_weight(int id) {
  NIB_CHECK(id >= 0 && id < (int)impl_->linears.size());
  const int64_t off = impl_->linears[id].w_offset;
  return off < 0 ? nullptr : values_ + off;
}

template <typename T>
std::pair<size_t, size_t> TransformerT<T>::linear_params(int id) const {
  NIB_CHECK(id >= 0 && id < (int)impl_->linears.size());
  return {impl_->linears[id].first_param, impl_->linears[id].num_params};
}

template <typename T>
int64_t TransformerT<T>::value_bytes() const {
  return impl_->values->size() * static_cast<int64_t>(sizeof(T));
}

template <typename T>
int64_t TransformerT<T>::gradient_bytes() const {
  return impl_->grads ? impl_->grads->size() * static_cast<int64_t>(sizeof(T)) : 0;
}

template <typename T>
int64_t TransformerT<T>::activation_bytes() const {
  return impl_->arena.size() * static_cast<int64_t>(sizeof(T)) +
         impl_->iarena.size() * static_cast<int64_t>(sizeof(int32_t));
}

template <typename T>
int64_t TransformerT<T>::workspace_bytes() const {
  const Impl& im = *impl_;
  auto b = [](const auto& buf) { return buf.size() * static_cast<int64_t>(sizeof(*buf.data())); };
  return b(im.arena) + b(im.iarena) + b(im.offsets_dev) + b(im.rope_cos) + b(im.rope_sin) + b(im.lm_w_bits) +
         b(im.lm_xf_bits) + b(im.lm_dlogits_bits) + b(im.logits_chunk) + b(im.ce_chunk_sums) + b(im.logits_full) +
         im.linear_ws.bytes();
}

template <typename T>
std::vector<Parameter> TransformerT<T>::parameters() {
  NIB_REQUIRE_TRAINING_STORAGE("parameters");
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
void TransformerT<T>::forward_decode(T* logits, const DecodeBatch& batch) {
  NIB_CHECK_MSG((std::is_same_v<T, float>), "forward_decode: float models only");
  const bool on_device = batch.logits_device != nullptr;
  NIB_CHECK_MSG((batch.tokens_device != nullptr) == (batch.positions_device != nullptr) &&
                    (batch.tokens_device == nullptr || on_device),
                "forward_decode: tokens_device and positions_device go together, and with logits_device");
  NIB_CHECK((logits != nullptr || on_device) && batch.kv != nullptr && batch.tokens != nullptr &&
            batch.positions != nullptr);
  NIB_CHECK_MSG(batch.N > 0, "forward_decode: empty batch");
  for (int64_t n = 0; n < batch.N; ++n) {
    NIB_CHECK_MSG(batch.positions[n] >= 0 && batch.positions[n] < config_.max_position_embeddings,
                  "forward_decode: position {} of row {} outside [0, {})", batch.positions[n], n,
                  config_.max_position_embeddings);
    NIB_CHECK_MSG(batch.tokens[n] >= 0 && batch.tokens[n] < config_.vocab_size,
                  "forward_decode: token {} of row {} outside the vocabulary", batch.tokens[n], n);
  }
  Impl& im = *impl_;
  // The decode state is set for this call only, also when an op throws.
  struct Scope {
    Impl& im;
    Scope(Impl& i, const DecodeBatch& b) : im(i) {
      im.decode = &b;
      for (auto& s : im.linears) s.decode_override = b.linears;
    }
    ~Scope() {
      im.decode = nullptr;
      for (auto& s : im.linears) s.decode_override = nullptr;
    }
  } scope(im, batch);
  // logits_out non-null selects the logits branch; run() writes to batch.logits_device when set
  T* logits_out = on_device ? reinterpret_cast<T*>(batch.logits_device) : logits;
  run(batch.tokens, nullptr, 1, batch.N, LossOptions{}, RoutingIO{nullptr, batch.routing_record}, /*backward=*/false,
      logits_out, nullptr);
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
  // kInference: the block linears' weights are the decode override's, and nothing is saved for a
  // backward, so one layer's activations serve every layer and two residual streams alternate.
  const bool inference = storage_ == ParameterStorage::kInference;
  NIB_CHECK_MSG(!inference || (im.decode != nullptr && im.decode->linears != nullptr),
                "model: an inference-storage model runs only forward_decode with a linear override");
  NIB_CHECK_MSG(impl_->decode != nullptr || Tn <= cfg.max_position_embeddings,  // decode checks positions instead
                "sequence length {} > max_position_embeddings {}", Tn,
                cfg.max_position_embeddings);
  auto W = [&](int64_t off) { return off < 0 ? nullptr : values_ + off; };  // -1: a block linear not kept
  auto G = [&](int64_t off) { return grads_ + off; };
  backend::Backend& mem = *im.mem;
  OpsOf<T>& ops = *im.ops;
  const int64_t Lm = num_moe_layers_;

  // ---- arena for (B,T) ----
  if (im.B != B || im.Tn != Tn) {
    std::vector<std::pair<T**, int64_t>> req;
    std::vector<std::pair<int32_t**, int64_t>> ireq;
    std::vector<std::pair<int64_t**, int64_t>> lreq;
    auto need = [&](T*& p, int64_t n) { req.push_back({&p, n}); };
    im.acts.assign(L, BlockActs<T>{});
    im.res.assign(L + 1, nullptr);
    for (int64_t l = 0; l <= (inference ? 1 : L); ++l) need(im.res[l], N * C);
    int64_t max_hidden = 0;
    bool any_moe = false;
    // inference: one set serves all layers, holding the fields of every kind of layer there is
    BlockActs<T> shared;
    const bool moe_layers = Lm > 0, dense_layers = Lm < L;
    for (int64_t l = 0; l < (inference ? 1 : L); ++l) {
      BlockActs<T>& a = inference ? shared : im.acts[l];
      const bool moe_fields = inference ? moe_layers : im.blocks[l].moe;
      const bool dense_fields = inference ? dense_layers : !im.blocks[l].moe;
      if (!olmo) { need(a.ln1, N * C); need(a.ln1_rstd, N); }
      need(a.q_raw, N * Nq); need(a.k_raw, N * Nkv); need(a.v, N * Nkv);
      need(a.q_rstd, olmo ? N : N * H); need(a.k_rstd, olmo ? N : N * Hkv);
      need(a.q_rot, N * Nq); need(a.k_rot, N * Nkv);
      need(a.lse, B * H * Tn); need(a.att_out, N * Nq);
      if (olmo) { need(a.o, N * C); need(a.o_rstd, N); }
      need(a.h, N * C);
      if (!olmo) { need(a.ln2, N * C); need(a.ln2_rstd, N); }
      if (olmo) { need(a.m, N * C); need(a.m_rstd, N); }
      if (moe_fields) {
        any_moe = true;
        need(a.rlogits, N * E); need(a.probs, N * E); need(a.rlse, N); need(a.topk_w, N * K);
        ireq.push_back({&a.topk_idx, N * K}); ireq.push_back({&a.row_of_slot, Nk}); ireq.push_back({&a.token_of_row, Nk});
        lreq.push_back({&a.offsets, E + 1});  // host
        need(a.xe, Nk * C); need(a.gue, Nk * 2 * Im); need(a.acte, Nk * Im); need(a.ye, Nk * C);
        if (Is > 0) { need(a.sgu, N * 2 * Is); need(a.sact, N * Is); max_hidden = std::max(max_hidden, Is); }
      }
      if (dense_fields) {
        need(a.gu, N * 2 * I); need(a.act, N * I);
        max_hidden = std::max(max_hidden, I);
      }
    }
    need(im.qkv, N * Nqkv); need(im.mtmp, N * C); need(im.sy, N * C);
    need(im.xf, N * C); need(im.xf_rstd, N); need(im.lse, N); need(im.tok_ce, N);
    if (!inference) {  // backward scratch
      need(im.dres, N * C); need(im.dt1, N * C); need(im.dt2, N * C); need(im.dt3, N * C);
      need(im.dqkv, N * Nqkv); need(im.dq, N * Nq); need(im.dk, N * Nkv); need(im.dv, N * Nkv);
      need(im.datt, N * Nq); need(im.dk2, N * Nkv);
      need(im.dgu, N * 2 * max_hidden); need(im.dact, N * max_hidden);
    }
    if (any_moe && !inference) {
      need(im.dye, Nk * C); need(im.dxe, Nk * C); need(im.dgue, Nk * 2 * Im); need(im.dacte, Nk * Im);
      need(im.dtopk, N * K); need(im.drl, N * E); need(im.aux_extra, E);
    }
    ireq.push_back({&im.tokens, N});
    ireq.push_back({&im.targets, N});
    ireq.push_back({&im.forced, Lm * Nk});
    ireq.push_back({&im.routing_out, Lm * Nk});
    ireq.push_back({&im.positions, N});
    auto round16 = [](int64_t n) { return (n + 15) / 16 * 16; };
    int64_t total = 0, itotal = 0, ltotal = 0;
    for (auto& r : req) total += round16(r.second);
    for (auto& r : ireq) itotal += r.second;
    for (auto& r : lreq) ltotal += r.second;
    // Grow only: a smaller (B,T) (eval, generation) reuses the memory of a larger one. Every
    // buffer is fully written before it is read, so stale contents never leak into results.
    im.arena.ensure(mem, total, "model activations");
    im.iarena.ensure(mem, itotal, "model token and routing ids");
    if (Lm > 0) {
      int64_t* od = im.offsets_dev.ensure(mem, Lm * (E + 1), "model expert offsets");
      for (int64_t l = 0; l < L; ++l)
        if (im.blocks[l].moe) im.acts[l].offsets_dev = od + im.blocks[l].moe_index * (E + 1);
    }
    if (im.larena.size() < static_cast<size_t>(ltotal)) im.larena.resize(static_cast<size_t>(ltotal));
    int64_t at = 0;
    for (auto& r : req) { *r.first = im.arena.data() + at; at += round16(r.second); }
    at = 0;
    for (auto& r : ireq) { *r.first = im.iarena.data() + at; at += r.second; }
    at = 0;
    for (auto& r : lreq) { *r.first = im.larena.data() + at; at += r.second; }
    if (inference) {  // every layer on the shared set; res[l] and res[l + 2] are one buffer
      for (int64_t l = 0; l < L; ++l) {
        int64_t* od = im.acts[l].offsets_dev;
        im.acts[l] = shared;
        im.acts[l].offsets_dev = od;
      }
      for (int64_t l = 2; l <= L; ++l) im.res[l] = im.res[l % 2];
    }
    im.B = B;
    im.Tn = Tn;
  }

  const int64_t call_id = im.decode != nullptr ? micro_step_ : micro_step_++;  // decode leaves training seeds alone
  auto call = [&](const LinearSlot<T>& s) {
    return LinearCall{step_, seed_, s.info.id, call_id, backward, &im.linear_ws};
  };
  const T* cosp = im.rope_cos.data();
  const T* sinp = im.rope_sin.data();
  // the host inputs in backend memory (a decode batch may have put them there itself)
  const bool inputs_on_device = im.decode != nullptr && im.decode->tokens_device != nullptr;
  const int32_t* tokens_dev = inputs_on_device ? im.decode->tokens_device : im.tokens;
  const int32_t* positions_dev = inputs_on_device ? im.decode->positions_device : im.positions;
  if (!inputs_on_device) mem.copy_to_device(im.tokens, tokens, static_cast<size_t>(N) * sizeof(int32_t));
  if (targets) mem.copy_to_device(im.targets, targets, static_cast<size_t>(N) * sizeof(int32_t));
  if (routing.forced && Lm > 0)
    mem.copy_to_device(im.forced, routing.forced, static_cast<size_t>(Lm * Nk) * sizeof(int32_t));
  if (im.decode != nullptr && !inputs_on_device)
    mem.copy_to_device(im.positions, im.decode->positions, static_cast<size_t>(N) * sizeof(int32_t));
  im.load_count.assign(E > 0 ? E : 0, 0.0);
  im.load_prob.assign(E > 0 ? E : 0, 0.0);
  im.router_lse2 = 0;

  // ---- MoE experts: all E experts of one part (0 gate_up, 1 down) of layer bp ----
  // Float models (not decoding) go through the experts' recipes' forward_experts /
  // backward_experts (one grouped GEMM each where the recipe and backend have it); the double
  // model and decode overrides walk the experts with the host offsets.
  auto experts_grouped = [&](const BlockParams& bp) {
    if constexpr (std::is_same_v<T, float>) {
      if (im.decode == nullptr) return im.linears[bp.lin_expert0].recipe->runs_experts_grouped(mem);
      return im.decode->linears != nullptr && im.decode->linears->runs_experts_grouped(mem);  // fused MoE decode
    }
    return false;
  };
  [[maybe_unused]] auto expert_group = [&](const BlockActs<T>& a, const BlockParams& bp, int part) {
    im.group_recipes.resize(static_cast<size_t>(E));
    im.group_calls.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      auto& s = im.linears[bp.lin_expert0 + 2 * e + part];
      im.group_recipes[e] = s.recipe.get();
      im.group_calls[e] = call(s);
    }
    ExpertGroup g;
    g.recipes = im.group_recipes.data(), g.calls = im.group_calls.data();
    g.offsets = a.experts_grouped ? a.offsets_dev : nullptr;
    g.offsets_host = a.experts_grouped ? nullptr : a.offsets;
    g.E = E, g.rows = Nk;
    g.token_of_row = a.token_of_row;
    g.w_stride = E > 1 ? im.linears[bp.lin_expert0 + 2 + part].w_offset - im.linears[bp.lin_expert0 + part].w_offset : 0;
    return g;
  };
  // y: (Nk, N of the part) = experts(x: (Nk, K of the part))
  auto experts_forward = [&](const BlockActs<T>& a, const BlockParams& bp, int part, T* y, const T* xin) {
    auto& s0 = im.linears[bp.lin_expert0 + part];
    if constexpr (std::is_same_v<T, float>) {
      if (im.decode == nullptr) {
        const ExpertGroup g = expert_group(a, bp, part);
        s0.recipe->forward_experts(ops, y, xin, W(s0.w_offset), s0.info.N, s0.info.K, g);
        return;
      }
      if (a.experts_grouped) {  // the decode override, all experts in one call on device offsets
        const auto key = static_cast<size_t>(bp.lin_expert0 + part);
        if (im.group_infos.size() <= key) im.group_infos.resize(im.linears.size());
        std::vector<LinearInfo>& infos = im.group_infos[key];
        for (int64_t e = static_cast<int64_t>(infos.size()); e < E; ++e)
          infos.push_back(im.linears[bp.lin_expert0 + 2 * e + part].info);
        im.decode->linears->forward_experts(ops, y, xin, Nk, infos.data(), E, a.offsets_dev, a.token_of_row, call(s0));
        return;
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = a.offsets[e], rows = a.offsets[e + 1] - r0;
      if (rows == 0) continue;  // no call: quantized recipes never see empty GEMMs
      auto& s = im.linears[bp.lin_expert0 + 2 * e + part];
      LinearCall c = call(s);
      c.token_of_row = a.token_of_row + r0;  // the plan's tokens of expert e's rows
      s.forward(ops, y + r0 * s.info.N, xin + r0 * s.info.K, W(s.w_offset), rows, c);
    }
  };
  // dx: (Nk, K of the part) overwritten, dW +=, from dy: (Nk, N of the part)
  auto experts_backward = [&](const BlockActs<T>& a, const BlockParams& bp, int part, T* dxo, const T* dy) {
    auto& s0 = im.linears[bp.lin_expert0 + part];
    if constexpr (std::is_same_v<T, float>) {
      const ExpertGroup g = expert_group(a, bp, part);
      s0.recipe->backward_experts(ops, dxo, G(s0.w_offset), dy, s0.info.N, s0.info.K, g);
      return;
    }
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = a.offsets[e], rows = a.offsets[e + 1] - r0;
      if (rows == 0) continue;
      auto& s = im.linears[bp.lin_expert0 + 2 * e + part];
      s.backward(ops, dxo + r0 * s.info.K, G(s.w_offset), dy + r0 * s.info.N, rows, call(s));
    }
  };

  // ---- MLP forward: m (N,C) = MLP(x (N,C)) ----
  auto mlp_forward = [&](T* m, const T* x, int64_t l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    if (!bp.moe) {
      auto& gu = im.linears[bp.lin_gate_up];
      auto& dn = im.linears[bp.lin_down];
      gu.forward(ops, a.gu, x, W(gu.w_offset), N, call(gu));
      ops.swiglu_forward(a.act, a.gu, N, I);
      dn.forward(ops, m, a.act, W(dn.w_offset), N, call(dn));
      return;
    }
    ops.matmul_nt(a.rlogits, x, W(bp.router), N, E, C);  // router in full precision
    const int32_t* forced = routing.forced ? im.forced + bp.moe_index * Nk : nullptr;
    ops.moe_router_forward(a.probs, a.rlse, a.topk_idx, a.topk_w, a.rlogits, forced, N, E, K, cfg.norm_topk_prob);
    if (routing.record)  // kept in backend memory; one read-back after the layers (no sync per layer)
      mem.copy(im.routing_out + bp.moe_index * Nk, a.topk_idx, sizeof(int32_t) * static_cast<size_t>(Nk));
    if (im.decode == nullptr)  // the load-balancing statistics of the training losses (a host read)
      im.router_lse2 +=
          ops.moe_accumulate_load(im.load_count.data(), im.load_prob.data(), a.probs, a.rlse, a.topk_idx, N, E, K);
    a.experts_grouped = experts_grouped(bp);
    if (a.experts_grouped)  // the offsets stay in backend memory: no host round trip
      mem.moe_dispatch_plan_device(a.offsets_dev, a.row_of_slot, a.token_of_row, a.topk_idx, N, E, K);
    else
      ops.moe_dispatch_plan(a.offsets, a.row_of_slot, a.token_of_row, a.topk_idx, N, E, K);
    ops.moe_gather(a.xe, x, a.token_of_row, Nk, C);
    experts_forward(a, bp, 0, a.gue, a.xe);   // gate_up (Nk, 2Im)
    ops.swiglu_forward(a.acte, a.gue, Nk, Im);  // row-wise: all experts' rows at once
    experts_forward(a, bp, 1, a.ye, a.acte);  // down (Nk, C)
    ops.moe_combine(m, a.ye, a.topk_w, a.row_of_slot, N, K, C);
    if (Is > 0) {
      auto& gu = im.linears[bp.lin_shared_gate_up];
      auto& dn = im.linears[bp.lin_shared_down];
      gu.forward(ops, a.sgu, x, W(gu.w_offset), N, call(gu));
      ops.swiglu_forward(a.sact, a.sgu, N, Is);
      dn.forward(ops, im.sy, a.sact, W(dn.w_offset), N, call(dn));
      ops.add_inplace(m, im.sy, N * C);
    }
  };

  // ---- forward ----
  ops.embedding_forward(im.res[0], tokens_dev, W(im.embed), N, V, C);
  for (int64_t l = 0; l < L; ++l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    const T* x = im.res[l];
    T* out = im.res[l + 1];
    const T* attn_in = x;
    if (!olmo) {
      ops.rmsnorm_forward(a.ln1, a.ln1_rstd, x, W(bp.input_ln), N, C, eps);
      attn_in = a.ln1;
    }
    auto& lq = im.linears[bp.lin_qkv];
    lq.forward(ops, im.qkv, attn_in, W(lq.w_offset), N, call(lq));
    // split the fused (N, Nq|Nkv|Nkv) rows
    ops.copy_2d(a.q_raw, Nq, im.qkv, Nqkv, N, Nq);
    ops.copy_2d(a.k_raw, Nkv, im.qkv + Nq, Nqkv, N, Nkv);
    ops.copy_2d(a.v, Nkv, im.qkv + Nq + Nkv, Nqkv, N, Nkv);
    // QK-norm: OLMo-2 over the full width (rows N), Qwen3 per head (rows N*H of width D)
    if (olmo) {
      ops.rmsnorm_forward(a.q_rot, a.q_rstd, a.q_raw, W(bp.q_norm), N, Nq, eps);
      ops.rmsnorm_forward(a.k_rot, a.k_rstd, a.k_raw, W(bp.k_norm), N, Nkv, eps);
    } else {
      ops.rmsnorm_forward(a.q_rot, a.q_rstd, a.q_raw, W(bp.q_norm), N * H, D, eps);
      ops.rmsnorm_forward(a.k_rot, a.k_rstd, a.k_raw, W(bp.k_norm), N * Hkv, D, eps);
    }
    const int32_t* rope_positions = im.decode != nullptr ? positions_dev : nullptr;  // decode: each row's own
    ops.rope_forward(a.q_rot, a.q_rot, cosp, sinp, rope_positions, B, Tn, H, D);
    ops.rope_forward(a.k_rot, a.k_rot, cosp, sinp, rope_positions, B, Tn, Hkv, D);
    if (im.decode != nullptr) {  // prefill / decode: keys and values go to the cache, queries read it
      if constexpr (std::is_same_v<T, float>)
        im.decode->kv->append_and_attend(mem, l, a.att_out, a.q_rot, a.k_rot, a.v, N);
    } else {
      // K and V as a quantized cache holds them (straight-through: backward leaves dk, dv alone)
      if constexpr (std::is_same_v<T, float>)
        if (kv_quantizer_ != nullptr) kv_quantizer_->quantize(mem, l, a.k_rot, a.v, N, Hkv, D);
      ops.attention_forward(a.att_out, a.lse, a.q_rot, a.k_rot, a.v, B, Tn, H, Hkv, D, im.attention_precision);
    }
    auto& lo = im.linears[bp.lin_o];
    if (olmo) {
      lo.forward(ops, a.o, a.att_out, W(lo.w_offset), N, call(lo));
      ops.rmsnorm_forward(a.h, a.o_rstd, a.o, W(bp.post_attn_ln), N, C, eps);
      ops.add_inplace(a.h, x, N * C);                      // h = x + RMSNorm(Attn(x))
      mlp_forward(a.m, a.h, l);
      ops.rmsnorm_forward(out, a.m_rstd, a.m, W(bp.post_ff_ln), N, C, eps);
      ops.add_inplace(out, a.h, N * C);                    // out = h + RMSNorm(MLP(h))
    } else {
      lo.forward(ops, im.mtmp, a.att_out, W(lo.w_offset), N, call(lo));
      ops.add(a.h, x, im.mtmp, N * C);                     // h = x + Attn(RMSNorm(x))
      ops.rmsnorm_forward(a.ln2, a.ln2_rstd, a.h, W(bp.post_attn_ln), N, C, eps);
      mlp_forward(im.mtmp, a.ln2, l);
      ops.add(out, a.h, im.mtmp, N * C);                   // out = h + MLP(RMSNorm(h))
    }
  }
  if (routing.record && Lm > 0)
    mem.copy_to_host(routing.record, im.routing_out, sizeof(int32_t) * static_cast<size_t>(Lm * Nk));
  ops.rmsnorm_forward(im.xf, im.xf_rstd, im.res[L], W(im.final_norm), N, C, eps);
  // forward_decode with logit_rows: only those rows reach the lm_head, moved to the front of xf
  // (row i <- row logit_rows[i] >= i: forward copies of distinct rows never overlap)
  int64_t head_rows = N;
  if (im.decode && im.decode->logit_rows) {
    head_rows = im.decode->num_logit_rows;
    NIB_CHECK_MSG(head_rows >= 0 && head_rows <= N, "forward_decode: {} logit rows of {}", head_rows, N);
    for (int64_t i = 0; i < head_rows; ++i) {
      const int64_t r = im.decode->logit_rows[i];
      NIB_CHECK_MSG(r >= i && r < N && (i == 0 || r > im.decode->logit_rows[i - 1]),
                    "forward_decode: logit rows must ascend within [0, {}) (row {} is {})", N, i, r);
      if (r != i) mem.copy(im.xf + i * C, im.xf + r * C, static_cast<size_t>(C) * sizeof(T));
    }
  }
  // ---- lm_head + loss, over row chunks (docs/training.md "lm_head") ----
  // Per chunk of rows [r0, r0+rows): logits = xf . W^T, the loss (in place: dL/dlogits when
  // backward), dxf rows (into dt1) = dlogits . W, dW += dlogits^T . xf rows. Only
  // forward_logits and a custom logits loss, which hand all logits to the caller, hold (N,V).
  // With BF16 operands (float only) W and xf are converted to BF16 bits once per forward and each
  // chunk's dlogits after its loss; the GEMMs take the bits (matmul_bf16_*: exact products, FP32
  // accumulation), so no GEMM converts an operand again per chunk.
  const bool head_bf16 = im.lm_head_bf16 && std::is_same_v<T, float>;
  const uint16_t* w_bits = nullptr;
  const uint16_t* xf_bits = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    if (head_bf16) {
      uint16_t* xb = im.lm_xf_bits.ensure(mem, N * C, "lm_head BF16 input");
      mem.to_bf16_bits(xb, im.xf, N * C);
      xf_bits = xb;
      if (im.decode && im.decode->lm_head_bf16) {
        w_bits = im.decode->lm_head_bf16;  // the decode caller's snapshot of these very bits
      } else {
        NIB_CHECK_MSG(im.lm_head >= 0, "model: the lm_head is not kept (inference storage): pass its BF16 bits");
        uint16_t* wb = im.lm_w_bits.ensure(mem, V * C, "lm_head BF16 weight");
        mem.to_bf16_bits(wb, W(im.lm_head), V * C);
        w_bits = wb;
      }
    }
  }
  // logits: (rows,V) <- xf[r0 : r0+rows] . W^T
  auto head_forward = [&](T* logits, int64_t r0, int64_t rows) {
    if constexpr (std::is_same_v<T, float>) {
      if (head_bf16) {
        mem.matmul_bf16_nt(logits, xf_bits + r0 * C, w_bits, rows, V, C);
        return;
      }
    }
    ops.matmul_nt(logits, im.xf + r0 * C, W(im.lm_head), rows, V, C);
  };
  // dxf[r0 : r0+rows] (in dt1) = dlogits . W; dW_lm (V,C) += dlogits^T . xf rows; dlogits: (rows,V)
  auto head_backward = [&](T* dlogits, int64_t r0, int64_t rows) {
    if constexpr (std::is_same_v<T, float>) {
      if (head_bf16) {
        uint16_t* db = im.lm_dlogits_bits.ensure(mem, rows * V, "lm_head BF16 dlogits chunk");
        mem.to_bf16_bits(db, dlogits, rows * V);
        mem.matmul_bf16_nn(im.dt1 + r0 * C, db, w_bits, rows, C, V);
        mem.matmul_bf16_tn(G(im.lm_head), db, xf_bits + r0 * C, V, C, rows, /*alpha=*/nullptr, /*accumulate=*/true);
        return;
      }
    }
    ops.matmul_nn(im.dt1 + r0 * C, dlogits, W(im.lm_head), rows, C, V);
    ops.matmul_tn(G(im.lm_head), dlogits, im.xf + r0 * C, V, C, rows, /*accumulate=*/true);
  };

  LossParts lp;
  if (logits_out || custom_loss) {
    if constexpr (std::is_same_v<T, float>) {
      if (im.decode != nullptr && im.decode->logits_device != nullptr) {  // left in backend memory
        if (head_rows > 0) head_forward(im.decode->logits_device, 0, head_rows);
        return LossParts{};
      }
    }
    T* logits = im.logits_full.ensure(mem, N * V, "all logits (forward_logits / custom loss)");
    if (head_rows > 0) head_forward(logits, 0, head_rows);
    const size_t bytes = static_cast<size_t>(head_rows * V) * sizeof(T);
    if (logits_out) {
      mem.copy_to_host(logits_out, logits, bytes);
      return LossParts{};
    }
    // host round trip: the custom objective is host code; it gets the logits and returns dL/dlogits
    im.logits_host.resize(static_cast<size_t>(N * V));
    mem.copy_to_host(im.logits_host.data(), logits, bytes);
    lp.ce = (*custom_loss)(im.logits_host.data(), N, V);
    mem.copy_to_device(logits, im.logits_host.data(), bytes);
    if (backward) head_backward(logits, 0, N);
  } else {
    double inv = 0;
    if (backward) {
      int64_t n_valid = 0;
      for (int64_t n = 0; n < N; ++n) n_valid += targets[n] >= 0;
      inv = n_valid > 0 ? 1.0 / static_cast<double>(n_valid) : 0.0;
    }
    const int64_t chunk = im.lm_chunk_rows > 0 ? std::min(im.lm_chunk_rows, N) : lm_head_chunk_rows(N, V);
    T* logits = im.logits_chunk.ensure(mem, chunk * V, "lm_head logits chunk");
    // Each chunk's sums stay in backend memory (no wait for the host per chunk) and are read once
    // after the loop; they are added in chunk order (deterministic); within a chunk the backend's
    // fixed order applies, so the totals depend on the chunk size only by double rounding.
    const int64_t n_chunks = (N + chunk - 1) / chunk;
    double* chunk_sums = im.ce_chunk_sums.ensure(mem, 4 * n_chunks, "cross-entropy chunk sums");
    for (int64_t r0 = 0, c = 0; r0 < N; r0 += chunk, ++c) {
      const int64_t rows = std::min(chunk, N - r0);
      head_forward(logits, r0, rows);
      if (backward) {
        ops.cross_entropy_forward_backward_sums(chunk_sums + 4 * c, logits, im.lse + r0, im.tok_ce + r0, logits,
                                                im.targets + r0, rows, V, inv, options.z_loss_coef * inv);
        head_backward(logits, r0, rows);
      } else {
        ops.cross_entropy_forward_sums(chunk_sums + 4 * c, im.lse + r0, token_ce ? im.tok_ce + r0 : nullptr, logits,
                                       im.targets + r0, rows, V);
      }
    }
    std::vector<double>& hs = im.ce_chunk_sums_host;
    hs.resize(static_cast<size_t>(4 * n_chunks));
    mem.copy_to_host(hs.data(), chunk_sums, hs.size() * sizeof(double));
    backend::CrossEntropySums sums;
    for (int64_t c = 0; c < n_chunks; ++c) {
      sums.ce_sum += hs[4 * c];
      sums.z_sum += hs[4 * c + 1];
      sums.n_valid += static_cast<int64_t>(hs[4 * c + 2]);
    }
    if (token_ce) mem.copy_to_host(token_ce, im.tok_ce, static_cast<size_t>(N) * sizeof(T));
    lp.n_tokens = sums.n_valid;
    const double inv_n = sums.n_valid > 0 ? 1.0 / static_cast<double>(sums.n_valid) : 0.0;
    lp.ce = sums.ce_sum * inv_n;
    lp.z_loss = sums.z_sum * inv_n;
  }
  const double aux_coef = options.router_aux_loss_coef >= 0 ? options.router_aux_loss_coef : cfg.router_aux_loss_coef;
  const double rz_coef = options.router_z_loss_coef >= 0 ? options.router_z_loss_coef : cfg.router_z_loss_coef;
  std::vector<double>& f = im.load_frac;
  f.assign(E > 0 ? E : 0, 0.0);
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
  double router_z_scale = 0;
  if (Lm > 0) {
    const double denom = static_cast<double>(Lm) * static_cast<double>(N);
    im.aux_host.assign(static_cast<size_t>(E), T(0));
    for (int64_t e = 0; e < E; ++e) im.aux_host[e] = static_cast<T>(aux_coef * static_cast<double>(E) * f[e] / denom);
    mem.copy_to_device(im.aux_extra, im.aux_host.data(), static_cast<size_t>(E) * sizeof(T));
    router_z_scale = rz_coef / denom;
  }
  // dt1 holds dxf (N,C) and the lm_head gradient is accumulated (the chunk loop above)
  ops.rmsnorm_backward(im.dres, G(im.final_norm), im.dt1, im.res[L], W(im.final_norm), im.xf_rstd, N, C);
  // grads_final_hook_: the gradients from a flat offset to the end are final (see transformer.h).
  auto grads_final_from = [&](int64_t offset) {
    if (grads_final_hook_) grads_final_hook_(offset);
  };
  grads_final_from(im.final_norm);  // model.norm and lm_head

  // dx (N,C) = d MLP(x) / dx applied to dm (N,C)
  auto mlp_backward = [&](T* dx, const T* dm, const T* x, int64_t l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    if (!bp.moe) {
      auto& gu = im.linears[bp.lin_gate_up];
      auto& dn = im.linears[bp.lin_down];
      dn.backward(ops, im.dact, G(dn.w_offset), dm, N, call(dn));
      ops.swiglu_backward(im.dgu, im.dact, a.gu, N, I);
      gu.backward(ops, dx, G(gu.w_offset), im.dgu, N, call(gu));
      return;
    }
    ops.moe_combine_backward(im.dye, im.dtopk, dm, a.ye, a.topk_w, a.row_of_slot, N, K, C);
    experts_backward(a, bp, 1, im.dacte, im.dye);            // down
    ops.swiglu_backward(im.dgue, im.dacte, a.gue, Nk, Im);   // all experts' rows at once
    experts_backward(a, bp, 0, im.dxe, im.dgue);             // gate_up
    ops.moe_gather_backward(dx, im.dxe, a.row_of_slot, N, K, C);
    // forced (R3) or not, the gate weights are the model's formula: renormalised iff norm_topk_prob
    ops.moe_router_backward(im.drl, im.dtopk, a.probs, a.rlse, a.topk_idx, a.topk_w, im.aux_extra,
                             router_z_scale, N, E, K, cfg.norm_topk_prob);
    ops.matmul_nn(dx, im.drl, W(bp.router), N, C, E, /*accumulate=*/true);  // dx += drl (N,E) . Wg (E,C)
    ops.matmul_tn(G(bp.router), im.drl, x, E, C, N, true);                 // dWg += drl^T . x
    if (Is > 0) {
      auto& gu = im.linears[bp.lin_shared_gate_up];
      auto& dn = im.linears[bp.lin_shared_down];
      dn.backward(ops, im.dact, G(dn.w_offset), dm, N, call(dn));
      ops.swiglu_backward(im.dgu, im.dact, a.sgu, N, Is);
      gu.backward(ops, im.dt3, G(gu.w_offset), im.dgu, N, call(gu));
      ops.add_inplace(dx, im.dt3, N * C);
    }
  };

  // datt (N,Nq) -> dqkv (N,Nqkv): attention, RoPE and QK-norm backward
  auto attention_block_backward = [&](int64_t l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    ops.attention_backward(im.dq, im.dk, im.dv, im.datt, a.att_out, a.lse, a.q_rot, a.k_rot, a.v, B, Tn, H, Hkv, D,
                           im.attention_precision);
    ops.rope_backward(im.dq, im.dq, cosp, sinp, nullptr, B, Tn, H, D);
    ops.rope_backward(im.dk, im.dk, cosp, sinp, nullptr, B, Tn, Hkv, D);
    T* dq_raw = im.datt;  // datt is dead now: reuse it
    if (olmo) {
      ops.rmsnorm_backward(dq_raw, G(bp.q_norm), im.dq, a.q_raw, W(bp.q_norm), a.q_rstd, N, Nq);
      ops.rmsnorm_backward(im.dk2, G(bp.k_norm), im.dk, a.k_raw, W(bp.k_norm), a.k_rstd, N, Nkv);
    } else {
      ops.rmsnorm_backward(dq_raw, G(bp.q_norm), im.dq, a.q_raw, W(bp.q_norm), a.q_rstd, N * H, D);
      ops.rmsnorm_backward(im.dk2, G(bp.k_norm), im.dk, a.k_raw, W(bp.k_norm), a.k_rstd, N * Hkv, D);
    }
    ops.copy_2d(im.dqkv, Nqkv, dq_raw, Nq, N, Nq);
    ops.copy_2d(im.dqkv + Nq, Nqkv, im.dk2, Nkv, N, Nkv);
    ops.copy_2d(im.dqkv + Nq + Nkv, Nqkv, im.dv, Nkv, N, Nkv);
  };

  for (int64_t l = L - 1; l >= 0; --l) {
    BlockActs<T>& a = im.acts[l];
    const BlockParams& bp = im.blocks[l];
    auto& lq = im.linears[bp.lin_qkv];
    auto& lo = im.linears[bp.lin_o];
    // im.dres holds dL/d(out of block l)
    if (olmo) {
      ops.rmsnorm_backward(im.dt1, G(bp.post_ff_ln), im.dres, a.m, W(bp.post_ff_ln), a.m_rstd, N, C);  // dm
      mlp_backward(im.dt2, im.dt1, a.h, l);
      ops.add_inplace(im.dres, im.dt2, N * C);                                                            // dh
      ops.rmsnorm_backward(im.dt1, G(bp.post_attn_ln), im.dres, a.o, W(bp.post_attn_ln), a.o_rstd, N, C);  // do
      lo.backward(ops, im.datt, G(lo.w_offset), im.dt1, N, call(lo));
      attention_block_backward(l);
      lq.backward(ops, im.dt1, G(lq.w_offset), im.dqkv, N, call(lq));
      ops.add_inplace(im.dres, im.dt1, N * C);                                                            // dx
    } else {
      mlp_backward(im.dt1, im.dres, a.ln2, l);                                                             // dln2
      ops.rmsnorm_backward(im.dt2, G(bp.post_attn_ln), im.dt1, a.h, W(bp.post_attn_ln), a.ln2_rstd, N, C);
      ops.add_inplace(im.dres, im.dt2, N * C);                                                            // dh
      lo.backward(ops, im.datt, G(lo.w_offset), im.dres, N, call(lo));
      attention_block_backward(l);
      lq.backward(ops, im.dt1, G(lq.w_offset), im.dqkv, N, call(lq));                                           // dln1
      ops.rmsnorm_backward(im.dt2, G(bp.input_ln), im.dt1, im.res[l], W(bp.input_ln), a.ln1_rstd, N, C);
      ops.add_inplace(im.dres, im.dt2, N * C);                                                            // dx
    }
    grads_final_from(bp.first);  // block l and everything after it
  }
  ops.embedding_backward(G(im.embed), im.dres, im.tokens, N, V, C);
  grads_final_from(0);
  return lp;
}

template class TransformerT<float>;
template class TransformerT<double>;

}  // namespace nibble::model
