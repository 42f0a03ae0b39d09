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
// The CPU emulates the math; the dequantized weight is kept beside the codes. The 4-bit weights
// may also arrive already quantized (set_quantized_weights: a trainer or a checkpoint).
#pragma once

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
  // after the weights change). recipe_name picks the NVFP4 layout ("nvfp4-nvidia": TE formats;
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

  // Weights received already quantized (issue #15 §2): weights[i] is the weight of linear i
  // (linear_infos() order) in weight_format(), shape (N, K); `where` says whether its pointers are
  // host memory (a checkpoint read) or the model's backend memory (a trainer's quantizer output:
  // RL's weight sync). Codes and scales are copied and the GEMM weight is their dequantization,
  // as create() does after quantizing, so the result is bit for bit create()'s on the weights
  // they were quantized from. Errors (nothing changed): the bf16 mode, a count, format or shape
  // that does not match.
  enum class Memory { kHost, kBackend };
  Status set_quantized_weights(const std::vector<backend::QuantizedTensor>& weights, Memory where);

  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M,
               const model::LinearInfo& info, const model::LinearCall& call) override;
  // w4a4: every quantized activation is shown to `observer` (null: none) right after quantizing.
  void set_observer(ActivationObserver* observer) { observer_ = observer; }

 private:
  struct Slot {
    backend::QuantizedBuffer qbuf;
    backend::QuantizedTensor q;  // 4-bit modes
    backend::Buffer<float> w;    // (N,K) 4-bit modes: the dequantized weight for the prefill GEMM
    backend::Buffer<uint16_t> w_bits;  // (N,K) bf16 mode: BF16 bits of the weight
  };
  backend::Backend* be_ = nullptr;
  std::vector<model::LinearInfo> infos_;
  PrecisionMode mode_ = PrecisionMode::kBf16;
  backend::QuantFormat weight_format_ = backend::QuantFormat::kNvfp4TwoLevel;
  backend::QuantFormat act_format_ = backend::QuantFormat::kNvfp4TwoLevel;
  std::vector<std::unique_ptr<Slot>> slots_;
  int64_t weight_bytes_ = 0;
  backend::Buffer<float> xs_, xd_;        // (Mp, K) activation scratch: bf16-rounded, dequantized
  backend::QuantizedBuffer xq_;           // (Mp, K) quantized activation
  backend::Buffer<uint16_t> xb_;          // (M, K) bf16 mode: BF16 bits of the activation
  ActivationObserver* observer_ = nullptr;
};

}  // namespace nibble::rollout
