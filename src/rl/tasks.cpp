// The task registry (make_task, task_names) and the helpers every task shares: the per-instance
// Philox stream (tasks_internal.h), instance construction and number formatting. Adding a task:
// a tasks_<name>.cpp with its factory, a new Philox tag in tasks_internal.h, a line here.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"
#include "rl/task.h"
#include "rl/tasks_internal.h"

namespace nibble::rl {

PhiloxStream instance_stream(uint64_t tag, int level, uint64_t seed, int64_t index) {
  NIB_CHECK_MSG(level >= 0 && level < 256, "level {}", level);
  NIB_CHECK_MSG(index >= 0, "index {}", index);
  return PhiloxStream(seed, static_cast<uint64_t>(index), (tag << 40) | (static_cast<uint64_t>(level) << 32));
}

int64_t uniform_int(PhiloxStream& rng, int64_t lo, int64_t hi) {
  NIB_CHECK(lo <= hi);
  return lo + static_cast<int64_t>(rng.next_below(static_cast<uint64_t>(hi - lo) + 1));
}

int64_t power_of_ten(int digits) {
  NIB_CHECK(digits >= 0 && digits <= 18);
  int64_t p = 1;
  for (int d = 0; d < digits; ++d) p *= 10;
  return p;
}

TaskInstance make_instance(std::string prompt, std::string solution, std::string answer, int level, uint64_t seed,
                           int64_t index) {
  TaskInstance instance;
  instance.prompt = std::move(prompt);
  instance.solution = std::move(solution);
  instance.answer = std::move(answer);
  instance.level = level;
  instance.seed = seed;
  instance.index = index;
  return instance;
}

std::string join_numbers(const std::vector<int64_t>& numbers) {
  return fmt::format("{}", fmt::join(numbers, " "));
}

std::vector<std::string> task_names() { return {"arithmetic", "countdown", "sorting"}; }

Result<std::unique_ptr<Task>> make_task(std::string_view name) {
  if (name == "arithmetic") return make_arithmetic_task();
  if (name == "countdown") return make_countdown_task();
  if (name == "sorting") return make_sorting_task();
  return invalid_argument("unknown task '{}' (known: {})", name, fmt::join(task_names(), ", "));
}

}  // namespace nibble::rl
