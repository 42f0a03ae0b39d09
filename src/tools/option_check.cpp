// The numeric option validators (see option_check.h): std::from_chars on the whole text, so
// overflow, signs, other bases and trailing characters are refused rather than coerced.
#include "tools/option_check.h"

#include <charconv>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace nibble::tools {

namespace {

std::string range_text(int64_t lo, int64_t hi) {
  if (hi == std::numeric_limits<int64_t>::max()) return fmt::format("an integer >= {}", lo);
  return fmt::format("an integer in [{}, {}]", lo, hi);
}

}  // namespace

CLI::Validator IntegerIn(int64_t lo, int64_t hi) {
  const std::string desc = range_text(lo, hi);
  return CLI::Validator(
      [lo, hi, desc](std::string& text) -> std::string {
        int64_t v = 0;
        const char* end = text.data() + text.size();
        auto [p, ec] = std::from_chars(text.data(), end, v);
        if (text.empty() || p != end || ec == std::errc::invalid_argument)
          return fmt::format("'{}' is not a decimal integer (expected {})", text, desc);
        if (ec == std::errc::result_out_of_range || v < lo || v > hi)
          return fmt::format("{} is out of range (expected {})", text, desc);
        return {};
      },
      desc.substr(desc.find(' ') + 1));
}

CLI::Validator Unsigned64() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t v = 0;
        const char* end = text.data() + text.size();
        auto [p, ec] = std::from_chars(text.data(), end, v);
        if (text.empty() || p != end || ec == std::errc::invalid_argument)
          return fmt::format("'{}' is not a decimal integer (expected an integer in [0, 2^64 - 1])", text);
        if (ec == std::errc::result_out_of_range)
          return fmt::format("{} is out of range (expected an integer in [0, 2^64 - 1])", text);
        return {};
      },
      "UINT64");
}

CLI::Validator FiniteIn(double lo, double hi, bool lo_open) {
  const std::string desc = std::isinf(hi) ? fmt::format("a finite number {} {}", lo_open ? ">" : ">=", lo)
                                          : fmt::format("a number in {}{}, {}]", lo_open ? "(" : "[", lo, hi);
  return CLI::Validator(
      [lo, hi, lo_open, desc](std::string& text) -> std::string {
        double v = 0;
        const char* end = text.data() + text.size();
        auto [p, ec] = std::from_chars(text.data(), end, v);
        if (text.empty() || p != end || ec == std::errc::invalid_argument)
          return fmt::format("'{}' is not a number (expected {})", text, desc);
        if (ec == std::errc::result_out_of_range || !std::isfinite(v) || (lo_open ? !(v > lo) : !(v >= lo)) || !(v <= hi))
          return fmt::format("{} is out of range (expected {})", text, desc);
        return {};
      },
      desc);
}

}  // namespace nibble::tools
