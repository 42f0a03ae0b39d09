// The nibble transformer: OLMo-2 (dense; norm-after blocks h = x + RMSNorm(Attn(x)),
// out = h + RMSNorm(MLP(h)); QK-norm over the full q/k width before RoPE) and Qwen3-MoE (pre-norm;
// per-head QK-norm; sparse MoE MLPs with top-k routing), each faithful to its transformers class
// so checkpoints with HF tensor names give the same logits. Forward and backward are written out
// once over the ops of a backend::Backend (llm.c style); block linears go through LinearRecipe
// instances. Parameters, gradients and activations live in the backend's memory; the API takes
// host token/target arrays. TransformerT<double> (plain double GEMMs, no recipes, always on the
// CPU) exists to check gradients by finite differences; training uses Model = TransformerT<float>.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/linear.h"

namespace nibble::model {

// One trainable tensor, HF-named, viewing the model's flat parameter / gradient buffers (in the
// backend's memory: Tensor::device() says where).
struct Parameter {
  std::string name;     // e.g. "model.layers.0.self_attn.q_proj.weight"
  Tensor value;         // F32, HF shape (out, in) for matrices
  Tensor grad;          // F32, same shape
  bool weight_decay;    // false only for model.embed_tokens.weight (OLMo-2), see docs/model.md
};

// The same for any float type (the double model's gradient checks use it); value and grad point
// into backend memory.
template <typename T>
struct ParamRef {
  std::string name;
  Shape shape;
  T* value;
  T* grad;
  int64_t numel;
  bool weight_decay;
};

struct LossOptions {
  double z_loss_coef = 0.0;            // OLMo-2 uses 1e-5: loss += z_coef * mean(logsumexp^2)
  double router_aux_loss_coef = -1.0;  // < 0: use ModelConfig::router_aux_loss_coef
  double router_z_loss_coef = -1.0;    // < 0: use ModelConfig::router_z_loss_coef
};

// Unscaled components and the total actually differentiated:
// loss = ce + z_loss_coef * z_loss + aux_coef * aux_loss + router_z_coef * router_z_loss.
struct LossParts {
  double loss = 0;
  double ce = 0;             // mean cross-entropy over non-ignored targets
  double z_loss = 0;         // mean logsumexp(logits)^2 over non-ignored targets
  double aux_loss = 0;       // E * sum_e f_e P_e over all MoE layers' tokens (HF load_balancing_loss_func)
  double router_z_loss = 0;  // mean over MoE layers and tokens of logsumexp(router logits)^2
  int64_t n_tokens = 0;      // non-ignored targets
};

// The lm_head + cross-entropy run over row chunks of at most this many FP32 logits bytes, so a
// training or eval step never holds the whole (B*T, V) logits (docs/training.md "lm_head").
inline constexpr int64_t kLmHeadChunkBytes = int64_t{256} << 20;
// Rows per lm_head chunk for N rows over a vocabulary of V: the most rows whose FP32 logits fit
// in budget_bytes, rounded down to a multiple of 128 (at least 128), and at most N.
int64_t lm_head_chunk_rows(int64_t N, int64_t V, int64_t budget_bytes = kLmHeadChunkBytes);

// MoE routing in/out, both (num_moe_layers, B*T, top_k) i32 expert ids, MoE layers in order.
struct RoutingIO {
  // R3 replay: use these expert sets; gate weights by the model's own formula over the set
  // (softmax probs, renormalised over the set iff norm_topk_prob)
  const int32_t* forced = nullptr;
  int32_t* record = nullptr;        // filled with the sets actually used
};

// ---- decode over a KV cache (the rollout engine, ../shared/spec/06-backends.md §8) --------------
// The cache belongs to the caller (rollout/kv_cache.h): for every layer the model hands it the
// new rows' rotated keys and values and gets back their attention outputs, so prefill and decode
// run the same per-layer code as the training forward.
class KvCacheAttention {
 public:
  virtual ~KvCacheAttention() = default;
  // Stores k, v: (N, Hkv*D) f32 (after QK-norm and RoPE) of this call's rows in layer `layer`'s
  // cache, then out: (N, H*D) f32 <- each row's query q: (N, H*D) attending to its sequence's
  // positions [0, its position]. All in be's memory.
  virtual void append_and_attend(backend::Backend& be, int64_t layer, float* out, const float* q, const float* k,
                                 const float* v, int64_t N) = 0;
};

// Runs the block linears of a decode call in place of their recipes (the rollout precision modes).
class LinearOverride {
 public:
  virtual ~LinearOverride() = default;
  // y: (M, info.N) f32 <- x: (M, info.K) f32 through linear info.id whose master weight is
  // w: (info.N, info.K) f32; all in be's memory. call: the model's call context (for a routed
  // expert, call.token_of_row names the step row of each of the M rows).
  virtual void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M,
                       const LinearInfo& info, const LinearCall& call) = 0;
  // The routed experts of one MoE layer part at once (the fused MoE decode): true when
  // forward_experts runs on `be` from offsets in backend memory; the model then plans the routing
  // on the device (moe_dispatch_plan_device) and reads no offsets back. Default: false (the model
  // walks the experts with host offsets, one forward() each).
  virtual bool runs_experts_grouped(backend::Backend& be) const { return false; }
  // y: (rows, N) f32 <- x: (rows, K) f32, rows [offsets[e], offsets[e+1]) through linear infos[e]
  // (the E experts of one layer and part, in expert order: the same N, K); offsets (E+1) i64 and
  // token_of_row (rows) i32 (the step row of each row) in be's memory; call: the first expert's.
  // Default: fails (only called where runs_experts_grouped said true).
  virtual void forward_experts(backend::Backend& be, float* y, const float* x, int64_t rows, const LinearInfo* infos,
                               int64_t E, const int64_t* offsets, const int32_t* token_of_row,
                               const LinearCall& call);
};

