// CUDA graphs for the rollout engine's decode step (issue #15 item 4; docs/architecture.md "CUDA
// graphs for the decode step"). A decode-only step (one row per decoding sample, no prompt chunk)
// of n rows uploads its inputs (tokens, positions, the cache's slots / context lengths / block
// tables: PagedKvCache::begin_padded_batch) to fixed buffers, runs one forward_decode that moves
// nothing between host and device (DecodeBatch::tokens_device ...) as a graph captured once per
// row count and block-table stride, and copies the logits back (the step's one synchronisation); sampling stays on the
// host. The first step of a row count runs that forward eagerly (sizing every buffer it touches),
// then captures it; a graph is captured again when the backend freed memory since
// (memory_epoch(): a larger prefill grew a buffer). One graph per row count keeps every kernel's
// shapes those of the eager step, so tokens and log-probs are the eager bits. With padding, a
// step runs padded_decode_rows(n) rows (1, 2, 4, 8, ... up to the max batch: fewer graphs), the
// padding rows feeding token 0 at position 0 into the cache's scratch page; a real row then
// shares no reduction with them, but a GEMM of more rows may take another kernel (OpenBLAS and
// cuBLASLt choose by shape) and sum the row in another order: the log-probs can differ from
// eager ones in their last bits. Without a capturing backend (the CPU) the same layout runs
// eagerly (DecodeGraphMode::kEagerLayout): the tests check that logic there.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/graph_capture.h"
#include "core/status.h"
#include "model/transformer.h"
#include "rollout/kv_cache.h"

namespace nibble::rollout {

// kOn: graphs where the backend captures and the step allows (the default); kOff: every step
// eager (`--no-cuda-graphs`, NIBBLE_CUDA_GRAPHS=off); kEagerLayout: the graph steps' fixed
// buffers (and padding, where asked), run eagerly on any backend (tests).
enum class DecodeGraphMode : uint8_t { kOff, kOn, kEagerLayout };
const char* decode_graph_mode_name(DecodeGraphMode m);  // "off" | "on" | "eager-layout"

// The rows a decode-only step of n rows runs as: the smallest power of two >= n, at most
// max_rows (n in [1, max_rows]).
int64_t padded_decode_rows(int64_t n, int64_t max_rows);
// Every padded size of max_rows: 1, 2, 4, ... (powers of two below max_rows), max_rows.
std::vector<int64_t> decode_graph_sizes(int64_t max_rows);

class DecodeGraphs {
 public:
  // For `model` (which must outlive this) with `max_rows` rows at most and the token and position
  // buffers allocated now (the logits' grows with the rows run); mode kOn needs a backend with graph capture (graph_capture()). pad: steps run
  // padded_decode_rows(n) rows (see above).
  static Result<std::unique_ptr<DecodeGraphs>> create(model::Model& model, DecodeGraphMode mode, int64_t max_rows,
                                                      bool pad);

  // Rows a step of n rows runs: padded_decode_rows(n, max_rows) with padding, else n.
  int64_t rows_for(int64_t n) const { return pad_ ? padded_decode_rows(n, max_rows_) : n; }
  // One decode-only step of n = tokens.size() rows whose metadata the KV cache holds already in
  // the graph layout (begin_padded_batch with rows_for(n)): logits (n, V) host (or null) <- the model on
  // the rows. base: the step's linears, lm_head bits and KV cache (its row fields are set here).
  // Replays the row count's graph, or runs eagerly and captures it.
  // Graphs are kept per (rows run, table_stride): the cache's block-table stride of the step
  // (PagedKvCache::table_stride()), a scalar its attention kernels take.
  void step(float* logits, const model::DecodeBatch& base, const std::vector<int32_t>& tokens,
            const std::vector<int32_t>& positions, int64_t table_stride);
  // The last step's logits in backend memory (rows_for(n), V): step(nullptr, ...) leaves them
  // there (greedy decoding on the device) instead of copying the first n rows to the host.
  const float* device_logits() const { return logits_.data(); }

  DecodeGraphMode mode() const { return mode_; }
  // False once a capture failed (failure() says why): the engine then runs its steps eagerly.
  bool active() const { return mode_ == DecodeGraphMode::kEagerLayout || capture_ != nullptr; }
  bool padded() const { return pad_; }
  const std::string& failure() const { return failure_; }
  int64_t max_rows() const { return max_rows_; }
  int64_t replays() const { return replays_; }    // steps run by replaying a graph
  int64_t captures() const { return captures_; }  // graphs captured (recaptures included)
  int64_t padding_rows() const { return padding_rows_; }  // padding rows run over all steps
  int64_t workspace_bytes() const;                        // the fixed buffers

 private:
  DecodeGraphs(model::Model& model, DecodeGraphMode mode, int64_t max_rows, bool pad)
      : model_(&model), mode_(mode), max_rows_(max_rows), pad_(pad) {}

  model::Model* model_;
  DecodeGraphMode mode_;
  int64_t max_rows_;
  bool pad_;
  backend::GraphCapture* capture_ = nullptr;  // kOn
  backend::Buffer<int32_t> tokens_, positions_;  // (max_rows) i32 backend memory
  backend::Buffer<float> logits_;                // (most rows run, V) f32 backend memory
  std::vector<int32_t> tok_h_, pos_h_;           // the host rows (padding included)
  // by (rows run, table stride)
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<backend::CapturedGraph>> graphs_;
  int64_t epoch_ = -1;                                                 // memory_epoch() at the captures
  int64_t replays_ = 0, captures_ = 0, padding_rows_ = 0;
  std::string failure_;
};

}  // namespace nibble::rollout
