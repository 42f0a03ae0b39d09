// The RL trainer's fake-quantized linear with TRACE guided rounding (see fake_quant.h).
#include "rl/fake_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "formats/e2m1.h"
#include "formats/quantize_cpu.h"
#include "model/transformer.h"
#include "model/kv_quantizer.h"
#include "rollout/recorders.h"

namespace nibble::rl {

using backend::QuantFormat;

bool e2m1_one_step_apart(uint32_t a, uint32_t b) { return formats::e2m1_one_step_apart(a, b); }

namespace {
// Where a guided call adds its counts: the guidance's device counts once reset_guided_counts made
// them (collected later, no wait per call), else null (the call copies its own back).
int64_t* device_counts(TraceGuidance& g) {
  return g.device_counts.size() >= 3 ? g.device_counts.data() : nullptr;
}

// gather_guidance of rows (sequences, positions) at (layer, site), through g.gathered: the same
// rows asked again (the same store) are answered from the last read.
Result<const TraceGuidance::Gathered*> gather_cached(TraceGuidance& g, uint16_t layer, uint16_t site,
                                                     std::vector<uint64_t>&& sequences, std::vector<uint32_t>&& positions,
                                                     bool with_found) {
  TraceGuidance::Gathered& c = g.gathered[{layer, site}];
  if (!c.sequences.empty() && c.with_found == with_found && c.sequences == sequences && c.positions == positions)
    return &c;
  c.sequences.clear(), c.positions.clear();  // a failed read leaves no entry that could match
  NIB_ASSIGN_OR_RETURN(c.batch, rollout::gather_guidance(*g.store, sequences.data(), positions.data(),
                                                         static_cast<int64_t>(sequences.size()), layer, site,
                                                         with_found ? &c.found : nullptr));
  c.with_found = with_found;
  c.sequences = std::move(sequences), c.positions = std::move(positions);
  return &c;
}
}  // namespace

void set_guidance_store(TraceGuidance& g, rollout::RecordStore* store) {
  g.store = store;
  g.gathered.clear();
}

void FakeQuantLinear::fake_quantize_weight(backend::Backend& be, float* wq, const float* w, int64_t N, int64_t K) {
  be.round_to_bf16(wq, w, N * K);  // the rollout quantizes the BF16 weight (rollout/precision.cpp)
  if (!options_.weights) return;
  backend::QuantizedTensor q = qbuf_.view(be, QuantFormat::kNvfp4TwoLevel, N, K);
  be.quantize(q, wq);
  be.dequantize(wq, q);
}

Status FakeQuantLinear::recorded_rows(int64_t r0, int64_t r1, const int32_t* tokens, std::vector<int64_t>& rows,
                                      std::vector<uint64_t>& seqs, std::vector<uint32_t>& poss) const {
  const TraceGuidance& g = *options_.guidance;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t n = tokens == nullptr ? r : tokens[r];  // the row's token row
    if (n < 0 || n >= static_cast<int64_t>(g.row_sequence.size()))
      return Status(StatusCode::kInternal, fmt::format("{}: linear {} row {} is token {}, the batch has {}",
                                                       kFakeQuantRecipe, info_.name, r, n, g.row_sequence.size()));
    const auto t = static_cast<size_t>(n);
    if (!g.row_recorded[t]) continue;
    rows.push_back(r);
    seqs.push_back(g.row_sequence[t]);
    poss.push_back(g.row_position[t]);
  }
  return Status::ok();
}

