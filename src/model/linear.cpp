// LinearRecipe registry, RecipeConfig parsing and the fp32 / bf16 reference recipes (see
// linear.h).
#include "model/linear.h"

#include <algorithm>
#include <mutex>

#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"

namespace nibble::model {

const char* linear_kind_name(LinearKind k) {
  switch (k) {
    case LinearKind::kQkv: return "qkv";
    case LinearKind::kAttnOut: return "attn_out";
    case LinearKind::kGateUp: return "gate_up";
    case LinearKind::kDown: return "down";
    case LinearKind::kExpertGateUp: return "expert_gate_up";
    case LinearKind::kExpertDown: return "expert_down";
    case LinearKind::kSharedGateUp: return "shared_gate_up";
    case LinearKind::kSharedDown: return "shared_down";
  }
  return "?";
}

// ---- RecipeConfig ------------------------------------------------------------------------------
namespace {

template <typename V>
Status read_field(const nlohmann::json& j, const char* key, const std::string& path, V& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::ok();
  if constexpr (std::is_same_v<V, bool>) {
    if (!it->is_boolean()) return invalid_argument("recipe config: field '{}{}' must be true or false", path, key);
  } else if constexpr (std::is_same_v<V, int64_t>) {
    if (!it->is_number_integer()) return invalid_argument("recipe config: field '{}{}' must be an integer", path, key);
  } else if constexpr (std::is_same_v<V, double>) {
    if (!it->is_number()) return invalid_argument("recipe config: field '{}{}' must be a number", path, key);
  } else {
    if (!it->is_string()) return invalid_argument("recipe config: field '{}{}' must be a string", path, key);
  }
  out = it->get<V>();
  return Status::ok();
}

Status only_keys(const nlohmann::json& j, const std::string& path, std::initializer_list<const char*> keys) {
  if (!j.is_object()) return invalid_argument("recipe config: field '{}' must be an object", path.empty() ? "<root>" : path);
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : keys) known |= it.key() == k;
    if (!known) return invalid_argument("recipe config: unknown field '{}{}'", path, it.key());
  }
  return Status::ok();
}

}  // namespace

Result<RecipeConfig> parse_recipe_config(const nlohmann::json& j) {
  RecipeConfig c;
  if (j.is_string()) {
    c.name = j.get<std::string>();
    c.raw = nlohmann::json{{"name", c.name}};
    return c;
  }
  NIB_RETURN_IF_ERROR(only_keys(j, "", {"name", "alignment", "sr", "outcontrol", "oscireset", "bf16_last_blocks"}));
  c.raw = j;
  auto nit = j.find("name");
  if (nit == j.end() || !nit->is_string()) return invalid_argument("recipe config: missing field 'name' (a string)");
  c.name = nit->get<std::string>();
  NIB_RETURN_IF_ERROR(read_field(j, "alignment", "", c.alignment));
  NIB_RETURN_IF_ERROR(read_field(j, "sr", "", c.sr));
  NIB_RETURN_IF_ERROR(read_field(j, "bf16_last_blocks", "", c.bf16_last_blocks));
  if (c.bf16_last_blocks < 0) return invalid_argument("recipe config: field 'bf16_last_blocks' must be >= 0");
  if (auto it = j.find("outcontrol"); it != j.end()) {
    NIB_RETURN_IF_ERROR(only_keys(*it, "outcontrol.", {"rht", "outliers"}));
    NIB_RETURN_IF_ERROR(read_field(*it, "rht", "outcontrol.", c.rht));
    if (auto ot = it->find("outliers"); ot != it->end()) {
      if (ot->is_boolean()) {
        c.outliers.enabled = ot->get<bool>();
      } else {
        const std::string p = "outcontrol.outliers.";
        NIB_RETURN_IF_ERROR(only_keys(*ot, p, {"enabled", "fraction", "round_to", "calibration_start", "calibration_end"}));
        c.outliers.enabled = true;
        NIB_RETURN_IF_ERROR(read_field(*ot, "enabled", p, c.outliers.enabled));
        NIB_RETURN_IF_ERROR(read_field(*ot, "fraction", p, c.outliers.fraction));
        NIB_RETURN_IF_ERROR(read_field(*ot, "round_to", p, c.outliers.round_to));
        NIB_RETURN_IF_ERROR(read_field(*ot, "calibration_start", p, c.outliers.calibration_start));
        NIB_RETURN_IF_ERROR(read_field(*ot, "calibration_end", p, c.outliers.calibration_end));
      }
      if (!(c.outliers.fraction >= 0 && c.outliers.fraction <= 1))
        return invalid_argument("recipe config: field 'outcontrol.outliers.fraction' must be in [0, 1]");
      if (c.outliers.round_to < 1) return invalid_argument("recipe config: field 'outcontrol.outliers.round_to' must be >= 1");
      if (c.outliers.calibration_start < 0 || c.outliers.calibration_end < c.outliers.calibration_start)
        return invalid_argument("recipe config: field 'outcontrol.outliers.calibration_end' must be >= calibration_start >= 0");
    }
  }
  if (auto it = j.find("oscireset"); it != j.end()) {
    if (it->is_boolean()) {
      c.oscireset.enabled = it->get<bool>();
    } else {
      const std::string p = "oscireset.";
      NIB_RETURN_IF_ERROR(only_keys(*it, p, {"enabled", "threshold", "window", "period", "start_step", "start_fraction",
                                             "variant", "tracked_fraction"}));
      c.oscireset.enabled = true;
      auto& o = c.oscireset;
      NIB_RETURN_IF_ERROR(read_field(*it, "enabled", p, o.enabled));
      NIB_RETURN_IF_ERROR(read_field(*it, "threshold", p, o.threshold));
      NIB_RETURN_IF_ERROR(read_field(*it, "window", p, o.window));
      NIB_RETURN_IF_ERROR(read_field(*it, "period", p, o.period));
      NIB_RETURN_IF_ERROR(read_field(*it, "start_step", p, o.start_step));
      NIB_RETURN_IF_ERROR(read_field(*it, "start_fraction", p, o.start_fraction));
      NIB_RETURN_IF_ERROR(read_field(*it, "variant", p, o.variant));
      NIB_RETURN_IF_ERROR(read_field(*it, "tracked_fraction", p, o.tracked_fraction));
      if (!(o.threshold > 0)) return invalid_argument("recipe config: field 'oscireset.threshold' must be > 0");
      if (o.window < 1) return invalid_argument("recipe config: field 'oscireset.window' must be >= 1");
      if (o.period <= o.window) return invalid_argument("recipe config: field 'oscireset.period' must be > window");
      if (!(o.start_fraction >= 0 && o.start_fraction <= 1))
        return invalid_argument("recipe config: field 'oscireset.start_fraction' must be in [0, 1]");
      if (o.variant != "full" && o.variant != "tracked")
        return invalid_argument("recipe config: field 'oscireset.variant' must be \"full\" or \"tracked\"");
      if (!(o.tracked_fraction > 0 && o.tracked_fraction <= 1))
        return invalid_argument("recipe config: field 'oscireset.tracked_fraction' must be in (0, 1]");
    }
  }
  return c;
}

