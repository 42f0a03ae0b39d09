// Precision modes of the rollout engine's block linears (see precision.h).
#include "rollout/precision.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "core/check.h"

namespace nibble::rollout {

using backend::QuantFormat;

const char* precision_mode_name(PrecisionMode m) {
  switch (m) {
    case PrecisionMode::kRecipe: return "recipe";
    case PrecisionMode::kBf16: return "bf16";
    case PrecisionMode::kW4A16: return "w4a16";
    case PrecisionMode::kW4A4: return "w4a4";
  }
  return "?";
}

Result<PrecisionMode> parse_precision_mode(const std::string& s) {
  if (s == "recipe") return PrecisionMode::kRecipe;
  if (s == "bf16") return PrecisionMode::kBf16;
  if (s == "w4a16") return PrecisionMode::kW4A16;
  if (s == "w4a4") return PrecisionMode::kW4A4;
  return invalid_argument("unknown precision mode '{}' (recipe, bf16, w4a16, w4a4)", s);
}

Result<std::unique_ptr<QuantizedLinears>> QuantizedLinears::create(model::Model& model, PrecisionMode mode,
                                                                   const std::string& recipe_name) {
  NIB_CHECK_MSG(mode != PrecisionMode::kRecipe, "QuantizedLinears: the recipe mode runs the model's recipes");
  std::unique_ptr<QuantizedLinears> q(new QuantizedLinears);
  q->mode_ = mode;
  q->be_ = &model.backend();
  q->infos_ = model.linear_infos();
  const bool te = recipe_name == "nvfp4-nvidia";
  q->weight_format_ = te ? QuantFormat::kNvfp4Te2d : QuantFormat::kNvfp4TwoLevel;
  if (const char* v = std::getenv("NIBBLE_FUSED_MOE_DECODE"); v != nullptr && std::string(v) == "off")
    q->fused_moe_ = false;
  q->act_format_ = te ? QuantFormat::kNvfp4Te : QuantFormat::kNvfp4TwoLevel;
  backend::Backend& be = model.backend();
  const bool four_bit = mode != PrecisionMode::kBf16;
  const std::vector<model::LinearInfo>& infos = model.linear_infos();
  for (const model::LinearInfo& info : infos)
    if (four_bit && (info.K % 16 != 0 || (te && info.N % 16 != 0)))
      return invalid_argument("{} mode: linear {} is ({}, {}); NVFP4 needs in-features{} a multiple of 16",
                              precision_mode_name(mode), info.name, info.N, info.K, te ? " and out-features" : "");
  // the routed experts of each MoE layer part back to back (the fused MoE decode's layout); the
  // TE formats keep one tensor per expert (their per-tensor scale is not row-local)
  std::vector<int> group_of_id(infos.size(), -1), expert_of_id(infos.size(), -1);
  if (!te) {
    std::map<std::pair<int, int>, std::vector<const model::LinearInfo*>> parts;  // (block, part) -> experts
    for (const model::LinearInfo& info : infos)
      if ((info.kind == model::LinearKind::kExpertGateUp || info.kind == model::LinearKind::kExpertDown) &&
          info.expert >= 0)
        parts[{info.block, info.kind == model::LinearKind::kExpertGateUp ? 0 : 1}].push_back(&info);
    for (auto& [key, experts] : parts) {
      std::sort(experts.begin(), experts.end(),
                [](const model::LinearInfo* a, const model::LinearInfo* b) { return a->expert < b->expert; });
      bool regular = true;
      for (size_t e = 0; e < experts.size(); ++e)
        regular = regular && experts[e]->expert == static_cast<int>(e) && experts[e]->N == experts[0]->N &&
                  experts[e]->K == experts[0]->K;
      if (!regular) continue;  // (not a model the engine makes) one tensor per expert
      ExpertGroupStorage g;
      g.E = static_cast<int64_t>(experts.size()), g.N = experts[0]->N, g.K = experts[0]->K;
      if (four_bit) {
        g.q0 = g.qbuf.view(be, q->weight_format_, g.E * g.N, g.K);
        g.q0.rows = g.N;
      } else {
        g.bits.ensure(be, g.E * g.N * g.K, "rollout expert BF16 weights");
      }
      for (const model::LinearInfo* info : experts) {
        g.ids.push_back(info->id);
        group_of_id[static_cast<size_t>(info->id)] = static_cast<int>(q->groups_.size());
        expert_of_id[static_cast<size_t>(info->id)] = info->expert;
      }
      q->groups_.push_back(std::move(g));
    }
  }
  for (const model::LinearInfo& info : infos) {
    auto slot = std::make_unique<Slot>();
    slot->group = group_of_id[static_cast<size_t>(info.id)];
    if (slot->group >= 0) {  // a view of its group's storage
      const ExpertGroupStorage& g = q->groups_[static_cast<size_t>(slot->group)];
      const int64_t e = expert_of_id[static_cast<size_t>(info.id)];
      if (four_bit) {
        slot->q = g.q0;
        slot->q.codes += e * backend::QuantizedTensor::code_bytes(g.q0.format, g.N, g.K);
        slot->q.scales += e * backend::QuantizedTensor::scale_bytes(g.q0.format, g.N, g.K);
        slot->q.outer += e * backend::QuantizedTensor::outer_count(g.q0.format, g.N, g.K);
      } else {
        slot->bits = const_cast<uint16_t*>(g.bits.data()) + e * g.N * g.K;
      }
    } else if (four_bit) {
      slot->q = slot->qbuf.view(be, q->weight_format_, info.N, info.K);
    } else {
      slot->bits = slot->w_bits.ensure(be, info.N * info.K, "rollout linear BF16 weight");
    }
    q->weight_bytes_ += four_bit ? backend::QuantizedTensor::code_bytes(q->weight_format_, info.N, info.K) +
                                       backend::QuantizedTensor::scale_bytes(q->weight_format_, info.N, info.K) +
                                       4 * backend::QuantizedTensor::outer_count(q->weight_format_, info.N, info.K)
                                 : 2 * info.N * info.K;
    q->slots_.push_back(std::move(slot));
  }
  q->waiting_ = static_cast<int64_t>(q->slots_.size());
  // a model with master weights: quantize them now (an inference-storage model has none: its
  // weights arrive through set_weight / set_quantized_weight(s))
  if (model.storage() == model::ParameterStorage::kTraining)
    for (const model::LinearInfo& info : model.linear_infos())
      q->quantize_from(info.id, model.linear_weight(info.id));  // (N,K) master weight in backend memory
  return q;
}

void QuantizedLinears::quantize_from(int id, const float* w) {
  const model::LinearInfo& info = infos_[id];
  Slot& slot = *slots_[id];
  backend::Backend& be = *be_;
  if (mode_ == PrecisionMode::kBf16) {
    be.to_bf16_bits(slot.bits, w, info.N * info.K);
  } else {
    float* wb = wd_.ensure(be, info.N * info.K, "rollout weight scratch");
    be.round_to_bf16(wb, w, info.N * info.K);  // the recipes quantize the BF16 weight
    be.quantize(slot.q, wb);                   // RTN, the trainer's forward quantizer
  }
  if (!slot.ready) --waiting_;
  slot.ready = true;
}

Status QuantizedLinears::set_weight(int id, const float* w, Memory where) {
  if (id < 0 || id >= static_cast<int>(slots_.size()))
    return invalid_argument("weight of linear {}: the model has {} block linears", id, slots_.size());
  if (w == nullptr) return invalid_argument("weight of linear {}: null", infos_[id].name);
  const int64_t n = infos_[id].N * infos_[id].K;
  if (where == Memory::kHost) {
    float* up = upload_.ensure(*be_, n, "rollout weight upload");
    be_->copy_to_device(up, w, static_cast<size_t>(n) * sizeof(float));
    w = up;
  }
  quantize_from(id, w);
  return Status::ok();
}

int64_t QuantizedLinears::storage_bytes() const {
  int64_t b = 0;
  for (const auto& s : slots_)
    b += s->qbuf.codes.size() + s->qbuf.scales.size() + 4 * s->qbuf.outer.size() + 2 * s->w_bits.size();
  for (const ExpertGroupStorage& g : groups_)
    b += g.qbuf.codes.size() + g.qbuf.scales.size() + 4 * g.qbuf.outer.size() + 2 * g.bits.size();
  return b;
}

int64_t QuantizedLinears::workspace_bytes() const {
  return 4 * (wd_.size() + upload_.size() + xs_.size() + xd_.size()) + xq_.codes.size() + xq_.scales.size() +
         4 * xq_.outer.size() + 2 * xb_.size();
}

int QuantizedLinears::first_waiting() const {
  for (size_t i = 0; i < slots_.size(); ++i)
    if (!slots_[i]->ready) return static_cast<int>(i);
  return -1;
}

const backend::QuantizedTensor& QuantizedLinears::quantized_weight(int id) const {
  NIB_CHECK(id >= 0 && id < static_cast<int>(slots_.size()));
  NIB_CHECK_MSG(mode_ != PrecisionMode::kBf16, "quantized_weight: the bf16 mode keeps no quantized weights");
  return slots_[id]->q;
}

Status QuantizedLinears::check_quantized(int id, const backend::QuantizedTensor& w) const {
  if (mode_ == PrecisionMode::kBf16)
    return invalid_argument("quantized weights: the bf16 mode keeps BF16 weights (use w4a16 or w4a4)");
  if (id < 0 || id >= static_cast<int>(infos_.size()))
    return invalid_argument("quantized weights: linear {} of {}", id, infos_.size());
  const model::LinearInfo& info = infos_[id];
  if (w.format != weight_format_)
    return invalid_argument("quantized weights: {} is {}, this engine's weights are {}", info.name,
                            backend::quant_format_name(w.format), backend::quant_format_name(weight_format_));
  if (w.rows != info.N || w.cols != info.K)
    return invalid_argument("quantized weights: {} is ({}, {}), the model's is ({}, {})", info.name, w.rows, w.cols,
                            info.N, info.K);
  if (!w.codes || !w.scales || !w.outer) return invalid_argument("quantized weights: {} has a null part", info.name);
  return Status::ok();
}

void QuantizedLinears::copy_quantized(int id, const backend::QuantizedTensor& w, Memory where) {
  using backend::QuantizedTensor;
  backend::Backend& be = *be_;
  Slot& slot = *slots_[id];
  const size_t cb = static_cast<size_t>(QuantizedTensor::code_bytes(w.format, w.rows, w.cols));
  const size_t sb = static_cast<size_t>(QuantizedTensor::scale_bytes(w.format, w.rows, w.cols));
  const size_t ob = static_cast<size_t>(4 * QuantizedTensor::outer_count(w.format, w.rows, w.cols));
  if (where == Memory::kHost) {
    be.copy_to_device(slot.q.codes, w.codes, cb);
    be.copy_to_device(slot.q.scales, w.scales, sb);
    be.copy_to_device(slot.q.outer, w.outer, ob);
  } else {
    be.copy(slot.q.codes, w.codes, cb);
    be.copy(slot.q.scales, w.scales, sb);
    be.copy(slot.q.outer, w.outer, ob);
  }
  if (!slot.ready) --waiting_;
  slot.ready = true;
}

Status QuantizedLinears::set_quantized_weight(int id, const backend::QuantizedTensor& w, Memory where) {
  NIB_RETURN_IF_ERROR(check_quantized(id, w));
  copy_quantized(id, w, where);
  return Status::ok();
}

Status QuantizedLinears::set_quantized_weights(const std::vector<backend::QuantizedTensor>& weights, Memory where) {
  if (mode_ == PrecisionMode::kBf16)
    return invalid_argument("quantized weights: the bf16 mode keeps BF16 weights (use w4a16 or w4a4)");
  if (weights.size() != infos_.size())
    return invalid_argument("quantized weights: {} given, the model has {} block linears", weights.size(),
                            infos_.size());
  for (size_t i = 0; i < weights.size(); ++i) NIB_RETURN_IF_ERROR(check_quantized(static_cast<int>(i), weights[i]));
  for (size_t i = 0; i < weights.size(); ++i) copy_quantized(static_cast<int>(i), weights[i], where);
  return Status::ok();
}

float* QuantizedLinears::dequantized_weight(backend::Backend& be, const backend::QuantizedTensor& q) {
  float* wd = wd_.ensure(be, q.rows * q.cols, "rollout weight scratch");
  be.dequantize(wd, q);
  return wd;
}

const float* QuantizedLinears::activation_operand(backend::Backend& be, const float* x, int64_t M, int64_t K,
                                                 const std::function<void(const backend::QuantizedTensor&)>& observe) {
  // the BF16 activation (zero rows pad the TE format's 16-row tiles)
  const int64_t Mp = mode_ == PrecisionMode::kW4A4 ? (M + 15) / 16 * 16 : M;
  float* xs = xs_.ensure(be, Mp * K, "rollout activation");
  be.round_to_bf16(xs, x, M * K);
  if (Mp > M) be.fill_zero(xs + M * K, static_cast<size_t>((Mp - M) * K) * sizeof(float));
  if (mode_ != PrecisionMode::kW4A4) return xs;
  backend::QuantizedTensor qx = xq_.view(be, act_format_, Mp, K);
  be.quantize(qx, xs);  // RTN, as the recipes' forward
  observe(qx);
  float* xd = xd_.ensure(be, Mp * K, "rollout dequantized activation");
  be.dequantize(xd, qx);
  return xd;
}

void QuantizedLinears::forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M,
                               const model::LinearInfo& info, const model::LinearCall& call) {
  NIB_CHECK(info.id >= 0 && info.id < static_cast<int>(slots_.size()));
  NIB_CHECK(M > 0 && info.N == infos_[info.id].N && info.K == infos_[info.id].K);
  NIB_CHECK_MSG(slots_[info.id]->ready, "rollout: linear {} has no weight yet", info.name);
  const int64_t N = info.N, K = info.K;
  Slot& s = *slots_[info.id];
  if (mode_ == PrecisionMode::kBf16) {  // BF16 bits of x against the weight's bits: exact products
    uint16_t* xb = xb_.ensure(be, M * K, "rollout BF16 activation");
    be.to_bf16_bits(xb, x, M * K);
    be.matmul_bf16_nt(y, xb, s.bits, M, N, K);
    return;
  }
  const float* a = activation_operand(be, x, M, K, [&](const backend::QuantizedTensor& qx) {
    if (observer_ != nullptr) observer_->on_quantized_activation(be, info, qx, M, call.token_of_row);
  });
  // The dequantized NVFP4 values carry FP32 scales (not BF16 numbers). Decode batches
  // (M <= kPackedGemmMaxRows) of two-level weights read the packed codes (the CUDA GEMV
  // dequantizes in registers; the CPU's is dequantize + matmul_nt, these very numbers).
  if (M <= kPackedGemmMaxRows && s.q.format == QuantFormat::kNvfp4TwoLevel &&
      K % 32 == 0 && be.supports(backend::Op::kNvfp4WeightGemm))
    be.matmul_nt_nvfp4_weight(y, a, s.q, M);
  else  // the dequantized weight, made for this call in the shared scratch
    be.matmul_nt(y, a, dequantized_weight(be, s.q), M, N, K, /*accumulate=*/false, /*operands_bf16=*/false);
  be.round_to_bf16(y, y, M * N);  // as the 4-bit recipes: the GEMM writes BF16
}