void FakeQuantLinear::forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N,
                              int64_t K, const model::LinearCall& call) {
  NIB_CHECK_MSG(K % 16 == 0, "{}: linear {} has in-features {}, NVFP4 needs a multiple of 16", kFakeQuantRecipe,
                info_.name, K);
  float* wq = wq_.ensure(be, N * K, "rl-fake-quant: saved weight");
  fake_quantize_weight(be, wq, w, N, K);
  float* xq = xq_.ensure(be, M * K, "rl-fake-quant: saved input");
  be.round_to_bf16(xq, x, M * K);
  const bool four_bit = options_.weights || options_.activations;
  if (options_.activations) {
    backend::QuantizedTensor q = qbuf_.view(be, QuantFormat::kNvfp4TwoLevel, M, K);
    be.quantize(q, xq);  // RTN with its own scales, the rollout's w4a4 quantizer
    TraceGuidance* g = options_.guidance;
    const auto site = rollout::guidance_site(info_);
    const bool routed = rollout::is_routed_expert(info_.kind);
    const bool guided = g != nullptr && g->store != nullptr && g->status.is_ok() && site.has_value() &&
                        info_.block < static_cast<int>(g->layers.size()) && g->layers[static_cast<size_t>(info_.block)] &&
                        (routed || static_cast<int64_t>(g->row_sequence.size()) == M);
    if (guided) {  // re-round the guided rows of q under the rollout's scales (xq still holds the BF16 input)
      Status s = routed && call.token_of_row == nullptr
                     ? Status(StatusCode::kInternal,
                              fmt::format("{}: routed expert linear {} ran without its tokens (LinearCall::token_of_row)",
                                          kFakeQuantRecipe, info_.name))
                     : apply_guidance(be, q, xq, M, K, *site, routed ? &call : nullptr);
      if (!s.is_ok()) g->status = s;
    }
    be.dequantize(xq, q);
  }
  be.matmul_nt(y, xq, wq, M, N, K, /*accumulate=*/false, /*operands_bf16=*/!four_bit);
  if (four_bit) be.round_to_bf16(y, y, M * N);  // as the rollout's 4-bit modes: the GEMM writes BF16
}

Status FakeQuantLinear::apply_guidance(backend::Backend& be, backend::QuantizedTensor& q, const float* xb, int64_t M,
                                       int64_t K, uint16_t site, const model::LinearCall* routed) {
  TraceGuidance& g = *options_.guidance;
  std::vector<int32_t> copy;  // host copy of token_of_row, unless the caller has one
  const int32_t* tokens = routed != nullptr ? routed->token_of_row_host : nullptr;
  if (routed != nullptr && tokens == nullptr) {
    copy.resize(static_cast<size_t>(M));
    be.copy_to_host(copy.data(), routed->token_of_row, sizeof(int32_t) * static_cast<size_t>(M));
    tokens = copy.data();
  }
  const auto block = static_cast<uint16_t>(info_.block);
  GuidedSiteStats st;
  std::vector<int64_t> rows;
  std::vector<uint64_t> seqs;
  std::vector<uint32_t> poss;
  NIB_RETURN_IF_ERROR(recorded_rows(0, M, tokens, rows, seqs, poss));
  if (rows.empty()) {
    g.stats.add(st);
    return Status::ok();
  }
  // a routed expert: the rollout may have routed some of these tokens elsewhere (no record here);
  // those rows keep the trainer's own rounding
  NIB_ASSIGN_OR_RETURN(const TraceGuidance::Gathered* gathered,
                       gather_cached(g, block, site, std::move(seqs), std::move(poss), tokens != nullptr));
  const rollout::GuidanceBatch& gb = gathered->batch;
  const std::vector<uint8_t>& found = gathered->found;
  if (tokens != nullptr) {
    st.routed_rows += static_cast<int64_t>(rows.size());
    size_t kept = 0;
    for (size_t i = 0; i < rows.size(); ++i)
      if (found[i] != 0) rows[kept++] = rows[i];
    st.routed_fallback_rows += static_cast<int64_t>(rows.size() - kept);
    rows.resize(kept);
    if (rows.empty()) {
      g.stats.add(st);
      return Status::ok();
    }
  }
  if (gb.cols != K || gb.rows_per_record != 1 || gb.format != QuantFormat::kNvfp4TwoLevel)
    return invalid_argument("{}: guidance of linear {} is {} {}x{}, the trainer quantizes {} rows of {} cols",
                            kFakeQuantRecipe, info_.name, backend::quant_format_name(gb.format), gb.rows_per_record,
                            gb.cols, backend::quant_format_name(QuantFormat::kNvfp4TwoLevel), K);
  NIB_RETURN_IF_ERROR(overwrite_guided_rows(be, q, xb, rows, gb, scratch_, st, device_counts(g)));
  g.stats.add(st);
  return Status::ok();
}

