// `nibble bench rl` (see rl_bench.h): each arm through run_rl on a fresh model, the warm-up step
// dropped, medians of the step-time split, and the trace-overhead / sync-byte summary.
#include "rl/rl_bench.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#include "core/check.h"

namespace nibble::rl {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

const RlBenchRow* find_arm(const std::vector<RlBenchRow>& rows, Arm a) {
  for (const RlBenchRow& r : rows)
    if (r.arm == a) return &r;
  return nullptr;
}

}  // namespace

json RlBenchRow::to_json() const {
  return json{{"bench", "rl"},
              {"arm", arm_name(arm)},
              {"timed_steps", timed_steps},
              {"rounds", rounds},
              {"step_s", step_seconds},
              {"rollout_s", rollout_seconds},
              {"logprob_s", logprob_seconds},
              {"moe_check_s", moe_check_seconds},
              {"train_s", train_seconds},
              {"sync_s", sync_seconds},
              {"other_s", other_seconds},
              {"rollout_tokens_per_s", rollout_tokens_per_s},
              {"train_tokens_per_s", train_tokens_per_s},
              {"response_len", response_len},
              {"sync_bytes", sync_bytes},
              {"sync_linear_bytes", sync_linear_bytes}};
}

json RlBenchSummary::to_json() const {
  return json{{"bench", "rl"},
              {"summary", true},
              {"trace_overhead", number_or_null(trace_overhead)},
              {"trace_overhead_goal", 0.08},
              {"sync_bytes_ratio", number_or_null(sync_bytes_ratio)},
              {"sync_linear_bytes_ratio", number_or_null(sync_linear_bytes_ratio)},
              {"sync_bytes_ratio_goal", 0.30}};
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

RlBenchSummary summarize_rl_bench(const std::vector<RlBenchRow>& rows) {
  RlBenchSummary s;
  const RlBenchRow *trace = find_arm(rows, Arm::kTrace), *naive = find_arm(rows, Arm::kFp4Naive),
                   *bf16 = find_arm(rows, Arm::kBf16Rollout);
  s.trace_overhead = trace && naive ? trace->step_seconds / naive->step_seconds - 1.0 : kNaN;
  // every arm but bf16-rollout syncs the same NVFP4 weights (w4a4): the first one listed
  const RlBenchRow* fp4 = nullptr;
  for (const RlBenchRow& r : rows)
    if (r.arm != Arm::kBf16Rollout && fp4 == nullptr) fp4 = &r;
  s.sync_bytes_ratio = fp4 && bf16 ? fp4->sync_bytes / bf16->sync_bytes : kNaN;
  s.sync_linear_bytes_ratio = fp4 && bf16 ? fp4->sync_linear_bytes / bf16->sync_linear_bytes : kNaN;
  return s;
}

Result<std::vector<RlBenchRow>> bench_rl(const RlBenchOptions& o, const Task& task,
                                         const std::function<void(const RlBenchRow&)>& on_row) {
  if (o.steps < 2) return invalid_argument("bench rl: --steps must be >= 2 (the first is a warm-up; got {})", o.steps);
  if (o.arms.empty()) return invalid_argument("bench rl: no arms");
  // the arms' run folders: under o.scratch_dir, else in a fresh temporary folder removed at the end
  struct OwnScratch {
    std::string path;
    ~OwnScratch() {
      std::error_code ec;
      if (!path.empty()) fs::remove_all(path, ec);
    }
  } own;
  std::string scratch = o.scratch_dir;
  if (scratch.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "nibble-bench-rl-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return io_error("bench rl: cannot create a temporary folder ({})", tmpl);
    own.path = scratch = tmpl;
  }
  if (o.rounds < 1) return invalid_argument("bench rl: --rounds must be >= 1 (got {})", o.rounds);
  // the distinct arms in order of first appearance; each one's timed steps over all rounds
  std::vector<Arm> arms;
  for (Arm a : o.arms)
    if (std::find(arms.begin(), arms.end(), a) == arms.end()) arms.push_back(a);
  std::vector<std::vector<RlStepMetrics>> timed(arms.size());
  std::vector<int64_t> rounds_of(arms.size(), 0);
  std::vector<RlBenchRow> rows;
  for (int64_t round = 0; round < o.rounds; ++round) {
    for (size_t ai = 0; ai < arms.size(); ++ai) {
      const Arm arm = arms[ai];
      json j = {{"model", o.model},
                {"arm", arm_name(arm)},
                {"task", task.name()},
                {"level", o.level},
                {"steps", o.steps},
                {"prompts_per_step", o.prompts_per_step},
                {"group_size", o.group_size},
                {"max_new_tokens", o.max_new_tokens}};
      NIB_ASSIGN_OR_RETURN(RlConfig cfg, parse_rl_config(j));
      const fs::path run = fs::path(scratch) / arm_name(arm);
      RlOptions ro;
      ro.run_dir = run.string();
      ro.backend = o.backend;
      ro.checkpoints = false;
      auto r = run_rl(cfg, task, ro);
      std::error_code ec;
      fs::remove_all(run, ec);
      if (!r) return Status(r.status().code(), fmt::format("bench rl: arm {}: {}", arm_name(arm), r.status().message()));
      const std::vector<RlStepMetrics>& steps = r->steps;
      NIB_CHECK_MSG(steps.size() >= 2, "bench rl: arm {} ran {} steps", arm_name(arm), steps.size());
      timed[ai].insert(timed[ai].end(), steps.begin() + 1, steps.end());  // the warm-up dropped
      ++rounds_of[ai];
      if (round + 1 < o.rounds) continue;
      const std::vector<RlStepMetrics>& t = timed[ai];
      auto med = [&](double RlStepMetrics::*field) {
        std::vector<double> v;
        for (const RlStepMetrics& m : t) v.push_back(m.*field);
        return median_of(std::move(v));
      };
      RlBenchRow row;
      row.arm = arm;
      row.timed_steps = static_cast<int64_t>(t.size());
      row.rounds = rounds_of[ai];
      row.step_seconds = med(&RlStepMetrics::step_seconds);
      row.rollout_seconds = med(&RlStepMetrics::rollout_seconds);
      row.logprob_seconds = med(&RlStepMetrics::logprob_seconds);
      row.moe_check_seconds = med(&RlStepMetrics::moe_check_seconds);
      row.train_seconds = med(&RlStepMetrics::train_seconds);
      row.sync_seconds = med(&RlStepMetrics::sync_seconds);
      row.other_seconds = med(&RlStepMetrics::other_seconds);
      row.rollout_tokens_per_s = med(&RlStepMetrics::rollout_tokens_per_s);
      row.train_tokens_per_s = med(&RlStepMetrics::train_tokens_per_s);
      row.response_len = med(&RlStepMetrics::response_len);
      row.sync_bytes = t.back().sync_bytes;
      row.sync_linear_bytes = t.back().sync_linear_bytes;
      if (on_row) on_row(row);
      rows.push_back(row);
    }
  }
  return rows;
}

}  // namespace nibble::rl
