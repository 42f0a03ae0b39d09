// The quantized-linear seam: every block linear (fused QKV, attention output, fused gate+up,
// down; every MoE expert's gate+up and down; the optional shared expert) runs through one
// LinearRecipe instance, so the pretraining recipes of 02-pretraining-recipes.md (bf16,
// nvfp4-nvidia, tetrajet-v2) are pluggable. Y = X W^T, X: (M,K), W: (N,K), Y: (M,N), FP32 master
// weights. The router, embedding and lm_head never go through it. Built-in recipes: `fp32`
// (plain GEMMs, for gradient checks) and `bf16` (BF16-rounded operands in all three GEMMs).
// Every data operation of a recipe is an op of the backend::Backend the call passes (x, w, y,
// dx, dw live in that backend's memory); each recipe's policy exists once for every backend.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/check.h"
#include "core/status.h"
#include "core/tensor.h"

namespace nibble::model {

// The recipes' shared scratch (issue #13 item 4): the transient operands of a linear's GEMMs
// (dequantized BF16 operands, padded copies, transposes, quantized scratch), one per model on its
// backend and shared by all its linears, in numbered grow-only slots: scratch is the largest
// linear's, not the sum over linears, and a steady-state step allocates nothing. A slot's
// contents are valid only within one forward() or backward() call; each call asks for a slot
// once, at its largest size (a second, larger request may move it). Slots from kGroupedSlot on
// belong to a layer's grouped experts (forward_experts / backward_experts), which call each
// expert's own operand code on slots below it.
class LinearWorkspace {
 public:
  static constexpr int kSlots = 18;
  static constexpr int kGroupedSlot = 10;
  static constexpr int kQuantSlots = 2;
  // Room for n elements of T in `slot` (0 <= slot < kSlots).
  template <typename T>
  T* get(backend::Backend& be, int slot, int64_t n, const char* what) {
    return reinterpret_cast<T*>(slot_bytes(be, slot, n * static_cast<int64_t>(sizeof(T)), what));
  }
  // A quantized operand `format` (rows, cols) backed by quantized slot `slot` (< kQuantSlots).
  backend::QuantizedTensor quantized(backend::Backend& be, int slot, backend::QuantFormat format, int64_t rows,
                                     int64_t cols);
  // Bytes held now in backend memory.
  int64_t bytes() const;

