// AdamW, global gradient-norm clipping and accumulation helpers; see optimizer.h.
#include "train/optimizer.h"

#include <cmath>
#include <cstring>
#include <set>

#include "core/check.h"
#include "core/parallel.h"

namespace nibble::train {

namespace {
constexpr int64_t kChunk = 1 << 16;  // elements per thread task and per partial norm sum
}

Status validate(const AdamWConfig& c) {
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return invalid_argument("adamw: beta1 {} must be in [0, 1)", c.beta1);
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return invalid_argument("adamw: beta2 {} must be in [0, 1)", c.beta2);
  if (!(c.eps > 0)) return invalid_argument("adamw: eps {} must be > 0", c.eps);
  if (!(c.weight_decay >= 0)) return invalid_argument("adamw: weight_decay {} must be >= 0", c.weight_decay);
  return Status::ok();
}

double grad_sum_squares(const std::vector<ParamView>& params, float grad_scale, backend::Backend& be) {
  // One sum per fixed chunk of each parameter (one call, one round trip for all), added here in
  // order: the same total on every backend and thread count.
  std::vector<const float*> grads;
  std::vector<int64_t> numels;
  int64_t pieces = 0;
  for (const ParamView& p : params) {
    NIB_CHECK_MSG(p.numel >= 0 && (p.numel == 0 || p.grad), "param {}", p.name);
    grads.push_back(p.grad), numels.push_back(p.numel);
    pieces += (p.numel + kChunk - 1) / kChunk;
  }
  std::vector<double> partial(static_cast<size_t>(pieces));
  be.sum_squares_chunks_multi(partial.data(), grads.data(), numels.data(), static_cast<int64_t>(params.size()), kChunk,
                              grad_scale);
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

GradNorm grad_norm_from_sum_squares(double sum_squares, double max_norm) {
  GradNorm r;
  r.norm = std::sqrt(sum_squares);
  r.finite = std::isfinite(r.norm);
  if (max_norm > 0 && r.finite) {
    const double coef = max_norm / (r.norm + 1e-6);
    r.clip_scale = coef < 1.0 ? static_cast<float>(coef) : 1.0f;
  }
  return r;
}

GradNorm global_grad_norm(const std::vector<ParamView>& params, double max_norm, float grad_scale,
                          backend::Backend& be) {
  return grad_norm_from_sum_squares(grad_sum_squares(params, grad_scale, be), max_norm);
}

void accumulate_grad(float* acc, const float* g, int64_t n) {
  parallel_for(n, kChunk, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) acc[i] += g[i];
  });
}

void scale_grad(float* g, int64_t n, float s) {
  parallel_for(n, kChunk, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) g[i] *= s;
  });
}

Status AdamW::step(const std::vector<ParamView>& params, double lr, float grad_scale) {
  NIB_RETURN_IF_ERROR(validate(config_));
  if (!std::isfinite(lr) || lr < 0) return invalid_argument("adamw: learning rate {} must be finite and >= 0", lr);
  std::set<Key> seen;
  for (const ParamView& p : params) {
    if (!seen.insert({p.name, p.offset}).second) return invalid_argument("adamw: parameter {} given twice", p.name);
    if (p.numel < 0 || (p.numel > 0 && (!p.value || !p.grad)))
      return invalid_argument("adamw: parameter {} has no data", p.name);
    if (p.offset < 0 || p.offset + p.numel > p.parameter_numel())
      return invalid_argument("adamw: slice [{}, {}) outside parameter {} of {} elements", p.offset,
                              p.offset + p.numel, p.name, p.parameter_numel());
    auto it = state_.find({p.name, p.offset});
    if (it != state_.end() && (it->second.numel != p.numel || it->second.full_numel != p.parameter_numel()))
      return invalid_argument("adamw: parameter {} has {} elements, its optimizer state {}", p.name, p.numel,
                              it->second.numel);
  }
  backend::AdamWStep hp;  // the backend computes PyTorch's scalars from these (see AdamWStep)
  hp.lr = lr;
  hp.beta1 = config_.beta1;
  hp.beta2 = config_.beta2;
  hp.eps = config_.eps;
  hp.step = ++step_;
  hp.grad_scale = grad_scale;
  hp.weight_decay = config_.weight_decay;  // where the parameter has weight decay
  ranges_.clear();
  for (const ParamView& p : params) {
    auto [it, fresh] = state_.try_emplace(Key{p.name, p.offset});
    Moments& st = it->second;
    if (fresh) {
      st.numel = p.numel;
      st.full_numel = p.parameter_numel();
      const size_t bytes = static_cast<size_t>(p.numel) * sizeof(float);
      be_->fill_zero(st.m.ensure(*be_, p.numel, "AdamW exp_avg"), bytes);
      be_->fill_zero(st.v.ensure(*be_, p.numel, "AdamW exp_avg_sq"), bytes);
    }
    if (p.numel == 0) continue;
    ranges_.push_back(backend::AdamWRange{p.value, st.m.data(), st.v.data(), p.grad, p.numel, p.weight_decay});
  }
  be_->adamw_update_multi(ranges_.data(), static_cast<int64_t>(ranges_.size()), hp);  // one call for all
  return Status::ok();
}