const QuantizedLinears::ExpertGroupStorage* QuantizedLinears::group_of(int id) const {
  if (id < 0 || id >= static_cast<int>(slots_.size()) || slots_[id]->group < 0) return nullptr;
  return &groups_[static_cast<size_t>(slots_[id]->group)];
}

bool QuantizedLinears::runs_experts_grouped(backend::Backend& be) const {
  if (!fused_moe_ || groups_.empty() || !be.supports(backend::Op::kGroupedGemm)) return false;  // + device plan
  if (mode_ == PrecisionMode::kBf16) return true;
  if (weight_format_ != QuantFormat::kNvfp4TwoLevel || !be.supports(backend::Op::kNvfp4WeightGemm)) return false;
  for (const ExpertGroupStorage& g : groups_)
    if (g.K % 32 != 0) return false;  // the packed GEMV's chunks
  return mode_ == PrecisionMode::kW4A16 || observer_ == nullptr || observer_->observes_experts_grouped(be);
}

void QuantizedLinears::forward_experts(backend::Backend& be, float* y, const float* x, int64_t rows,
                                       const model::LinearInfo* infos, int64_t E, const int64_t* offsets,
                                       const int32_t* token_of_row, const model::LinearCall& call) {
  NIB_CHECK(infos != nullptr && E > 0 && rows >= 0);
  const ExpertGroupStorage* g = group_of(infos[0].id);
  NIB_CHECK_MSG(g != nullptr && g->E == E && g->ids[0] == infos[0].id && g->ids[static_cast<size_t>(E - 1)] == infos[E - 1].id,
                "rollout: {} is not the first of a grouped expert part of {} experts", infos[0].name, E);
  for (int id : g->ids) NIB_CHECK_MSG(slots_[id]->ready, "rollout: linear {} has no weight yet", infos_[id].name);
  const int64_t N = g->N, K = g->K;
  if (rows == 0) return;
  if (mode_ == PrecisionMode::kBf16) {  // BF16 bits of every row against each expert's bits
    uint16_t* xb = xb_.ensure(be, rows * K, "rollout BF16 activation");
    be.to_bf16_bits(xb, x, rows * K);
    be.grouped_matmul_bf16_nt(y, xb, g->bits.data(), offsets, E, rows, N, K, N * K);
    return;
  }
  // w4a4 (two-level): each row quantized on its own, so every expert's rows get its own call's codes
  const float* a = activation_operand(be, x, rows, K, [&](const backend::QuantizedTensor& qx) {
    if (observer_ != nullptr) observer_->on_quantized_activation_experts(be, infos, E, qx, rows, offsets, token_of_row);
  });
  be.grouped_matmul_nt_nvfp4_weight(y, a, g->q0, offsets, E, rows);
  be.round_to_bf16(y, y, rows * N);  // as the 4-bit recipes: the GEMM writes BF16
}

}  // namespace nibble::rollout
