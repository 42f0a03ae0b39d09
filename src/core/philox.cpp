// Host-only parts of the Philox stream (see philox.h).
#include "core/philox.h"

#include <cmath>

namespace nibble {

double PhiloxStream::next_normal() {
  double u1 = next_uniform_double();
  double u2 = next_uniform_double();
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925286766559 * u2);
}

}  // namespace nibble
