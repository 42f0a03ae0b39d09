// The rollout engine's precision modes (issue #15 §2), as the model::LinearOverride its decode
// calls run every block linear through (the router, embedding and lm_head stay FP32):
//   recipe the model's own linear recipes, forward only (what `nibble generate` ran before the
//          engine; no override).
//   bf16   y = bf16(x) . bf16(W)^T, FP32 accumulation (the `bf16` recipe's forward); W is kept as
//          BF16 bits and x converted to bits per call, so a decode step reads 2 bytes a weight and
//          no GEMM converts its operands again (matmul_bf16_nt).
//   w4a16  W quantized once to NVFP4 by the backend quantizer the trainer's recipes call (same
//          bits: tetrajet-v2's two-level 1x16 format from the BF16 weight; for a checkpoint of
//          the nvfp4-nvidia recipe its 16x16-tile TE format), kept as codes + scales, and
//          dequantized exactly for the GEMM; activations BF16.
//   w4a4   as w4a16, and the BF16 activation entering each linear quantized (RTN) with the
//          same quantizer and dequantized.
// The CPU emulates the math. Only the mode's storage is kept per linear (codes + block scales +
// outer scales, or BF16 bits): a GEMM that needs the dequantized weight (prefill chunks) makes it
// in one scratch shared by all linears. Weights arrive from the model's master weights (training
// storage), tensor by tensor (set_weight: an FP32 tensor quantized here), or already quantized
// (set_quantized_weight(s): a trainer or a checkpoint).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "model/transformer.h"

namespace nibble::rollout {

enum class PrecisionMode { kRecipe, kBf16, kW4A16, kW4A4 };

// Sees each activation the w4a4 mode quantizes (the TRACE guidance recorder, recorders.h).
class ActivationObserver {
 public:
  virtual ~ActivationObserver() = default;
  // qx: the quantized activation entering linear `info` (backend memory; rows [0, M) are the
  // call's rows, any further rows are the TE tiles' zero padding). token_of_row: (M) i32 backend
  // memory, the step row of each row for a routed expert's linear (LinearCall::token_of_row);
  // null for the other linears, whose rows are the step's rows.
  virtual void on_quantized_activation(backend::Backend& be, const model::LinearInfo& info,
                                       const backend::QuantizedTensor& qx, int64_t M,
                                       const int32_t* token_of_row) = 0;
  // The fused MoE decode's form: true when on_quantized_activation_experts can take the routed
  // experts of a layer part at once on `be` (else QuantizedLinears walks the experts). Default: no.
  virtual bool observes_experts_grouped(backend::Backend& be) const { return false; }
  // qx: the quantized activations of all `rows` rows (backend memory, zero rows may follow); rows
  // [offsets[e], offsets[e+1]) enter expert linear infos[e] (E of one layer and part, in expert
  // order); offsets (E+1) i64 and token_of_row (rows) i32 in backend memory.
  virtual void on_quantized_activation_experts(backend::Backend& be, const model::LinearInfo* infos, int64_t E,
                                               const backend::QuantizedTensor& qx, int64_t rows,
                                               const int64_t* offsets, const int32_t* token_of_row) {}
};
const char* precision_mode_name(PrecisionMode m);
// "recipe" | "bf16" | "w4a16" | "w4a4"
Result<PrecisionMode> parse_precision_mode(const std::string& s);

class QuantizedLinears final : public model::LinearOverride {
 public:
  // Rows up to which the 4-bit modes multiply through Backend::matmul_nt_nvfp4_weight (the packed
  // weights; decode batches), above it through the dequantized weight (prefill chunks).
  static constexpr int64_t kPackedGemmMaxRows = 64;
  // Prepares every block linear of `model` for `mode` (not kRecipe) from its current master weights (call again
  // after the weights change); for a model of inference storage (no master weights) the storage
  // is allocated and each weight must arrive through set_weight / set_quantized_weight(s).
  // recipe_name picks the NVFP4 layout ("nvfp4-nvidia": TE formats;
  // any other: two-level). Errors: a linear whose in-features (or, for the TE tile format,
  // out-features) is not a multiple of 16 in a 4-bit mode.
  static Result<std::unique_ptr<QuantizedLinears>> create(model::Model& model, PrecisionMode mode,
                                                          const std::string& recipe_name);

  PrecisionMode mode() const { return mode_; }
  backend::QuantFormat weight_format() const { return weight_format_; }
  backend::QuantFormat activation_format() const { return act_format_; }
  // The quantized weight of linear `id` (4-bit modes), a view of backend memory.
  const backend::QuantizedTensor& quantized_weight(int id) const;
  // Bytes the weights of the block linears take in this mode's storage (codes + scales, or BF16).
  int64_t weight_bytes() const { return weight_bytes_; }
  // Backend memory held now: the weights' storage (== weight_bytes()), and the scratch of the
  // calls (activations, the dequantized weight of a prefill GEMM, an FP32 weight being quantized).
  int64_t storage_bytes() const;
  int64_t workspace_bytes() const;
  // True once every linear holds a weight (always, when made from master weights); otherwise
  // the first linear still waiting.
  bool weights_ready() const { return waiting_ == 0; }
  int first_waiting() const;

