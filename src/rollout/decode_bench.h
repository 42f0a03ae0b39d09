// `nibble bench decode` (issue #15 §4): decode tokens/s of the rollout engine on random weights for
// a model config, precision mode and batch size (batch prompts of `prompt` random tokens, `new`
// greedy tokens each), next to the bound set by the bytes a decode step must read (the block
// linears in the mode's storage, the lm_head in BF16 (the engine's snapshot) and embedding rows, the KV pages of the average
// context) at the device-copy bandwidth measured in the same run. Decode time = time of a run
// generating `new` tokens minus a run generating 1 (the prefill and its first token). With
// `profile`, both runs are repeated once more with every op timed (backend/profiling_backend.h):
// the prefill run's profile, and the per-decode-step profile (their difference / (new - 1)).
// The model is built in inference storage (no gradients, no FP32 block linears) and its random
// weights arrive tensor by tensor (Engine::init_random_weights), so a model whose FP32 weights
// alone exceed device and host memory (Qwen3-30B-A3B: 122 GB) runs in w4a16 on one GPU; the
// engine's memory by kind and the time the weights took are reported. The decode steps run as
// CUDA graphs where the engine can (rollout/decode_graph.h; with `profile` never: the profiling
// decorator cannot capture), and the result says whether they did.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/profiling_backend.h"
#include "core/status.h"
#include "model/config.h"
#include "rollout/engine.h"
#include "rollout/precision.h"

namespace nibble::rollout {

struct DecodeBenchOptions {
  PrecisionMode mode = PrecisionMode::kBf16;
  backend::KvPageFormat kv_format = backend::KvPageFormat::kBf16;
  int64_t prompt = 512, new_tokens = 128;
  uint64_t seed = 1;
  int64_t copy_bytes = int64_t{1} << 30;  // size of the bandwidth-measuring copy
  double temperature = 0, top_p = 1;  // the requests' sampling (0: greedy; no stop ids either way)
  bool reference_sampler = false;  // EngineOptions::reference_sampler (the host-time comparison)
  bool profile = false;  // after the timed runs, profile the prefill run and the decode steps
  bool cuda_graphs = true;     // EngineOptions::decode_graphs kOn (true) or kOff (`--no-cuda-graphs`)
  bool graph_padding = false;  // EngineOptions::decode_graph_padding (`--cuda-graph-padding`)
  // kTraining: the model of the training path (FP32 master weights and gradients, quantized
  // from them) as before inference storage existed; the same bits, for comparisons.
  model::ParameterStorage storage = model::ParameterStorage::kInference;
  // The random weights: the training init's (default) or the fast uniform one (`--init uniform`;
  // Engine::init_random_weights) for shapes whose training init takes minutes.
  Engine::WeightInit init = Engine::WeightInit::kTraining;
};

struct DecodeBenchResult {
  int64_t batch = 0;
  double prefill_seconds = 0;       // prefill + the first token of every sequence
  double decode_seconds = 0;        // the remaining new_tokens - 1 steps
  double decode_tokens_per_s = 0;   // batch * (new_tokens - 1) / decode_seconds
  double bytes_per_step = 0;        // weights + KV read by one decode step (average context)
  double copy_bytes_per_s = 0;      // measured device-to-device copy: bytes read + written per second
  double bound_tokens_per_s = 0;    // batch * copy_bytes_per_s / bytes_per_step
  double fraction_of_bound = 0;
  int64_t weight_bytes = 0, kv_bytes_per_token = 0;
  double init_seconds = 0;          // the model, the engine and their random weights
  EngineMemory memory;              // after the runs (workspace grown to the prefill's)
  int64_t peak_bytes = -1;          // the backend's peak allocation since the start (-1: not tracked)
  // Host wall time of one decode step by part (ms; EngineStats, the run of `new` minus the run of
  // 1, per step): the forward (issuing ops + the logits copy's wait), sampling and log-probs, the
  // cache's block tables, and the whole step.
  double host_forward_ms = 0, host_sample_ms = 0, host_metadata_ms = 0, host_step_ms = 0;
  // Engine::decode_graphs_status() ("on", "off: <why>", ...), and of the timed run of `new`
  // tokens: decode steps replayed from a graph, graphs captured during it.
  std::string cuda_graphs;
  int64_t graph_replays = 0, graph_captures = 0;
  int64_t device_greedy_steps = 0;  // steps sampled where the logits are (EngineOptions::device_greedy)
  bool profiled = false;
  backend::StepProfile prefill_profile;      // the run generating 1 token (prefill + first token)
  backend::StepProfile decode_step_profile;  // one decode step: (run of `new` - run of 1) / (new - 1)
};

// Runs the benchmark on `be` for each batch size of `batches`, in order, on one model and engine
// built (and given its weights) once, sized for the largest batch; on_result receives each
// batch's result as soon as it is measured. Errors: bad options (no batch, a batch < 1,
// new_tokens < 2, a prompt that does not fit the context), out of memory (one line), on_result's.
using DecodeBenchSink = std::function<Status(const DecodeBenchResult&)>;
Status bench_decode(backend::Backend& be, const model::ModelConfig& config, const DecodeBenchOptions& options,
                    const std::vector<int64_t>& batches, const DecodeBenchSink& on_result);

// Bandwidth of `be` measured with a device-to-device copy of `bytes` (best of `repeats`): bytes
// moved (2 * bytes: read and written) per second, what a read-only stream can reach at best.
double measure_copy_bandwidth(backend::Backend& be, int64_t bytes, int repeats);

}  // namespace nibble::rollout
