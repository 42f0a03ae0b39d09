// Tests of the verifiable tasks (task.h, tasks_*.cpp): the registry; for every task and level,
// generator determinism (the same (level, seed, index) anywhere, other seeds/indices differ),
// the solution always scoring 1 and the answer field agreeing with it; perturbed and truncated
// answers scoring 0; malformed, huge and deeply nested text and random strings scoring 0 or 1
// without a crash; and the task-specific rules (countdown's multiset and exact rationals).
#include <cmath>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "core/check.h"
#include "core/philox.h"
#include "rl/task.h"

namespace nibble::rl {
namespace {

std::unique_ptr<Task> task_named(const std::string& name) {
  auto task = make_task(name);
  EXPECT_TRUE(task.is_ok()) << task.status().message();
  return std::move(task).value();
}

TEST(TaskRegistry, KnowsEveryTaskAndRefusesOthers) {
  EXPECT_EQ(task_names(), (std::vector<std::string>{"arithmetic", "countdown", "sorting"}));
  for (const std::string& name : task_names()) {
    auto task = make_task(name);
    ASSERT_TRUE(task.is_ok()) << name;
    EXPECT_EQ((*task)->name(), name);
    EXPECT_GE((*task)->num_levels(), 4);
  }
  auto bad = make_task("chess");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message(), "unknown task 'chess' (known: arithmetic, countdown, sorting)");
}

class EachTask : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { task_ = task_named(GetParam()); }
  std::unique_ptr<Task> task_;
};

bool same(const TaskInstance& a, const TaskInstance& b) {
  return a.prompt == b.prompt && a.solution == b.solution && a.answer == b.answer && a.level == b.level &&
         a.seed == b.seed && a.index == b.index;
}

TEST_P(EachTask, GeneratorIsDeterministicAndPerInstance) {
  for (int level = 0; level < task_->num_levels(); ++level) {
    TaskInstance late = task_->make(level, 7, 1000);  // made first: no hidden state between calls
    std::set<std::string> prompts;
    for (int64_t index = 0; index < 50; ++index) {
      TaskInstance a = task_->make(level, 7, index);
      EXPECT_TRUE(same(a, task_->make(level, 7, index)));
      EXPECT_EQ(a.level, level);
      EXPECT_EQ(a.seed, 7u);
      EXPECT_EQ(a.index, index);
      prompts.insert(a.prompt);
    }
    EXPECT_TRUE(same(late, task_->make(level, 7, 1000)));
    // Distinct instances (level 0 of arithmetic has only 200 problems, so ask for most, not all).
    EXPECT_GE(prompts.size(), 35u) << "level " << level;
    int differ = 0;
    for (int64_t index = 0; index < 20; ++index) differ += task_->make(level, 8, index).prompt != task_->make(level, 7, index).prompt;
    EXPECT_GE(differ, 10) << "another seed, other instances; level " << level;
  }
  EXPECT_THROW(task_->make(task_->num_levels(), 0, 0), CheckError);
  EXPECT_THROW(task_->make(-1, 0, 0), CheckError);
  EXPECT_THROW(task_->make(0, 0, -1), CheckError);
}

TEST_P(EachTask, SolutionScoresOne) {
  for (int level = 0; level < task_->num_levels(); ++level) {
    for (int64_t index = 0; index < 300; ++index) {
      TaskInstance inst = task_->make(level, 11, index);
      ASSERT_FALSE(inst.prompt.empty());
      ASSERT_FALSE(inst.solution.empty());
      ASSERT_EQ(inst.solution.find('\n'), std::string::npos);
      EXPECT_EQ(task_->reward(inst, inst.solution), 1.0) << inst.prompt << " | " << inst.solution;
      // The answer line ends at the first newline; blanks around it do not matter.
      EXPECT_EQ(task_->reward(inst, " " + inst.solution + " \nanything after"), 1.0) << inst.solution;
    }
  }
}

