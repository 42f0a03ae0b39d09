// The RL trainer's fake-quantized linear with TRACE guided rounding (see fake_quant.h).
#include "rl/fake_quant.h"

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

bool e2m1_one_step_apart(uint32_t a, uint32_t b) {
  // signed grid index: magnitude index, negated when the sign bit is set (-0 == +0)
  auto s = [](uint32_t c) { return (c & 8u) ? -static_cast<int>(c & 7u) : static_cast<int>(c & 7u); };
  return std::abs(s(a) - s(b)) == 1;
}

void FakeQuantLinear::forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N,
                              int64_t K, const model::LinearCall& call) {
  NIB_CHECK_MSG(K % 16 == 0, "{}: linear {} has in-features {}, NVFP4 needs a multiple of 16", kFakeQuantRecipe,
                info_.name, K);
  float* wq = wq_.ensure(be, N * K, "rl-fake-quant: saved weight");
  be.round_to_bf16(wq, w, N * K);  // the rollout quantizes the BF16 weight (rollout/precision.cpp)
  if (options_.weights) {
    backend::QuantizedTensor q = qbuf_.view(be, QuantFormat::kNvfp4TwoLevel, N, K);
    be.quantize(q, wq);
    be.dequantize(wq, q);
  }
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
    if (guided) {
      // keep the BF16 input for the guided rows, then dequantize the RTN codes and overwrite them
      std::vector<float> xb(static_cast<size_t>(M * K));
      be.copy_to_host(xb.data(), xq, sizeof(float) * static_cast<size_t>(M * K));
      be.dequantize(xq, q);
      Status s = routed && call.token_of_row == nullptr
                     ? Status(StatusCode::kInternal,
                              fmt::format("{}: routed expert linear {} ran without its tokens (LinearCall::token_of_row)",
                                          kFakeQuantRecipe, info_.name))
                     : apply_guidance(be, xq, xb.data(), q.codes, M, K, *site, routed ? call.token_of_row : nullptr);
      if (!s.is_ok()) g->status = s;
    } else {
      be.dequantize(xq, q);
    }
  }
  be.matmul_nt(y, xq, wq, M, N, K, /*accumulate=*/false, /*operands_bf16=*/!four_bit);
  if (four_bit) be.round_to_bf16(y, y, M * N);  // as the rollout's 4-bit modes: the GEMM writes BF16
}

