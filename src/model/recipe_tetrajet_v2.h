// The `tetrajet-v2` LinearRecipe (02-pretraining-recipes.md §2-§4): six nvfp4-2level quantizers
// (Q1/Q2 RTN forward along K; Q3/Q4 SR(RHT) dgrad along N; Q5/Q6 SR(RHT) wgrad along tokens) with
// tensor alignment (the backward re-quantizes the forward-quantized X̂, Ŵ), OutControl (RHT +
// static outlier channels kept in MXFP8) and OsciReset (per-element weight-oscillation reset).
// Through backend ops: each quantized operand is dequantized to BF16 and multiplied by a BF16
// GEMM with FP32 accumulation (issue #13). Switches come from RecipeConfig; docs/recipes.md maps
// every spec line to this file.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/linear.h"

namespace nibble::model {

// Stream purposes (linear_call_stream) of one tetrajet-v2 backward call.
inline constexpr uint32_t kTetraStreamQ3 = 0;         // SR of RHT(dY) along N        (dgrad)
inline constexpr uint32_t kTetraStreamQ4 = 1;         // SR of RHT(Ŵ^T) along N       (dgrad)
inline constexpr uint32_t kTetraStreamQ5 = 2;         // SR of RHT(dY^T) along tokens (wgrad)
inline constexpr uint32_t kTetraStreamQ6 = 3;         // SR of RHT(X̂^T) along tokens  (wgrad)
inline constexpr uint32_t kTetraStreamRhtDgrad = 4;   // sign vector shared by Q3, Q4
inline constexpr uint32_t kTetraStreamRhtWgrad = 5;   // sign vector shared by Q5, Q6

// OsciReset of one weight (N,K) (spec §3). Driven by after_optimizer_step(step): a snapshot at
// step % period == 0 (step >= start), distances accumulated over the `window` following steps,
// decision and reset at snapshot + window + 1, then the buffers are freed. `quant` is the
// forward weight quantize-dequantize: wq (N,K) <- Q(w) and, when `scale` is not null, the
// effective FP4 block scale sp of every element (N,K) (0 for elements that are not FP4).
class OsciReset {
 public:
  using QuantFn = std::function<void(float* wq, float* scale, const float* w)>;
  explicit OsciReset(const OsciResetConfig& config) : config_(config) {}
  void set_total_steps(int64_t total_steps) { total_steps_ = total_steps; }
  // The first step at which snapshots may happen: start_step, or floor(start_fraction * total
  // steps); -1 when start_step < 0 and the total is unknown (then OsciReset never runs).
  int64_t start_step() const;
  // eligible: (N*K) 1 for FP4 elements (others are never tracked or reset); empty = all.
  // Returns the number of elements reset at this step (0 on non-decision steps).
  int64_t on_step(float* w, int64_t N, int64_t K, int64_t step, const QuantFn& quant,
                  const std::vector<uint8_t>& eligible);
  bool active() const { return snapshot_step_ >= 0; }
  int64_t snapshot_step() const { return snapshot_step_; }
  int64_t tracked() const { return static_cast<int64_t>(index_.size()); }
  int64_t resets_last() const { return resets_last_; }
  int64_t resets_total() const { return resets_total_; }
  int64_t decisions() const { return decisions_; }
  // Checkpoint state: "oscireset.counters" I64 (3) = (snapshot_step, resets_total, decisions),
  // and while a window is open "oscireset.index" I64 (n), "oscireset.buffers" F32 (4, n) =
  // (w_prev, q_prev, dist_w, dist_q).
  void save(std::map<std::string, Tensor>& out) const;
  Status load(const std::map<std::string, Tensor>& in, int64_t numel);

  // Score of an element for the tracked variant: distance of |w|/sp to its nearest E2M1 grid
  // point divided by the width of the grid interval holding it (0 on the grid, 0.5 at a rounding
  // threshold; 0 when saturated at 6 or sp == 0). Larger = closer to a rounding threshold.
  static float threshold_score(float w, float sp);

