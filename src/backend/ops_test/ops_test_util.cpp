// The op-test harness (ops_test_util.h): backend selection, test data, comparisons.
// Compiled into the op-test program only (the *_util.cpp name keeps it out of the libraries).
#include "backend/ops_test/ops_test_util.h"

#include <fmt/format.h>

#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace nibble::backend::testing {

std::vector<std::string> backend_kinds() {
#ifdef NIBBLE_HAVE_CUDA
  return {"cpu", "cuda"};
#else
  return {"cpu"};
#endif
}

void OpsTest::SetUp() {
#ifdef NIBBLE_HAVE_CUDA
  cuda::register_cuda_backend();
#endif
  Result<std::unique_ptr<Backend>> r = make_backend(GetParam());
  if (!r.is_ok()) GTEST_SKIP() << "backend '" << GetParam() << "' unavailable: " << r.status().message();
  backend_ = std::move(r).value();
}

std::vector<float> normal_vector(int64_t n, uint64_t seed, double std) {
  PhiloxStream rng(seed, 0);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(rng.next_normal() * std);
  return v;
}

namespace {
template <typename T>
::testing::AssertionResult bits_equal_impl(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << "first difference at index " << i << ": " << +a[i] << " vs " << +b[i];
  return ::testing::AssertionSuccess();
}
}  // namespace

::testing::AssertionResult bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return bits_equal_impl(a, b);
}
::testing::AssertionResult bits_equal(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  return bits_equal_impl(a, b);
}

::testing::AssertionResult all_close(const std::vector<float>& a, const std::vector<float>& b, double atol,
                                     double rtol) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      if (std::isnan(a[i]) != std::isnan(b[i]))
        return ::testing::AssertionFailure() << "NaN mismatch at " << i << ": " << a[i] << " vs " << b[i];
      continue;
    }
    const double tol = atol + rtol * std::fabs(static_cast<double>(b[i]));
    if (!(std::fabs(static_cast<double>(a[i]) - b[i]) <= tol))
      return ::testing::AssertionFailure() << fmt::format("index {}: {} vs reference {} (|diff| {:.3g} > tol {:.3g})", i,
                                                          a[i], b[i], std::fabs(double(a[i]) - b[i]), tol);
  }
  return ::testing::AssertionSuccess();
}

}  // namespace nibble::backend::testing