// One prefill/decode call: N rows, each a token at a position of some sequence of the cache.
struct DecodeBatch {
  const int32_t* tokens = nullptr;     // (N) host
  const int32_t* positions = nullptr;  // (N) host, each in [0, max_position_embeddings)
  int64_t N = 0;
  KvCacheAttention* kv = nullptr;      // required
  LinearOverride* linears = nullptr;   // null: the model's recipes (forward only, needs_backward = false)
  int32_t* routing_record = nullptr;   // (num_moe_layers, N, top_k) host or null: each row's expert ids
  // Rows whose logits are wanted, strictly ascending (host); null: every row. Only those rows go
  // through the lm_head and `logits` is (num_logit_rows, V) in their order (a prompt chunk needs
  // its last row's alone; 0 rows: no lm_head at all).
  const int32_t* logit_rows = nullptr;
  int64_t num_logit_rows = 0;
  // (V,C) BF16 bits of the lm_head weight in backend memory, made by the caller from the current
  // weights (the rollout engine snapshots it with its block linears); null: converted in this
  // forward. Used only where the lm_head runs on BF16 operands (lm_head_bf16()).
  const uint16_t* lm_head_bf16 = nullptr;
  // A forward that moves nothing between host and backend memory (the rollout engine's CUDA-graph
  // steps, rollout/decode_graph.h): when set, the rows' tokens and positions are read from these
  // (N) i32 arrays in backend memory (holding the same values as `tokens` and `positions`, which
  // are still checked on the host) instead of being uploaded, and the logits are written to
  // logits_device: (num_logit_rows, or N without logit_rows, V) f32 in backend memory instead of
  // the host (forward_decode's `logits` may then be null). The two inputs go together and need
  // logits_device; logits_device may be set alone (the logits stay on the device: greedy decoding
  // there, Backend::greedy_rows).
  const int32_t* tokens_device = nullptr;
  const int32_t* positions_device = nullptr;
  float* logits_device = nullptr;
};

// The training forward's step between RoPE and attention that gives K and V the values a
// quantized KV cache holds (the RL trainer with an NVFP4 rollout cache; model/kv_quantizer.h):
// each layer's rotated keys and values are rounded in place before attention reads them, so
// attention (and its backward) sees the rounded values; backward is straight-through (dk, dv
// pass unchanged into RoPE / the QKV projection). Not called by forward_decode (the cache
// quantizes there) nor by the double model.
class KvQuantizer {
 public:
  virtual ~KvQuantizer() = default;
  // k, v: (N, Hkv*D) f32 in be's memory, rows the batch's token rows (N = B*T, row b*T + t).
  virtual void quantize(backend::Backend& be, int64_t layer, float* k, float* v, int64_t N, int64_t Hkv,
                        int64_t D) = 0;
};

// What a float model keeps in backend memory (issue #15 item 4: a real-size model on one GPU).
// kTraining: FP32 values and gradients of every parameter. kInference (the rollout engine's
// models): FP32 values only of the parameters outside the block linears (embedding, norms,
// routers; the lm_head only where it runs on FP32 operands, the fp32 recipe); no gradients and
// no master copy of the block linears, whose weights live in the engine's storage of its
// precision mode (rollout/precision.h) and arrive there tensor by tensor, nor of a BF16 lm_head,
// whose bits the engine holds and passes in DecodeBatch::lm_head_bf16. An inference model runs forward_decode with a LinearOverride only (every training and
// eval entry point refuses it), with one layer's activations shared by all layers.
enum class ParameterStorage { kTraining, kInference };

