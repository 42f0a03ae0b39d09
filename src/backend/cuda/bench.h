// GPU bandwidth benchmark of nibble's format kernels against a device-to-device copy of the same
// input, on the same GPU in the same process (05-performance-anchors.md: every speed claim is a
// ratio to a baseline measured alongside). Plain C++ (no CUDA header), so the `nibble bench`
// CLI can call it. Effective bandwidth = bytes the algorithm must move (each input read once per
// pass it needs, each output written once) / median time of one launch sequence.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace nibble::cuda {

struct BandwidthRow {
  std::string name;     // kernel, e.g. "nvfp4_te_1x16 bf16 rtn (amax+quant)"
  std::string shape;    // "8192x8192"
  uint64_t bytes = 0;   // bytes the algorithm moves (reads + writes), see bench.cu per row
  double ms = 0;        // median over repeats
  double gbps = 0;      // bytes / ms / 1e6
  double ratio_to_copy = 0;  // gbps / copy gbps at the same shape
};

struct BandwidthBenchConfig {
  std::vector<std::pair<int64_t, int64_t>> shapes{{8192, 8192}, {16384, 16384}};  // (M, K) BF16 inputs
  int warmup = 3;
  int repeats = 30;
  int buffers = 3;  // input/output sets rotated between launches (each well beyond the 60 MB L2)
  uint64_t seed = 20261130;
};

// Runs every kernel on every shape; needs nibble::cuda::init() to have succeeded.
Result<std::vector<BandwidthRow>> run_quantize_bandwidth_bench(const BandwidthBenchConfig& config = {});

// A fixed-width text table of the rows (name, shape, MB moved, ms, GB/s, ratio to copy).
std::string format_bandwidth_table(const std::vector<BandwidthRow>& rows);

}  // namespace nibble::cuda
