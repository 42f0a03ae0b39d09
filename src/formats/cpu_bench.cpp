// bench_quantize_cpu (cpu_bench.h): times each CPU quantizer of quantize_cpu.h and a threaded
// memcpy of the same byte count, in one process, and reports GB/s and the ratio. Byte counts:
// inputs read once per pass the algorithm needs (TE: amax pass + quantize pass) plus outputs.
#include "formats/cpu_bench.h"

#include <chrono>
#include <cstring>
#include <functional>

#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"
#include "core/philox.h"
#include "formats/quantize_cpu.h"

namespace nibble::formats {
namespace {

double time_best(const std::function<void()>& fn, int repeats, bool warm_up = true) {
  if (warm_up) fn();  // page faults, caches
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

}  // namespace

// A threaded memcpy moving `bytes` bytes (bytes/2 read + bytes/2 written), 1 MiB chunks.
struct MemcpyJob {
  explicit MemcpyJob(int64_t bytes)
      : half(std::max<int64_t>(bytes / 2, 1)), src(static_cast<size_t>(half), 1), dst(static_cast<size_t>(half)) {}
  void operator()() {
    constexpr int64_t kChunk = int64_t{1} << 20;
    int64_t chunks = (half + kChunk - 1) / kChunk;
    parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int64_t b = c * kChunk, n = std::min(kChunk, half - b);
        std::memcpy(dst.data() + b, src.data() + b, static_cast<size_t>(n));
      }
    });
  }
  int64_t half;
  std::vector<uint8_t> src, dst;
};

double bench_memcpy_seconds(int64_t bytes, int repeats) {
  MemcpyJob job(bytes);
  return time_best([&] { job(); }, repeats);
}

double bench_quantize_cpu_memory_bytes(int64_t M, int64_t K) {
  const double n = static_cast<double>(M) * static_cast<double>(K);
  // xb, xf, elems, y, yt; codes(_t), scales(_t), outer(_t) (as allocated below).
  const double buffers = n * (2 + 4 + 1 + 4 + 2) + 2 * (n / 2) + 2 * (n / 16) + 2 * (4 * n / 128);
  const double largest_copy = 2 * 4 * n + n / 2 + n / 16 + 4;  // nvfp4_te_f32_rtn's bytes moved
  return buffers + largest_copy;
}