nlohmann::json RecipeConfig::to_json() const {
  nlohmann::json j;
  j["name"] = name;
  j["alignment"] = alignment;
  j["sr"] = sr;
  j["outcontrol"] = {{"rht", rht},
                     {"outliers", {{"enabled", outliers.enabled}, {"fraction", outliers.fraction},
                                   {"round_to", outliers.round_to}, {"calibration_start", outliers.calibration_start},
                                   {"calibration_end", outliers.calibration_end}}}};
  j["oscireset"] = {{"enabled", oscireset.enabled}, {"threshold", oscireset.threshold}, {"window", oscireset.window},
                    {"period", oscireset.period}, {"start_step", oscireset.start_step},
                    {"start_fraction", oscireset.start_fraction}, {"variant", oscireset.variant},
                    {"tracked_fraction", oscireset.tracked_fraction}};
  j["bf16_last_blocks"] = bf16_last_blocks;
  return j;
}

// ---- registry -----------------------------------------------------------------------------------
// linear_registry.cpp: calls add(name, factory) for each built-in recipe.
void register_builtin_linear_recipes(const std::function<void(const std::string&, LinearRecipeFactory)>& add);

namespace {
struct Registry {
  std::mutex mu;
  std::map<std::string, LinearRecipeFactory> factories;
};
// The registry with the built-ins in it (added once, before any other registration).
Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    register_builtin_linear_recipes(
        [reg](const std::string& name, LinearRecipeFactory f) { reg->factories[name] = std::move(f); });
    return reg;
  }();
  return *r;
}
}  // namespace

void register_linear_recipe(const std::string& name, LinearRecipeFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[name] = std::move(factory);
}

std::vector<std::string> linear_recipe_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (auto& [k, v] : r.factories) names.push_back(k);
  return names;
}

bool has_linear_recipe(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.factories.count(name) > 0;
}

Result<std::unique_ptr<LinearRecipe>> make_linear_recipe(const RecipeConfig& config, const LinearInfo& info) {
  LinearRecipeFactory f;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(config.name);
    if (it == r.factories.end()) {
      std::string names;
      for (auto& [k, v] : r.factories) names += (names.empty() ? "" : ", ") + k;
      return invalid_argument("recipe config: unknown recipe '{}' (known: {})", config.name, names);
    }
    f = it->second;
  }
  return f(config, info);
}

