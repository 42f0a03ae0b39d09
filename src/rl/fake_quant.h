// The RL trainer's fake-quantized linear (../shared/spec/03-rl-and-trace.md §2-3): the recipe
// "rl-fake-quant" that the qat, quads, trace-full and trace arms train with. Forward: the master
// weight rounded to BF16 and, when `weights` is on, quantized to NVFP4 (two-level, RTN) and
// dequantized; the input rounded to BF16 and, when `activations` is on, quantized the same way
// — by the very backend quantizer the rollout engine's w4a4 mode runs (rollout/precision.h), so
// the two paths agree bit for bit on equal inputs — then y = x̂ ŵ^T with y rounded to BF16 as in
// the rollout. TRACE: at a guided site (TraceGuidance: a recorded layer and site, a row with a
// rollout record) the input is instead rounded under the rollout's block scales to the E2M1
// neighbour the rollout's code (trace-full) or mantissa bit (trace) names (formats/guided.h).
// Backward is straight-through: dx = dy ŵ, dw += dy^T x̂. A routed expert's linear is guided
// too: its rows are the tokens routed to that expert (LinearCall::token_of_row, the dispatch
// plan's), each looked up at (its token's sequence and position, layer, routed_expert_site(e,
// part)); a row whose token the rollout did not route to e (R3 off) has no record and stays RTN,
// counted in GuidedSiteStats::routed_fallback_rows.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "model/linear.h"
#include "model/transformer.h"
#include "rollout/guidance_store.h"

