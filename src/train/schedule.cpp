// Learning-rate schedules; see schedule.h for the formulas.
#include "train/schedule.h"

#include <cmath>
#include <numbers>

namespace nibble::train {

Result<ScheduleConfig> schedule_from_json(const nlohmann::json& j) {
  if (!j.is_object()) return invalid_argument("schedule: expected a JSON object, got {}", j.dump());
  ScheduleConfig c;
  try {
    for (const auto& [key, value] : j.items())
      if (key != "type" && key != "warmup_steps" && key != "final_lr_fraction" && key != "decay_fraction" &&
          key != "decay_shape")
        return invalid_argument("schedule: unknown key \"{}\"", key);
    if (!j.contains("type")) return invalid_argument("schedule: missing \"type\" (cosine, wsd or constant)");
    const std::string type = j.at("type").get<std::string>();
    if (type == "cosine") {
      c.type = ScheduleType::kCosine;
      c.final_lr_fraction = 0.1;
    } else if (type == "wsd") {
      c.type = ScheduleType::kWsd;
      c.final_lr_fraction = 0.0;
    } else if (type == "constant") {
      c.type = ScheduleType::kConstant;
    } else {
      return invalid_argument("schedule: unknown type \"{}\" (cosine, wsd or constant)", type);
    }
    if (j.contains("warmup_steps")) {
      const auto& w = j.at("warmup_steps");
      if (!w.is_number_integer() || w.get<int64_t>() < 0)
        return invalid_argument("schedule: warmup_steps must be an integer >= 0, got {}", w.dump());
      c.warmup_steps = w.get<int64_t>();
    }
    if (j.contains("final_lr_fraction")) {
      const auto& f = j.at("final_lr_fraction");
      if (!f.is_number() || !(f.get<double>() >= 0.0 && f.get<double>() <= 1.0))
        return invalid_argument("schedule: final_lr_fraction must be a number in [0, 1], got {}", f.dump());
      c.final_lr_fraction = f.get<double>();
    }
    if (j.contains("decay_fraction")) {
      const auto& d = j.at("decay_fraction");
      if (!d.is_number() || !(d.get<double>() > 0.0 && d.get<double>() <= 1.0))
        return invalid_argument("schedule: decay_fraction must be a number in (0, 1], got {}", d.dump());
      c.decay_fraction = d.get<double>();
    }
    if (j.contains("decay_shape")) {
      const std::string s = j.at("decay_shape").get<std::string>();
      if (s == "linear") c.decay_shape = DecayShape::kLinear;
      else if (s == "1-sqrt") c.decay_shape = DecayShape::kOneMinusSqrt;
      else return invalid_argument("schedule: decay_shape must be \"linear\" or \"1-sqrt\", got \"{}\"", s);
    }
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument("schedule: {}", e.what());
  }
  return c;
}

nlohmann::json schedule_to_json(const ScheduleConfig& c) {
  nlohmann::json j;
  j["type"] = c.type == ScheduleType::kCosine ? "cosine" : c.type == ScheduleType::kWsd ? "wsd" : "constant";
  j["warmup_steps"] = c.warmup_steps;
  if (c.type != ScheduleType::kConstant) j["final_lr_fraction"] = c.final_lr_fraction;
  if (c.type == ScheduleType::kWsd) {
    j["decay_fraction"] = c.decay_fraction;
    j["decay_shape"] = c.decay_shape == DecayShape::kLinear ? "linear" : "1-sqrt";
  }
  return j;
}

Result<LrSchedule> LrSchedule::create(const ScheduleConfig& c, double peak_lr, int64_t total_steps) {
  if (!(std::isfinite(peak_lr) && peak_lr > 0)) return invalid_argument("schedule: peak lr {} must be > 0", peak_lr);
  if (total_steps < 1) return invalid_argument("schedule: total steps {} must be >= 1", total_steps);
  if (c.warmup_steps < 0 || c.warmup_steps >= total_steps)
    return invalid_argument("schedule: warmup_steps {} must be in [0, total steps {})", c.warmup_steps, total_steps);
  if (!(c.final_lr_fraction >= 0 && c.final_lr_fraction <= 1))
    return invalid_argument("schedule: final_lr_fraction {} must be in [0, 1]", c.final_lr_fraction);
  LrSchedule s;
  s.config_ = c;
  s.peak_ = peak_lr;
  s.total_ = total_steps;
  s.decay_start_ = c.warmup_steps;
  if (c.type == ScheduleType::kWsd) {
    if (!(c.decay_fraction > 0 && c.decay_fraction <= 1))
      return invalid_argument("schedule: decay_fraction {} must be in (0, 1]", c.decay_fraction);
    const int64_t decay_steps = std::llround(c.decay_fraction * static_cast<double>(total_steps));
    s.decay_start_ = std::max<int64_t>(c.warmup_steps, total_steps - decay_steps);
  }
  return s;
}

double LrSchedule::lr(int64_t step) const {
  const int64_t W = config_.warmup_steps;
  if (step < 0) step = 0;
  if (step < W) return peak_ * static_cast<double>(step + 1) / static_cast<double>(W);
  const double f = config_.final_lr_fraction;
  const int64_t last = total_ - 1;
  auto progress = [&](int64_t begin) {  // 0 at `begin`, 1 at the last step
    if (last <= begin) return step >= begin ? 1.0 : 0.0;
    const double p = static_cast<double>(step - begin) / static_cast<double>(last - begin);
    return p < 0 ? 0.0 : (p > 1 ? 1.0 : p);
  };
  switch (config_.type) {
    case ScheduleType::kConstant:
      return peak_;
    case ScheduleType::kCosine: {
      const double p = progress(W);
      return peak_ * (f + (1.0 - f) * 0.5 * (1.0 + std::cos(std::numbers::pi * p)));
    }
    case ScheduleType::kWsd: {
      if (step < decay_start_) return peak_;
      const double q = progress(decay_start_);
      const double keep = config_.decay_shape == DecayShape::kLinear ? 1.0 - q : 1.0 - std::sqrt(q);
      return peak_ * (f + (1.0 - f) * keep);
    }
  }
  return peak_;
}

}  // namespace nibble::train
