// Threading for the CPU backend: a parallel loop over [0, n) in chunks, on OpenMP's pool.
// Chunks are contiguous and their split depends only on n, grain and the thread count, never on
// timing, so results stay deterministic when each index writes its own outputs.
#pragma once

#include <cstdint>

namespace nibble {

int num_threads();
void set_num_threads(int n);

// Calls fn(begin, end) on disjoint chunks covering [0, n); chunks are at least `grain` long.
template <typename Fn>
void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int64_t chunks = (n + grain - 1) / grain;
  if (chunks <= 1 || num_threads() <= 1) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t b = c * grain;
    int64_t e = b + grain < n ? b + grain : n;
    fn(b, e);
  }
}

}  // namespace nibble
