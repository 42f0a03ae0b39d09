// NIB_CHECK: invariants that hold unless nibble itself has a bug. Always on (also in Release);
// on failure it throws nibble::CheckError with the expression, file and line, so the CLI can
// print one line and exit non-zero, and tests can EXPECT_THROW. Never used for user input.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace nibble {

class CheckError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] inline void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  throw CheckError(fmt::format("check failed: {} at {}:{}{}{}", expr, file, line, msg.empty() ? "" : ": ", msg));
}

}  // namespace nibble

#define NIB_CHECK(cond)                                                        \
  do {                                                                         \
    if (!(cond)) ::nibble::check_failed(#cond, __FILE__, __LINE__, {});        \
  } while (0)

// NIB_CHECK_MSG(cond, "fmt {}", args...)
#define NIB_CHECK_MSG(cond, ...)                                                              \
  do {                                                                                        \
    if (!(cond)) ::nibble::check_failed(#cond, __FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)