 private:
  uint8_t* slot_bytes(backend::Backend& be, int slot, int64_t bytes, const char* what);
  backend::Buffer<uint8_t> slots_[kSlots];
  backend::QuantizedBuffer quant_[kQuantSlots];
};

// Per-call context. The pair (layer_id, micro_step) is unique per forward call of one training
// run, so recipes derive fresh SR/RHT seeds from (seed, step, layer_id, micro_step).
struct LinearCall {
  int64_t step = 0;          // optimizer step (Model::set_step)
  uint64_t seed = 0;         // run seed (Model::set_step)
  int layer_id = 0;          // LinearInfo::id of this instance
  int64_t micro_step = 0;    // forward-call counter of the model (one per micro-batch)
  bool needs_backward = true;  // false in eval/generation forwards: no state need be saved
  // The model's shared scratch; null: the recipe instance's own (tests and tools that call one
  // recipe by itself).
  LinearWorkspace* workspace = nullptr;
  // A routed expert's linear (kExpertGateUp / kExpertDown): (M) i32 in backend memory, the token
  // (row of the forward's B*T or N token rows) that each of the call's M rows belongs to — the
  // dispatch plan's token_of_row for this expert's rows. Null for every other linear (its rows
  // are the tokens themselves) and where the caller has no plan (a recipe called by itself).
  const int32_t* token_of_row = nullptr;
  // The same tokens in host memory where the caller already has them (a recipe's forward_experts
  // that copied the layer's plan once), else null: a recipe that needs them on the host copies them.
  const int32_t* token_of_row_host = nullptr;
};

enum class LinearKind { kQkv, kAttnOut, kGateUp, kDown, kExpertGateUp, kExpertDown, kSharedGateUp, kSharedDown };
const char* linear_kind_name(LinearKind k);

// What a factory knows about the linear it builds.
struct LinearInfo {
  int id = 0;            // 0.. in model order (stable)
  std::string name;      // e.g. "model.layers.3.self_attn.qkv_proj", "model.layers.1.mlp.experts.5.down_proj"
  LinearKind kind = LinearKind::kQkv;
  int block = 0;         // transformer block index
  int num_blocks = 0;    // number of blocks in the model (for "last k blocks in BF16")
  int expert = -1;       // expert index for expert linears
  int64_t N = 0, K = 0;  // weight shape (N,K)
};

class LinearRecipe;
struct ExpertGroup;

// The group's (E+1) host offsets: its own, or a (synchronising) copy of the device ones in `copy`.
const int64_t* expert_offsets_host(backend::Backend& be, const ExpertGroup& g, std::vector<int64_t>& copy);

// All experts of one MoE layer's gate_up (or down) linears at once (issue #13): expert g's rows
// are [offsets[g], offsets[g+1]) of x, y, dx, dy; its weight and gradient start w_stride elements
// after expert g-1's. Each expert keeps its own recipe instance (its own state and quantizers).
struct ExpertGroup {
  LinearRecipe* const* recipes = nullptr;  // (E) the experts' recipes
  const LinearCall* calls = nullptr;       // (E) each expert's call context
  const int64_t* offsets = nullptr;        // (E+1) i64 in backend memory, or null (host offsets only)
  const int64_t* offsets_host = nullptr;   // (E+1) host copy, or null (the grouped path reads none)
  int64_t E = 0;
  int64_t rows = 0;      // rows of x, y (offsets[E] <= rows)
  int64_t w_stride = 0;  // elements between consecutive experts' weights (and gradients)
  // (rows) i32 in backend memory: the token of each row (the dispatch plan's token_of_row), or
  // null; the per-expert default passes expert g's part on as its LinearCall::token_of_row.
  const int32_t* token_of_row = nullptr;
};

// The rows of a grouped FP4 experts call (nvfp4-nvidia, tetrajet-v2): each expert's own recipe
// instance quantizes its operands (its own per-tensor amax, SR streams, outlier channels) into the
// layer's grouped operand buffers, then one grouped GEMM per product runs every expert. The
// per-expert quantizers need the host offsets; the along-token (wgrad) operands are padded per
// expert to `multiple` rows, so their blocks never cross experts and expert g's start at padded
// row pad[g]. Both offset arrays are also put in backend memory (workspace slot kSlots - 1).
struct ExpertRowPlan {
  const int64_t* off = nullptr;      // (E+1) host: row offsets
  const int64_t* pad = nullptr;      // (E+1) host: padded row offsets
  const int64_t* off_dev = nullptr;  // (E+1) in backend memory
  const int64_t* pad_dev = nullptr;  // (E+1) in backend memory
  int64_t E = 0;
  int64_t max_rows = 0, max_padded = 0;  // of one expert
  int64_t rows() const { return off[E]; }
  int64_t padded_rows() const { return pad[E]; }
  // Builds the plan of `group` (host offsets, copied from the device ones where not given).
  // Returns false, building nothing, where the backend has no grouped GEMMs (Op::kGroupedGemm) or
  // the group no experts: the caller then takes the per-expert loop.
  bool build(backend::Backend& be, const ExpertGroup& group, int64_t multiple, LinearWorkspace& ws);