const std::vector<float>* AdamW::host_copy(const Key& key, bool second) const {
  auto it = state_.find(key);
  if (it == state_.end()) return nullptr;
  std::vector<float>& h = (second ? host_v_ : host_m_)[key];
  h.resize(static_cast<size_t>(it->second.numel));
  const backend::Buffer<float>& b = second ? it->second.v : it->second.m;
  if (!h.empty()) be_->copy_to_host(h.data(), b.data(), h.size() * sizeof(float));
  return &h;
}
const std::vector<float>* AdamW::exp_avg(const std::string& name, int64_t offset) const {
  return host_copy({name, offset}, false);
}
const std::vector<float>* AdamW::exp_avg_sq(const std::string& name, int64_t offset) const {
  return host_copy({name, offset}, true);
}

const float* AdamW::moment_data(const std::string& name, int64_t offset, bool second) const {
  auto it = state_.find({name, offset});
  if (it == state_.end() || it->second.numel == 0) return nullptr;
  return second ? it->second.v.data() : it->second.m.data();
}

int64_t AdamW::moment_elems() const {
  int64_t n = 0;
  for (const auto& [key, st] : state_) n += st.numel;
  return n;
}

std::vector<io::NamedTensor> AdamW::export_state() const {
  std::vector<io::NamedTensor> out;
  Tensor step(DType::kI64, {1});
  step.data<int64_t>()[0] = step_;
  out.push_back({"optimizer.step", step});
  for (const auto& [key, st] : state_) {
    const std::string& name = key.first;
    NIB_CHECK_MSG(key.second == 0 && st.numel == st.full_numel,
                  "adamw export_state: {} holds a slice (ZeRO-1 state is exported by Zero1::gather_state)", name);
    const int64_t n = st.numel;
    Tensor m(DType::kF32, {n}), v(DType::kF32, {n});
    if (n > 0) {
      be_->copy_to_host(m.data<float>(), st.m.data(), n * sizeof(float));
      be_->copy_to_host(v.data<float>(), st.v.data(), n * sizeof(float));
    }
    out.push_back({"optimizer." + name + ".exp_avg", m});
    out.push_back({"optimizer." + name + ".exp_avg_sq", v});
  }
  return out;
}

Status AdamW::import_state(const std::vector<io::NamedTensor>& tensors, const std::vector<ParamView>& params) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& t : tensors) {
    if (!by_name.emplace(t.name, &t.tensor).second)
      return invalid_argument("optimizer state: tensor {} appears twice", t.name);
  }
  auto step_it = by_name.find("optimizer.step");
  if (step_it == by_name.end()) return invalid_argument("optimizer state: missing optimizer.step");
  const Tensor& st = *step_it->second;
  if (st.dtype() != DType::kI64 || st.numel() != 1 || st.device() != Device::kCPU)
    return invalid_argument("optimizer state: optimizer.step must be one I64 on the CPU");
  const int64_t step = st.data<int64_t>()[0];
  if (step < 0) return invalid_argument("optimizer state: negative step {}", step);

  std::map<Key, Moments> state;
  std::set<std::string> used = {"optimizer.step"};
  for (const ParamView& p : params) {
    if (p.numel < 0 || p.offset < 0 || p.offset + p.numel > p.parameter_numel())
      return invalid_argument("optimizer state: slice [{}, {}) outside parameter {} of {} elements", p.offset,
                              p.offset + p.numel, p.name, p.parameter_numel());
    Moments mo;
    mo.numel = p.numel;
    mo.full_numel = p.parameter_numel();
    for (int which = 0; which < 2; ++which) {
      const std::string key = "optimizer." + p.name + (which == 0 ? ".exp_avg" : ".exp_avg_sq");
      auto it = by_name.find(key);
      if (it == by_name.end()) return invalid_argument("optimizer state: missing {} for parameter {}", key, p.name);
      const Tensor& t = *it->second;
      if (t.dtype() != DType::kF32 || t.device() != Device::kCPU)
        return invalid_argument("optimizer state: {} must be F32 on the CPU (is {})", key, dtype_name(t.dtype()));
      if (t.numel() != p.parameter_numel())
        return invalid_argument("optimizer state: {} has {} elements, parameter {} has {}", key, t.numel(), p.name,
                                p.parameter_numel());
      backend::Buffer<float>& dst = which == 0 ? mo.m : mo.v;
      float* d = dst.ensure(*be_, p.numel, which == 0 ? "AdamW exp_avg" : "AdamW exp_avg_sq");
      if (p.numel > 0) be_->copy_to_device(d, t.data<float>() + p.offset, p.numel * sizeof(float));
      used.insert(key);
    }
    if (!state.emplace(Key{p.name, p.offset}, std::move(mo)).second)
      return invalid_argument("optimizer state: parameter {} given twice", p.name);
  }
  for (const auto& [name, t] : by_name)
    if (!used.count(name)) return invalid_argument("optimizer state: tensor {} matches no parameter", name);
  step_ = step;
  state_ = std::move(state);
  return Status::ok();
}

}  // namespace nibble::train
