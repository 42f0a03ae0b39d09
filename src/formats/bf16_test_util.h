// Test helper (tests only): whole-vector BF16 conversions built on core/bits.h, so the quantizer
// tests can feed the BF16 input paths the rounding of an FP32 input. Plain host C++ (no CUDA), so
// the GPU tests can include it as well.
#pragma once

#include <cstdint>
#include <vector>

#include "core/bits.h"

namespace nibble::formats::testing {

// (n) bf16 bits <- round-to-nearest-even of x: (n) f32.
inline std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16_bits(x[i]);
  return b;
}

// (n) f32 <- the exact values of b: (n) bf16 bits.
inline std::vector<float> from_bf16(const std::vector<uint16_t>& b) {
  std::vector<float> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_bits_to_f32(b[i]);
  return x;
}

}  // namespace nibble::formats::testing