// ---- LinearWorkspace ----------------------------------------------------------------------------
uint8_t* LinearWorkspace::slot_bytes(backend::Backend& be, int slot, int64_t bytes, const char* what) {
  NIB_CHECK_MSG(slot >= 0 && slot < kSlots, "linear workspace: slot {} out of range [0, {})", slot, kSlots);
  return slots_[slot].ensure(be, bytes, what);
}

backend::QuantizedTensor LinearWorkspace::quantized(backend::Backend& be, int slot, backend::QuantFormat format,
                                                    int64_t rows, int64_t cols) {
  NIB_CHECK_MSG(slot >= 0 && slot < kQuantSlots, "linear workspace: quantized slot {} out of range [0, {})", slot,
                kQuantSlots);
  return quant_[slot].view(be, format, rows, cols);
}

int64_t LinearWorkspace::bytes() const {
  int64_t n = 0;
  for (const auto& s : slots_) n += s.size();
  for (const auto& q : quant_)
    n += q.codes.size() + q.scales.size() + q.outer.size() * static_cast<int64_t>(sizeof(float));
  return n;
}

// ---- all experts of a layer: the per-expert loop -------------------------------------------------
const int64_t* expert_offsets_host(backend::Backend& be, const ExpertGroup& g, std::vector<int64_t>& copy) {
  if (g.offsets_host != nullptr) return g.offsets_host;
  NIB_CHECK_MSG(g.offsets != nullptr, "experts: no offsets");
  copy.resize(static_cast<size_t>(g.E + 1));
  be.copy_to_host(copy.data(), g.offsets, copy.size() * sizeof(int64_t));
  return copy.data();
}

bool ExpertRowPlan::build(backend::Backend& be, const ExpertGroup& group, int64_t multiple, LinearWorkspace& ws) {
  if (!be.supports(backend::Op::kGroupedGemm) || group.E == 0) return false;
  std::vector<int64_t> copy;
  const int64_t* o = expert_offsets_host(be, group, copy);
  E = group.E;
  host_.assign(static_cast<size_t>(2 * (E + 1)), 0);
  int64_t* h_off = host_.data();
  int64_t* h_pad = h_off + E + 1;
  std::copy(o, o + E + 1, h_off);
  max_rows = max_padded = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = h_off[e + 1] - h_off[e], padded = (rows + multiple - 1) / multiple * multiple;
    NIB_CHECK_MSG(rows >= 0, "experts: offsets decrease at expert {}", e);
    h_pad[e + 1] = h_pad[e] + padded;
    max_rows = std::max(max_rows, rows), max_padded = std::max(max_padded, padded);
  }
  int64_t* dev = ws.get<int64_t>(be, LinearWorkspace::kSlots - 1, 2 * (E + 1), "experts: offsets");
  be.copy_to_device(dev, host_.data(), host_.size() * sizeof(int64_t));  // both arrays in one copy
  off = h_off, pad = h_pad, off_dev = dev, pad_dev = dev + E + 1;
  return true;
}

void LinearRecipe::forward_experts(backend::Backend& be, float* y, const float* x, const float* w, int64_t N,
                                   int64_t K, const ExpertGroup& group) {
  std::vector<int64_t> copy;
  const int64_t* off = expert_offsets_host(be, group, copy);
  for (int64_t e = 0; e < group.E; ++e) {
    const int64_t r0 = off[e], rows = off[e + 1] - r0;
    if (rows == 0) continue;  // no call: quantized recipes never see empty GEMMs
    LinearCall call = group.calls[e];
    if (group.token_of_row != nullptr) call.token_of_row = group.token_of_row + r0;
    group.recipes[e]->forward(be, y + r0 * N, x + r0 * K, w + e * group.w_stride, rows, N, K, call);
  }
}

void LinearRecipe::backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t N,
                                    int64_t K, const ExpertGroup& group) {
  std::vector<int64_t> copy;
  const int64_t* off = expert_offsets_host(be, group, copy);
  for (int64_t e = 0; e < group.E; ++e) {
    const int64_t r0 = off[e], rows = off[e + 1] - r0;
    if (rows == 0) continue;
    group.recipes[e]->backward(be, dx + r0 * K, dw + e * group.w_stride, dy + r0 * N, rows, N, K, group.calls[e]);
  }
}

// ---- fp32 -------------------------------------------------------------------------------------
void Fp32LinearRecipe::forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N,
                               int64_t K, const LinearCall& call) {
  be.matmul_nt(y, x, w, M, N, K);
  x_ = x;
  w_ = w;
}

