// The "arithmetic" task: integer expressions of + - * over multi-digit operands, evaluated with
// the usual precedence (* before + and -, left to right). Levels grow the operand count, the
// digits and the operator set (kLevels). Prompt "12+34*5=", answer the canonical integer "182"
// (negative results keep their '-'); the reward is 1 when the completion's answer line is exactly
// that integer, else 0 (docs/rl.md).
#include <fmt/format.h>

#include "core/check.h"
#include "rl/expression.h"
#include "rl/tasks_internal.h"

namespace nibble::rl {
namespace {

struct ArithmeticLevel {
  int operands;
  int digits;        // each operand is uniform in [0, 10^digits)
  bool multiply;     // '*' among the operators (else + and - only)
};
// Level 5's largest value, 9999^4 < 10^16, fits int64 with room to spare.
constexpr ArithmeticLevel kLevels[] = {
    {2, 1, false}, {2, 2, false}, {2, 2, true}, {3, 2, true}, {3, 3, true}, {4, 4, true},
};
constexpr int kNumLevels = static_cast<int>(std::size(kLevels));

class ArithmeticTask final : public Task {
 public:
  std::string name() const override { return "arithmetic"; }
  int num_levels() const override { return kNumLevels; }

  TaskInstance make(int level, uint64_t seed, int64_t index) const override {
    NIB_CHECK_MSG(level >= 0 && level < kNumLevels, "arithmetic level {} (0..{})", level, kNumLevels - 1);
    const ArithmeticLevel& spec = kLevels[level];
    PhiloxStream rng = instance_stream(kArithmeticTag, level, seed, index);
    const int64_t limit = power_of_ten(spec.digits);
    std::string expression;
    for (int i = 0; i < spec.operands; ++i) {
      if (i > 0) expression += "+-*"[uniform_int(rng, 0, spec.multiply ? 2 : 1)];
      expression += fmt::format("{}", uniform_int(rng, 0, limit - 1));
    }
    auto parsed = parse_expression(expression);
    NIB_CHECK_MSG(parsed && parsed->value.is_integer(), "arithmetic generated '{}'", expression);
    const std::string answer = fmt::format("{}", parsed->value.num);
    return make_instance(expression + "=", answer, answer, level, seed, index);
  }

  double reward(const TaskInstance& instance, std::string_view completion) const override {
    std::string_view line = answer_line(completion);
    return is_canonical_integer(line) && line == instance.answer ? 1.0 : 0.0;
  }
};

}  // namespace

std::unique_ptr<Task> make_arithmetic_task() { return std::make_unique<ArithmeticTask>(); }

}  // namespace nibble::rl
