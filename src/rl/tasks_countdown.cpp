// The "countdown" task: reach a target from given numbers with + - * / and parentheses, each
// number used at most once (the numbers game of the TV show). The generator draws the numbers,
// then random expression trees over them until one meets the level's rules (every step a
// positive integer, division exact, target not one of the numbers and at most target_max); the
// sum of all numbers is the fallback, so a solution always exists and `solution` is one. The
// reward evaluates the answer line exactly over the rationals (intermediate fractions are
// allowed; only the final value must equal the target) and checks its literals against the
// numbers as a multiset (docs/rl.md).
#include <algorithm>
#include <charconv>

#include <fmt/format.h>

#include "core/check.h"
#include "rl/expression.h"
#include "rl/tasks_internal.h"

namespace nibble::rl {
namespace {

struct CountdownLevel {
  int small_count;     // numbers drawn uniformly from [1, small_max]
  int small_max;
  int large_count;     // numbers drawn from {25, 50, 75, 100}
  int min_used;        // the generated solution uses at least this many numbers
  bool divide;         // '/' among the solution's operators
  int64_t target_max;
};
constexpr CountdownLevel kLevels[] = {
    {2, 9, 0, 2, false, 99},   {3, 9, 0, 3, false, 999}, {3, 20, 0, 2, true, 999},
    {4, 25, 0, 3, true, 999},  {4, 10, 2, 3, true, 999},
};
constexpr int kNumLevels = static_cast<int>(std::size(kLevels));
constexpr int kMaxAttempts = 256;
constexpr int64_t kMaxIntermediate = 1000000;

// A node of a generated solution: its value, its text, and its top operator (0: a literal).
struct Node {
  int64_t value;
  std::string text;
  char op;
};

bool additive(char op) { return op == '+' || op == '-'; }
std::string wrap(const Node& n, bool parenthesize) { return parenthesize ? "(" + n.text + ")" : n.text; }

// a op b as text with only the parentheses the precedence needs.
std::string combine_text(const Node& a, char op, const Node& b) {
  bool wrap_left = (op == '*' || op == '/') && additive(a.op);
  bool wrap_right = op == '+' ? false : op == '-' ? additive(b.op) : op == '*' ? additive(b.op) : b.op != 0;
  return wrap(a, wrap_left) + op + wrap(b, wrap_right);
}

// One random expression tree over `numbers` (all of them); nullopt when a step breaks the rules.
std::optional<Node> random_tree(PhiloxStream& rng, std::vector<int64_t> numbers, bool divide) {
  std::vector<Node> pool;
  for (int64_t n : numbers) pool.push_back(Node{n, fmt::format("{}", n), 0});
  while (pool.size() > 1) {
    size_t i = uniform_int(rng, 0, static_cast<int64_t>(pool.size()) - 1);
    size_t j = uniform_int(rng, 0, static_cast<int64_t>(pool.size()) - 2);
    if (j >= i) ++j;
    char op = "+-*/"[uniform_int(rng, 0, divide ? 3 : 2)];
    Node a = pool[i], b = pool[j];
    if ((op == '-' || op == '/') && a.value < b.value) std::swap(a, b);
    int64_t value = 0;
    switch (op) {
      case '+': value = a.value + b.value; break;
      case '-': value = a.value - b.value; break;
      case '*': value = a.value * b.value; break;
      default:
        if (b.value <= 1 || a.value % b.value != 0) return std::nullopt;
        value = a.value / b.value;
    }
    if (value <= 0 || value > kMaxIntermediate) return std::nullopt;
    Node combined{value, combine_text(a, op, b), op};
    pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(std::max(i, j)));
    pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(std::min(i, j)));
    pool.push_back(std::move(combined));
  }
  return pool.front();
}

// The numbers and target of a prompt "use 3 7 25 to make 175:" (nullopt if it is not one).
struct CountdownProblem {
  std::vector<int64_t> numbers;
  int64_t target = 0;
};
constexpr std::string_view kUse = "use ", kMake = " to make ";

