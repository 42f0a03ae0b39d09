// The rollout engine's recorders (issue #15 item 3; ../shared/spec/03-rl-and-trace.md §2.2, §4):
// what a generate() call hands to the RL trainer besides tokens and log-probs. R3: each token's
// top-k expert ids per MoE layer (routing_record.h) into a RecordStore. TRACE (w4a4 mode only):
// at the chosen layers, the NVFP4 codes (or only their mantissa bits) and block scales of each
// activation entering a quantized linear (guidance_store.h), prompt tokens included; a two-level
// activation's record payloads are made on its backend (Backend::guidance_payload_rows: codes or
// mantissa bits, scales) into a step arena in backend memory (with a routed expert's tokens) and
// come to the host in one copy per step (GuidanceRecorder::finish_step). Both are
// keyed by (recorded_sequence(request id, sample), position, layer, site): a prompt row the G
// samples share is stored once per sample, so the trainer reads every sequence alone.
// The sites recorded are kAttnInput, kAttnOutputInput, kMlpInput (dense MLP or shared expert),
// kMlpDownInput, kSharedExpertDownInput and each routed expert's gate/up and down inputs
// (routed_expert_site(e, part)), the latter for the tokens routed to e, found through the dispatch
// plan's token_of_row the model passes with the call. With an NVFP4 KV cache also kKeyCache and
// kValueCache: each row's K and V as its page slot holds them (read back after each layer's
// kv_cache_write), one version-2 record of Hkv rows of head_dim per token and site.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/transformer.h"
#include "rollout/guidance_store.h"
#include "rollout/kv_cache.h"
#include "rollout/precision.h"

namespace nibble::rollout {

// The record sequence id of sample `sample` of the request whose Request::id is `request_id`.
inline uint64_t recorded_sequence(uint64_t request_id, int64_t sample) {
  return (request_id << 16) | static_cast<uint64_t>(sample);
}

struct RolloutRecorders {
  RecordStore* routing = nullptr;   // MoE expert ids (null: not recorded)
  RecordStore* guidance = nullptr;  // TRACE guidance (null: not recorded); needs the w4a4 mode
  GuidanceMode guidance_mode = GuidanceMode::kTraceFull;
  std::vector<int64_t> guidance_layers;  // blocks recorded; empty: all
};

// The guidance site of a linear's input: by kind, and for a routed expert's linears by its expert
// id (routed_expert_site); nullopt for an expert linear without an expert id.
std::optional<uint16_t> guidance_site(const model::LinearInfo& info);
// Whether the linear is a routed expert's (its rows are the tokens routed to info.expert).
bool is_routed_expert(model::LinearKind kind);

// One step's rows as the engine lays them out: row i is position positions[i] of sample
// samples[i] (-1: a prompt row shared by all samples_of[i] samples) of the request with id ids[i].
struct RecordedRows {
  std::span<const uint64_t> ids;
  std::span<const int64_t> samples;
  std::span<const int64_t> samples_of;
  std::span<const int32_t> positions;
};

// The TRACE guidance recorder: an ActivationObserver on the engine's QuantizedLinears and, with
// an NVFP4 KV cache, a KvWriteObserver on its pages, that appends the records of each step's rows.
// Errors (a failed append) are kept and returned by status().
class GuidanceRecorder final : public ActivationObserver, public KvWriteObserver {
 public:
  GuidanceRecorder(const RolloutRecorders& recorders, int64_t num_layers);
  void set_rows(const RecordedRows& rows) { rows_ = rows; }
  void on_quantized_activation(backend::Backend& be, const model::LinearInfo& info, const backend::QuantizedTensor& qx,
                               int64_t M, const int32_t* token_of_row) override;
  // The fused MoE decode's routed experts (two-level activations on a backend with
  // Op::kTraceGuidedRows): one payload kernel over all rows; the offsets come with the tokens.
  bool observes_experts_grouped(backend::Backend& be) const override;
  void on_quantized_activation_experts(backend::Backend& be, const model::LinearInfo* infos, int64_t E,
                                       const backend::QuantizedTensor& qx, int64_t rows, const int64_t* offsets,
                                       const int32_t* token_of_row) override;
  // kKeyCache / kValueCache records of the batch's rows at `layer` (an NVFP4 cache; a recorded layer).
  void on_kv_written(const PagedKvCache& cache, int64_t layer) override;
  // Ends the step whose rows set_rows named: brings the step arena's payloads to the host in one
  // copy and appends their records, in the order of the calls. Returns the first error of the step.
  Status finish_step();
  const Status& status() const { return status_; }

 private:
  // A recorded call (a two-level activation) whose payloads wait in the step arena: rows [0, M) of
  // `site` at `block`, P payload bytes each at payload_at; a routed expert's M i32 step rows at
  // tokens_at (else -1). A grouped call (E > 0) of routed experts: E + 1 i64 offsets at offsets_at,
  // rows [offsets[e], offsets[e+1]) are expert e's, site routed_expert_site(e, part).
  struct Pending {
    std::string linear;  // its name, for errors
    int block;
    uint16_t site;
    int64_t cols, M, P, payload_at, tokens_at;
    int64_t E = 0, offsets_at = -1;
    int part = 0;
  };
  // Makes the step arena's part of call p (its rows' payloads from q, then the tokens and the
  // offsets where given: p.P and the *_at fields are set here), flushing the arena first when full.
  Status stage(backend::Backend& be, Pending p, const backend::QuantizedTensor& q, const int32_t* tokens,
               const int64_t* offsets);
  Status flush_pending();  // the arena's payloads to the host, their records to the store
  Status record(backend::Backend& be, const model::LinearInfo& info, const backend::QuantizedTensor& qx, int64_t M,
                const int32_t* token_of_row);
  Status record_kv(const PagedKvCache& cache, int64_t layer);
  std::vector<uint8_t> slots_;  // host copy of a layer's K or V slot records
  RolloutRecorders recorders_;
  std::vector<bool> layer_on_;
  RecordedRows rows_;
  Status status_;
  backend::Buffer<uint8_t> arena_;        // the step's payloads and tokens (grow-only)
  backend::Backend* arena_be_ = nullptr;  // the backend arena_ lives on
  int64_t arena_used_ = 0;
  std::vector<Pending> pending_;
  std::vector<uint8_t> arena_host_;       // its host copy
  std::vector<uint8_t> codes_, scales_;   // host copies of a device activation (formats other than 2-level)
  std::vector<float> outer_;
  std::vector<int32_t> tokens_;  // host copy of a routed expert's token_of_row
};

// Appends the routing records of one step: expert_ids (num_moe_layers, N, top_k) i32 host.
Status record_routing_step(RecordStore& store, const RecordedRows& rows, const int32_t* expert_ids,
                           int64_t num_moe_layers, int64_t top_k, int64_t num_experts);

}  // namespace nibble::rollout
