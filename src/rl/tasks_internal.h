// Shared pieces of the task implementations (tasks_*.cpp): each task's factory, and the seeded
// random source of one instance. Instance (task, level, seed, index) draws from
// PhiloxStream(key = seed, stream = index, position = tag << 40 | level << 32): every instance
// has its own 2^32 words, so an instance never depends on which other instances were made.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/philox.h"
#include "rl/task.h"

namespace nibble::rl {

// Philox position tags of the tasks (never reuse one).
inline constexpr uint64_t kArithmeticTag = 1, kCountdownTag = 2, kSortingTag = 3;

// The random source of one instance (checks 0 <= level < 256 and index >= 0).
PhiloxStream instance_stream(uint64_t tag, int level, uint64_t seed, int64_t index);
// Uniform integer in [lo, hi].
int64_t uniform_int(PhiloxStream& rng, int64_t lo, int64_t hi);
// 10^digits (digits in [0, 18]).
int64_t power_of_ten(int digits);
// The instance (prompt, solution, answer) made at (level, seed, index).
TaskInstance make_instance(std::string prompt, std::string solution, std::string answer, int level, uint64_t seed,
                           int64_t index);
// "3 7 25" from {3, 7, 25}.
std::string join_numbers(const std::vector<int64_t>& numbers);

std::unique_ptr<Task> make_arithmetic_task();
std::unique_ptr<Task> make_countdown_task();
std::unique_ptr<Task> make_sorting_task();

}  // namespace nibble::rl
