// CUDA graphs for the rollout engine's decode step: padding, fixed buffers, capture and replay
// (see decode_graph.h).
#include "rollout/decode_graph.h"

#include <algorithm>
#include <exception>

#include <fmt/format.h>

#include "core/check.h"

namespace nibble::rollout {

const char* decode_graph_mode_name(DecodeGraphMode m) {
  switch (m) {
    case DecodeGraphMode::kOff: return "off";
    case DecodeGraphMode::kOn: return "on";
    case DecodeGraphMode::kEagerLayout: return "eager-layout";
  }
  return "?";
}

int64_t padded_decode_rows(int64_t n, int64_t max_rows) {
  NIB_CHECK_MSG(n >= 1 && n <= max_rows, "padded_decode_rows: {} rows outside [1, {}]", n, max_rows);
  int64_t p = 1;
  while (p < n) p *= 2;
  return std::min(p, max_rows);
}

std::vector<int64_t> decode_graph_sizes(int64_t max_rows) {
  std::vector<int64_t> out;
  for (int64_t p = 1; p < max_rows; p *= 2) out.push_back(p);
  if (max_rows >= 1) out.push_back(max_rows);
  return out;
}

Result<std::unique_ptr<DecodeGraphs>> DecodeGraphs::create(model::Model& model, DecodeGraphMode mode,
                                                           int64_t max_rows, bool pad) {
  if (mode == DecodeGraphMode::kOff) return invalid_argument("decode graphs: mode off has no graphs");
  if (max_rows <= 0) return invalid_argument("decode graphs: max rows must be positive (got {})", max_rows);
  backend::Backend& be = model.backend();
  std::unique_ptr<DecodeGraphs> g(new DecodeGraphs(model, mode, max_rows, pad));
  if (mode == DecodeGraphMode::kOn) {
    g->capture_ = backend::graph_capture(be);
    if (g->capture_ == nullptr) return unimplemented("backend '{}' cannot capture graphs", be.name());
  }
  try {
    g->tokens_.ensure(be, max_rows, "decode graph tokens");
    g->positions_.ensure(be, max_rows, "decode graph positions");
  } catch (const backend::AllocationError& e) {
    return invalid_argument("{} (lower the max batch)", e.what());
  }
  return g;
}

int64_t DecodeGraphs::workspace_bytes() const {
  return static_cast<int64_t>(sizeof(int32_t)) * (tokens_.size() + positions_.size()) +
         static_cast<int64_t>(sizeof(float)) * logits_.size();
}

void DecodeGraphs::step(float* logits, const model::DecodeBatch& base, const std::vector<int32_t>& tokens,
                        const std::vector<int32_t>& positions, int64_t table_stride) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  NIB_CHECK(positions.size() == tokens.size());
  const int64_t P = rows_for(n);
  const int64_t V = model_->config().vocab_size;
  backend::Backend& be = model_->backend();
  // the logits of the most rows run so far (grown before the epoch is read: a graph holding the
  // old buffer is then captured again)
  logits_.ensure(be, P * V, "decode graph logits");
  // padding rows (if any): token 0 at position 0 (their keys and values go to the scratch page)
  tok_h_.assign(static_cast<size_t>(P), 0);
  pos_h_.assign(static_cast<size_t>(P), 0);
  std::copy(tokens.begin(), tokens.end(), tok_h_.begin());
  std::copy(positions.begin(), positions.end(), pos_h_.begin());
  be.copy_to_device(tokens_.data(), tok_h_.data(), static_cast<size_t>(P) * sizeof(int32_t));
  be.copy_to_device(positions_.data(), pos_h_.data(), static_cast<size_t>(P) * sizeof(int32_t));
  padding_rows_ += P - n;

  model::DecodeBatch b = base;
  b.tokens = tok_h_.data();
  b.positions = pos_h_.data();
  b.N = P;
  // the lm_head on every row run: without padding the n rows of the eager step (whose logit rows
  // are its decode rows 0 .. n-1, the same GEMM); with padding all P (a graph serves every n it
  // pads), the copy below takes the first n
  b.logit_rows = nullptr;
  b.num_logit_rows = 0;
  b.routing_record = nullptr;
  b.tokens_device = tokens_.data();
  b.positions_device = positions_.data();
  b.logits_device = logits_.data();

  bool replayed = false;
  if (capture_ != nullptr) {
    if (capture_->memory_epoch() != epoch_) graphs_.clear();  // memory a graph may point into was freed
    auto it = graphs_.find({P, table_stride});
    if (it != graphs_.end()) {
      it->second->replay();
      ++replays_;
      replayed = true;
    }
  }
  if (!replayed) {
    model_->forward_decode(nullptr, b);  // this step's results; every buffer now has its size
    if (capture_ != nullptr) {
      // Nothing runs while recording: the same ops are recorded with the same pointers and
      // scalars (the fixed buffers above and the cache's), for the next steps of P rows.
      // A capture that fails (an op the graph cannot hold: a bug) turns graphs off for the
      // engine's life, saying why; this step's logits are the eager forward's above.
      std::unique_ptr<backend::CapturedGraph> graph;
      try {
        capture_->begin_capture();
        model_->forward_decode(nullptr, b);
        graph = capture_->end_capture();
      } catch (const std::exception& e) {
        capture_->abort_capture();
        failure_ = fmt::format("capturing the decode step of {} rows (table stride {}) failed: {}", P, table_stride,
                               e.what());
        capture_ = nullptr;
        graphs_.clear();
      }
      if (graph) {
        if (capture_->memory_epoch() != epoch_) graphs_.clear();
        epoch_ = capture_->memory_epoch();
        graphs_[{P, table_stride}] = std::move(graph);
        ++captures_;
      }
    }
  }
  if (logits != nullptr) be.copy_to_host(logits, logits_.data(), static_cast<size_t>(n * V) * sizeof(float));
}

}  // namespace nibble::rollout