 private:
  std::vector<int64_t> host_;  // (2(E+1)) off then pad: one copy to the backend (reused)
};

// Expert e's recipe of `group` as the grouped implementation's class R (a layer's experts are built
// by one factory from one config, so they share it; checked).
template <typename R>
R* group_expert(const ExpertGroup& group, int64_t e) {
  R* r = dynamic_cast<R*>(group.recipes[e]);
  NIB_CHECK_MSG(r != nullptr, "experts: expert {} of the group has another recipe class than expert 0", e);
  return r;
}

// One instance per linear layer; per-layer state (saved operands, outlier channels,
// OsciReset buffers) lives in the instance.
// Contract: backward() pairs with the most recent forward() that had needs_backward = true;
// the x and w buffers given to that forward stay alive and unchanged until backward returns
// (the model guarantees this), so a recipe may keep pointers instead of copies.
// Gradient accumulation over micro-batches = forward/backward pairs in sequence, dw += each time.
class LinearRecipe {
 public:
  virtual ~LinearRecipe() = default;
  virtual std::string name() const = 0;
  // y: (M,N) f32 (overwritten); x: (M,K) f32; w: (N,K) f32 master weight; all in be's memory.
  virtual void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N,
                       int64_t K, const LinearCall& call) = 0;
  // dx: (M,K) f32 (overwritten), dw: (N,K) f32 (accumulated +=), dy: (M,N) f32; in be's memory.
  virtual void backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N,
                        int64_t K, const LinearCall& call) = 0;
  // Called after each optimizer update with the new master weight w: (N,K) in be's memory
  // (OsciReset hook; it may modify w). Default: nothing.
  virtual void after_optimizer_step(backend::Backend& be, float* w, int64_t N, int64_t K, int64_t step) {}

  // The same on host arrays through backend::cpu_backend() (tests, tools).
  void forward(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K, const LinearCall& call) {
    forward(backend::cpu_backend(), y, x, w, M, N, K, call);
  }
  void backward(float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K, const LinearCall& call) {
    backward(backend::cpu_backend(), dx, dw, dy, M, N, K, call);
  }
  void after_optimizer_step(float* w, int64_t N, int64_t K, int64_t step) {
    after_optimizer_step(backend::cpu_backend(), w, N, K, step);
  }

  // ---- all experts of a layer at once (called on group.recipes[0]; see ExpertGroup) --------------
  // True when forward_experts / backward_experts run without host offsets on `be` (one grouped
  // GEMM per call); the model then plans the routing on the device only. Default: false.
  virtual bool runs_experts_grouped(backend::Backend& be) const { return false; }
  // y: (rows,N) f32, x: (rows,K) f32, w: expert g's (N,K) at w + g * w_stride. Default: each
  // non-empty expert's own forward() in turn (needs offsets_host; copies it from offsets if null).
  virtual void forward_experts(backend::Backend& be, float* y, const float* x, const float* w, int64_t N, int64_t K,
                               const ExpertGroup& group);
  // dx: (rows,K) overwritten, dw: expert g's (N,K) at dw + g * w_stride (+=), dy: (rows,N).
  // Default: each non-empty expert's own backward() in turn.
  virtual void backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t N, int64_t K,
                                const ExpertGroup& group);

  // Recipe state that belongs in checkpoints  // Recipe state that belongs in checkpoints (e.g. outlier channel ids), by short name (host tensors).
  virtual std::map<std::string, Tensor> state() const { return {}; }
  virtual Status load_state(const std::map<std::string, Tensor>& state) { return Status::ok(); }
  // The run's total optimizer step count (OsciReset's start_fraction); the trainer calls it once
  // before training (0 = unknown). Default: nothing.
  virtual void set_total_steps(int64_t total_steps) {}
  // Counters for logging by short name (e.g. "oscireset.resets_total", "outliers.channels").
  // Default: none.
  virtual std::map<std::string, double> stats() const { return {}; }

 protected:
  // The call's shared workspace, or this instance's own when the caller passed none.
  LinearWorkspace& workspace(const LinearCall& call) {
    return call.workspace != nullptr ? *call.workspace : own_workspace_;
  }

 private:
  LinearWorkspace own_workspace_;
};

// A derived recipe re-exposes the host overloads its overrides would hide.
#define NIB_LINEAR_RECIPE_HOST_OVERLOADS   \
  using LinearRecipe::forward;             \
  using LinearRecipe::backward;            \
  using LinearRecipe::after_optimizer_step