void Fp32LinearRecipe::backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N,
                                int64_t K, const LinearCall& call) {
  NIB_CHECK_MSG(x_ && w_, "fp32 linear: backward without a forward");
  be.matmul_nn(dx, dy, w_, M, K, N);                       // dx (M,K) = dy (M,N) . w (N,K)
  be.matmul_tn(dw, dy, x_, N, K, M, /*accumulate=*/true);  // dw (N,K) += dy^T . x
}

// ---- bf16 -------------------------------------------------------------------------------------
void round_to_bf16_array(float* dst, const float* src, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = round_to_bf16(src[i]);
  });
}

// x and w are saved as BF16 bits for the backward; dY's bits are transient (workspace slot 0).
void Bf16LinearRecipe::forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M, int64_t N,
                               int64_t K, const LinearCall& call) {
  uint16_t* xb = xb_.ensure(be, M * K, "bf16 linear: saved x");
  uint16_t* wb = wb_.ensure(be, N * K, "bf16 linear: saved w");
  be.to_bf16_bits(xb, x, M * K);
  be.to_bf16_bits(wb, w, N * K);
  be.matmul_bf16_nt(y, xb, wb, M, N, K);
}

void Bf16LinearRecipe::backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M, int64_t N,
                                int64_t K, const LinearCall& call) {
  NIB_CHECK_MSG(xb_.data() != nullptr && wb_.data() != nullptr && xb_.size() >= M * K && wb_.size() >= N * K,
                "bf16 linear: backward without a matching forward");
  uint16_t* dyb = workspace(call).get<uint16_t>(be, 0, M * N, "bf16 linear: BF16 dY");
  be.to_bf16_bits(dyb, dy, M * N);
  be.matmul_bf16_nn(dx, dyb, wb_.data(), M, K, N);                                     // dx (M,K) = dy . w
  be.matmul_bf16_tn(dw, dyb, xb_.data(), N, K, M, /*alpha=*/nullptr, /*accumulate=*/true);  // dw += dy^T . x
}

// Grouped: the bits of x (rows,K) and of the whole span of the E experts' weights (strided: the
// span also holds the other linears of each expert, converted and unused) are made once, saved
// for the backward; one grouped GEMM per product. Bits equal the per-expert recipe's (same
// roundings, same per-group GEMMs on the CPU backend).
bool Bf16LinearRecipe::runs_experts_grouped(backend::Backend& be) const { return be.supports(backend::Op::kGroupedGemm); }

void Bf16LinearRecipe::forward_experts(backend::Backend& be, float* y, const float* x, const float* w, int64_t N,
                                       int64_t K, const ExpertGroup& group) {
  if (!runs_experts_grouped(be) || group.offsets == nullptr || group.E == 0)
    return LinearRecipe::forward_experts(be, y, x, w, N, K, group);
  const int64_t span = (group.E - 1) * group.w_stride + N * K;
  uint16_t* xb = xb_.ensure(be, group.rows * K, "bf16 experts: saved x");
  uint16_t* wb = wb_.ensure(be, span, "bf16 experts: saved w");
  be.to_bf16_bits(xb, x, group.rows * K);
  be.to_bf16_bits(wb, w, span);
  be.grouped_matmul_bf16_nt(y, xb, wb, group.offsets, group.E, group.rows, N, K, group.w_stride);
  grouped_rows_ = group.rows, grouped_E_ = group.E, grouped_stride_ = group.w_stride;
}

void Bf16LinearRecipe::backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t N,
                                        int64_t K, const ExpertGroup& group) {
  if (!runs_experts_grouped(be) || group.offsets == nullptr || group.E == 0)
    return LinearRecipe::backward_experts(be, dx, dw, dy, N, K, group);
  NIB_CHECK_MSG(grouped_rows_ == group.rows && grouped_E_ == group.E && grouped_stride_ == group.w_stride &&
                    xb_.data() != nullptr && wb_.data() != nullptr,
                "bf16 experts: backward without a matching forward_experts");
  uint16_t* dyb = workspace(group.calls[0]).get<uint16_t>(be, 0, group.rows * N, "bf16 experts: BF16 dY");
  be.to_bf16_bits(dyb, dy, group.rows * N);
  // dx_g (rows_g,K) = dy_g (rows_g,N) . w_g (N,K); dw_g (N,K) += dy_g^T . x_g
  be.grouped_matmul_bf16_nn(dx, dyb, wb_.data(), group.offsets, group.E, group.rows, K, N, group.w_stride);
  be.grouped_matmul_bf16_tn(dw, dyb, xb_.data(), group.offsets, group.E, group.rows, N, K, group.w_stride,
                            /*alpha=*/nullptr, /*accumulate=*/true);
}

}  // namespace nibble::model
