// The rollout engine (issue #15, CPU first): generation for many prompts at once on the model's
// prefill/decode path (model::Model::forward_decode) over a paged KV cache (kv_cache.h).
// Continuous batching: a request's G samples join the running batch when the cache can hold
// their worst case (prompt + max_new_tokens) and leave it when they stop, freeing their pages, so
// the next request starts while others are still decoding; a full cache makes requests wait,
// never fail (one that could never fit is an error up front). Prefix sharing: a request's prompt
// is prefilled once and its G samples fork its pages (refcounted, copy-on-write). Every step is
// one forward_decode over the rows of all running sequences (a decode token each, or a chunk of
// a prompt). Stop conditions: stop ids (EOS), max tokens, the model's context, stop strings.
// Sampling (sampler.h) draws from PhiloxStream(seed, sample_stream(request id, sample)): the same
// seed gives the same tokens whatever else is in the batch. Each sampled token carries its
// log-probability under log_softmax(logits / temperature), the trainer's transform.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/transformer.h"
#include "rollout/decode_graph.h"
#include "rollout/kv_cache.h"
#include "rollout/precision.h"
#include "rollout/recorders.h"
#include "rollout/sampler.h"

namespace nibble::rollout {

// Philox stream tag ("GENR" << 32, as train::kGenerateStream: sample 0 of request 0 draws what
// `nibble generate` drew before the engine).
inline constexpr uint64_t kRolloutStreamTag = uint64_t{0x47454E52} << 32;
// The stream of sample `sample` of request `id` (both < 2^16).
inline uint64_t sample_stream(uint64_t id, uint64_t sample) { return kRolloutStreamTag + (id << 16) + sample; }

struct EngineOptions {
  PrecisionMode mode = PrecisionMode::kBf16;
  std::string recipe_name = "bf16";  // the checkpoint's recipe: picks the NVFP4 layout (precision.h)
  backend::KvPageFormat kv_format = backend::KvPageFormat::kBf16;
  int64_t page_size = 16;
  int64_t num_pages = 0;        // 0: enough for max_batch sequences of the full context
  int64_t max_batch = 16;       // sequences decoding at once (a request's G samples join together)
  int64_t max_step_tokens = 0;  // rows per forward (prompt chunks); 0: max(max_position_embeddings, max_batch)
  bool share_prefix = true;     // prefill a prompt once for its G samples
  // Draw with the reference sampler (sample_token then token_logprob, one row after the other)
  // instead of sample_with_logprob over the rows in parallel: the same tokens and log-probs,
  // slower; kept for comparisons (tests, `nibble bench decode --reference-sampler`).
  bool reference_sampler = false;
  // CUDA graphs for decode-only steps (rollout/decode_graph.h; NIBBLE_CUDA_GRAPHS=on|off overrides
  // every engine's choice): kOn, the default, uses them where
  // the backend captures graphs and the engine allows them (bf16 / w4a16 / w4a4 modes of a dense
  // model; padded w4a4 only with per-row activation scales), else runs eagerly (decode_graphs_status()
  // says why); kOff always eager (`nibble bench decode --no-cuda-graphs`; the environment variable
  // NIBBLE_CUDA_GRAPHS=off does the same for every engine); kEagerLayout runs the graph steps'
  // layout eagerly on any backend (tests). Tokens and log-probs are the eager bits unless
  // decode_graph_padding. Steps with prompt chunks, guidance recording or the routing hook always
  // run eagerly.
  DecodeGraphMode decode_graphs = DecodeGraphMode::kOn;
  // Pad graph steps to 1, 2, 4, ... rows (one graph per size instead of one per row count); a
  // GEMM over more rows may sum a real row in another order, so log-probs may differ from the
  // eager ones in their last bits (tokens only where that flips a draw). `--cuda-graph-padding`.
  bool decode_graph_padding = false;
  // Greedy steps sampled where the logits are (Backend::greedy_rows: the token and the softmax
  // sums of each row, the host sampler's bits; only those come back, not the (rows, V) logits).
  // kAuto: on a device backend that has Op::kGreedyRows; NIBBLE_DEVICE_GREEDY=on|off overrides
  // (on also runs it on the CPU backend: tests). Steps with any sampled row, or reference_sampler,
  // sample on the host.
  enum class DeviceGreedy { kAuto, kOn, kOff };
  DeviceGreedy device_greedy = DeviceGreedy::kAuto;
};

struct GenerationParams {
  SamplingParams sampling;
  int64_t max_new_tokens = 64;             // capped by the context: prompt + new <= max_position_embeddings
  std::vector<int32_t> stop_ids;           // e.g. {eos}: the token ends the sample (and is part of it)
  std::vector<std::string> stop_strings;   // the sample ends when its text contains one (needs a detokenizer)
  uint64_t seed = 0;
  int64_t num_samples = 1;                 // G
};

struct Request {
  std::vector<int32_t> prompt;
  GenerationParams params;
  uint64_t id = 0;  // names the request's Philox streams (sample_stream); the CLI uses the line index
};

enum class FinishReason { kStopId, kLength, kStopString, kCancelled };
const char* finish_reason_name(FinishReason r);  // "eos" | "length" | "stop" | "cancelled"

struct Completion {
  int64_t request = 0;             // index into the requests given to generate()
  int64_t sample = 0;              // 0 .. G-1
  std::vector<int32_t> tokens;     // new tokens (a final stop id included)
  std::vector<double> logprobs;    // log p of each token under log_softmax(logits / temperature)
  FinishReason finish = FinishReason::kLength;
};

// One forward step's rows for the MoE routing recorder hook: row i is position positions[i] of
// sample samples[i] (-1: a prompt row shared by all samples) of request requests[i];
// expert_ids: (num_moe_layers, rows, top_k) i32 host.
struct RoutingStep {
  std::span<const int64_t> requests, samples;
  std::span<const int32_t> positions;
  const int32_t* expert_ids = nullptr;
};

struct EngineCallbacks {
  // Each new token as soon as it is sampled (streaming); a non-ok Status stops generate().
  std::function<Status(int64_t request, int64_t sample, int32_t token)> on_token;
  // Each sample when it finishes (JSON-lines writers, progress).
  std::function<Status(const Completion&)> on_finish;
  // Text of tokens, for stop strings.
  std::function<Result<std::string>(std::span<const int32_t>)> detokenize;
  // MoE models: each step's expert ids (the routing-record store's hand-over point).
  std::function<Status(const RoutingStep&)> on_routing;
  // R3 routing and TRACE guidance records (recorders.h), keyed by recorded_sequence(Request::id,
  // sample); null: none. Guidance needs the w4a4 mode.
  const RolloutRecorders* recorders = nullptr;
  // Serving (`nibble serve`): requests that arrive while generate() runs. Called before every
  // step with idle = nothing running or waiting; the requests it returns are numbered after those
  // before them (Completion::request) and validated like them. An empty answer while idle ends
  // generate(), so a caller may block in admit(true) until work arrives. With admit set,
  // completions go only to on_finish (generate returns none) and a finished request's prompt is
  // freed: memory stays bounded however long generate() runs.
  std::function<Result<std::vector<Request>>(bool idle)> admit;
  // Checked for each running request before every step: true stops its samples there
  // (FinishReason::kCancelled, through on_finish) and frees their pages.
  std::function<bool(int64_t request)> cancelled;
};

// Backend memory the engine and its model hold, by kind (issue #15 item 4; bytes).
struct EngineMemory {
  int64_t packed_weights = 0;          // block linears in the mode's storage: codes + scales (+ outer), or BF16
  int64_t high_precision_weights = 0;  // the model's FP32 values (inference storage: embedding, norms,
                                       // routers; the lm_head only with the fp32 recipe) + the
                                       // lm_head's BF16 bits (a snapshot, or in inference storage its
                                       // only copy: lm_head_held())
  int64_t master_weights = 0;          // training storage only: the FP32 block linears the model keeps
  int64_t gradients = 0;               // training storage only
  int64_t kv_pages = 0;                // the paged cache's K and V pages
  int64_t workspace = 0;               // activations, scratch, page tables, RoPE tables (grow-only)
  int64_t total() const {
    return packed_weights + high_precision_weights + master_weights + gradients + kv_pages + workspace;
  }
};

// Counters of the last generate() call.
struct EngineStats {
  int64_t steps = 0, prompt_tokens = 0, generated_tokens = 0, peak_running = 0, peak_pages_in_use = 0;
  int64_t waits = 0;  // steps on which a request waited for cache pages or batch room
  // Host wall time of generate() by part (seconds; docs/benchmarks.md "Decode: host time"):
  // forward = forward_decode (issuing the ops; on an asynchronous backend also the wait for the
  // logits copy, the step's one sync), sample = tokens and log-probs over the vocabulary,
  // metadata = the cache's block tables and slots (begin_batch); the rest of total is scheduling
  // and callbacks.
  double forward_seconds = 0, sample_seconds = 0, metadata_seconds = 0, total_seconds = 0;
  // Decode graphs: steps run padded through DecodeGraphs, of them replayed from a graph, graphs
  // captured, padding rows run.
  int64_t graph_steps = 0, graph_replays = 0, graph_captures = 0, padding_rows = 0;
  int64_t device_greedy_steps = 0;  // steps sampled where the logits are (EngineOptions::device_greedy)
};

class Engine {
 public:
  // The engine runs `model` (which must outlive it) on the model's backend. Errors: bad options,
  // a backend without the paged KV-cache ops, a linear the 4-bit modes cannot hold.
  static Result<std::unique_ptr<Engine>> create(model::Model& model, const EngineOptions& options);

