// Tasks with verifiable rewards (issue #16): the interface the SFT warm start and the RL loop
// (GRPO) use. A task makes seeded instances at a difficulty level and scores a model's
// completion exactly. Implementations live in src/rl/tasks_*.cpp and register by name
// (`make_task("arithmetic")`). The same (task, level, seed, index) always gives the same
// instance, so runs and their resumes see the same prompts. Rewards never throw: a malformed or
// truncated completion scores 0.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace nibble::rl {

// One problem. `prompt` is what the model is given (it ends where the answer starts);
// `solution` is one correct completion (what SFT trains on, answer tokens only); `answer` is what
// the reward compares with (the canonical final answer; task-specific, e.g. "1234").
struct TaskInstance {
  std::string prompt;
  std::string solution;
  std::string answer;
  int level = 0;
  uint64_t seed = 0;
  int64_t index = 0;
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  virtual int num_levels() const = 0;  // levels 0 .. num_levels()-1, increasing difficulty
  // The index-th instance of (level, seed): deterministic, independent of other calls.
  virtual TaskInstance make(int level, uint64_t seed, int64_t index) const = 0;
  // The exact reward of `completion` (the model's text after the prompt) for `instance`, in [0, 1].
  // Malformed, empty or truncated text scores 0; never throws.
  virtual double reward(const TaskInstance& instance, std::string_view completion) const = 0;
};

// "arithmetic" | "countdown" | the third task; an unknown name is an error listing the known ones.
Result<std::unique_ptr<Task>> make_task(std::string_view name);
std::vector<std::string> task_names();

}  // namespace nibble::rl
