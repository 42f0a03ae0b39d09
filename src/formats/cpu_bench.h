// Timing of the CPU quantizers against memcpy, for `nibble bench quantize` and
// bench/formats_cpu_bench.cpp. Each row counts the bytes the algorithm must move (inputs read,
// passes included, plus outputs written) and compares with a threaded memcpy that moves the same
// number of bytes in the same run (copying bytes/2: bytes/2 read + bytes/2 written).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nibble::formats {

struct QuantizeBenchRow {
  std::string name;        // e.g. "nvfp4_te_bf16_rtn"
  double bytes = 0;        // bytes the algorithm moves (reads + writes)
  double seconds = 0;      // best of the repeats
  double gbps = 0;         // bytes / seconds / 1e9
  double memcpy_gbps = 0;  // memcpy of the same bytes, same run
  double ratio_to_memcpy = 0;
};

// Times every CPU quantizer on a random N(0,1) (M, K) tensor (M % 128 == 0, K % 128 == 0),
// best of `repeats` runs each. `filter`: only rows whose name contains it ("" = all).
std::vector<QuantizeBenchRow> bench_quantize_cpu(int64_t M, int64_t K, int repeats, const std::string& filter = "");

// The host memory bench_quantize_cpu(M, K, ...) allocates at its peak, in bytes (its input,
// output and scratch buffers plus the largest row's memcpy job): about 23 bytes per element.
double bench_quantize_cpu_memory_bytes(int64_t M, int64_t K);

// Times a threaded memcpy (parallel_for over 1 MiB chunks) moving `bytes` bytes; best of repeats.
double bench_memcpy_seconds(int64_t bytes, int repeats);

}  // namespace nibble::formats
