// The "sorting" task: sort a list of non-negative integers ascending. Levels grow the list length
// and the digits (kLevels). Prompt "sort 5 3 9 1:", answer "1 3 5 9"; the reward is 1 when the
// completion's answer line, split at blanks, is exactly the sorted list of canonical integers,
// else 0 (docs/rl.md).
#include <algorithm>

#include "core/check.h"
#include "rl/expression.h"
#include "rl/tasks_internal.h"

namespace nibble::rl {
namespace {

struct SortingLevel {
  int count;
  int digits;  // each number is uniform in [0, 10^digits)
};
constexpr SortingLevel kLevels[] = {{3, 1}, {5, 1}, {5, 2}, {8, 2}, {12, 3}};
constexpr int kNumLevels = static_cast<int>(std::size(kLevels));

// The blank-separated words of `line`.
std::vector<std::string_view> words(std::string_view line) {
  std::vector<std::string_view> out;
  size_t pos = 0;
  while (pos < line.size()) {
    while (pos < line.size() && (line[pos] == ' ' || line[pos] == '\t')) ++pos;
    size_t end = pos;
    while (end < line.size() && line[end] != ' ' && line[end] != '\t') ++end;
    if (end > pos) out.push_back(line.substr(pos, end - pos));
    pos = end;
  }
  return out;
}

class SortingTask final : public Task {
 public:
  std::string name() const override { return "sorting"; }
  int num_levels() const override { return kNumLevels; }

  TaskInstance make(int level, uint64_t seed, int64_t index) const override {
    NIB_CHECK_MSG(level >= 0 && level < kNumLevels, "sorting level {} (0..{})", level, kNumLevels - 1);
    const SortingLevel& spec = kLevels[level];
    PhiloxStream rng = instance_stream(kSortingTag, level, seed, index);
    const int64_t limit = power_of_ten(spec.digits);
    std::vector<int64_t> numbers;
    for (int i = 0; i < spec.count; ++i) numbers.push_back(uniform_int(rng, 0, limit - 1));
    std::string prompt = "sort " + join_numbers(numbers) + ":";
    std::sort(numbers.begin(), numbers.end());
    const std::string answer = join_numbers(numbers);
    return make_instance(std::move(prompt), answer, answer, level, seed, index);
  }

  double reward(const TaskInstance& instance, std::string_view completion) const override {
    std::string_view line = answer_line(completion);
    if (line.size() > kMaxExpressionBytes) return 0.0;
    std::vector<std::string_view> got = words(line), want = words(instance.answer);
    if (got != want) return 0.0;
    for (std::string_view w : got)
      if (!is_canonical_integer(w) || w.front() == '-') return 0.0;
    return 1.0;
  }
};

}  // namespace

std::unique_ptr<Task> make_sorting_task() { return std::make_unique<SortingTask>(); }

}  // namespace nibble::rl