namespace nibble::rl {

inline constexpr const char* kFakeQuantRecipe = "rl-fake-quant";

// Counters of one or more forwards over guided sites (elements).
struct GuidedSiteStats {
  int64_t elements = 0;        // guided elements (rows with a record x columns)
  int64_t rtn_mismatch = 0;    // the trainer's own RTN code differs from the rollout's (trace-full) or from the
                               // guided code (trace: the rollout's code as far as its mantissa bit says)
  int64_t one_step = 0;        // of those, the two codes are adjacent values of the E2M1 grid
  int64_t reproduced = 0;      // guided code == the rollout's code (trace-full) / its mantissa bit == the rollout's (trace)
  // rows (not elements) of routed experts' linears at guided layers whose token the rollout recorded
  int64_t routed_rows = 0;
  int64_t routed_fallback_rows = 0;  // of those, rows without a record for that expert: RTN
  void add(const GuidedSiteStats& o) {
    elements += o.elements, rtn_mismatch += o.rtn_mismatch, one_step += o.one_step, reproduced += o.reproduced;
    routed_rows += o.routed_rows, routed_fallback_rows += o.routed_fallback_rows;
  }
};

// What the RL loop tells the model's fake-quantized linears about the batch being run (shared
// by all of them). Rows are the (B, T) batch's token rows b*T + t (a routed expert's row r is
// token row call.token_of_row[r]).
struct TraceGuidance {
  rollout::RecordStore* store = nullptr;  // null: RTN everywhere (set through set_guidance_store)
  std::vector<bool> layers;               // guided blocks
  std::vector<uint64_t> row_sequence;     // (B*T) record sequence of each row
  std::vector<uint32_t> row_position;     // (B*T) its position
  std::vector<uint8_t> row_recorded;      // (B*T) 1 where the rollout recorded the row (not padding)
  GuidedSiteStats stats;                  // accumulated by every guided forward
  Status status;                          // the first error (a missing record); forward() cannot return one
  // (3) i64 in backend memory once reset_guided_counts made it: {rtn_mismatch, one_step,
  // reproduced} summed on the device by every guided call, brought into `stats` by
  // collect_guided_counts, so no call waits for its counts. Empty: each call copies its own back.
  backend::Buffer<int64_t> device_counts;
  // The last rows each guided (layer, site) read from `store` and what it found: a later forward
  // asking for the same rows (the update's forward after the pi_old forward, one minibatch) reuses
  // them instead of reading the store again. Emptied whenever `store` changes.
  struct Gathered {
    std::vector<uint64_t> sequences;
    std::vector<uint32_t> positions;
    bool with_found = false;
    rollout::GuidanceBatch batch;
    std::vector<uint8_t> found;
  };
  std::map<std::pair<uint16_t, uint16_t>, Gathered> gathered;
};

// Points g at `store` (a step's records; null: RTN everywhere) and forgets what was gathered from
// the previous one.
void set_guidance_store(TraceGuidance& g, rollout::RecordStore* store);

// Zeroes `stats` and the device counts (making them on first use): the start of a measured forward.
void reset_guided_counts(backend::Backend& be, TraceGuidance& g);
// Adds the device counts summed since the last reset or collect into g.stats and zeroes them (one
// synchronising copy).
void collect_guided_counts(backend::Backend& be, TraceGuidance& g);

// Where overwrite_guided_rows keeps one call's upload (grow-only, reused call to call).
struct GuidedRowsScratch {
  std::vector<uint8_t> host;        // the packed upload: stats, row indices, outer, scales, guide
  backend::Buffer<uint8_t> device;  // its copy in backend memory
};

struct FakeQuantOptions {
  bool weights = true;      // W4: NVFP4 weights
  bool activations = true;  // A4: NVFP4 inputs (RTN or guided)
  TraceGuidance* guidance = nullptr;
};

class FakeQuantLinear final : public model::LinearRecipe {
 public:
  NIB_LINEAR_RECIPE_HOST_OVERLOADS;
  FakeQuantLinear(const FakeQuantOptions& options, const model::LinearInfo& info) : options_(options), info_(info) {}
  std::string name() const override { return kFakeQuantRecipe; }
  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
               const model::LinearCall& call) override;
  void backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K,
                const model::LinearCall& call) override;
  // A layer part's routed experts at once (called on the first expert's instance, which keeps the
  // group's saved operands): all rows rounded to BF16 and quantized in one call (the two-level
  // format is row-local: each expert's rows get the codes its own call gave), at a guided layer
  // one guidance gather per expert site and one re-rounding upload and kernel for all of them
  // (the dispatch plan's tokens come to the host once), one dequantize; then each expert's weight
  // fake-quantized and its FP32 GEMM (the per-expert calls' shapes, so the same bits). backward_experts
  // pairs with it. Without activation or weight quantization: LinearRecipe's per-expert loop.
  void forward_experts(backend::Backend& be, float* y, const float* x, const float* w, int64_t N, int64_t K,
                       const model::ExpertGroup& group) override;
  void backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t N, int64_t K,
                        const model::ExpertGroup& group) override;
  void set_guidance(TraceGuidance* g) { options_.guidance = g; }

 private:
  // Rows of q (M, K: the RTN quantization of the BF16 input xb (M, K), backend memory) whose
  // rollout record at `site` exists are re-rounded under the rollout's scales (overwrite_guided_rows).
  // routed: a routed expert's call, whose token_of_row (or token_of_row_host) names each row's token
  // row; null for every other linear.
  Status apply_guidance(backend::Backend& be, backend::QuantizedTensor& q, const float* xb, int64_t M, int64_t K,
                        uint16_t site, const model::LinearCall* routed);
  // wq (N,K) <- w rounded to BF16 and, with `weights`, quantized and dequantized (the rollout's weight).
  void fake_quantize_weight(backend::Backend& be, float* wq, const float* w, int64_t N, int64_t K);
  // Rows r in [r0, r1) whose token row (tokens[r], or r without tokens) the rollout recorded: r
  // and its token's record sequence and position appended. A token outside the batch: an error.
  Status recorded_rows(int64_t r0, int64_t r1, const int32_t* tokens, std::vector<int64_t>& rows,
                       std::vector<uint64_t>& seqs, std::vector<uint32_t>& poss) const;
  // The guided rows of the grouped q (rows, K): expert e's rows [off[e], off[e+1]) at its site,
  // tokens (rows) host: each row's token row. One overwrite_guided_rows for all experts.
  Status apply_guidance_experts(backend::Backend& be, backend::QuantizedTensor& q, const float* xb,
                                const int64_t* off, int64_t E, const int32_t* tokens);
  FakeQuantOptions options_;
  model::LinearInfo info_;
  backend::Buffer<float> wq_, xq_;  // saved ŵ (N,K), x̂ (M,K) for backward
  // forward_experts' saved operands: x̂ (rows, K) of all experts, ŵ (E, N, K); its offsets (host)
  backend::Buffer<float> group_wq_, group_xq_;
  std::vector<int64_t> group_off_;
  int64_t group_stride_ = 0;
  backend::QuantizedBuffer qbuf_;
  GuidedRowsScratch scratch_;
};