  // Weights received already quantized (issue #15 §2): weights[i] is the weight of linear i
  // (linear_infos() order) in weight_format(), shape (N, K); `where` says whether its pointers are
  // host memory (a checkpoint read) or the model's backend memory (a trainer's quantizer output:
  // RL's weight sync). Codes and scales are copied and the GEMM weight is their dequantization,
  // as create() does after quantizing, so the result is bit for bit create()'s on the weights
  // they were quantized from. Errors (nothing changed): the bf16 mode, a count, format or shape
  // that does not match.
  enum class Memory { kHost, kBackend };
  Status set_quantized_weights(const std::vector<backend::QuantizedTensor>& weights, Memory where);
  // One linear's weight at a time (what set_quantized_weights does per linear, same checks).
  Status set_quantized_weight(int id, const backend::QuantizedTensor& weight, Memory where);
  // w: (N,K) f32 FP32 weight of linear `id` in `where` memory: quantized (or made BF16 bits) as
  // create() does from a master weight, the same bits. A host weight goes through one (N,K)
  // upload scratch, so loading a model tensor by tensor holds one tensor at a time.
  Status set_weight(int id, const float* w, Memory where);

  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M,
               const model::LinearInfo& info, const model::LinearCall& call) override;
  // The fused MoE decode (model::LinearOverride): each MoE layer part's routed experts keep their
  // weights back to back (bf16: BF16 bits; w4a16 / w4a4 two-level NVFP4 codes + scales), so one
  // grouped GEMM on device offsets runs them all (grouped_matmul_bf16_nt, or the packed-weight
  // grouped GEMV grouped_matmul_nt_nvfp4_weight: only routed experts' weights are read). The same
  // roundings as forward() per expert (the activation formats are row-local); CPU: the same bits.
  // Not for the TE formats (nvfp4-nvidia: a per-tensor activation scale per expert), nor with an
  // observer that cannot take the grouped form, nor when NIBBLE_FUSED_MOE_DECODE=off (read at create).
  bool runs_experts_grouped(backend::Backend& be) const override;
  void forward_experts(backend::Backend& be, float* y, const float* x, int64_t rows, const model::LinearInfo* infos,
                       int64_t E, const int64_t* offsets, const int32_t* token_of_row,
                       const model::LinearCall& call) override;
  // w4a4: every quantized activation is shown to `observer` (null: none) right after quantizing.
  void set_observer(ActivationObserver* observer) { observer_ = observer; }

 private:
  struct Slot {
    backend::QuantizedBuffer qbuf;     // own storage (a linear outside the expert groups)
    backend::QuantizedTensor q;        // 4-bit modes: a view of qbuf or of its expert group's storage
    backend::Buffer<uint16_t> w_bits;  // (N,K) bf16 mode, own storage
    uint16_t* bits = nullptr;          // (N,K) bf16 mode: BF16 bits of the weight (w_bits or the group's)
    bool ready = false;                // holds a weight
    int group = -1;                    // index in groups_, or -1
  };
  // The E routed experts of one MoE layer and part, stored back to back: expert e's tensor starts
  // e tensors after expert 0's (the grouped GEMMs' weight layout).
  struct ExpertGroupStorage {
    int64_t E = 0, N = 0, K = 0;
    std::vector<int> ids;            // (E) linear ids in expert order
    backend::QuantizedBuffer qbuf;   // 4-bit modes: (E N, K) two-level (row-local: E (N, K) tensors)
    backend::QuantizedTensor q0;     // expert 0's (N, K) view of qbuf
    backend::Buffer<uint16_t> bits;  // bf16 mode: (E N K)
  };
  // The group of linear `id`, or null.
  const ExpertGroupStorage* group_of(int id) const;
  // The 4-bit modes' GEMM activation operand of x (M, K) f32: rounded to BF16 (w4a4: zero rows pad
  // to 16-row tiles, then quantized RTN, shown to `observe`, and dequantized), in this object's scratch.
  const float* activation_operand(backend::Backend& be, const float* x, int64_t M, int64_t K,
                                  const std::function<void(const backend::QuantizedTensor&)>& observe);
  // (q.rows, q.cols) f32 in wd_ <- dequantize(q): the GEMM weight of a prefill chunk.
  float* dequantized_weight(backend::Backend& be, const backend::QuantizedTensor& q);
  // Makes slot `id`'s storage from w: (N,K) f32 in backend memory.
  void quantize_from(int id, const float* w);
  Status check_quantized(int id, const backend::QuantizedTensor& w) const;
  void copy_quantized(int id, const backend::QuantizedTensor& w, Memory where);
  backend::Backend* be_ = nullptr;
  std::vector<model::LinearInfo> infos_;
  PrecisionMode mode_ = PrecisionMode::kBf16;
  backend::QuantFormat weight_format_ = backend::QuantFormat::kNvfp4TwoLevel;
  backend::QuantFormat act_format_ = backend::QuantFormat::kNvfp4TwoLevel;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<ExpertGroupStorage> groups_;
  bool fused_moe_ = true;  // NIBBLE_FUSED_MOE_DECODE=off walks the experts (A/B benches, tests)
  int64_t weight_bytes_ = 0;
  int64_t waiting_ = 0;                   // linears without a weight
  backend::Buffer<float> wd_;             // (N, K) of the largest linear: dequantized / BF16-rounded weight
  backend::Buffer<float> upload_;         // (N, K) set_weight: a host FP32 weight in backend memory
  backend::Buffer<float> xs_, xd_;        // (Mp, K) activation scratch: bf16-rounded, dequantized
  backend::QuantizedBuffer xq_;           // (Mp, K) quantized activation
  backend::Buffer<uint16_t> xb_;          // (M, K) bf16 mode: BF16 bits of the activation
  ActivationObserver* observer_ = nullptr;
};

}  // namespace nibble::rollout