std::optional<int64_t> parse_int(std::string_view s) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

std::optional<CountdownProblem> parse_prompt(std::string_view prompt) {
  if (!prompt.starts_with(kUse) || !prompt.ends_with(':')) return std::nullopt;
  prompt.remove_prefix(kUse.size());
  prompt.remove_suffix(1);
  size_t make = prompt.find(kMake);
  if (make == std::string_view::npos) return std::nullopt;
  CountdownProblem problem;
  auto target = parse_int(prompt.substr(make + kMake.size()));
  if (!target) return std::nullopt;
  problem.target = *target;
  std::string_view list = prompt.substr(0, make);
  while (!list.empty()) {
    size_t space = list.find(' ');
    auto n = parse_int(list.substr(0, space));
    if (!n) return std::nullopt;
    problem.numbers.push_back(*n);
    list = space == std::string_view::npos ? std::string_view() : list.substr(space + 1);
  }
  return problem;
}

class CountdownTask final : public Task {
 public:
  std::string name() const override { return "countdown"; }
  int num_levels() const override { return kNumLevels; }

  TaskInstance make(int level, uint64_t seed, int64_t index) const override {
    NIB_CHECK_MSG(level >= 0 && level < kNumLevels, "countdown level {} (0..{})", level, kNumLevels - 1);
    const CountdownLevel& spec = kLevels[level];
    PhiloxStream rng = instance_stream(kCountdownTag, level, seed, index);
    std::vector<int64_t> numbers;
    for (int i = 0; i < spec.small_count; ++i) numbers.push_back(uniform_int(rng, 1, spec.small_max));
    for (int i = 0; i < spec.large_count; ++i) numbers.push_back(25 * uniform_int(rng, 1, 4));
    std::sort(numbers.begin(), numbers.end());
    const int count = static_cast<int>(numbers.size());

    std::optional<Node> found;
    for (int attempt = 0; attempt < kMaxAttempts && !found; ++attempt) {
      // A random subset of at least min_used numbers (a shuffled prefix).
      std::vector<int64_t> shuffled = numbers;
      for (int i = count - 1; i > 0; --i) std::swap(shuffled[i], shuffled[uniform_int(rng, 0, i)]);
      shuffled.resize(uniform_int(rng, spec.min_used, count));
      auto tree = random_tree(rng, shuffled, spec.divide);
      if (tree && tree->value <= spec.target_max &&
          std::find(numbers.begin(), numbers.end(), tree->value) == numbers.end())
        found = std::move(tree);
    }
    if (!found) {  // the sum of all numbers: positive, above each of them (all >= 1), small
      Node sum{numbers[0], fmt::format("{}", numbers[0]), 0};
      for (int i = 1; i < count; ++i) sum = Node{sum.value + numbers[i], fmt::format("{}+{}", sum.text, numbers[i]), '+'};
      found = std::move(sum);
    }
    return make_instance(fmt::format("{}{}{}{}:", kUse, join_numbers(numbers), kMake, found->value), found->text,
                         fmt::format("{}", found->value), level, seed, index);
  }

  double reward(const TaskInstance& instance, std::string_view completion) const override {
    auto problem = parse_prompt(instance.prompt);
    if (!problem) return 0.0;
    auto parsed = parse_expression(answer_line(completion));
    if (!parsed || parsed->value != Rational{problem->target, 1}) return 0.0;
    std::vector<int64_t> unused = problem->numbers;  // each number at most once
    for (int64_t literal : parsed->literals) {
      auto it = std::find(unused.begin(), unused.end(), literal);
      if (it == unused.end()) return 0.0;
      unused.erase(it);
    }
    return 1.0;
  }
};

}  // namespace

std::unique_ptr<Task> make_countdown_task() { return std::make_unique<CountdownTask>(); }

}  // namespace nibble::rl
