// `nibble bench quantize`: bandwidth of the format quantizers, each row next to a copy of the
// same bytes measured in the same run (05-performance-anchors.md: speed is a ratio to a baseline
// measured alongside). CPU table from formats/cpu_bench.h (vs threaded memcpy); GPU table from
// backend/cuda/bench.h (vs device-to-device copy) when built with CUDA and a device is present.
#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

#include "core/parallel.h"
#include "formats/cpu_bench.h"
#include "tools/command.h"
#include "tools/option_check.h"
#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/bench.h"
#include "backend/cuda/device.h"
#endif

namespace nibble::tools {
namespace {

constexpr int64_t kMaxRepeats = 100000, kMaxThreads = 4096;

struct BenchArgs {
  std::string size;  // "MxK"; empty: CPU 2048x4096, GPU the bench's default shapes
  int repeats = 0;   // not given: CPU 5, GPU the bench's default (given: 1..kMaxRepeats)
  int threads = 0;   // not given: all of OpenMP's (given: 1..kMaxThreads)
  std::string filter;
  bool cpu_only = false;
  CLI::App* quantize = nullptr;
};

// The machine's physical memory in bytes (0 if unknown).
double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

Status parse_size(const std::string& s, int64_t* M, int64_t* K) {
  long long m = 0, k = 0;
  char x = 0, extra = 0;
  if (std::sscanf(s.c_str(), "%lld%c%lld%c", &m, &x, &k, &extra) != 3 || x != 'x' || m <= 0 || k <= 0)
    return invalid_argument("--size {}: expected MxK, e.g. 4096x4096", s);
  *M = m;
  *K = k;
  return Status::ok();
}

int run_bench_quantize(const BenchArgs& a) {
  int64_t M = 2048, K = 4096;
  if (!a.size.empty()) {
    Status st = parse_size(a.size, &M, &K);
    if (!st) return report_error("bench", st);
    if (M % 128 != 0 || K % 128 != 0)
      return report_error("bench", invalid_argument("--size {}: M and K must be multiples of 128", a.size));
    // Refuse up front what cannot be allocated (it ended in "std::bad_alloc").
    const double need = formats::bench_quantize_cpu_memory_bytes(M, K), have = physical_memory_bytes();
    if (have > 0 && need > have)
      return report_error("bench", invalid_argument("--size {}: the CPU bench needs {:.1f} GiB of memory at this size, "
                                                    "more than this machine's {:.1f} GiB",
                                                    a.size, need / double(1ull << 30), have / double(1ull << 30)));
  }
  if (a.threads > 0) set_num_threads(a.threads);
  const int cpu_repeats = a.repeats > 0 ? a.repeats : 5;

  std::printf("CPU quantizers, %lldx%lld N(0,1) input, %d threads, best of %d (ratio = GB/s / memcpy GB/s of the "
              "same bytes, same run)\n",
              static_cast<long long>(M), static_cast<long long>(K), num_threads(), cpu_repeats);
  auto rows = formats::bench_quantize_cpu(M, K, cpu_repeats, a.filter);
  std::printf("  %-32s %10s %10s %10s %12s %8s\n", "kernel", "MB moved", "ms", "GB/s", "memcpy GB/s", "ratio");
  for (const auto& r : rows)
    std::printf("  %-32s %10.4g %10.4g %10.4g %12.4g %8.3g\n", r.name.c_str(), r.bytes / 1e6, r.seconds * 1e3, r.gbps,
                r.memcpy_gbps, r.ratio_to_memcpy);
  if (a.cpu_only) return 0;

#ifdef NIBBLE_HAVE_CUDA
  if (nibble::cuda::device_count() == 0) {
    std::printf("no CUDA device: GPU table skipped\n");
    return 0;
  }
  if (Status st = nibble::cuda::init(0); !st) {
    std::printf("no CUDA device: GPU table skipped (%s)\n", st.message().c_str());
    return 0;
  }
  if (auto info = nibble::cuda::device_info(0)) std::printf("GPU: %s\n", nibble::cuda::describe(*info).c_str());
  nibble::cuda::BandwidthBenchConfig config;
  if (!a.size.empty()) config.shapes = {{M, K}};
  if (a.repeats > 0) config.repeats = a.repeats;
  auto gpu = nibble::cuda::run_quantize_bandwidth_bench(config);
  if (!gpu) return report_error("bench", gpu.status());
  std::printf("GPU quantizers (ratio = GB/s / device-to-device copy GB/s, same shape, same run)\n%s",
              nibble::cuda::format_bandwidth_table(*gpu).c_str());
#else
  std::printf("no CUDA device: GPU table skipped (this nibble was built without CUDA)\n");
#endif
  return 0;
}

CommandRun setup_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  app.require_subcommand(1);
  a->quantize = app.add_subcommand("quantize", "Bandwidth of the format quantizers vs memcpy / device copy");
  a->quantize->add_option("--size", a->size, "MxK (multiples of 128); default CPU 2048x4096, GPU the bench's shapes");
  a->quantize->add_option("--repeats", a->repeats, "Timed runs per row (best on CPU, median on GPU; default CPU 5)")
      ->check(IntegerIn(1, kMaxRepeats));
  a->quantize->add_option("--threads", a->threads, "CPU threads (default: all)")->check(IntegerIn(1, kMaxThreads));
  a->quantize->add_option("--filter", a->filter, "CPU rows whose name contains this");
  a->quantize->add_flag("--cpu-only", a->cpu_only, "Skip the GPU table");
  return [a]() -> int {
    if (a->quantize->parsed()) return run_bench_quantize(*a);
    return 2;
  };
}

}  // namespace

NIBBLE_REGISTER_COMMAND(bench_command, "bench", "Benchmarks (bench quantize: quantizer bandwidth vs memcpy)",
                        setup_bench);

}  // namespace nibble::tools
