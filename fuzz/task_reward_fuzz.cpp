// libFuzzer target for the RL tasks' reward parsing (rl/expression.h, rl/tasks_*.cpp): any byte
// string, read as a completion of an instance of any task and level, must score exactly 0 or 1
// without a crash, unbounded recursion, an out-of-bounds read (ASan) or undefined behaviour
// (UBSan, e.g. signed overflow in the rational arithmetic). Byte 0 picks the task and level,
// byte 1 the instance; the rest is the completion. Seeds in fuzz/corpus/task_reward_fuzz/.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "rl/expression.h"
#include "rl/task.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  static const auto tasks = [] {
    std::vector<std::unique_ptr<nibble::rl::Task>> all;
    for (const std::string& name : nibble::rl::task_names()) all.push_back(std::move(nibble::rl::make_task(name)).value());
    return all;
  }();
  const nibble::rl::Task& task = *tasks[data[0] % tasks.size()];
  int level = (data[0] / tasks.size()) % task.num_levels();
  nibble::rl::TaskInstance instance = task.make(level, 1, data[1]);
  std::string_view completion(reinterpret_cast<const char*>(data + 2), size - 2);
  double r = task.reward(instance, completion);
  if (r != 0.0 && r != 1.0) std::abort();
  // The evaluator alone: a value is in lowest terms with a positive denominator.
  auto parsed = nibble::rl::parse_expression(completion);
  if (parsed && (parsed->value.den <= 0 || parsed->literals.size() > completion.size())) std::abort();
  return 0;
}
