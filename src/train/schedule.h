// Learning-rate schedules, all with a linear warmup: cosine decay to a final fraction of the
// peak (spec 02 §6: to 10% of peak, as OLMo-2), warmup-stable-decay (WSD; Hu et al. 2024,
// MiniCPM: constant at the peak, then a linear or 1-sqrt decay over the last fraction of
// training), and constant. Configured from JSON, e.g.
// {"type": "cosine", "warmup_steps": 100, "final_lr_fraction": 0.1}. Steps count from 0.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace nibble::train {

enum class ScheduleType { kCosine, kWsd, kConstant };
enum class DecayShape { kLinear, kOneMinusSqrt };

struct ScheduleConfig {
  ScheduleType type = ScheduleType::kCosine;
  int64_t warmup_steps = 0;
  double final_lr_fraction = 0.1;   // cosine and WSD: lr at the last step / peak
  double decay_fraction = 0.2;      // WSD: share of total steps spent decaying
  DecayShape decay_shape = DecayShape::kLinear;  // WSD: "linear" or "1-sqrt"
};

// Keys: "type" ("cosine" | "wsd" | "constant"), "warmup_steps" (>= 0), "final_lr_fraction"
// ([0, 1]; default 0.1 cosine, 0.0 wsd), "decay_fraction" (wsd, (0, 1]), "decay_shape" (wsd,
// "linear" | "1-sqrt"). Unknown keys and bad values are errors.
Result<ScheduleConfig> schedule_from_json(const nlohmann::json& j);
nlohmann::json schedule_to_json(const ScheduleConfig& c);

// A schedule bound to a run: peak learning rate and total number of optimizer steps.
class LrSchedule {
 public:
  // warmup_steps must be < total_steps; WSD's decay must fit after the warmup.
  static Result<LrSchedule> create(const ScheduleConfig& config, double peak_lr, int64_t total_steps);

  // The learning rate of step `step` (0-based):
  //   warmup (step < W):  peak * (step + 1) / W           (reaches the peak at step W-1)
  //   cosine (step >= W): p = (step - W) / (S - 1 - W) in [0, 1],
  //                       peak * (f + (1 - f) * (1 + cos(pi p)) / 2)   (peak at W, f*peak at S-1)
  //   wsd:                peak until D = S - round(decay_fraction * S) (at least W), then
  //                       q = (step - D) / (S - 1 - D): peak * (f + (1 - f) * (1 - q)) linear or
  //                       peak * (f + (1 - f) * (1 - sqrt(q))) for 1-sqrt   (f*peak at S-1)
  //   constant:           peak
  // Steps past the end keep the last value.
  double lr(int64_t step) const;

  const ScheduleConfig& config() const { return config_; }
  double peak_lr() const { return peak_; }
  int64_t total_steps() const { return total_; }
  int64_t decay_start() const { return decay_start_; }

 private:
  ScheduleConfig config_;
  double peak_ = 0;
  int64_t total_ = 0, decay_start_ = 0;
};

}  // namespace nibble::train