// The KV-cache sites (an NVFP4 rollout cache, RlConfig::rollout_kv): the trainer's step between
// RoPE and attention (model::KvQuantizer). Each (token, kv head) row of K and V is quantized as
// the page codec does (model::nvfp4_kv_round_trip, RTN); at a guided layer, a token row with a
// rollout record at kKeyCache / kValueCache (version 2: Hkv rows of head_dim) is instead rounded
// under the rollout's scales to the code (trace-full) or mantissa bit (trace) it records, and
// dequantized with the rollout's scales. Straight-through backward (the model's). Counted in the
// guidance's GuidedSiteStats with the linears' sites.
class TraceKvQuantizer final : public model::KvQuantizer {
 public:
  void quantize(backend::Backend& be, int64_t layer, float* k, float* v, int64_t N, int64_t Hkv, int64_t D) override;
  void set_guidance(TraceGuidance* g) { guidance_ = g; }  // null: RTN everywhere

 private:
  // q (N*Hkv, D): the RTN quantization of x (N*Hkv, D) backend memory; its guided rows re-rounded.
  Status apply_guidance(backend::Backend& be, backend::QuantizedTensor& q, const float* x, int64_t N, int64_t Hkv,
                        int64_t D, uint16_t layer, uint16_t site);
  TraceGuidance* guidance_ = nullptr;
  backend::QuantizedBuffer buf_;
  GuidedRowsScratch scratch_;
};

// The rows of q (rows, K) kNvfp4TwoLevel that the gathered records cover <- their guided rounding
// under the rollout's scales (codes, inner and outer scales replaced: dequantize(q) then gives
// the rollout-scaled values), through Backend::guided_overwrite_rows: one upload of the row
// indices and gb's scales, outer and guide bytes, one op, and one copy of the three counts back
// unless device_counts ((3) i64 backend memory) takes them (+=, read later: no wait here). rows:
// the token rows of gb's records (record i covers matrix rows rows[i] * gb.rows_per_record + j);
// xb (rows, K) backend memory: the values q was quantized from. st += the elements and, without
// device_counts, the counts.
Status overwrite_guided_rows(backend::Backend& be, backend::QuantizedTensor& q, const float* xb,
                             const std::vector<int64_t>& rows, const rollout::GuidanceBatch& gb,
                             GuidedRowsScratch& scratch, GuidedSiteStats& st, int64_t* device_counts = nullptr);

// Registers "rl-fake-quant" (idempotent). RecipeConfig::raw may hold {"weights": b, "activations": b};
// guidance is attached afterwards with attach_guidance.
void register_fake_quant_recipe();
// The recipe config of an arm's trainer: weights/activations switches.
model::RecipeConfig fake_quant_recipe_config(bool weights, bool activations);
// Points every fake-quantized linear of `model` at `guidance` (null: detach). Other recipes: ignored.
void attach_guidance(model::Model& model, TraceGuidance* guidance);

// True when E2M1 codes a and b (sign | magnitude index) are adjacent values of the signed grid.
bool e2m1_one_step_apart(uint32_t a, uint32_t b);

}  // namespace nibble::rl