  // All samples of all requests, in (request, sample) order. Errors (one line, nothing generated
  // for any request): an empty prompt, a prompt longer than the context, a token outside the
  // vocabulary, G outside [1, max_batch], a request that cannot fit the cache even alone, bad
  // sampling parameters; or a callback's error.
  Result<std::vector<Completion>> generate(const std::vector<Request>& requests, const EngineCallbacks& callbacks = {});

  // The checks generate() applies to a request (for callers that queue requests and must refuse
  // a bad one alone rather than fail a whole generate()).
  Status check_request(const Request& request) const { return validate({request}); }

  // Re-quantizes the weights after the model's master weights changed (weight sync). Not for a
  // model of inference storage (no master weights: use set_linear_weight and
  // refresh_high_precision_weights).
  Status refresh_weights();
  // Weights arriving tensor by tensor (models of inference storage; bf16 / w4a16 / w4a4):
  // w: (N,K) f32 host, linear `id`'s weight (its members stacked, linear_params), quantized or
  // made BF16 as refresh_weights() would from the same master weight (the same bits). After the
  // model's kept parameters changed, refresh_high_precision_weights() re-snapshots the lm_head
  // (where the model keeps one; a held lm_head changes through set_lm_head_weight).
  // generate() refuses to run while a linear has no weight.
  Status set_linear_weight(int id, const float* w);
  void refresh_high_precision_weights() { snapshot_lm_head(); }
  // The lm_head of a model of inference storage that keeps none (its GEMM runs on BF16 operands:
  // every recipe but fp32; lm_head_held()): w: (V,C) f32 host, kept only as the BF16 bits
  // snapshot_lm_head makes from the same weight (converted on the host in slices, so neither
  // side holds an FP32 copy). generate() refuses to run before it arrives.
  Status set_lm_head_weight(const float* w);
  // True where the engine alone holds the lm_head (as BF16 bits; the model keeps no FP32 copy).
  bool lm_head_held() const { return lm_head_index_ >= 0; }
  // A checkpoint's weights, tensor by tensor, into this engine's model of inference storage
  // (rollout/checkpoint_weights.h): `path` is a model.safetensors of HF-named F32 or BF16 tensors
  // (a training checkpoint's), or a `nibble quantize --format nvfp4-2level` output (raw, RTN)
  // whose block linears are taken as they are (w4a16 / w4a4). Everything is checked before
  // anything changes; errors name the file and the tensor.
  Status load_weights(const std::string& path);
  // Random weights, tensor by tensor: bit for bit a training-storage model's init_weights(seed)
  // followed by refresh_weights(). The block linears are drawn on the host in parallel, one per
  // thread (num_threads() tensors on the host at once), each quantized as it arrives. On a
  // training-storage model: init_weights(seed) then refresh_weights().
  //
  // WeightInit::kUniform (benchmarks of large shapes: the training init draws a truncated normal
  // at 70-100 ns an element, minutes for Qwen3-30B-A3B's 30 G weights): the block linears are
  // instead uniform on [-sqrt(3) sigma, sqrt(3) sigma) (sigma = initializer_range, the normal's
  // standard deviation), element e of linear `id` from Philox4x32-10 word e%4 of block
  // (stream 0x1417 + id, offset e/4) under `seed`, 24 bits each; every other tensor is the
  // training init's. Same values on every host and thread count; not the training init's bits.
  enum class WeightInit { kTraining, kUniform };
  Status init_random_weights(uint64_t seed, WeightInit init = WeightInit::kTraining);
  // Backend memory held now, by kind (the model's included).
  EngineMemory memory() const;
  // Weights received already quantized (w4a16 / w4a4; QuantizedLinears::set_quantized_weights):
  // from a trainer, one QuantizedTensor per block linear (linear_infos() order) in the model's
  // backend memory (RL's weight sync hand-over); or from a `nibble quantize --format nvfp4-2level`
  // file (quantized_weights.h). Bit for bit what refresh_weights() makes from the weights they
  // were quantized from (for the file: from the BF16 values of those weights).
  Status receive_quantized_weights(const std::vector<backend::QuantizedTensor>& per_linear);
  Status load_quantized_weights(const std::string& path);

