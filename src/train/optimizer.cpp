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

GradNorm global_grad_norm(const std::vector<ParamView>& params, double max_norm, float grad_scale) {
  double total = 0;
  for (const ParamView& p : params) {
    NIB_CHECK_MSG(p.numel >= 0 && (p.numel == 0 || p.grad), "param {}", p.name);
    const int64_t chunks = (p.numel + kChunk - 1) / kChunk;
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
    parallel_for(chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t b = c * kChunk, e = std::min(p.numel, b + kChunk);
        double s = 0;
        for (int64_t i = b; i < e; ++i) {
          const double g = static_cast<double>(p.grad[i] * grad_scale);
          s += g * g;
        }
        partial[c] = s;
      }
    });
    for (double s : partial) total += s;
  }
  GradNorm r;
  r.norm = std::sqrt(total);
  r.finite = std::isfinite(r.norm);
  if (max_norm > 0 && r.finite) {
    const double coef = max_norm / (r.norm + 1e-6);
    r.clip_scale = coef < 1.0 ? static_cast<float>(coef) : 1.0f;
  }
  return r;
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
  std::set<std::string> seen;
  for (const ParamView& p : params) {
    if (!seen.insert(p.name).second) return invalid_argument("adamw: parameter {} given twice", p.name);
    if (p.numel < 0 || (p.numel > 0 && (!p.value || !p.grad)))
      return invalid_argument("adamw: parameter {} has no data", p.name);
    auto it = state_.find(p.name);
    if (it != state_.end() && static_cast<int64_t>(it->second.m.size()) != p.numel)
      return invalid_argument("adamw: parameter {} has {} elements, its optimizer state {}", p.name, p.numel,
                              it->second.m.size());
  }
  const int64_t t = ++step_;
  // Scalars as PyTorch computes them (Python doubles), then used in f32 element arithmetic.
  const float decay = static_cast<float>(1.0 - lr * config_.weight_decay);
  const float one_minus_b1 = static_cast<float>(1.0 - config_.beta1);
  const float b2 = static_cast<float>(config_.beta2);
  const float one_minus_b2 = static_cast<float>(1.0 - config_.beta2);
  const double bc1 = 1.0 - std::pow(config_.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(config_.beta2, static_cast<double>(t));
  const float step_size = static_cast<float>(lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(config_.eps);
  for (const ParamView& p : params) {
    Moments& st = state_[p.name];
    if (st.m.empty() && p.numel > 0) {
      st.m.assign(static_cast<size_t>(p.numel), 0.0f);
      st.v.assign(static_cast<size_t>(p.numel), 0.0f);
    }
    float* w = p.value;
    const float* grad = p.grad;
    float* m = st.m.data();
    float* v = st.v.data();
    const bool wd = p.weight_decay && config_.weight_decay != 0.0;
    parallel_for(p.numel, kChunk, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float g = grad[i] * grad_scale;
        float wi = w[i];
        if (wd) wi = wi * decay;                         // param.mul_(1 - lr*wd)
        m[i] = m[i] + one_minus_b1 * (g - m[i]);         // exp_avg.lerp_(grad, 1-beta1)
        v[i] = v[i] * b2 + one_minus_b2 * (g * g);       // exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
        const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
        w[i] = wi + (-step_size) * (m[i] / denom);       // param.addcdiv_(m, denom, -step_size)
      }
    });
  }
  return Status::ok();
}

const std::vector<float>* AdamW::exp_avg(const std::string& name) const {
  auto it = state_.find(name);
  return it == state_.end() ? nullptr : &it->second.m;
}
const std::vector<float>* AdamW::exp_avg_sq(const std::string& name) const {
  auto it = state_.find(name);
  return it == state_.end() ? nullptr : &it->second.v;
}

std::vector<io::NamedTensor> AdamW::export_state() const {
  std::vector<io::NamedTensor> out;
  Tensor step(DType::kI64, {1});
  step.data<int64_t>()[0] = step_;
  out.push_back({"optimizer.step", step});
  for (const auto& [name, st] : state_) {
    const int64_t n = static_cast<int64_t>(st.m.size());
    Tensor m(DType::kF32, {n}), v(DType::kF32, {n});
    if (n > 0) {
      std::memcpy(m.data<float>(), st.m.data(), n * sizeof(float));
      std::memcpy(v.data<float>(), st.v.data(), n * sizeof(float));
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

  std::map<std::string, Moments> state;
  std::set<std::string> used = {"optimizer.step"};
  for (const ParamView& p : params) {
    Moments mo;
    for (int which = 0; which < 2; ++which) {
      const std::string key = "optimizer." + p.name + (which == 0 ? ".exp_avg" : ".exp_avg_sq");
      auto it = by_name.find(key);
      if (it == by_name.end()) return invalid_argument("optimizer state: missing {} for parameter {}", key, p.name);
      const Tensor& t = *it->second;
      if (t.dtype() != DType::kF32 || t.device() != Device::kCPU)
        return invalid_argument("optimizer state: {} must be F32 on the CPU (is {})", key, dtype_name(t.dtype()));
      if (t.numel() != p.numel)
        return invalid_argument("optimizer state: {} has {} elements, parameter {} has {}", key, t.numel(), p.name,
                                p.numel);
      std::vector<float>& dst = which == 0 ? mo.m : mo.v;
      dst.resize(static_cast<size_t>(p.numel));
      if (p.numel > 0) std::memcpy(dst.data(), t.data<float>(), p.numel * sizeof(float));
      used.insert(key);
    }
    state[p.name] = std::move(mo);
  }
  for (const auto& [name, t] : by_name)
    if (!used.count(name)) return invalid_argument("optimizer state: tensor {} matches no parameter", name);
  step_ = step;
  state_ = std::move(state);
  return Status::ok();
}

}  // namespace nibble::train
