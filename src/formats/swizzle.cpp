// CPU linear <-> 128x4-swizzled block-scale conversion (swizzle.h, 01-formats.md §8). The
// swizzled buffer covers rows padded to 128 and columns padded to 4; padding bytes are 0.
#include "formats/swizzle.h"

#include <cstring>

#include "core/parallel.h"

namespace nibble::formats {

void scales_linear_to_swizzled(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols) {
  std::memset(dst, 0, static_cast<size_t>(swizzled_scale_bytes(rows, cols)));
  parallel_for(rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[swizzled_scale_offset(r, c, cols)] = src[r * cols + c];
  });
}

void scales_swizzled_to_linear(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols) {
  parallel_for(rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = src[swizzled_scale_offset(r, c, cols)];
  });
}

}  // namespace nibble::formats