template <typename T>
class TransformerT {
 public:
  // Builds the model (zero weights; call init_weights) on backend `be` (memory and ops; it must
  // outlive the model). For T = double the recipe and `be` are ignored: every linear is a plain
  // double GEMM on the CPU. Errors: unknown recipe, recipe factory errors.
  // storage: see ParameterStorage (kInference: float models only).
  static Result<std::unique_ptr<TransformerT>> create(const ModelConfig& config, const RecipeConfig& recipe,
                                                      backend::Backend* be = &backend::cpu_backend(),
                                                      ParameterStorage storage = ParameterStorage::kTraining);
  ~TransformerT();
  TransformerT(const TransformerT&) = delete;
  TransformerT& operator=(const TransformerT&) = delete;

  const ModelConfig& config() const { return config_; }
  // OLMo-style init: every matrix ~ N(0, initializer_range^2) truncated at 3 std, norm weights 1.
  // Parameter i draws from PhiloxStream(seed, stream = i): independent of threads and of T.
  // kInference: only the parameters it keeps (one tensor at a time through the host).
  void init_weights(uint64_t seed);
  // host: (param_refs()[index].numel) <- the values init_weights(seed) gives parameter `index`
  // (one tensor: what the rollout engine's per-tensor initialisation quantizes).
  void init_parameter(T* host, size_t index, uint64_t seed) const;

