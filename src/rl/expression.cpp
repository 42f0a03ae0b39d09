// Recursive-descent evaluation of task expressions (expression.h) with exact, overflow-checked
// rational arithmetic. Grammar (whitespace between tokens is skipped):
//   expr   := term (('+' | '-') term)*
//   term   := factor (('*' | '/') factor)*
//   factor := literal | '(' expr ')'
// No unary minus: the tasks' operands are non-negative literals.
#include "rl/expression.h"

#include <numeric>

namespace nibble::rl {
namespace {

std::optional<Rational> make_rational(int64_t num, int64_t den) {
  if (den == 0) return std::nullopt;
  if (num == INT64_MIN || den == INT64_MIN) return std::nullopt;  // |x| must fit for gcd/negation
  if (den < 0) {
    num = -num;
    den = -den;
  }
  int64_t g = std::gcd(num, den);  // den > 0, so g > 0
  return Rational{num / g, den / g};
}

std::optional<int64_t> mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}
std::optional<int64_t> add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// a/b + sign*c/d = (a*d + sign*c*b) / (b*d), reduced.
std::optional<Rational> add_sub(Rational x, Rational y, bool subtract) {
  auto ad = mul(x.num, y.den), cb = mul(y.num, x.den), bd = mul(x.den, y.den);
  if (!ad || !cb || !bd) return std::nullopt;
  if (subtract) {
    if (*cb == INT64_MIN) return std::nullopt;
    *cb = -*cb;
  }
  auto n = add(*ad, *cb);
  if (!n) return std::nullopt;
  return make_rational(*n, *bd);
}

std::optional<Rational> mul_div(Rational x, Rational y, bool divide) {
  if (divide) {
    if (y.num == 0) return std::nullopt;
    y = Rational{y.den, y.num};  // make_rational below fixes the sign
  }
  // Cross-reduce first so that in-range results do not overflow on the way.
  int64_t g1 = std::gcd(x.num, y.den), g2 = std::gcd(y.num, x.den);
  if (g1 == 0) g1 = 1;
  if (g2 == 0) g2 = 1;
  auto n = mul(x.num / g1, y.num / g2), d = mul(x.den / g2, y.den / g1);
  if (!n || !d) return std::nullopt;
  return make_rational(*n, *d);
}

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  std::optional<ParsedExpression> parse() {
    auto v = expr(0);
    if (!v) return std::nullopt;
    skip_blanks();
    if (pos_ != text_.size()) return std::nullopt;  // trailing garbage
    return ParsedExpression{*v, std::move(literals_)};
  }

 private:
  void skip_blanks() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t')) ++pos_;
  }
  // The next non-blank character (0 at the end).
  char peek() {
    skip_blanks();
    return pos_ < text_.size() ? text_[pos_] : '\0';
  }

  std::optional<Rational> expr(int depth) {
    auto left = term(depth);
    while (left) {
      char c = peek();
      if (c != '+' && c != '-') break;
      ++pos_;
      auto right = term(depth);
      if (!right) return std::nullopt;
      left = add_sub(*left, *right, c == '-');
    }
    return left;
  }

  std::optional<Rational> term(int depth) {
    auto left = factor(depth);
    while (left) {
      char c = peek();
      if (c != '*' && c != '/') break;
      ++pos_;
      auto right = factor(depth);
      if (!right) return std::nullopt;
      left = mul_div(*left, *right, c == '/');
    }
    return left;
  }

  std::optional<Rational> factor(int depth) {
    char c = peek();
    if (c == '(') {
      if (depth + 1 > kMaxExpressionDepth) return std::nullopt;
      ++pos_;
      auto v = expr(depth + 1);
      if (!v || peek() != ')') return std::nullopt;
      ++pos_;
      return v;
    }
    if (c < '0' || c > '9') return std::nullopt;
    int64_t value = 0;
    int digits = 0;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      if (++digits > kMaxLiteralDigits) return std::nullopt;
      value = value * 10 + (text_[pos_] - '0');
      ++pos_;
    }
    literals_.push_back(value);
    return Rational{value, 1};
  }

  std::string_view text_;
  size_t pos_ = 0;
  std::vector<int64_t> literals_;
};

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }

}  // namespace

std::optional<ParsedExpression> parse_expression(std::string_view text) {
  if (text.size() > kMaxExpressionBytes) return std::nullopt;
  return Parser(text).parse();
}

std::string_view answer_line(std::string_view completion) {
  size_t end = completion.find('\n');
  std::string_view line = completion.substr(0, end);
  while (!line.empty() && is_blank(line.front())) line.remove_prefix(1);
  while (!line.empty() && is_blank(line.back())) line.remove_suffix(1);
  return line;
}

bool is_canonical_integer(std::string_view text) {
  bool negative = !text.empty() && text.front() == '-';
  std::string_view digits = negative ? text.substr(1) : text;
  if (digits.empty() || digits.size() > 19) return false;
  for (char c : digits)
    if (c < '0' || c > '9') return false;
  if (digits.front() == '0') return digits.size() == 1 && !negative;
  return true;
}

}  // namespace nibble::rl
