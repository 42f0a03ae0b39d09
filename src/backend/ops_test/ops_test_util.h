// The op-test suite's harness (ggml's test-backend-ops): every op case is a GoogleTest
// parameterised over the backends available in this process ("cpu" always; "cuda" where the
// CUDA backend is linked and a device is present, else the case skips with the reason). A case
// computes the op with the CPU reference on host arrays and with the backend under test on its
// own memory, then compares bit-exactly (format ops, SR given the seed) or within a tolerance
// derived and written beside the check. Helpers move host vectors in and out of backend memory.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/philox.h"

namespace nibble::backend::testing {

// The backend kinds this test program may run: "cpu", and "cuda" when linked.
std::vector<std::string> backend_kinds();

// Fixture: GetParam() is the backend kind; be() is that backend (the test skips when it cannot
// be made, e.g. no GPU).
class OpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override;
  Backend& be() { return *backend_; }

  // A host vector copied into backend memory, freed with the fixture.
  template <typename T>
  T* upload(const std::vector<T>& host) {
    Buffer<T>& b = keep<T>();
    T* p = b.ensure(be(), static_cast<int64_t>(host.size()), "op-test input");
    if (!host.empty()) be().copy_to_device(p, host.data(), host.size() * sizeof(T));
    return p;
  }
  // n zeroed elements of backend memory.
  template <typename T>
  T* zeros(int64_t n) {
    Buffer<T>& b = keep<T>();
    T* p = b.ensure(be(), n, "op-test output");
    be().fill_zero(p, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T));
    return p;
  }
  template <typename T>
  std::vector<T> download(const T* p, int64_t n) {
    std::vector<T> host(static_cast<size_t>(n));
    if (n > 0) be().copy_to_host(host.data(), p, static_cast<size_t>(n) * sizeof(T));
    return host;
  }

 private:
  template <typename T>
  Buffer<T>& keep() {
    auto holder = std::make_shared<Buffer<T>>();
    buffers_.push_back(holder);
    return *holder;
  }
  std::unique_ptr<Backend> backend_;
  std::vector<std::shared_ptr<void>> buffers_;  // declared after backend_: freed first
};

// n values ~ N(0, std^2) from Philox stream `seed` (device-neutral test data).
std::vector<float> normal_vector(int64_t n, uint64_t seed, double std = 1.0);

// Bitwise equality of two float/byte arrays; reports the first differing index.
::testing::AssertionResult bits_equal(const std::vector<float>& a, const std::vector<float>& b);
::testing::AssertionResult bits_equal(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);
// max |a - b| <= atol + rtol * |b| elementwise (b is the reference); NaNs must match.
::testing::AssertionResult all_close(const std::vector<float>& a, const std::vector<float>& b, double atol,
                                     double rtol);

#define NIB_INSTANTIATE_OPS_TEST(Fixture) \
  INSTANTIATE_TEST_SUITE_P(Backends, Fixture, ::testing::ValuesIn(::nibble::backend::testing::backend_kinds()), \
                           [](const ::testing::TestParamInfo<std::string>& i) { return i.param; })

}  // namespace nibble::backend::testing