TEST_P(EachTask, TruncatedAndMalformedScoreZero) {
  std::vector<std::string> malformed = {"", "\n", " ", "\n" + std::string("1"), "?", "\x01\xff\xfe",
                                        std::string(100000, '9'), std::string(100000, '('),
                                        std::string(50000, '(') + std::string(50000, ')'), std::string(1 << 20, ' ')};
  for (int level = 0; level < task_->num_levels(); ++level) {
    for (int64_t index = 0; index < 40; ++index) {
      TaskInstance inst = task_->make(level, 3, index);
      if (index < 2) {
        for (const std::string& text : malformed) EXPECT_EQ(task_->reward(inst, text), 0.0) << inst.prompt;
      }
      EXPECT_EQ(task_->reward(inst, "\n" + inst.solution), 0.0) << "the answer must be on the first line";
      EXPECT_EQ(task_->reward(inst, inst.solution + inst.solution), 0.0) << inst.solution;
      // Truncations that end in an operator, '(' or a blank-free cut of a number list.
      for (size_t n = 0; n < inst.solution.size(); ++n) {
        char last = n == 0 ? '+' : inst.solution[n - 1];
        if (std::string_view("+-*/( ").find(last) != std::string_view::npos || GetParam() != "countdown") {
          EXPECT_EQ(task_->reward(inst, inst.solution.substr(0, n)), 0.0) << inst.solution << " cut at " << n;
        }
      }
    }
  }
}

TEST_P(EachTask, RandomStringsNeverCrash) {
  // A fuzz-like sweep: strings over the tasks' alphabet (valid-looking fragments included) and
  // raw bytes. Rewards stay exactly 0 or 1; almost all are 0.
  PhiloxStream rng(99, 1);
  const std::string alphabet = "0123456789+-*/() \n\t-";
  int ones = 0, total = 0;
  for (int level = 0; level < task_->num_levels(); ++level) {
    TaskInstance inst = task_->make(level, 5, level);
    for (int i = 0; i < 3000; ++i) {
      size_t length = rng.next_below(40);
      std::string text;
      bool raw = rng.next_below(4) == 0;
      for (size_t k = 0; k < length; ++k)
        text += raw ? static_cast<char>(rng.next_below(256)) : alphabet[rng.next_below(alphabet.size())];
      if (rng.next_below(3) == 0) text = inst.solution.substr(0, rng.next_below(inst.solution.size() + 1)) + text;
      double r = task_->reward(inst, text);
      ASSERT_TRUE(r == 0.0 || r == 1.0) << r;
      ones += r == 1.0;
      ++total;
    }
  }
  EXPECT_LT(ones, total / 20);
}

INSTANTIATE_TEST_SUITE_P(AllTasks, EachTask, ::testing::Values("arithmetic", "countdown", "sorting"),
                         [](const auto& info) { return info.param; });

TEST(Arithmetic, FormatsAndPerturbations) {
  auto task = task_named("arithmetic");
  for (int level = 0; level < task->num_levels(); ++level) {
    for (int64_t index = 0; index < 100; ++index) {
      TaskInstance inst = task->make(level, 1, index);
      ASSERT_TRUE(inst.prompt.ends_with("="));
      EXPECT_EQ(inst.solution, inst.answer);
      int64_t value = std::stoll(inst.answer);
      EXPECT_EQ(task->reward(inst, std::to_string(value + 1)), 0.0);
      EXPECT_EQ(task->reward(inst, std::to_string(value - 1)), 0.0);
      EXPECT_EQ(task->reward(inst, "0" + inst.answer), 0.0) << "leading zero";
      EXPECT_EQ(task->reward(inst, "+" + inst.answer), 0.0);
      EXPECT_EQ(task->reward(inst, inst.answer + ".0"), 0.0);
      EXPECT_EQ(task->reward(inst, inst.answer + "0"), 0.0);
    }
  }
  // Precedence and a hand-checked instance format.
  TaskInstance inst{"12+34*5=", "182", "182", 2, 0, 0};
  EXPECT_EQ(task->reward(inst, "182"), 1.0);
  EXPECT_EQ(task->reward(inst, "230"), 0.0);
  EXPECT_EQ(task->reward(inst, "12+34*5"), 0.0) << "the value, not an expression";
}