std::vector<QuantizeBenchRow> bench_quantize_cpu(int64_t M, int64_t K, int repeats, const std::string& filter) {
  NIB_CHECK_MSG(M % 128 == 0 && K % 128 == 0, "bench: M={} K={} must be multiples of 128", M, K);
  const int64_t n = M * K;
  std::vector<uint16_t> xb(static_cast<size_t>(n));
  std::vector<float> xf(static_cast<size_t>(n));
  PhiloxStream rng(20260521, 7);
  for (int64_t i = 0; i < n; ++i) {
    xf[static_cast<size_t>(i)] = static_cast<float>(rng.next_normal());
    xb[static_cast<size_t>(i)] = f32_to_bf16_bits(xf[static_cast<size_t>(i)]);
  }
  std::vector<uint8_t> codes(static_cast<size_t>(n / 2)), scales(static_cast<size_t>(n / 16)),
      elems(static_cast<size_t>(n)), codes_t(static_cast<size_t>(n / 2)), scales_t(static_cast<size_t>(n / 16));
  std::vector<float> outer(static_cast<size_t>(n / 128)), outer_t(static_cast<size_t>(n / 128)),
      y(static_cast<size_t>(n));
  std::vector<uint16_t> yt(static_cast<size_t>(n));
  const SrKey key{1234, 5};
  const double N = static_cast<double>(n);
  const double nvfp4_out = N / 2 + N / 16;  // codes + E4M3 scales

  struct Case {
    std::string name;
    double bytes;
    std::function<void()> fn;
  };
  std::vector<Case> cases = {
      {"nvfp4_te_bf16_rtn", 2 * 2 * N + nvfp4_out + 4,
       [&] { nvfp4_te_quantize_cpu(codes.data(), scales.data(), xb.data(), M, K); }},
      {"nvfp4_te_f32_rtn", 2 * 4 * N + nvfp4_out + 4,
       [&] { nvfp4_te_quantize_cpu(codes.data(), scales.data(), xf.data(), M, K); }},
      {"nvfp4_te_bf16_sr", 2 * 2 * N + nvfp4_out + 4,
       [&] { nvfp4_te_quantize_cpu(codes.data(), scales.data(), xb.data(), M, K, &key); }},
      {"nvfp4_2level_bf16_rtn", 2 * N + nvfp4_out + 4 * N / 128,
       [&] { nvfp4_2level_quantize_cpu(codes.data(), scales.data(), outer.data(), xb.data(), M, K); }},
      {"nvfp4_2level_f32_rtn", 4 * N + nvfp4_out + 4 * N / 128,
       [&] { nvfp4_2level_quantize_cpu(codes.data(), scales.data(), outer.data(), xf.data(), M, K); }},
      {"nvfp4_2level_bf16_sr", 2 * N + nvfp4_out + 4 * N / 128,
       [&] { nvfp4_2level_quantize_cpu(codes.data(), scales.data(), outer.data(), xb.data(), M, K, &key); }},
      {"nvfp4_te_dequant_f32", nvfp4_out + 4 * N,
       [&] { nvfp4_te_dequantize_cpu(y.data(), codes.data(), scales.data(), 3.0f, M, K); }},
      {"nvfp4_2level_dequant_f32", nvfp4_out + 4 * N / 128 + 4 * N,
       [&] { nvfp4_2level_dequantize_cpu(y.data(), codes.data(), scales.data(), outer.data(), M, K); }},
      {"mxfp4_te_ceil_bf16_rtn", 2 * N + N / 2 + N / 32,
       [&] { mxfp4_quantize_cpu(codes.data(), scales.data(), xb.data(), M, K, MxScaleRule::kTeCeil); }},
      {"mxfp8_floor_bf16", 2 * N + N + N / 32,
       [&] { mxfp8_quantize_cpu(elems.data(), scales.data(), xb.data(), M, K, MxScaleRule::kFloor); }},
      {"mxfp4_floor_bf16_rtn", 2 * N + N / 2 + N / 32,
       [&] { mxfp4_quantize_cpu(codes.data(), scales.data(), xb.data(), M, K, MxScaleRule::kFloor); }},
      {"mxfp4_rceil_bf16_rtn", 2 * N + N / 2 + N / 32,
       [&] { mxfp4_quantize_cpu(codes.data(), scales.data(), xb.data(), M, K, MxScaleRule::kRceil); }},
      {"mxfp8_rceil_bf16", 2 * N + N + N / 32,
       [&] { mxfp8_quantize_cpu(elems.data(), scales.data(), xb.data(), M, K, MxScaleRule::kRceil); }},
      {"rht16_te_transpose_bf16", 2 * N + 2 * N, [&] { rht16_te_transpose_cpu(yt.data(), xb.data(), M, K); }},
      {"nvfp4_2level_backward_operand", 2 * (nvfp4_out + 4 * N / 128),
       [&] {
         nvfp4_2level_backward_operand_cpu(codes_t.data(), scales_t.data(), outer_t.data(), codes.data(), scales.data(),
                                           outer.data(), M, K, 0xA5C3u, key);
       }},
  };
  // The backward operand needs a valid 2-level input.
  nvfp4_2level_quantize_cpu(codes.data(), scales.data(), outer.data(), xb.data(), M, K);

  std::vector<QuantizeBenchRow> rows;
  for (const Case& c : cases) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    if (c.name == "nvfp4_2level_backward_operand" || c.name == "nvfp4_2level_dequant_f32")
      nvfp4_2level_quantize_cpu(codes.data(), scales.data(), outer.data(), xb.data(), M, K);
    QuantizeBenchRow r;
    r.name = c.name;
    r.bytes = c.bytes;
    // Quantizer and memcpy alternate, best of `repeats` each, so both see the same machine state.
    MemcpyJob copy(static_cast<int64_t>(c.bytes));
    c.fn();
    copy();
    double tq = 1e30, tm = 1e30;
    for (int i = 0; i < std::max(repeats, 1); ++i) {
      tq = std::min(tq, time_best(c.fn, 1, false));
      tm = std::min(tm, time_best([&] { copy(); }, 1, false));
    }
    r.seconds = tq;
    r.gbps = r.bytes / r.seconds / 1e9;
    r.memcpy_gbps = r.bytes / tm / 1e9;
    r.ratio_to_memcpy = r.gbps / r.memcpy_gbps;
    rows.push_back(r);
  }
  return rows;
}

}  // namespace nibble::formats