Status FakeQuantLinear::apply_guidance(backend::Backend& be, float* xq, const float* xb, const uint8_t* rtn_codes_dev,
                                       int64_t M, int64_t K, uint16_t site, const int32_t* token_of_row) {
  TraceGuidance& g = *options_.guidance;
  std::vector<int32_t> tokens;  // host copy of token_of_row
  if (token_of_row != nullptr) {
    tokens.resize(static_cast<size_t>(M));
    be.copy_to_host(tokens.data(), token_of_row, sizeof(int32_t) * static_cast<size_t>(M));
  }
  const auto block = static_cast<uint16_t>(info_.block);
  GuidedSiteStats st;
  std::vector<int64_t> rows;
  std::vector<uint64_t> seqs;
  std::vector<uint32_t> poss;
  for (int64_t r = 0; r < M; ++r) {
    const int64_t n = tokens.empty() ? r : tokens[static_cast<size_t>(r)];  // the row's token row
    if (n < 0 || n >= static_cast<int64_t>(g.row_sequence.size()))
      return Status(StatusCode::kInternal, fmt::format("{}: linear {} row {} is token {}, the batch has {}",
                                                       kFakeQuantRecipe, info_.name, r, n, g.row_sequence.size()));
    const auto t = static_cast<size_t>(n);
    if (!g.row_recorded[t]) continue;
    if (!tokens.empty()) {  // a routed expert: the rollout may have routed this token elsewhere
      ++st.routed_rows;
      if (!g.store->contains(rollout::RecordKey{g.row_sequence[t], g.row_position[t], block, site})) {
        ++st.routed_fallback_rows;
        continue;
      }
    }
    rows.push_back(r);
    seqs.push_back(g.row_sequence[t]);
    poss.push_back(g.row_position[t]);
  }
  if (rows.empty()) {
    g.stats.add(st);
    return Status::ok();
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  NIB_ASSIGN_OR_RETURN(rollout::GuidanceBatch gb,
                       rollout::gather_guidance(*g.store, seqs.data(), poss.data(), R, block, site));
  if (gb.cols != K || gb.rows_per_record != 1 || gb.format != QuantFormat::kNvfp4TwoLevel)
    return invalid_argument("{}: guidance of linear {} is {} {}x{}, the trainer quantizes {} rows of {} cols",
                            kFakeQuantRecipe, info_.name, backend::quant_format_name(gb.format), gb.rows_per_record,
                            gb.cols, backend::quant_format_name(QuantFormat::kNvfp4TwoLevel), K);
  NIB_RETURN_IF_ERROR(overwrite_guided_rows(be, xq, xb, rtn_codes_dev, M, K, rows, gb, st));
  g.stats.add(st);
  return Status::ok();
}

Status overwrite_guided_rows(backend::Backend& be, float* xq, const float* xb, const uint8_t* rtn_codes_dev, int64_t M,
                             int64_t K, const std::vector<int64_t>& rows, const rollout::GuidanceBatch& gb,
                             GuidedSiteStats& st) {
  const int64_t Rr = gb.rows_per_record;  // matrix rows per record
  const int64_t R = static_cast<int64_t>(rows.size()) * Rr;
  NIB_CHECK(gb.rows == R && gb.cols == K);
  std::vector<float> xr(static_cast<size_t>(R * K));
  std::vector<uint8_t> rtn_all(static_cast<size_t>(M * K / 2)), guided(static_cast<size_t>(R * K / 2));
  be.copy_to_host(rtn_all.data(), rtn_codes_dev, rtn_all.size());
  auto matrix_row = [&](int64_t i) { return rows[static_cast<size_t>(i / Rr)] * Rr + i % Rr; };
  for (int64_t i = 0; i < R; ++i)
    std::memcpy(xr.data() + i * K, xb + matrix_row(i) * K, sizeof(float) * static_cast<size_t>(K));
  rollout::guided_quantize_cpu(guided.data(), xr.data(), gb);
  std::vector<float> deq(static_cast<size_t>(R * K));
  formats::nvfp4_2level_dequantize_cpu(deq.data(), guided.data(), gb.scales.data(), gb.outer.data(), R, K);
  const rollout::GuidanceMode mode = gb.mode;
  for (int64_t i = 0; i < R; ++i) {
    const uint8_t* rtn = rtn_all.data() + matrix_row(i) * (K / 2);
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t own = formats::e2m1_unpack(rtn, k);
      const uint32_t gc = formats::e2m1_unpack(guided.data() + i * (K / 2), k);
      uint32_t roll = gc;  // trace: the guided code stands for the rollout's
      bool same;
      if (mode == rollout::GuidanceMode::kTraceFull) {
        roll = formats::e2m1_unpack(gb.guide.data() + i * (K / 2), k);
        same = gc == roll || ((gc & 7u) == 0 && (roll & 7u) == 0);  // +0 == -0
      } else {
        same = (gc & 1u) == ((gb.guide[static_cast<size_t>(i * (K / 8) + k / 8)] >> (k & 7)) & 1u);
      }
      const bool mism = own != roll && !((own & 7u) == 0 && (roll & 7u) == 0);
      st.rtn_mismatch += mism;
      st.one_step += mism && e2m1_one_step_apart(own, roll);
      st.reproduced += same;
    }
  }
  // one copy per run of consecutive matrix rows
  for (int64_t i = 0; i < R;) {
    int64_t j = i + 1;
    while (j < R && matrix_row(j) == matrix_row(j - 1) + 1) ++j;
    be.copy_to_device(xq + matrix_row(i) * K, deq.data() + i * K, sizeof(float) * static_cast<size_t>((j - i) * K));
    i = j;
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
    xb_.resize(static_cast<size_t>(N * Hkv * D));
    be.copy_to_host(xb_.data(), x, sizeof(float) * xb_.size());  // the input, for the guided rows
    const backend::QuantizedTensor q = model::nvfp4_kv_round_trip(be, x, N * Hkv, D, buf_);
    Status s = apply_guidance(be, x, q.codes, N, Hkv, D, static_cast<uint16_t>(layer),
                              values ? rollout::kValueCache : rollout::kKeyCache);
    if (!s.is_ok()) g->status = s;
  }
}

Status TraceKvQuantizer::apply_guidance(backend::Backend& be, float* x, const uint8_t* rtn_codes_dev, int64_t N,
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
    NIB_ASSIGN_OR_RETURN(rollout::GuidanceBatch gb, rollout::gather_guidance(*g.store, seqs.data(), poss.data(),
                                                                             static_cast<int64_t>(rows.size()), layer, site));
    if (gb.cols != D || gb.rows_per_record != Hkv || gb.format != QuantFormat::kNvfp4TwoLevel)
      return invalid_argument("{}: KV guidance of layer {} site {} is {} {}x{}, the trainer's cache rows are {} {}x{}",
                              kFakeQuantRecipe, layer, site, backend::quant_format_name(gb.format), gb.rows_per_record,
                              gb.cols, backend::quant_format_name(QuantFormat::kNvfp4TwoLevel), Hkv, D);
    NIB_RETURN_IF_ERROR(overwrite_guided_rows(be, x, xb_.data(), rtn_codes_dev, N * Hkv, D, rows, gb, st));
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
