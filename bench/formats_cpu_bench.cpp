// CPU quantizer throughput vs memcpy (Google Benchmark). Each benchmark reports bytes/s with
// the bytes the algorithm must move (see formats/cpu_bench.h); BM_memcpy_* moves the same byte
// counts, so the ratio is read in one run. `--benchmark_filter=te` etc. to select.
// A summary table (ratio to memcpy) from formats::bench_quantize_cpu is printed at the end.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <vector>

#include "formats/cpu_bench.h"

namespace {

constexpr int64_t kM = 8192, kK = 4096;

void BM_formats_summary(benchmark::State& state) {
  std::vector<nibble::formats::QuantizeBenchRow> rows;
  for (auto _ : state) rows = nibble::formats::bench_quantize_cpu(kM, kK, 5);
  for (const auto& r : rows) {
    state.counters[r.name + "_GBps"] = r.gbps;
    state.counters[r.name + "_ratio"] = r.ratio_to_memcpy;
  }
  std::printf("%-32s %12s %10s %10s %12s %8s\n", "name", "bytes", "ms", "GB/s", "memcpy GB/s", "ratio");
  for (const auto& r : rows)
    std::printf("%-32s %12.0f %10.3f %10.2f %12.2f %8.2f\n", r.name.c_str(), r.bytes, r.seconds * 1e3, r.gbps,
                r.memcpy_gbps, r.ratio_to_memcpy);
}
BENCHMARK(BM_formats_summary)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