void FakeQuantLinear::forward_experts(backend::Backend& be, float* y, const float* x, const float* w, int64_t N,
                                      int64_t K, const model::ExpertGroup& group) {
  const bool four_bit = options_.weights || options_.activations;
  group_off_.clear();
  if (!four_bit || group.E == 0) {
    model::LinearRecipe::forward_experts(be, y, x, w, N, K, group);
    return;
  }
  NIB_CHECK_MSG(K % 16 == 0, "{}: linear {} has in-features {}, NVFP4 needs a multiple of 16", kFakeQuantRecipe,
                info_.name, K);
  const int64_t E = group.E;
  std::vector<int64_t> copy;
  const int64_t* off = model::expert_offsets_host(be, group, copy);
  const int64_t rows = off[E];
  group_off_.assign(off, off + E + 1);
  group_stride_ = group.w_stride;
  float* xq = group_xq_.ensure(be, std::max<int64_t>(rows, 1) * K, "rl-fake-quant: saved expert inputs");
  float* wq = group_wq_.ensure(be, E * N * K, "rl-fake-quant: saved expert weights");
  if (rows > 0) be.round_to_bf16(xq, x, rows * K);
  if (options_.activations && rows > 0) {
    backend::QuantizedTensor q = qbuf_.view(be, QuantFormat::kNvfp4TwoLevel, rows, K);
    be.quantize(q, xq);  // RTN, each row on its own: every expert's rows as its own call quantizes them
    TraceGuidance* g = options_.guidance;
    const bool guided = g != nullptr && g->store != nullptr && g->status.is_ok() && group.token_of_row != nullptr &&
                        rollout::is_routed_expert(info_.kind) && info_.block < static_cast<int>(g->layers.size()) &&
                        g->layers[static_cast<size_t>(info_.block)];
    if (guided) {
      std::vector<int32_t> tokens(static_cast<size_t>(rows));
      be.copy_to_host(tokens.data(), group.token_of_row, tokens.size() * sizeof(int32_t));
      const Status st = apply_guidance_experts(be, q, xq, off, E, tokens.data());
      if (!st.is_ok()) g->status = st;
    }
    be.dequantize(xq, q);
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], m = off[e + 1] - r0;
    if (m == 0) continue;  // as the per-expert loop: an expert without rows is not called
    float* we = wq + e * N * K;
    fake_quantize_weight(be, we, w + e * group.w_stride, N, K);
    be.matmul_nt(y + r0 * N, xq + r0 * K, we, m, N, K, /*accumulate=*/false, /*operands_bf16=*/false);
  }
  if (rows > 0) be.round_to_bf16(y, y, rows * N);  // as the rollout's 4-bit modes: the GEMM writes BF16
}

void FakeQuantLinear::backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t N,
                                       int64_t K, const model::ExpertGroup& group) {
  if (group_off_.empty()) {  // the forward took the per-expert loop
    model::LinearRecipe::backward_experts(be, dx, dw, dy, N, K, group);
    return;
  }
  NIB_CHECK_MSG(static_cast<int64_t>(group_off_.size()) == group.E + 1 && group.w_stride == group_stride_,
                "rl-fake-quant: backward_experts without a matching forward_experts");
  const float* xq = group_xq_.data();
  const float* wq = group_wq_.data();
  for (int64_t e = 0; e < group.E; ++e) {  // straight-through, each expert's rows as its own backward
    const int64_t r0 = group_off_[e], m = group_off_[e + 1] - r0;
    if (m == 0) continue;
    be.matmul_nn(dx + r0 * K, dy + r0 * N, wq + e * N * K, m, K, N);
    be.matmul_tn(dw + e * group.w_stride, dy + r0 * N, xq + r0 * K, N, K, m, /*accumulate=*/true);
  }
}

