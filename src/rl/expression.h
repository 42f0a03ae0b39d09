// The small, safe expression evaluator behind the arithmetic and countdown tasks (docs/rl.md
// "Answer formats"): non-negative integer literals, + - * /, parentheses, blanks; exact rational
// arithmetic (int64 numerator/denominator in lowest terms, every operation overflow-checked).
// Anything else (another character, a literal over 18 digits, nesting deeper than
// kMaxExpressionDepth, text longer than kMaxExpressionBytes, division by zero, an overflow) is
// refused with nullopt; it never throws and never recurses without bound.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace nibble::rl {

inline constexpr int kMaxExpressionDepth = 32;          // parentheses nested at most this deep
inline constexpr size_t kMaxExpressionBytes = 512;      // longer text is refused unread
inline constexpr int kMaxLiteralDigits = 18;            // < 2^63 whatever the digits

// A rational in lowest terms, den > 0.
struct Rational {
  int64_t num = 0;
  int64_t den = 1;
  bool operator==(const Rational&) const = default;
  bool is_integer() const { return den == 1; }
};

struct ParsedExpression {
  Rational value;
  std::vector<int64_t> literals;  // the integer literals, in text order
};

// The value and literals of `text` (the whole text must be one expression), or nullopt.
std::optional<ParsedExpression> parse_expression(std::string_view text);

// The answer line of a completion: the text before the first '\n' (all of it if none), without
// leading and trailing blanks (' ', '\t', '\r').
std::string_view answer_line(std::string_view completion);

// True when `text` is a canonical decimal integer: "0", or an optional '-' then 1..19 digits
// without a leading zero ("-0", "+1", "01", "" are not).
bool is_canonical_integer(std::string_view text);

}  // namespace nibble::rl