// A Philox stream for random draw `purpose` (0..15) of one linear call, a function of
// (step, layer_id, micro_step) only: each quantizer / RHT sign vector of a call draws from
// its own stream under key call.seed, so no two operands share SR noise.
inline uint64_t linear_call_stream(const LinearCall& call, uint32_t purpose) {
  auto mix = [](uint64_t z) {  // splitmix64 finaliser
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(static_cast<uint64_t>(call.step) + 0x9E3779B97F4A7C15ull);
  h = mix(h ^ static_cast<uint64_t>(static_cast<uint32_t>(call.layer_id)));
  h = mix(h ^ static_cast<uint64_t>(call.micro_step));
  return (h << 4) | (purpose & 15u);
}

// ---- recipe configuration (JSON; switches of 02-pretraining-recipes.md) ----------------------
struct OutlierConfig {          // outcontrol.outliers (TetraJet-v2 static outlier retention)
  bool enabled = false;
  double fraction = 0.10;       // top p of input channels kept in MXFP8
  int64_t round_to = 128;       // channel count rounded up to a multiple of this
  int64_t calibration_start = 501;  // first step of the calibration window (inclusive)
  int64_t calibration_end = 550;    // last step (inclusive)
};
struct OsciResetConfig {        // oscireset
  bool enabled = false;
  double threshold = 8.0;       // risk = dist_Q / dist_W >= threshold -> reset
  int64_t window = 50;          // T: steps accumulated after each snapshot
  int64_t period = 200;         // P
  int64_t start_step = -1;      // absolute start step; -1 = use start_fraction
  double start_fraction = 0.65; // of total training steps
  std::string variant = "full"; // "full" | "tracked" (memory-efficient: track the closest elements)
  double tracked_fraction = 0.10;
};
struct RecipeConfig {
  std::string name = "bf16";    // registry key: "fp32", "bf16", "nvfp4-nvidia", "tetrajet-v2", ...
  // tetrajet-v2
  bool alignment = true;        // backward re-quantizes the forward-quantized X^, W^ (double quantization)
  bool sr = true;               // stochastic rounding of the four backward operands
  bool rht = true;              // outcontrol.rht: RHT16 on the backward operands
  OutlierConfig outliers;       // outcontrol.outliers
  OsciResetConfig oscireset;
  // nvfp4-nvidia
  int64_t bf16_last_blocks = 0; // keep the last k blocks' linears in BF16
  nlohmann::json raw;           // the whole JSON object as given (recipe-specific extras)

  nlohmann::json to_json() const;
};
// Accepts {"name": ..., "alignment": b, "sr": b, "outcontrol": {"rht": b, "outliers": {"enabled",
// "fraction", "round_to", "calibration_start", "calibration_end"}}, "oscireset": {"enabled",
// "threshold", "window", "period", "start_step", "start_fraction", "variant", "tracked_fraction"},
// "bf16_last_blocks": n}; a bare string is the name. Unknown keys are errors (typos).
Result<RecipeConfig> parse_recipe_config(const nlohmann::json& j);

// ---- the registry ------------------------------------------------------------------------------
using LinearRecipeFactory =
    std::function<Result<std::unique_ptr<LinearRecipe>>(const RecipeConfig& config, const LinearInfo& info)>;
// Adds or replaces a recipe. Built-ins are registered in linear_registry.cpp (add a line there
// for a new recipe so static linking keeps it).
void register_linear_recipe(const std::string& name, LinearRecipeFactory factory);
std::vector<std::string> linear_recipe_names();
bool has_linear_recipe(const std::string& name);
// Builds the recipe config.name for one linear; unknown name -> invalid_argument listing the names.
Result<std::unique_ptr<LinearRecipe>> make_linear_recipe(const RecipeConfig& config, const LinearInfo& info);

// ---- the two reference recipes -------------------------------------------------------------------
// fp32: y = x w^T; dx = dy w; dw += dy^T x, all binary32 (the backend's FP32 GEMMs).
class Fp32LinearRecipe final : public LinearRecipe {
 public:
  NIB_LINEAR_RECIPE_HOST_OVERLOADS;
  std::string name() const override { return "fp32"; }
  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
               const LinearCall& call) override;
  void backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K,
                const LinearCall& call) override;

 private:
  const float* x_ = nullptr;  // saved pointers (see the LinearRecipe contract)
  const float* w_ = nullptr;
};

// bf16: BF16 GEMMs with FP32 accumulation: every GEMM operand (x, w in the forward; dy, w in
// dgrad; dy, x in wgrad) is rounded to the nearest bf16 (to_bf16_bits) and multiplied by the
// backend's BF16-operand GEMMs (matmul_bf16_*: tensor cores on CUDA, exact widening + FP32 GEMM
// on the CPU), outputs are binary32. x and w are saved as BF16 bits (half the FP32 bytes).
class Bf16LinearRecipe final : public LinearRecipe {
 public:
  NIB_LINEAR_RECIPE_HOST_OVERLOADS;
  std::string name() const override { return "bf16"; }
  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
               const LinearCall& call) override;
  void backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K,
                const LinearCall& call) override;
  // Grouped experts where the backend has Op::kGroupedGemm: x of all experts and the span of
  // their weights to BF16 bits once, then one grouped GEMM per product (saved in this instance).
  bool runs_experts_grouped(backend::Backend& be) const override;
  void forward_experts(backend::Backend& be, float* y, const float* x, const float* w, int64_t N, int64_t K,
                       const ExpertGroup& group) override;
  void backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t N, int64_t K,
                        const ExpertGroup& group) override;

 private:
  backend::Buffer<uint16_t> xb_, wb_;  // saved BF16 bits of x (M,K), w (N,K); dY's go to the workspace
  // the last forward_experts (rows, E, w_stride; 0 rows: none), whose bits xb_ / wb_ hold
  int64_t grouped_rows_ = 0, grouped_E_ = 0, grouped_stride_ = 0;
};

// dst: (n) = round_to_bf16(src: (n)), host arrays
void round_to_bf16_array(float* dst, const float* src, int64_t n);

}  // namespace nibble::model