 private:
  OsciResetConfig config_;
  int64_t total_steps_ = 0;
  int64_t snapshot_step_ = -1;
  std::vector<int64_t> index_;                        // tracked flat element indices, ascending
  std::vector<float> w_prev_, q_prev_, dist_w_, dist_q_;  // one per tracked element
  std::vector<float> wq_, scale_;                      // (N,K) scratch, freed with the window
  int64_t resets_last_ = 0, resets_total_ = 0, decisions_ = 0;
};

// Per call, Y = X W^T with X (M,K), W (N,K), dY (M,N); every source operand is first rounded to
// BF16 (the engine's activations/gradients/compute weights are BF16). With alignment on:
//  forward  Y  = BF16( X̂ Ŵ^T ),  X̂ = Q1 = RTN(X), Ŵ = Q2 = RTN(W)           nvfp4-2level along K
//  dgrad    dX = BF16( Q3 · Q4^T ), Q3 = SR(RHT_d(dY)) (M,N), Q4 = SR(RHT_d(Ŵ^T)) (K,N)  along N
//  wgrad    dW += Q5 · Q6^T (FP32), Q5 = SR(RHT_w(dY^T)) (N,M), Q6 = SR(RHT_w(X̂^T)) (K,M) along M
// alignment off: Q4/Q6 quantize W^T / X^T (BF16) instead of Ŵ^T / X̂^T. sr off: RTN in Q3..Q6.
// rht off: no transform. Tokens M and outputs N are zero-padded to multiples of 128 for the
// 128-blocks along them (zero blocks have s_o = 1, codes 0, and add nothing to any GEMM); K must
// be a multiple of 16 (a last partial 128-block along K is the driver's zero-padded block); N is any.
// Outlier channels (after calibration): X and W columns `outlier_channels()` are gathered into
// dense (M, n_o) / (N, n_o) operands quantized MXFP8 (E4M3, E8M0 rounded up, blocks of 32 along
// the gathered channels, zero-padded to 32); the rest are gathered into (M, K_m) / (N, K_m) and
// quantized as above. Y = X̂_m Ŵ_m^T + X̂_o Ŵ_o^T. dgrad rebuilds Ŵ (N,K) from both parts, then
// Q4 as above. wgrad: dW[:, main] += Q5 Q6_m^T, dW[:, out] += Q5 · MXFP8_RTN(RHT_w(X̂_o^T))^T.
// GEMM operands: every product above multiplies BF16 operands with FP32 sums (backend
// matmul_bf16_nt): a 2-level value code × fl(inner × outer) is rounded to the nearest BF16
// (relative error <= 2^-8: the FP32 outer scale varies per row and per 128 columns along K, so it
// cannot be a GEMM alpha; docs/architecture.md "accepted rounding"), an MXFP8 value E4M3 × 2^k is
// exact. The re-quantizations (alignment, Q4/Q6) read the FP32 dequantized values, not the
// rounded operands.
// Grouped experts (where the backend has Op::kGroupedGemm and every routed expert has as many
// outlier channels): each expert's instance quantizes its own operands (its own SR streams, RHT
// signs, outlier channels) into the layer's grouped buffers, the along-token ones padded to 128
// rows per expert; one grouped GEMM per product.
class TetraJetV2LinearRecipe final : public LinearRecipe {
 public:
  NIB_LINEAR_RECIPE_HOST_OVERLOADS;
  TetraJetV2LinearRecipe(const RecipeConfig& config, const LinearInfo& info);
  std::string name() const override { return "tetrajet-v2"; }
  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
               const LinearCall& call) override;
  void backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K,
                const LinearCall& call) override;
  void after_optimizer_step(backend::Backend& be, float* w, int64_t N, int64_t K, int64_t step) override;
  void forward_experts(backend::Backend& be, float* y, const float* x, const float* w, int64_t N, int64_t K,
                       const ExpertGroup& group) override;
  void backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t N, int64_t K,
                        const ExpertGroup& group) override;
  std::map<std::string, Tensor> state() const override;
  Status load_state(const std::map<std::string, Tensor>& state) override;
  void set_total_steps(int64_t total_steps) override { oscireset_.set_total_steps(total_steps); }
  std::map<std::string, double> stats() const override;

  // The forward weight quantize-dequantize Q(w) (what OsciReset compares), on host arrays: wq
  // (N,K) <- FP4 main channels fake-quantized exactly as Q2, outlier channels MXFP8 as in the
  // forward; scale (N,K) or null <- sp of each FP4 element, 0 on outlier channels. Runs on the
  // backend of the last call (the CPU backend before any).
  void fake_quantize_weight(float* wq, float* scale, const float* w) const;
  // Outlier input channels (ascending), empty before/without selection.
  const std::vector<int64_t>& outlier_channels() const { return out_idx_; }
  bool outliers_selected() const { return selected_; }
  // Selects outliers now from the accumulated calibration sums (normally automatic at the first
  // forward after calibration_end). Returns the count selected.
  int64_t select_outliers();
  const OsciReset& oscireset() const { return oscireset_; }

 private:
  void set_outliers(std::vector<int64_t> channels);
  void calibrate(backend::Backend& be, const float* x, int64_t M, const LinearCall& call);
  // The calibration sums (K) on the host (from the backend, or as loaded from a checkpoint).
  std::vector<double> calibration_sums_host() const;
  // Copies the channel lists to be's memory when they changed (or the backend did).
  void upload_channels(backend::Backend& be) const;
  backend::Backend& backend_or_cpu() const;
  // The padded shapes of a call with M tokens: Mp, Np = M, N rounded up to 128; nm main and no
  // outlier channels, Km = nm rounded up to 16, No = no rounded up to 32.
  struct Shapes {
    int64_t Mp, Np, nm, Km, no, No;
  };
  Shapes shapes(int64_t M, int64_t N) const;
  // The shapes every routed expert of `plan` shares for N outputs (Mp 0: each pads its own rows),
  // or none when their outlier-channel counts differ (each selects its channels at its own first
  // forward after calibration).
  static std::optional<Shapes> common_shapes(const ExpertGroup& group, const ExpertRowPlan& plan, int64_t N);
  // The split of one call (forward = prepare_forward + forward_prepared; the grouped experts call
  // the parts for each expert and run the GEMMs grouped); shapes as in Shapes.
  void prepare_forward(backend::Backend& be, const float* x, int64_t M, const LinearCall& call);  // calibration
  void forward_prepared(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N,
                        int64_t K, const LinearCall& call);
  // xq (Mp,Km), wq (Np,Km): the main channels' X̂, Ŵ operands (written where nm > 0); xoq (Mp,No),
  // woq (N,No): the outlier channels' (written where there are outliers).
  void forward_operands(backend::Backend& be, uint16_t* xq, uint16_t* wq, uint16_t* xoq, uint16_t* woq,
                        const float* x, const float* w, int64_t M, int64_t N, int64_t K, const LinearCall& call);
  // q3 (M,Np), q4 (K,Np) dgrad operands; q5 (Np,Mp), q6 (Km,Mp), q6o (No,Mp) wgrad operands (q6
  // where nm > 0, q6o where there are outliers).
  void backward_operands(backend::Backend& be, uint16_t* q3, uint16_t* q4, uint16_t* q5, uint16_t* q6,
                         uint16_t* q6o, const float* dy, int64_t M, int64_t N, int64_t K, const LinearCall& call);

  RecipeConfig config_;
  LinearInfo info_;
  backend::Backend* be_ = nullptr;     // backend of the last call
  // outliers
  backend::Buffer<double> calib_sumsq_;  // (K) sum over calibration tokens of x^2 per input channel
  bool calib_ready_ = false;             // calib_sumsq_ holds the running sums
  std::vector<double> calib_loaded_;     // (K) sums from a checkpoint, uploaded at the next calibration
  int64_t calib_calls_ = 0;
  bool selected_ = false;
  std::vector<int64_t> out_idx_, main_idx_;  // ascending channel ids (host)
  // the same lists in backend memory (op inputs), refreshed by upload_channels
  mutable backend::Buffer<int64_t> out_idx_dev_, main_idx_dev_;
  mutable const backend::Backend* idx_be_ = nullptr;
  mutable bool idx_dirty_ = true;
  // OsciReset
  OsciReset oscireset_;
  std::vector<float> w_host_;          // (N,K) host copy of w while OsciReset works
  // saved forward state (backend memory, grow-only): the quantized operands only; every
  // dequantized operand, padded copy and transpose is transient, in the model's LinearWorkspace
  int64_t M_ = 0, N_ = 0, K_ = 0;
  const float* x_saved_ = nullptr;     // (M,K) x of the last forward (alignment off: fresh X^T)
  const float* w_saved_ = nullptr;     // (N,K) w of the last forward (alignment off: fresh W^T)
  backend::QuantizedBuffer xhat_buf_, what_buf_;  // X̂_m (Mp,Km) / Ŵ_m (Np,Km) 2-level codes + scales
  backend::QuantizedTensor xhat_, what_;
  backend::QuantizedBuffer xohat_buf_, wohat_buf_;  // MXFP8 X̂_o (Mp,No) / Ŵ_o (N,No); No = n_o padded to 32
  backend::QuantizedTensor xohat_, wohat_;
  ExpertRowPlan expert_plan_;          // grouped experts (expert 0's instance): the rows of the last call
  // fake_quantize_weight scratch
  mutable backend::Buffer<float> fq_w_, fq_src_, fq_deq_;
  mutable backend::QuantizedBuffer fq_q_;
};

Result<std::unique_ptr<LinearRecipe>> make_tetrajet_v2_recipe(const RecipeConfig& config, const LinearInfo& info);

}  // namespace nibble::model
