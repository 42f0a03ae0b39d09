// AdamW (Loshchilov & Hutter 2019) with FP32 master weights and FP32 moments, in exactly the
// operation order of PyTorch's torch.optim.AdamW (single-tensor path): decoupled weight decay
// w *= 1 - lr*wd, m = lerp(m, g, 1-b1), v = b2*v + (1-b2)*g*g, then
// w -= (lr / (1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps). Also the global gradient-norm
// clip of torch.nn.utils.clip_grad_norm_ and gradient-accumulation helpers. Parameters, gradients
// and moments live in a backend::Backend's memory; the update is the backend's adamw_update_multi
// over all parameters (one call: one launch on CUDA), the norm its sum_squares_chunks_multi over
// fixed chunks of each (one round trip). Results do not depend on the thread count.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "io/safetensors.h"

namespace nibble::train {

// One trainable tensor as the optimizer sees it, in the backend's memory. value: (numel) f32
// master weights, updated in place; grad: (numel) f32 gradient of the step (unscaled: the step
// multiplies by grad_scale).
struct ParamView {
  std::string name;
  float* value = nullptr;
  const float* grad = nullptr;
  int64_t numel = 0;
  bool weight_decay = true;  // false for norms' gains and (by convention) embeddings if wanted
  // ZeRO-1 (train/zero.h): this view is the elements [offset, offset + numel) of parameter `name`,
  // which has full_numel elements (value and grad point at element `offset`). A parameter may
  // appear once per disjoint slice. full_numel < 0: the whole parameter (offset 0).
  int64_t offset = 0;
  int64_t full_numel = -1;
  int64_t parameter_numel() const { return full_numel < 0 ? numel : full_numel; }
};

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;  // spec 02 §6
};
Status validate(const AdamWConfig& c);

struct GradNorm {
  double norm = 0;      // L2 norm over all params of grad * grad_scale (before clipping)
  bool finite = true;   // false when the norm is NaN or Inf: the caller should skip the step
  float clip_scale = 1; // min(1, max_norm / (norm + 1e-6)) as torch's clip_grad_norm_; 1 if max_norm <= 0
};

// The global gradient norm of `params` (grads in be's memory, multiplied by grad_scale) and the
// clip factor for `max_norm`. be.sum_squares of each fixed 64K-element chunk, added in order on
// the host in double.
GradNorm global_grad_norm(const std::vector<ParamView>& params, double max_norm, float grad_scale = 1.0f,
                          backend::Backend& be = backend::cpu_backend());
// The two halves of global_grad_norm: the sum of squares (in that order), and the norm and clip
// factor from a sum of squares (ZeRO-1 sums the ranks' owned parts in between).
double grad_sum_squares(const std::vector<ParamView>& params, float grad_scale, backend::Backend& be);
GradNorm grad_norm_from_sum_squares(double sum_squares, double max_norm);

// Gradient accumulation over micro-batches: acc += g, then scale once by 1/n (or pass 1/n as
// the step's grad_scale instead). acc, g: (n) f32 host arrays.
void accumulate_grad(float* acc, const float* g, int64_t n);
void scale_grad(float* g, int64_t n, float s);

class AdamW {
 public:
  // Moments live in be's memory (be must outlive the optimizer); params given to step() too.
  explicit AdamW(AdamWConfig config = {}, backend::Backend* be = &backend::cpu_backend())
      : config_(config), be_(be) {}

  // One update of every param with learning rate `lr`, using grad[i] * grad_scale (fold
  // 1/accumulation-steps and the clip factor in here). Moments are created (zero) the first
  // time a name is seen; a name whose numel changed is an error. Increments step_count().
  Status step(const std::vector<ParamView>& params, double lr, float grad_scale = 1.0f);

  int64_t step_count() const { return step_; }
  const AdamWConfig& config() const { return config_; }
  // A host copy of m or v of a param (nullptr if unknown): (numel) f32, valid until the next
  // call of the same accessor for the same name. offset: the slice's (ZeRO-1 views).
  const std::vector<float>* exp_avg(const std::string& name, int64_t offset = 0) const;
  const std::vector<float>* exp_avg_sq(const std::string& name, int64_t offset = 0) const;
  // m (second = false) or v of the slice of `name` at `offset`, in the backend's memory: (numel of
  // that view) f32; nullptr if unknown or empty.
  const float* moment_data(const std::string& name, int64_t offset, bool second) const;
  // Elements of moments held (each of m and v): the sum of the views' numel.
  int64_t moment_elems() const;

  // State as named tensors for a checkpoint: "optimizer.step" (I64, shape (1)), and per param
  // "optimizer.<name>.exp_avg", "optimizer.<name>.exp_avg_sq" (F32, shape (numel)).
  std::vector<io::NamedTensor> export_state() const;
  // Restores what export_state wrote. Every param in `params` must have both moments with its
  // numel (parameter_numel(): the full size; a slice view takes its elements of them); tensors
  // for names not in `params`, missing tensors, wrong dtypes or sizes are errors. export_state needs
  // whole-parameter state (a slice is a checked error): ZeRO-1 checkpoints go through
  // Zero1::gather_state, which writes the same tensors.
  Status import_state(const std::vector<io::NamedTensor>& tensors, const std::vector<ParamView>& params);

 private:
  struct Moments {
    backend::Buffer<float> m, v;  // (numel) each, backend memory
    int64_t numel = 0, full_numel = 0;  // the slice's and its parameter's elements
  };
  using Key = std::pair<std::string, int64_t>;  // (parameter name, slice offset)
  const std::vector<float>* host_copy(const Key& key, bool second) const;

  AdamWConfig config_;
  backend::Backend* be_;
  int64_t step_ = 0;
  std::map<Key, Moments> state_;
  std::vector<backend::AdamWRange> ranges_;  // step()'s parameter list for adamw_update_multi (reused)
  mutable std::map<Key, std::vector<float>> host_m_, host_v_;  // exp_avg / exp_avg_sq copies
};

}  // namespace nibble::train