TEST(Arithmetic, AnswersAreTheExpressionValue) {
  // Recompute level 5's answers (4 operands of 4 digits, + - *) with an independent evaluator.
  auto task = task_named("arithmetic");
  for (int64_t index = 0; index < 200; ++index) {
    TaskInstance inst = task->make(5, 2, index);
    std::vector<int64_t> terms{0};
    std::vector<char> signs{'+'};
    int64_t number = 0;
    char pending = 0;
    auto flush = [&] {
      if (pending == '*') terms.back() *= number;
      else terms.back() = number;
    };
    for (char c : inst.prompt) {
      if (c >= '0' && c <= '9') {
        number = number * 10 + (c - '0');
        continue;
      }
      flush();
      number = 0;
      if (c == '*') {
        pending = '*';
      } else {
        pending = 0;
        if (c != '=') {
          terms.push_back(0);
          signs.push_back(c);
        }
      }
    }
    int64_t value = 0;
    for (size_t i = 0; i < terms.size(); ++i) value += signs[i] == '-' ? -terms[i] : terms[i];
    EXPECT_EQ(inst.answer, std::to_string(value)) << inst.prompt;
  }
}

TEST(Countdown, SolutionsUseTheNumbersAtMostOnce) {
  auto task = task_named("countdown");
  for (int level = 0; level < task->num_levels(); ++level) {
    for (int64_t index = 0; index < 100; ++index) {
      TaskInstance inst = task->make(level, 4, index);
      ASSERT_TRUE(inst.prompt.starts_with("use ") && inst.prompt.ends_with(":")) << inst.prompt;
      // Value right, but a literal outside the set (numbers are >= 1, so 0 never is one).
      EXPECT_EQ(task->reward(inst, "(" + inst.solution + ")+0"), 0.0) << inst.prompt;
      // Value right, but the first number used more often than it is given.
      std::string first = inst.prompt.substr(4, inst.prompt.find(' ', 4) - 4);
      std::string reuse = "(" + inst.solution + ")";
      for (int k = 0; k < 7; ++k) reuse += "+" + first + "-" + first;
      EXPECT_EQ(task->reward(inst, reuse), 0.0) << reuse;
      // The wrong value.
      EXPECT_EQ(task->reward(inst, "(" + inst.solution + ")*2"), 0.0) << inst.solution;
      // Only the target counts, not any expression over the numbers: the numbers' sum is
      // right only when it is the target.
      std::string numbers = inst.prompt.substr(4, inst.prompt.find(" to make ") - 4);
      std::string sum = numbers;
      for (char& c : sum) c = c == ' ' ? '+' : c;
      int64_t total = 0;
      for (size_t p = 0; p < numbers.size();) {
        size_t q = numbers.find(' ', p);
        total += std::stoll(numbers.substr(p, q - p));
        p = q == std::string::npos ? numbers.size() : q + 1;
      }
      EXPECT_EQ(task->reward(inst, sum), total == std::stoll(inst.answer) ? 1.0 : 0.0) << sum;
    }
  }
}