  const PagedKvCache& cache() const { return *cache_; }
  // The block linears of the bf16 / w4a16 / w4a4 modes (null in the recipe mode).
  const QuantizedLinears* linears() const { return linears_.get(); }
  const EngineOptions& options() const { return options_; }
  const model::ModelConfig& model_config() const { return model_->config(); }
  const EngineStats& stats() const { return stats_; }
  // "on", "eager-layout" (+ " (padded)"), or "off: <why>" (the option, the environment, the mode, the model, the
  // backend, or a capture that failed).
  std::string decode_graphs_status() const;

 private:
  Engine(model::Model& model, const EngineOptions& options) : model_(&model), options_(options) {}
  Status validate(const std::vector<Request>& requests) const;
  int64_t worst_case_pages(const Request& r) const;
  // The bf16/w4a16/w4a4 modes: BF16 bits of the lm_head weight, made with the block linears (so a
  // decode step does not convert the (V,C) weight again); the recipe mode converts per forward.
  void snapshot_lm_head();
  // lm_head_bits_ <- BF16 bits of w: (V,C) host, F32 or BF16 (bits taken as they are).
  void upload_lm_head(const void* w, bool bf16);

  model::Model* model_;
  EngineOptions options_;
  std::unique_ptr<PagedKvCache> cache_;
  std::unique_ptr<QuantizedLinears> linears_;
  backend::Buffer<uint16_t> lm_head_bits_;  // (V,C) see snapshot_lm_head
  bool lm_head_snapshot_ = false;
  int64_t lm_head_index_ = -1;  // lm_head_held(): its index in param_refs()
  std::unique_ptr<DecodeGraphs> graphs_;  // null: every step eager (graphs_off_ says why)
  bool device_greedy_ = false;             // greedy steps on the device (EngineOptions::device_greedy)
  backend::Buffer<float> greedy_logits_;   // (logit rows, V) an eager greedy step's logits
  backend::Buffer<uint8_t> greedy_out_;    // (rows) i32 tokens, then (rows, 3) f64 stats (8-aligned)
  std::string graphs_off_;
  EngineStats stats_;
};

}  // namespace nibble::rollout
