// `nibble bench train` (issue #13 item 5): the speed of a whole training step and of one
// quantized linear layer on a backend, measured the way 05-performance-anchors.md measures
// the PyTorch baseline: random tokens, warm-up steps first, then the median step time over timed
// steps (each step synchronised: forward+backward with CE + z-loss, global-norm clip, AdamW).
// Reports tokens/s, model FLOPs utilisation (6 x non-embedding active params, lm_head included,
// + 6 x layers x width x seq per token, against a given peak; the formula that reproduces the
// anchors' PyTorch MFU) and the backend's peak memory. With profile set, one more step runs after
// the timed ones with every op timed (backend/profiling_backend.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/profiling_backend.h"
#include "core/status.h"
#include "model/config.h"
#include "model/linear.h"

namespace nibble::train {

struct TrainBenchOptions {
  int64_t batch = 8, seq_len = 4096;
  int warmup_steps = 2, timed_steps = 5;
  double peak_tflops = 756.0;  // measured H200 BF16 GEMM rate (05-performance-anchors.md)
  uint64_t seed = 1;
  bool profile = false;  // after the timed steps, one step with every op synchronised and timed
};

struct TrainBenchResult {
  std::string recipe;
  double step_seconds = 0;       // median over timed steps
  double tokens_per_second = 0;
  double flops_per_token = 0;
  double mfu = 0;                // tokens/s x flops/token / peak
  int64_t peak_bytes = -1;       // the backend's peak allocated bytes (-1: not tracked)
  double first_loss = 0, last_loss = 0;
  int64_t active_nonembedding_params = 0;
  bool profiled = false;
  backend::StepProfile profile;  // the extra profiled step (profiled only)
};

// Model FLOPs per token of `config` at sequence length seq_len (the anchors' formula).
double model_flops_per_token(const model::ModelConfig& config, int64_t seq_len, int64_t* active_params = nullptr);

// Builds the model on `be` (random init), runs warm-up and timed steps on Philox random tokens.
Result<TrainBenchResult> bench_train_step(backend::Backend& be, const model::ModelConfig& config,
                                          const model::RecipeConfig& recipe, const TrainBenchOptions& options);

struct LinearBenchResult {
  std::string recipe;
  double forward_s = 0, backward_s = 0;  // medians
  // Backend bytes the recipe keeps between forward and backward (its saved operands), and the
  // model-shared LinearWorkspace scratch the layer needed (-1 where memory is not tracked).
  int64_t saved_bytes = -1, workspace_bytes = -1;
  double total_s() const { return forward_s + backward_s; }
};

// One linear layer Y = X W^T, X (M,K), W (N,K), through `recipe` on `be` (BF16-operand GEMMs,
// transient scratch from a LinearWorkspace as in a model): median forward and backward (dgrad +
// wgrad) times over `repeats` runs after 2 warm-up runs, and the layer's bytes.
Result<LinearBenchResult> bench_linear(backend::Backend& be, const model::RecipeConfig& recipe, int64_t M, int64_t N,
                                       int64_t K, int repeats);

}  // namespace nibble::train
