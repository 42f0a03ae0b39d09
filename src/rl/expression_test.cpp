// Tests of the task expression evaluator (expression.h): precedence and associativity, exact
// rational values, every refusal (syntax, depth, length, literal size, division by zero,
// overflow), the answer line and canonical integers.
#include "rl/expression.h"

#include <string>

#include <gtest/gtest.h>

namespace nibble::rl {
namespace {

Rational value_of(std::string_view text) {
  auto parsed = parse_expression(text);
  EXPECT_TRUE(parsed.has_value()) << text;
  return parsed ? parsed->value : Rational{-999, 1};
}

TEST(Expression, PrecedenceAndAssociativity) {
  EXPECT_EQ(value_of("2+3*4"), (Rational{14, 1}));
  EXPECT_EQ(value_of("(2+3)*4"), (Rational{20, 1}));
  EXPECT_EQ(value_of("10-4-3"), (Rational{3, 1}));  // left to right, not 10-(4-3)
  EXPECT_EQ(value_of("8/4/2"), (Rational{1, 1}));
  EXPECT_EQ(value_of("2*3-4*5"), (Rational{-14, 1}));
  EXPECT_EQ(value_of(" 7 *\t( 1 + 2 ) "), (Rational{21, 1}));
  EXPECT_EQ(value_of("007"), (Rational{7, 1}));
}

TEST(Expression, ExactRationals) {
  EXPECT_EQ(value_of("1/3+1/6"), (Rational{1, 2}));
  EXPECT_EQ(value_of("6/(1-3/4)"), (Rational{24, 1}));
  EXPECT_EQ(value_of("1-4/3"), (Rational{-1, 3}));
  EXPECT_EQ(value_of("2/(1-4/3)"), (Rational{-6, 1}));  // a negative divisor: the sign moves up
  EXPECT_EQ(value_of("0/5"), (Rational{0, 1}));
}

TEST(Expression, LiteralsInTextOrder) {
  auto parsed = parse_expression("(25-7)*3+25");
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->literals, (std::vector<int64_t>{25, 7, 3, 25}));
}

TEST(Expression, RefusesMalformedText) {
  for (std::string_view bad : {"", " ", "1+", "+1", "-1", "(1", "1)", "()", "1 2", "1++2", "2*/3", "1.5", "1e3",
                               "a", "1+x", "1=1", "１", "(1+2", "((3)", "3,4"})
    EXPECT_FALSE(parse_expression(bad).has_value()) << "'" << bad << "'";
}

TEST(Expression, RefusesDivisionByZero) {
  EXPECT_FALSE(parse_expression("1/0"));
  EXPECT_FALSE(parse_expression("5/(3-3)"));
  EXPECT_FALSE(parse_expression("0/(2*0)"));
}

TEST(Expression, LimitsDepthLengthDigitsAndRange) {
  auto nested = [](int depth) { return std::string(depth, '(') + "1" + std::string(depth, ')'); };
  EXPECT_TRUE(parse_expression(nested(kMaxExpressionDepth)));
  EXPECT_FALSE(parse_expression(nested(kMaxExpressionDepth + 1)));
  EXPECT_FALSE(parse_expression(nested(100000)));  // refused by length, never recursed into
  std::string sum = "1";
  while (sum.size() + 2 <= kMaxExpressionBytes) sum += "+1";
  EXPECT_EQ(value_of(sum), (Rational{static_cast<int64_t>(sum.size() / 2 + 1), 1}));
  EXPECT_FALSE(parse_expression(sum + "+1"));
  EXPECT_EQ(value_of(std::string(kMaxLiteralDigits, '9')), (Rational{999999999999999999, 1}));
  EXPECT_FALSE(parse_expression(std::string(kMaxLiteralDigits + 1, '9')));
  EXPECT_FALSE(parse_expression("999999999999999999*999999999999999999"));
  EXPECT_FALSE(parse_expression("999999999999999999*10-999999999999999999*10"));  // overflows on the way
  EXPECT_FALSE(parse_expression("1/999999999999999999+1/999999999999999998"));
}

TEST(Expression, AnswerLine) {
  EXPECT_EQ(answer_line("  42 \r\nrest"), "42");
  EXPECT_EQ(answer_line("\t1 2 3"), "1 2 3");
  EXPECT_EQ(answer_line("\n42"), "");
  EXPECT_EQ(answer_line(""), "");
}

TEST(Expression, CanonicalIntegers) {
  for (std::string_view good : {"0", "7", "-7", "1234567890123456789"}) EXPECT_TRUE(is_canonical_integer(good)) << good;
  for (std::string_view bad : {"", "-", "-0", "+1", "01", "1 ", "1a", "12345678901234567890", "--1"})
    EXPECT_FALSE(is_canonical_integer(bad)) << bad;
}

}  // namespace
}  // namespace nibble::rl