Status FakeQuantLinear::apply_guidance_experts(backend::Backend& be, backend::QuantizedTensor& q, const float* xb,
                                               const int64_t* off, int64_t E, const int32_t* tokens) {
  TraceGuidance& g = *options_.guidance;
  const auto block = static_cast<uint16_t>(info_.block);
  const int part = info_.kind == model::LinearKind::kExpertGateUp ? 0 : 1;
  const int64_t K = q.cols;
  GuidedSiteStats st;
  std::vector<int64_t> rows;  // the guided rows of q, all experts
  rollout::GuidanceBatch all;
  all.cols = K;
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> mine;
    std::vector<uint64_t> seqs;
    std::vector<uint32_t> poss;
    NIB_RETURN_IF_ERROR(recorded_rows(off[e], off[e + 1], tokens, mine, seqs, poss));
    if (mine.empty()) continue;
    const uint16_t site = rollout::routed_expert_site(e, part);
    NIB_ASSIGN_OR_RETURN(const TraceGuidance::Gathered* gathered,
                         gather_cached(g, block, site, std::move(seqs), std::move(poss), /*with_found=*/true));
    const rollout::GuidanceBatch& gb = gathered->batch;
    st.routed_rows += static_cast<int64_t>(mine.size());
    int64_t kept = 0;
    for (size_t i = 0; i < mine.size(); ++i)
      if (gathered->found[i] != 0) rows.push_back(mine[i]), ++kept;
    st.routed_fallback_rows += static_cast<int64_t>(mine.size()) - kept;
    if (kept == 0) continue;
    if (gb.cols != K || gb.rows_per_record != 1 || gb.format != QuantFormat::kNvfp4TwoLevel || gb.rows != kept ||
        (all.rows > 0 && gb.mode != all.mode))
      return invalid_argument("{}: guidance of linear {} expert {} is {} {}x{}, the trainer quantizes {} rows of {} cols",
                              kFakeQuantRecipe, info_.name, e, backend::quant_format_name(gb.format), gb.rows_per_record,
                              gb.cols, backend::quant_format_name(QuantFormat::kNvfp4TwoLevel), K);
    all.format = gb.format, all.mode = gb.mode;
    all.rows += kept;
    all.scales.insert(all.scales.end(), gb.scales.begin(), gb.scales.end());
    all.outer.insert(all.outer.end(), gb.outer.begin(), gb.outer.end());
    all.guide.insert(all.guide.end(), gb.guide.begin(), gb.guide.end());
  }
  if (!rows.empty()) NIB_RETURN_IF_ERROR(overwrite_guided_rows(be, q, xb, rows, all, scratch_, st, device_counts(g)));
  g.stats.add(st);
  return Status::ok();
}

void reset_guided_counts(backend::Backend& be, TraceGuidance& g) {
  g.stats = GuidedSiteStats{};
  be.fill_zero(g.device_counts.ensure(be, 3, "rl-fake-quant: guided counts"), 3 * sizeof(int64_t));
}

void collect_guided_counts(backend::Backend& be, TraceGuidance& g) {
  if (g.device_counts.size() < 3) return;
  int64_t counts[3];
  be.copy_to_host(counts, g.device_counts.data(), sizeof(counts));
  g.stats.rtn_mismatch += counts[0], g.stats.one_step += counts[1], g.stats.reproduced += counts[2];
  be.fill_zero(g.device_counts.data(), sizeof(counts));
}

