// The CPU backend's NT product (y = x . w^T) through OpenBLAS (cpu::matmul_nt) against the
// batch-invariant one the rollout engine's steps use (cpu::matmul_nt_row_invariant), at decode
// batches and a prefill chunk of a 768-wide model (Google Benchmark; docs/benchmarks.md "CPU
// row-invariant NT GEMM"). Both run in the same process on the same operands:
//   build/cuda/bin/gemm_cpu_bench --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "backend/cpu/gemm.h"

namespace {

struct Operands {
  std::vector<float> x, w, y;
  Operands(int64_t M, int64_t N, int64_t K)
      : x(static_cast<size_t>(M * K)), w(static_cast<size_t>(N * K)), y(static_cast<size_t>(M * N)) {
    std::mt19937 g(1);
    std::normal_distribution<float> d;
    for (float& v : x) v = d(g);
    for (float& v : w) v = d(g);
  }
};

template <bool kRowInvariant>
void BM_MatmulNt(benchmark::State& state) {
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  Operands o(M, N, K);
  for (auto _ : state) {
    if (kRowInvariant)
      nibble::cpu::matmul_nt_row_invariant(o.y.data(), o.x.data(), o.w.data(), M, N, K);
    else
      nibble::cpu::matmul_nt(o.y.data(), o.x.data(), o.w.data(), M, N, K);
    benchmark::DoNotOptimize(o.y.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * M * N * K * state.iterations(), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}

void Shapes(benchmark::internal::Benchmark* b) {
  for (const auto& s : std::vector<std::vector<int64_t>>{
           {1, 2048, 768}, {8, 2048, 768}, {16, 3072, 768}, {64, 2048, 768}, {512, 2048, 768}})
    b->Args(s);
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK_TEMPLATE(BM_MatmulNt, false)->Name("openblas")->Apply(Shapes);
BENCHMARK_TEMPLATE(BM_MatmulNt, true)->Name("row_invariant")->Apply(Shapes);

}  // namespace

BENCHMARK_MAIN();
