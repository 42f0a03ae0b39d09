// Validators for the numeric options of every `nibble` command. CLI11 2.1 reads integers with
// strtoll/strtoull (saturating, base 0: "99999999999999999999" becomes INT64_MAX, "-1" a huge
// unsigned, "010" octal 8) and accepts "nan" for floating options; these check the text itself
// before any conversion: a decimal integer that fits and lies in a range, or a finite number in a
// range. A failure is a CLI11 ValidationError, printed as one line naming the option (exit 2).
#pragma once

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

namespace nibble::tools {

// A decimal integer (optional '-', digits only) in [lo, hi].
CLI::Validator IntegerIn(int64_t lo, int64_t hi);
// A decimal unsigned integer (digits only) that fits in 64 bits (seeds).
CLI::Validator Unsigned64();
// A finite decimal number in [lo, hi] (or (lo, hi] when lo_open); hi may be +infinity.
CLI::Validator FiniteIn(double lo, double hi, bool lo_open = false);

}  // namespace nibble::tools