Status overwrite_guided_rows(backend::Backend& be, backend::QuantizedTensor& q, const float* xb,
                             const std::vector<int64_t>& rows, const rollout::GuidanceBatch& gb,
                             GuidedRowsScratch& scratch, GuidedSiteStats& st, int64_t* device_counts) {
  const int64_t Rr = gb.rows_per_record;  // matrix rows per record
  const int64_t R = static_cast<int64_t>(rows.size()) * Rr, K = q.cols;
  NIB_CHECK(gb.rows == R && gb.cols == K && q.format == QuantFormat::kNvfp4TwoLevel && K % 16 == 0);
  if (R == 0) return Status::ok();
  if (q.rows > INT32_MAX)
    return invalid_argument("{}: {} guided rows do not fit the op's i32 row indices", kFakeQuantRecipe, q.rows);
  // One upload: stats (3) i64 zeroed | row indices (R) i32 | outer | inner scales | guide, each
  // part 8-byte aligned (the kernels load the guide and the codes 8 bytes at a time).
  const auto align8 = [](int64_t n) { return (n + 7) & ~int64_t{7}; };
  const int64_t no = (K + 127) / 128;
  const int64_t guide_bytes = static_cast<int64_t>(gb.guide.size());
  NIB_CHECK(static_cast<int64_t>(gb.scales.size()) == R * (K / 16) && static_cast<int64_t>(gb.outer.size()) == R * no);
  const int64_t o_rows = 3 * 8, o_outer = o_rows + align8(4 * R), o_scales = o_outer + align8(4 * R * no),
                o_guide = o_scales + align8(R * (K / 16)), total = o_guide + guide_bytes;
  scratch.host.assign(static_cast<size_t>(total), 0);
  uint8_t* h = scratch.host.data();
  for (int64_t i = 0; i < R; ++i) {
    const auto m = static_cast<int32_t>(rows[static_cast<size_t>(i / Rr)] * Rr + i % Rr);  // the matrix row
    std::memcpy(h + o_rows + 4 * i, &m, 4);
  }
  std::memcpy(h + o_outer, gb.outer.data(), sizeof(float) * gb.outer.size());
  std::memcpy(h + o_scales, gb.scales.data(), gb.scales.size());
  std::memcpy(h + o_guide, gb.guide.data(), gb.guide.size());
  uint8_t* d = scratch.device.ensure(be, total, "rl-fake-quant: guidance upload");
  be.copy_to_device(d, h, static_cast<size_t>(total));
  auto* stats_dev = device_counts != nullptr ? device_counts : reinterpret_cast<int64_t*>(d);
  be.guided_overwrite_rows(q, stats_dev, xb, reinterpret_cast<const int32_t*>(d + o_rows), R, d + o_scales,
                           reinterpret_cast<const float*>(d + o_outer), d + o_guide, rollout::guidance_kind(gb.mode));
  if (device_counts == nullptr) {
    int64_t counts[3];
    be.copy_to_host(counts, stats_dev, sizeof(counts));
    st.rtn_mismatch += counts[0], st.one_step += counts[1], st.reproduced += counts[2];
  }
  st.elements += R * K;
  return Status::ok();
}

// ---- the KV-cache sites ---------------------------------------------------------------------------

void TraceKvQuantizer::quantize(backend::Backend& be, int64_t layer, float* k, float* v, int64_t N, int64_t Hkv,
                                int64_t D) {
  TraceGuidance* g = guidance_;
  const bool guided = g != nullptr && g->store != nullptr && g->status.is_ok() && layer >= 0 &&
                      layer < static_cast<int64_t>(g->layers.size()) && g->layers[static_cast<size_t>(layer)] &&
                      static_cast<int64_t>(g->row_sequence.size()) == N;
  for (const bool values : {false, true}) {
    float* x = values ? v : k;
    if (!guided) {
      model::nvfp4_kv_round_trip(be, x, N * Hkv, D, buf_);
      continue;
    }
    // model::nvfp4_kv_round_trip with the guided rows re-rounded between quantize and dequantize
    NIB_CHECK_MSG(D > 0 && D % 16 == 0, "nvfp4 KV cache: head dim {} is not a multiple of 16", D);
    backend::QuantizedTensor q = buf_.view(be, QuantFormat::kNvfp4TwoLevel, N * Hkv, D);
    be.quantize(q, x);
    Status s = apply_guidance(be, q, x, N, Hkv, D, static_cast<uint16_t>(layer),
                              values ? rollout::kValueCache : rollout::kKeyCache);
    if (!s.is_ok()) g->status = s;
    be.dequantize(x, q);
  }
}

