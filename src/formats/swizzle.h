// The 128x4 swizzled block-scale layout GPU GEMM libraries (cuBLASLt, CUTLASS) read
// (01-formats.md §8): rows padded to 128, columns to 4, tiles of 128x4 scales = 512 bytes,
//   offset(r, c) = ((r/128)*ceil(C/4) + c/4)*512 + (r%32)*16 + ((r/32)%4)*4 + (c%4).
// Host+device offset function plus CPU linear <-> swizzled conversion (padding bytes = 0).
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace nibble::formats {

NIB_HOST_DEVICE int64_t swizzle_padded_rows(int64_t rows) { return (rows + 127) / 128 * 128; }
NIB_HOST_DEVICE int64_t swizzle_padded_cols(int64_t cols) { return (cols + 3) / 4 * 4; }
// Bytes of the swizzled buffer for a (rows, cols) scale matrix.
NIB_HOST_DEVICE int64_t swizzled_scale_bytes(int64_t rows, int64_t cols) {
  return swizzle_padded_rows(rows) * swizzle_padded_cols(cols);
}
// Byte offset of scale (r, c) of a matrix with `cols` (unpadded) columns.
NIB_HOST_DEVICE int64_t swizzled_scale_offset(int64_t r, int64_t c, int64_t cols) {
  int64_t col_tiles = (cols + 3) / 4;
  return ((r / 128) * col_tiles + c / 4) * 512 + (r % 32) * 16 + ((r / 32) % 4) * 4 + (c % 4);
}

// dst: swizzled_scale_bytes(rows, cols) bytes; src: (rows, cols) u8 row-major. Pads with 0.
void scales_linear_to_swizzled(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols);
// dst: (rows, cols) u8 row-major; src: swizzled_scale_bytes(rows, cols) bytes.
void scales_swizzled_to_linear(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols);

}  // namespace nibble::formats