  // tokens, targets: (B,T) i32 host arrays (targets < 0 ignored, e.g. -100). Runs forward and backward,
  // ACCUMULATES parameter gradients (call zero_grad between optimizer steps) and returns the loss.
  LossParts forward_backward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t Tn,
                             const LossOptions& options = {}, const RoutingIO& routing = {});
  // A custom objective on the logits (e.g. RL policy-gradient losses): loss_fn receives the logits
  // (N,V) = (B*T,V) as a host array, must overwrite them in place with dL/dlogits and return L. The MoE aux and
  // router z-losses are added as usual; LossParts::ce holds loss_fn's value, n_tokens = 0.
  using LogitsLossFn = std::function<double(T* logits_to_dlogits, int64_t N, int64_t V)>;
  LossParts forward_backward_custom(const int32_t* tokens, int64_t B, int64_t Tn, const LogitsLossFn& loss_fn,
                                    const LossOptions& options = {}, const RoutingIO& routing = {});
  // Forward only (eval). token_ce: (B,T) host array or nullptr: per-token cross-entropy
  // (-log p(target)), 0 if ignored.
  LossParts forward_loss(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t Tn,
                         const LossOptions& options = {}, const RoutingIO& routing = {}, T* token_ce = nullptr);
  // logits: (B,T,V) caller-allocated host array.
  void forward_logits(T* logits, const int32_t* tokens, int64_t B, int64_t Tn, const RoutingIO& routing = {});
  // Prefill and decode (float models only): logits: (N,V) host <- the model on the rows of
  // `batch`, attention through batch.kv (see KvCacheAttention). The same per-layer code as the
  // training forward; no activations are kept for backward and micro_step() does not advance.
  // With DecodeBatch::logits_device the logits stay in backend memory (logits may be null).
  void forward_decode(T* logits, const DecodeBatch& batch);

  void zero_grad();
  // Step and seed passed to every LinearRecipe call (SR/RHT seeds, calibration windows).
  void set_step(int64_t step, uint64_t seed) { step_ = step; seed_ = seed; }
  int64_t step() const { return step_; }
  // Rows per lm_head + cross-entropy chunk; 0 (the default) derives it with lm_head_chunk_rows().
  // Tests set 1, 7, ... to check that results do not depend on it.
  void set_lm_head_chunk_rows(int64_t rows);
  // True where the lm_head GEMMs take BF16 operands (every recipe except fp32; never for double).
  bool lm_head_bf16() const;
  // Forward-call counter passed as LinearCall::micro_step (incremented by every forward). The
  // trainer sets it before each training micro-batch so a resumed run derives the same SR seeds.
  void set_micro_step(int64_t m) { micro_step_ = m; }
  int64_t micro_step() const { return micro_step_; }

  // All parameters in a stable order (embed, layer 0 .. L-1 in HF order, final norm, lm_head).
  // Values and grads are each one contiguous buffer in this order (flat_values / flat_grads), in
  // backend memory (host memory on the CPU backend). Host code reads and writes them through
  // the copies below (training storage only). kInference: flat_values holds the kept parameters
  // in this order, a block linear's members (and a BF16 lm_head) have null value and grad,
  // flat_grads is null.
  const std::vector<ParamRef<T>>& param_refs() const { return params_; }
  T* flat_values() { return values_; }
  T* flat_grads() { return grads_; }
  int64_t num_params() const { return num_params_; }
  // host: (num_params) in param_refs() order.
  void download_parameters(T* host) const;
  void upload_parameters(const T* host);
  void download_gradients(T* host) const;
  void upload_gradients(const T* host);
  // The backend holding this model's memory and running its ops (the CPU backend for double).
  backend::Backend& backend() const { return *be_; }
  ParamRef<T>* find_param(const std::string& name);

  // ---- storage (ParameterStorage) ----
  ParameterStorage storage() const { return storage_; }
  // Bytes of backend memory held for parameter values / gradients (0 for kInference), and for
  // everything else the model holds: activations, RoPE tables, the linears' workspace, lm_head
  // scratch (grow-only: what the largest call so far needed).
  int64_t value_bytes() const;
  int64_t gradient_bytes() const;
  int64_t workspace_bytes() const;
  int64_t activation_bytes() const;  // the part of workspace_bytes() that holds activations
  // Indices into param_refs() of the parameters whose rows, stacked in order, make up linear
  // `id`'s (N,K) weight (q|k|v, gate|up, or one matrix): [first, first + count).
  std::pair<size_t, size_t> linear_params(int id) const;

  // Linear instances in model order; recipes are null for T = double.
  const std::vector<LinearInfo>& linear_infos() const { return linear_infos_; }
  LinearRecipe* linear_recipe(int id);
  // The attention precision the model runs: kBf16 for every recipe but "fp32" (kFp32); the double
  // model's attention is exact whatever this says.
  backend::AttentionPrecision attention_precision() const;
  // Index of each linear's weight view (N,K) in backend memory: q|k|v and gate|up are adjacent parameters.
  // Null for kInference (the model keeps no block-linear weights).
  T* linear_weight(int id);

  int64_t num_moe_layers() const { return num_moe_layers_; }

  // ---- gradient readiness (the data-parallel reduce overlapped with backward) ----
  // Called during each backward (forward_backward*) with a flat offset f, on the calling thread,
  // once every gradient in [f, num_params) has its final value for this backward: the kernels
  // producing them are queued on the backend (not necessarily finished on a GPU). The offsets
  // fall: model.norm's (with lm_head), each block's first parameter from the last block down,
  // then 0 (the embedding). Parameters no token reached (an MoE expert without tokens) are final
  // with their block. Null: none (the default).
  void set_grads_final_hook(std::function<void(int64_t final_from)> hook) { grads_final_hook_ = std::move(hook); }

  // The K/V step of the training forward (see KvQuantizer; it must outlive its use); null: none,
  // the default. Float models only (the double model ignores it).
  void set_kv_quantizer(KvQuantizer* quantizer) { kv_quantizer_ = quantizer; }
  KvQuantizer* kv_quantizer() const { return kv_quantizer_; }

  // Float models only: Tensor views of the parameters (see Parameter).
  std::vector<Parameter> parameters();

 private:
  struct Impl;
  explicit TransformerT(const ModelConfig& config);
  LossParts run(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t Tn, const LossOptions& options,
                const RoutingIO& routing, bool backward, T* logits_out, T* token_ce,
                const LogitsLossFn* custom_loss = nullptr);

  ModelConfig config_;
  ParameterStorage storage_ = ParameterStorage::kTraining;
  backend::Backend* be_ = nullptr;
  std::vector<ParamRef<T>> params_;
  std::shared_ptr<Storage> value_storage_, grad_storage_;
  T* values_ = nullptr;
  T* grads_ = nullptr;
  int64_t num_params_ = 0;
  std::vector<LinearInfo> linear_infos_;
  int64_t num_moe_layers_ = 0;
  int64_t step_ = 0;
  uint64_t seed_ = 0;
  int64_t micro_step_ = 0;
  std::function<void(int64_t)> grads_final_hook_;
  KvQuantizer* kv_quantizer_ = nullptr;
  std::unique_ptr<Impl> impl_;
};

using Model = TransformerT<float>;
using ModelF64 = TransformerT<double>;

}  // namespace nibble::model