Status TraceKvQuantizer::apply_guidance(backend::Backend& be, backend::QuantizedTensor& q, const float* x, int64_t N,
                                        int64_t Hkv, int64_t D, uint16_t layer, uint16_t site) {
  TraceGuidance& g = *guidance_;
  std::vector<int64_t> rows;
  std::vector<uint64_t> seqs;
  std::vector<uint32_t> poss;
  for (int64_t n = 0; n < N; ++n) {
    const auto t = static_cast<size_t>(n);
    if (!g.row_recorded[t]) continue;
    rows.push_back(n);
    seqs.push_back(g.row_sequence[t]);
    poss.push_back(g.row_position[t]);
  }
  GuidedSiteStats st;
  if (!rows.empty()) {
    NIB_ASSIGN_OR_RETURN(const TraceGuidance::Gathered* gathered,
                         gather_cached(g, layer, site, std::move(seqs), std::move(poss), /*with_found=*/false));
    const rollout::GuidanceBatch& gb = gathered->batch;
    if (gb.cols != D || gb.rows_per_record != Hkv || gb.format != QuantFormat::kNvfp4TwoLevel)
      return invalid_argument("{}: KV guidance of layer {} site {} is {} {}x{}, the trainer's cache rows are {} {}x{}",
                              kFakeQuantRecipe, layer, site, backend::quant_format_name(gb.format), gb.rows_per_record,
                              gb.cols, backend::quant_format_name(QuantFormat::kNvfp4TwoLevel), Hkv, D);
    NIB_RETURN_IF_ERROR(overwrite_guided_rows(be, q, x, rows, gb, scratch_, st, device_counts(g)));
  }
  g.stats.add(st);
  return Status::ok();
}

void FakeQuantLinear::backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N,
                               int64_t K, const model::LinearCall& call) {
  NIB_CHECK_MSG(xq_.data() != nullptr && wq_.size() >= N * K && xq_.size() >= M * K,
                "rl-fake-quant: backward without a matching forward");
  // straight-through: the quantizers' derivative is taken as 1
  be.matmul_nn(dx, dy, wq_.data(), M, K, N);                                // dx (M,K) = dy . ŵ
  be.matmul_tn(dw, dy, xq_.data(), N, K, M, /*accumulate=*/true);          // dw += dy^T . x̂
}

void register_fake_quant_recipe() {
  if (model::has_linear_recipe(kFakeQuantRecipe)) return;
  model::register_linear_recipe(
      kFakeQuantRecipe,
      [](const model::RecipeConfig& cfg, const model::LinearInfo& info) -> Result<std::unique_ptr<model::LinearRecipe>> {
        FakeQuantOptions o;
        if (cfg.raw.is_object()) {
          for (auto it = cfg.raw.begin(); it != cfg.raw.end(); ++it) {
            if (it.key() == "name") continue;
            if (it.key() != "weights" && it.key() != "activations")
              return invalid_argument("{}: unknown key '{}' (weights, activations)", kFakeQuantRecipe, it.key());
            if (!it.value().is_boolean()) return invalid_argument("{}: '{}' must be true or false", kFakeQuantRecipe, it.key());
          }
          o.weights = cfg.raw.value("weights", true);
          o.activations = cfg.raw.value("activations", true);
        }
        if (info.K % 16 != 0)
          return invalid_argument("{}: linear {} has in-features {}, NVFP4 needs a multiple of 16", kFakeQuantRecipe,
                                  info.name, info.K);
        return std::unique_ptr<model::LinearRecipe>(new FakeQuantLinear(o, info));
      });
}

model::RecipeConfig fake_quant_recipe_config(bool weights, bool activations) {
  model::RecipeConfig rc;
  rc.name = kFakeQuantRecipe;
  rc.raw = nlohmann::json{{"name", kFakeQuantRecipe}, {"weights", weights}, {"activations", activations}};
  return rc;
}

void attach_guidance(model::Model& model, TraceGuidance* guidance) {
  for (const model::LinearInfo& info : model.linear_infos())
    if (auto* f = dynamic_cast<FakeQuantLinear*>(model.linear_recipe(info.id))) f->set_guidance(guidance);
}

}  // namespace nibble::rl