TEST(Countdown, ExactRationalRules) {
  auto task = task_named("countdown");
  TaskInstance inst{"use 1 3 4 6 to make 24:", "6/(1-3/4)", "24", 3, 0, 0};
  EXPECT_EQ(task->reward(inst, "6/(1-3/4)"), 1.0) << "an intermediate fraction is allowed";
  EXPECT_EQ(task->reward(inst, "6*4"), 1.0) << "not every number must be used";
  EXPECT_EQ(task->reward(inst, "4*6"), 1.0);
  EXPECT_EQ(task->reward(inst, "(6*4)"), 1.0);
  EXPECT_EQ(task->reward(inst, "6*4*1"), 1.0);
  EXPECT_EQ(task->reward(inst, "6*4*1*1"), 0.0) << "1 is given once";
  EXPECT_EQ(task->reward(inst, "6*4=24"), 0.0) << "only the expression";
  EXPECT_EQ(task->reward(inst, "24"), 0.0) << "24 is not one of the numbers";
  EXPECT_EQ(task->reward(inst, "6*4/(3-3)"), 0.0) << "division by zero";
  EXPECT_EQ(task->reward(inst, "6/4*16"), 0.0);
  // A prompt that is not a countdown prompt scores 0 rather than guessing.
  TaskInstance broken{"make 24 from 6 4:", "6*4", "24", 0, 0, 0};
  EXPECT_EQ(task->reward(broken, "6*4"), 0.0);
}

TEST(Countdown, SolutionsHaveTheLevelsShape) {
  auto task = task_named("countdown");
  // Level 4: six numbers, two of them from {25, 50, 75, 100}; the solution uses three or more.
  for (int64_t index = 0; index < 100; ++index) {
    TaskInstance inst = task->make(4, 9, index);
    int numbers = 1, large = 0;
    for (char c : inst.prompt.substr(0, inst.prompt.find(" to make "))) numbers += c == ' ';
    EXPECT_EQ(numbers - 1, 6) << inst.prompt;  // "use" is one of the words
    for (std::string big : {" 25 ", " 50 ", " 75 ", " 100 "}) {
      std::string list = inst.prompt.substr(3, inst.prompt.find(" to make ") - 3) + " ";
      for (size_t p = list.find(big); p != std::string::npos; p = list.find(big, p + 1)) ++large;
    }
    EXPECT_GE(large, 2) << inst.prompt;
    int literals = 1;
    for (char c : inst.solution) literals += std::string_view("+-*/").find(c) != std::string_view::npos;
    EXPECT_GE(literals, 3) << inst.solution;
  }
}

TEST(Sorting, FormatsAndPerturbations) {
  auto task = task_named("sorting");
  TaskInstance inst = task->make(3, 1, 0);
  ASSERT_TRUE(inst.prompt.starts_with("sort ") && inst.prompt.ends_with(":"));
  std::vector<std::string> sorted;
  for (size_t p = 0; p < inst.answer.size();) {
    size_t q = inst.answer.find(' ', p);
    sorted.push_back(inst.answer.substr(p, q - p));
    p = q == std::string::npos ? inst.answer.size() : q + 1;
  }
  ASSERT_EQ(sorted.size(), 8u);
  auto join = [](const std::vector<std::string>& v, const std::string& sep) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
    return s;
  };
  EXPECT_EQ(task->reward(inst, join(sorted, "  ")), 1.0) << "blanks between numbers are free";
  auto missing = sorted;
  missing.pop_back();
  EXPECT_EQ(task->reward(inst, join(missing, " ")), 0.0);
  auto extra = sorted;
  extra.push_back(sorted.back());
  EXPECT_EQ(task->reward(inst, join(extra, " ")), 0.0);
  auto reversed = std::vector<std::string>(sorted.rbegin(), sorted.rend());
  if (reversed != sorted) {
    EXPECT_EQ(task->reward(inst, join(reversed, " ")), 0.0);
  }
  EXPECT_EQ(task->reward(inst, join(sorted, ",")), 0.0);
  TaskInstance hand{"sort 10 2 7:", "2 7 10", "2 7 10", 0, 0, 0};
  EXPECT_EQ(task->reward(hand, "2 7 10"), 1.0);
  EXPECT_EQ(task->reward(hand, "02 7 10"), 0.0);
  EXPECT_EQ(task->reward(hand, "2 10 7"), 0.0);
  EXPECT_EQ(task->reward(hand, "2 7 10 "), 1.0);
  EXPECT_EQ(task->reward(task->make(0, 0, 0), std::string(5000, '1') + " 2"), 0.0);
}

}  // namespace
}  // namespace nibble::rl
