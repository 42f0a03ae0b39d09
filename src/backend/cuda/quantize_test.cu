// GPU tests of the CUDA format kernels: (1) every golden file of ../shared/testdata/fp4
// reproduced bit for bit by the kernels; (2) every kernel compared bit for bit with the CPU
// reference driver (formats/quantize_cpu.h) on random inputs of several shapes, including
// non-multiple-of-tile shapes, zeros, NaN/Inf, and SR with several seeds. Every test skips
// (GTEST_SKIP) without a CUDA device, so GPU-less CI still runs the binary. The bandwidth
// benchmark lives here too, as a disabled test (run with --gtest_also_run_disabled_tests).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/bench.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/quantize.h"
#include "core/bits.h"
#include "core/philox.h"
#include "formats/bf16_test_util.h"
#include "formats/e4m3.h"
#include "formats/golden.h"
#include "formats/nvfp4.h"
#include "formats/quantize_cpu.h"
#include "formats/rht.h"
#include "formats/swizzle.h"

namespace nibble::cuda {
namespace {

namespace fm = ::nibble::formats;

bool gpu_available() {
  static bool ok = [] {
    Status s = init();
    if (!s.is_ok()) std::fprintf(stderr, "[cuda tests] %s\n", s.message().c_str());
    return s.is_ok();
  }();
  return ok;
}

#define NIB_REQUIRE_GPU() \
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device"

// A device copy of a host vector (or an uninitialised buffer poisoned with 0xA5 bytes, so
// unwritten outputs show up as mismatches).
template <typename T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) {
    NIB_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)));
    NIB_CUDA_CHECK(cudaMemset(p_, 0xA5, std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) {
    if (!h.empty()) NIB_CUDA_CHECK(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  T* get() const { return p_; }
  std::vector<T> host() const {
    NIB_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(n_);
    if (n_) NIB_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

void expect_ok(const Status& s) { ASSERT_TRUE(s.is_ok()) << s.message(); }

// BF16 bits viewed as a value for comparisons: NaN matches any NaN, like float.
struct Bf16 {
  uint16_t bits;
};
std::vector<Bf16> as_bf16(const std::vector<uint16_t>& v) {
  std::vector<Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i].bits = v[i];
  return out;
}

// Bit-exact comparison; floats compare by bits except that any NaN matches any NaN (the README
// compares NaN by position).
template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    bool eq;
    if constexpr (std::is_same_v<T, float>) {
      eq = std::memcmp(&got[i], &want[i], 4) == 0 || (std::isnan(got[i]) && std::isnan(want[i]));
    } else if constexpr (std::is_same_v<T, Bf16>) {
      auto nan = [](uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu) != 0; };
      eq = got[i].bits == want[i].bits || (nan(got[i].bits) && nan(want[i].bits));
    } else {
      eq = got[i] == want[i];
    }
    if (!eq && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  auto show = [](T v) {
    if constexpr (std::is_same_v<T, float>) return std::to_string(v);
    else if constexpr (std::is_same_v<T, Bf16>) return std::to_string(v.bits);
    else return std::to_string(static_cast<uint64_t>(v));
  };
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " differ; first at " << first << ": got "
                                       << show(got[first]) << " want " << show(want[first]);
}

// ---- inputs ------------------------------------------------------------------------------------

enum class Fill { kNormal, kWide, kZeros, kSpecial };

// x (M, K) f32: N(0,1), or times a lognormal(0,3) factor per 16 elements (wide), all zeros, or
// normal with ~3% zeros / -0.0 / NaN / +-Inf / huge / subnormal values sprinkled in (special).
std::vector<float> make_input(int64_t M, int64_t K, Fill fill, uint64_t seed) {
  PhiloxStream rng(seed, 99);
  std::vector<float> x(static_cast<size_t>(M * K));
  float factor = 1.0f;
  for (size_t i = 0; i < x.size(); ++i) {
    if (i % 16 == 0) factor = static_cast<float>(std::exp(3.0 * rng.next_normal()));
    float v = static_cast<float>(rng.next_normal());
    switch (fill) {
      case Fill::kNormal: x[i] = v; break;
      case Fill::kWide: x[i] = v * factor; break;
      case Fill::kZeros: x[i] = (i % 3 == 0) ? -0.0f : 0.0f; break;
      case Fill::kSpecial: {
        uint64_t r = rng.next_below(200);
        const float kSpecials[] = {0.0f, -0.0f, NAN, INFINITY, -INFINITY, 3e38f, -1e-40f, 2688.0f};
        x[i] = r < 8 ? kSpecials[r] : v;
        break;
      }
    }
  }
  return x;
}

using fm::testing::from_bf16;
using fm::testing::to_bf16;

struct Shape2 {
  int64_t M, K;
};

// ---- golden files --------------------------------------------------------------------------------

const char* kKinds[] = {"normal", "student_t3", "wide", "ties_zero", "allzero"};

TEST(CudaGolden, Nvfp4Te1x16) {
  NIB_REQUIRE_GPU();
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    auto f = fm::golden::load(std::string("nvfp4_te_1x16_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    Dev<float> x(xt.as<float>());
    Dev<uint8_t> codes(M * K / 2), scales(M * K / 16);
    Dev<float> amax(1), y(M * K);
    expect_ok(quantize_nvfp4_te(codes.get(), scales.get(), amax.get(), x.get(), M, K));
    expect_ok(dequantize_nvfp4_te(y.get(), codes.get(), scales.get(), amax.get(), M, K));
    EXPECT_TRUE(same_bits(codes.host(), f.at("codes").as<uint8_t>()));
    EXPECT_TRUE(same_bits(scales.host(), f.at("scales").as<uint8_t>()));
    EXPECT_TRUE(same_bits(amax.host(), f.at("amax").as<float>()));
    EXPECT_TRUE(same_bits(y.host(), f.at("dequant").as<float>()));
  }
}

TEST(CudaGolden, Nvfp4Te2d) {
  NIB_REQUIRE_GPU();
  for (const char* kind : {"normal", "wide", "ties_zero"}) {
    SCOPED_TRACE(kind);
    auto f = fm::golden::load(std::string("nvfp4_te_2d_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    Dev<float> x(xt.as<float>());
    Dev<uint8_t> codes(M * K / 2), scales(M * K / 16), codes_t(K * M / 2), scales_t(K * ((M + 15) / 16));
    Dev<float> amax(1), y(M * K);
    expect_ok(quantize_nvfp4_te_2d(codes.get(), scales.get(), codes_t.get(), scales_t.get(), amax.get(), x.get(), M, K));
    expect_ok(dequantize_nvfp4_te(y.get(), codes.get(), scales.get(), amax.get(), M, K));
    EXPECT_TRUE(same_bits(codes.host(), f.at("codes").as<uint8_t>()));
    EXPECT_TRUE(same_bits(scales.host(), f.at("scales").as<uint8_t>()));
    EXPECT_TRUE(same_bits(amax.host(), f.at("amax").as<float>()));
    EXPECT_TRUE(same_bits(y.host(), f.at("dequant").as<float>()));
    EXPECT_TRUE(same_bits(codes_t.host(), f.at("codes_t").as<uint8_t>()));
    EXPECT_TRUE(same_bits(scales_t.host(), f.at("scales_t").as<uint8_t>()));
  }
}

// The TE wgrad transform's element-by-element loads: K % 8 != 0 (rows not in whole 16-byte
// chunks), and an x that is not 16-byte aligned; special values (NaN, Inf, wide tiles that take
// the double form) included.
TEST(CudaVsCpu, RhtTransposeBf16UnalignedRows) {
  NIB_REQUIRE_GPU();
  for (auto [M, K, offset] : {std::tuple<int64_t, int64_t, int64_t>{32, 20, 0}, {144, 13, 0}, {128, 64, 1}}) {
    SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(K) + " offset " + std::to_string(offset));
    const int64_t n = M * K;
    auto xb = to_bf16(make_input(M, K, Fill::kSpecial, static_cast<uint64_t>(M + K)));
    std::vector<uint16_t> ref(n), padded(offset, 0);
    fm::rht16_te_transpose_cpu(ref.data(), xb.data(), M, K);
    padded.insert(padded.end(), xb.begin(), xb.end());
    Dev<uint16_t> xbd(padded), yt(n);
    expect_ok(rht16_transpose_bf16(yt.get(), xbd.get() + offset, M, K, fm::kRhtTeSignMask));
    EXPECT_TRUE(same_bits(as_bf16(yt.host()), as_bf16(ref)));
  }
}

TEST(CudaGolden, Nvfp4TeRht) {
  NIB_REQUIRE_GPU();
  auto f = fm::golden::load("nvfp4_te_rht_normal");
  const auto& xt = f.at("x_bf16");
  int64_t M = xt.shape[0], K = xt.shape[1];
  Dev<uint16_t> xb(xt.as<uint16_t>());
  Dev<uint16_t> yt(K * M);
  Dev<uint8_t> codes_t(K * M / 2), scales_t(K * M / 16);
  Dev<float> amax_t(1), deq_t(K * M);
  expect_ok(quantize_nvfp4_te_rht_t(codes_t.get(), scales_t.get(), amax_t.get(), yt.get(), xb.get(), M, K));
  expect_ok(dequantize_nvfp4_te(deq_t.get(), codes_t.get(), scales_t.get(), amax_t.get(), K, M));
  EXPECT_TRUE(same_bits(as_bf16(yt.host()), as_bf16(f.at("x_t_rht").as<uint16_t>())));
  EXPECT_TRUE(same_bits(amax_t.host(), f.at("amax_t").as<float>()));
  EXPECT_TRUE(same_bits(codes_t.host(), f.at("codes_t").as<uint8_t>()));
  EXPECT_TRUE(same_bits(scales_t.host(), f.at("scales_t").as<uint8_t>()));
  EXPECT_TRUE(same_bits(deq_t.host(), f.at("dequant_t").as<float>()));
  // Rowwise (no RHT) from the BF16 tensor: quantizes exactly like its f32 upcast `x`.
  Dev<uint8_t> codes(M * K / 2), scales(M * K / 16);
  Dev<float> amax(1);
  expect_ok(quantize_nvfp4_te(codes.get(), scales.get(), amax.get(), static_cast<const uint16_t*>(xb.get()), M, K));
  EXPECT_TRUE(same_bits(codes.host(), f.at("codes").as<uint8_t>()));
  EXPECT_TRUE(same_bits(scales.host(), f.at("scales").as<uint8_t>()));
  EXPECT_TRUE(same_bits(amax.host(), f.at("amax").as<float>()));
}

TEST(CudaGolden, Nvfp4TwoLevel) {
  NIB_REQUIRE_GPU();
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    auto f = fm::golden::load(std::string("nvfp4_tetrajet_v2_doubleblock_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    Dev<float> x(xt.as<float>());
    Dev<uint8_t> codes(M * K / 2), inner(M * K / 16);
    Dev<float> outer(M * K / 128), y(M * K);
    expect_ok(quantize_nvfp4_2level(codes.get(), inner.get(), outer.get(), x.get(), M, K));
    expect_ok(dequantize_nvfp4_2level(y.get(), codes.get(), inner.get(), outer.get(), M, K));
    EXPECT_TRUE(same_bits(codes.host(), f.at("codes").as<uint8_t>()));
    EXPECT_TRUE(same_bits(inner.host(), f.at("inner_scales").as<uint8_t>()));
    EXPECT_TRUE(same_bits(outer.host(), f.at("outer_scales").as<float>()));
    EXPECT_TRUE(same_bits(y.host(), f.at("dequant").as<float>()));
  }
}

TEST(CudaGolden, Mxfp4) {
  NIB_REQUIRE_GPU();
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    auto f = fm::golden::load(std::string("mxfp4_e2m1_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    Dev<float> x(xt.as<float>());
    struct R { const char* prefix; MxScaleRule rule; bool deq; };
    for (R r : {R{"floor", MxScaleRule::kFloor, true}, R{"rceil", MxScaleRule::kRceil, true}, R{"te_ceil", MxScaleRule::kTeCeil, false}}) {
      SCOPED_TRACE(r.prefix);
      Dev<uint8_t> codes(M * K / 2), scales(M * K / 32);
      Dev<float> y(M * K);
      expect_ok(quantize_mxfp4(codes.get(), scales.get(), x.get(), M, K, r.rule));
      EXPECT_TRUE(same_bits(codes.host(), f.at(std::string(r.prefix) + "_codes").as<uint8_t>()));
      EXPECT_TRUE(same_bits(scales.host(), f.at(std::string(r.prefix) + "_scales").as<uint8_t>()));
      if (r.deq) {
        expect_ok(dequantize_mxfp4(y.get(), codes.get(), scales.get(), M, K));
        EXPECT_TRUE(same_bits(y.host(), f.at(std::string(r.prefix) + "_dequant").as<float>()));
      }
    }
  }
}

TEST(CudaGolden, Mxfp8) {
  NIB_REQUIRE_GPU();
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    auto f = fm::golden::load(std::string("mxfp8_e4m3_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    Dev<float> x(xt.as<float>());
    for (auto [prefix, rule] : {std::pair{"floor", MxScaleRule::kFloor}, std::pair{"rceil", MxScaleRule::kRceil}}) {
      SCOPED_TRACE(prefix);
      Dev<uint8_t> elems(M * K), scales(M * K / 32);
      Dev<float> y(M * K);
      expect_ok(quantize_mxfp8(elems.get(), scales.get(), x.get(), M, K, rule));
      expect_ok(dequantize_mxfp8(y.get(), elems.get(), scales.get(), M, K));
      EXPECT_TRUE(same_bits(elems.host(), f.at(std::string(prefix) + "_codes").as<uint8_t>()));
      EXPECT_TRUE(same_bits(scales.host(), f.at(std::string(prefix) + "_scales").as<uint8_t>()));
      EXPECT_TRUE(same_bits(y.host(), f.at(std::string(prefix) + "_dequant").as<float>()));
    }
  }
}

// ---- GPU vs the CPU reference drivers ---------------------------------------------------------------

const Fill kFills[] = {Fill::kNormal, Fill::kWide, Fill::kZeros, Fill::kSpecial};
const char* fill_name(Fill f) {
  switch (f) {
    case Fill::kNormal: return "normal";
    case Fill::kWide: return "wide";
    case Fill::kZeros: return "zeros";
    default: return "special";
  }
}
const uint64_t kSeeds[] = {1, 2, 0xDEADBEEFCAFEull};

// Runs `body(x_f32, M, K, seed)` for each shape and fill, with a trace naming them.
template <typename Body>
void for_inputs(const std::vector<Shape2>& shapes, Body body) {
  uint64_t seed = 100;
  for (Shape2 s : shapes)
    for (Fill fill : kFills) {
      SCOPED_TRACE(std::to_string(s.M) + "x" + std::to_string(s.K) + " " + fill_name(fill));
      body(make_input(s.M, s.K, fill, ++seed), s.M, s.K);
    }
}

// Shapes whose K is a multiple of 16 (TE, 2-level), of 32 (MX), and with M % 128 == 0 (fused op).
const std::vector<Shape2> kShapes16 = {{1, 16}, {7, 48}, {33, 160}, {128, 256}, {61, 400}};
// (9 x 1056: two whole 512-element groups per row for the CPU's AVX-512 MX BF16 kernels, then a tail.)
const std::vector<Shape2> kShapes32 = {{1, 32}, {7, 96}, {33, 160}, {128, 256}, {61, 416}, {9, 1056}};

template <typename In>
void check_te(const std::vector<In>& xin, int64_t M, int64_t K) {
  const int64_t n = M * K;
  Dev<In> x(xin);
  for (int s = -1; s < 3; ++s) {
    SCOPED_TRACE(s < 0 ? std::string("rtn") : "sr seed " + std::to_string(kSeeds[s]));
    fm::SrKey key{s < 0 ? 0 : kSeeds[s], 5};
    const fm::SrKey* sr = s < 0 ? nullptr : &key;
    std::vector<uint8_t> c_ref(n / 2), s_ref(n / 16);
    float amax_ref = fm::nvfp4_te_quantize_cpu(c_ref.data(), s_ref.data(), xin.data(), M, K, sr);
    Dev<uint8_t> codes(n / 2), scales(n / 16);
    Dev<float> amax(1);
    expect_ok(quantize_nvfp4_te(codes.get(), scales.get(), amax.get(), x.get(), M, K, sr));
    EXPECT_TRUE(same_bits(codes.host(), c_ref));
    EXPECT_TRUE(same_bits(scales.host(), s_ref));
    EXPECT_TRUE(same_bits(amax.host(), std::vector<float>{amax_ref}));
    if (s < 0) {
      std::vector<float> y_ref(n);
      fm::nvfp4_te_dequantize_cpu(y_ref.data(), c_ref.data(), s_ref.data(), amax_ref, M, K);
      Dev<float> y(n);
      Dev<uint16_t> yb(n);
      expect_ok(dequantize_nvfp4_te(y.get(), codes.get(), scales.get(), amax.get(), M, K));
      expect_ok(dequantize_nvfp4_te(yb.get(), codes.get(), scales.get(), amax.get(), M, K));
      EXPECT_TRUE(same_bits(y.host(), y_ref));
      EXPECT_TRUE(same_bits(as_bf16(yb.host()), as_bf16(to_bf16(y_ref))));
      // Swizzled scales: the CPU linear result, rearranged.
      std::vector<uint8_t> swz_ref(fm::swizzled_scale_bytes(M, K / 16));
      fm::scales_linear_to_swizzled(swz_ref.data(), s_ref.data(), M, K / 16);
      Dev<uint8_t> codes2(n / 2), swz(swz_ref.size());
      expect_ok(quantize_nvfp4_te(codes2.get(), swz.get(), amax.get(), x.get(), M, K, nullptr, AmaxMode::kCompute,
                                  ScaleLayout::kSwizzled));
      EXPECT_TRUE(same_bits(swz.host(), swz_ref));
      EXPECT_TRUE(same_bits(codes2.host(), c_ref));
      // Given amax (any value >= max|x|, here twice the true one).
      float amax2 = amax_ref * 2.0f;
      fm::nvfp4_te_quantize_with_amax_cpu(c_ref.data(), s_ref.data(), xin.data(), M, K, amax2);
      Dev<float> a2(std::vector<float>{amax2});
      expect_ok(quantize_nvfp4_te(codes2.get(), scales.get(), a2.get(), x.get(), M, K, nullptr, AmaxMode::kGiven));
      EXPECT_TRUE(same_bits(codes2.host(), c_ref));
      EXPECT_TRUE(same_bits(scales.host(), s_ref));
    }
  }
}

TEST(CudaVsCpu, Nvfp4TeF32) {
  NIB_REQUIRE_GPU();
  for_inputs(kShapes16, [](const std::vector<float>& x, int64_t M, int64_t K) { check_te(x, M, K); });
}
TEST(CudaVsCpu, Nvfp4TeBf16) {
  NIB_REQUIRE_GPU();
  for_inputs(kShapes16, [](const std::vector<float>& x, int64_t M, int64_t K) { check_te(to_bf16(x), M, K); });
}

TEST(CudaVsCpu, Absmax) {
  NIB_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{1} << 20, (int64_t{1} << 20) + 3}) {
    for (Fill fill : kFills) {
      auto x = make_input(1, n, fill, static_cast<uint64_t>(n) + 7);
      Dev<float> xd(x), a(1);
      expect_ok(absmax(a.get(), xd.get(), n));
      EXPECT_TRUE(same_bits(a.host(), std::vector<float>{fm::amax_cpu(x.data(), n)})) << n << " " << fill_name(fill);
    }
  }
}

TEST(CudaVsCpu, Nvfp4Te2d) {
  NIB_REQUIRE_GPU();
  // M need not be a multiple of 16 (last tile row zero-padded); columnwise output needs M even.
  for_inputs({{16, 16}, {6, 48}, {34, 160}, {128, 512}, {62, 400}, {288, 96}}, [](const std::vector<float>& x, int64_t M,
                                                                                   int64_t K) {
    const int64_t n = M * K, mt = (M + 15) / 16;
    std::vector<uint8_t> c_ref(n / 2), s_ref(n / 16), ct_ref(n / 2), st_ref(K * mt);
    float amax_ref = fm::nvfp4_te_quantize_2d_cpu(c_ref.data(), s_ref.data(), ct_ref.data(), st_ref.data(), x.data(), M, K);
    Dev<float> xd(x), amax(1);
    Dev<uint8_t> codes(n / 2), scales(n / 16), codes_t(n / 2), scales_t(K * mt);
    expect_ok(quantize_nvfp4_te_2d(codes.get(), scales.get(), codes_t.get(), scales_t.get(), amax.get(), xd.get(), M, K));
    EXPECT_TRUE(same_bits(codes.host(), c_ref));
    EXPECT_TRUE(same_bits(scales.host(), s_ref));
    EXPECT_TRUE(same_bits(codes_t.host(), ct_ref));
    EXPECT_TRUE(same_bits(scales_t.host(), st_ref));
    EXPECT_TRUE(same_bits(amax.host(), std::vector<float>{amax_ref}));
    // BF16 input: rowwise only, rowwise + columnwise, and the swizzled scale layout with the
    // columnwise scales alone.
    auto xb = to_bf16(x);
    const std::vector<float> xbf = from_bf16(xb);
    fm::nvfp4_te_quantize_2d_cpu(c_ref.data(), s_ref.data(), ct_ref.data(), st_ref.data(), xbf.data(), M, K);
    Dev<uint16_t> xbd(xb);
    const uint16_t* xbp = xbd.get();
    expect_ok(quantize_nvfp4_te_2d(codes.get(), scales.get(), nullptr, nullptr, amax.get(), xbp, M, K));
    EXPECT_TRUE(same_bits(codes.host(), c_ref));
    EXPECT_TRUE(same_bits(scales.host(), s_ref));
    Dev<uint8_t> codes2(n / 2), codes_t2(n / 2), scales_t2(K * mt);
    expect_ok(quantize_nvfp4_te_2d(codes2.get(), scales.get(), codes_t2.get(), scales_t2.get(), amax.get(), xbp, M, K));
    EXPECT_TRUE(same_bits(codes2.host(), c_ref));
    EXPECT_TRUE(same_bits(codes_t2.host(), ct_ref));
    EXPECT_TRUE(same_bits(scales_t2.host(), st_ref));
    std::vector<uint8_t> swz_ref(fm::swizzled_scale_bytes(M, K / 16));
    fm::scales_linear_to_swizzled(swz_ref.data(), s_ref.data(), M, K / 16);
    Dev<uint8_t> swz(swz_ref.size()), scales_t3(K * mt);
    expect_ok(quantize_nvfp4_te_2d(codes2.get(), swz.get(), nullptr, scales_t3.get(), amax.get(), xbp, M, K,
                                   AmaxMode::kCompute, ScaleLayout::kSwizzled));
    EXPECT_TRUE(same_bits(swz.host(), swz_ref));
    EXPECT_TRUE(same_bits(scales_t3.host(), st_ref));
    EXPECT_TRUE(same_bits(codes2.host(), c_ref));
    // codes_t only 8-byte aligned (all the API asks): the 16-byte column stores give way to bytes.
    Dev<uint8_t> ct_off(n / 2 + 8);
    expect_ok(quantize_nvfp4_te_2d(codes2.get(), scales.get(), ct_off.get() + 8, nullptr, amax.get(), xbp, M, K));
    std::vector<uint8_t> got_off = ct_off.host();
    got_off.erase(got_off.begin(), got_off.begin() + 8);
    EXPECT_TRUE(same_bits(got_off, ct_ref));
  });
}

template <typename In>
void check_2level(const std::vector<In>& xin, int64_t M, int64_t K) {
  const int64_t n = M * K, no = (K + 127) / 128;
  Dev<In> x(xin);
  for (int s = -1; s < 3; ++s) {
    SCOPED_TRACE(s < 0 ? std::string("rtn") : "sr seed " + std::to_string(kSeeds[s]));
    fm::SrKey key{s < 0 ? 0 : kSeeds[s], 9};
    const fm::SrKey* sr = s < 0 ? nullptr : &key;
    std::vector<uint8_t> c_ref(n / 2), i_ref(n / 16);
    std::vector<float> o_ref(M * no);
    fm::nvfp4_2level_quantize_cpu(c_ref.data(), i_ref.data(), o_ref.data(), xin.data(), M, K, sr);
    Dev<uint8_t> codes(n / 2), inner(n / 16);
    Dev<float> outer(M * no);
    expect_ok(quantize_nvfp4_2level(codes.get(), inner.get(), outer.get(), x.get(), M, K, sr));
    EXPECT_TRUE(same_bits(codes.host(), c_ref));
    EXPECT_TRUE(same_bits(inner.host(), i_ref));
    EXPECT_TRUE(same_bits(outer.host(), o_ref));
    if (s < 0) {
      std::vector<float> y_ref(n);
      fm::nvfp4_2level_dequantize_cpu(y_ref.data(), c_ref.data(), i_ref.data(), o_ref.data(), M, K);
      Dev<float> y(n);
      expect_ok(dequantize_nvfp4_2level(y.get(), codes.get(), inner.get(), outer.get(), M, K));
      EXPECT_TRUE(same_bits(y.host(), y_ref));
      Dev<uint16_t> yb(n);
      expect_ok(dequantize_nvfp4_2level(yb.get(), codes.get(), inner.get(), outer.get(), M, K));
      EXPECT_TRUE(same_bits(as_bf16(yb.host()), as_bf16(to_bf16(y_ref))));
      std::vector<uint8_t> swz_ref(fm::swizzled_scale_bytes(M, K / 16));
      fm::scales_linear_to_swizzled(swz_ref.data(), i_ref.data(), M, K / 16);
      Dev<uint8_t> swz(swz_ref.size());
      expect_ok(quantize_nvfp4_2level(codes.get(), swz.get(), outer.get(), x.get(), M, K, nullptr, ScaleLayout::kSwizzled));
      EXPECT_TRUE(same_bits(swz.host(), swz_ref));
    }
  }
}

TEST(CudaVsCpu, Nvfp4TwoLevelF32) {
  NIB_REQUIRE_GPU();
  for_inputs(kShapes16, [](const std::vector<float>& x, int64_t M, int64_t K) { check_2level(x, M, K); });
}
TEST(CudaVsCpu, Nvfp4TwoLevelBf16) {
  NIB_REQUIRE_GPU();
  for_inputs(kShapes16, [](const std::vector<float>& x, int64_t M, int64_t K) { check_2level(to_bf16(x), M, K); });
}
// Shapes larger than one resident grid of the persistent 2-level quantize kernel, so threads
// run more than one iteration of its grid-stride loop (with the prefetched next load): on an H200
// (132 SMs; ptxas: 62-79 registers, i.e. 3-4 CTAs of 256 threads per SM) one grid covers at most
// 132*4*256 lanes x 16 elements = 2.2M elements; 1031 x 4368 (4.5M, K % 128 == 16: partial last
// 128-block, the lane index by division) and 1280 x 4608 (5.9M, K % 128 == 0: the division-free
// lane index) exceed it 2-3 times. CUDA-vs-CPU bit-exactness as above.
const std::vector<Shape2> kShapesGridStride = {{1031, 4368}, {1280, 4608}};
TEST(CudaVsCpu, Nvfp4TwoLevelGridStride) {
  NIB_REQUIRE_GPU();
  for_inputs(kShapesGridStride, [](const std::vector<float>& x, int64_t M, int64_t K) {
    check_2level(to_bf16(x), M, K);
    check_2level(x, M, K);
  });
}

// ---- the packed BF16 RTN path of the TE and 2-level kernels (backend/cuda/bf16_e2m1.cuh) -------

// Every BF16 bit pattern once (65536 = 256 x 256), in a fixed scrambled order (i -> i * 40503 +
// 12345 mod 2^16 is a bijection); NaN patterns kept (their blocks take the per-element path) or
// replaced by +0 (nearly every block takes the packed path).
std::vector<uint16_t> every_bf16_pattern(bool keep_nan) {
  std::vector<uint16_t> x(65536);
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t b = static_cast<uint16_t>((i * 40503u + 12345u) & 0xFFFFu);
    x[i] = (!keep_nan && (b & 0x7FFFu) > 0x7F80u) ? uint16_t{0} : b;
  }
  return x;
}

// Blocks of small integers times a power of two: "round" block scales whose decision points fall
// exactly on BF16 values, so elements sit on E2M1 rounding ties.
std::vector<uint16_t> round_blocks(int64_t M, int64_t K, uint64_t seed) {
  PhiloxStream rng(seed, 17);
  std::vector<uint16_t> x(static_cast<size_t>(M * K));
  int e = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (i % 16 == 0) e = static_cast<int>(rng.next_below(41)) - 20;
    const int k = static_cast<int>(rng.next_below(25)) - 12;
    x[i] = f32_to_bf16_bits(std::ldexp(static_cast<float>(k), e));
  }
  return x;
}

// Elements planted on and around every decision point of their own block: each 16-block has a
// random amax A (element 0; the first block of a 128-block holds the 128-block max) and 15
// elements at BF16 patterns (y_k >> 16) + d, d in -1..2, y_k = fl(T_k * s) for the decision values
// T_k of e2m1_rne_index, where s is the block's scale as the CPU reference forms it (sp for
// 2-level; fl(e4m3 * s_dec) for TE).
std::vector<uint16_t> planted_thresholds(int64_t M, int64_t K, bool te, uint64_t seed) {
  PhiloxStream rng(seed, 23);
  std::vector<float> amax(static_cast<size_t>(M * K / 16));
  for (size_t b = 0; b < amax.size(); ++b) {
    amax[b] = bf16_bits_to_f32(f32_to_bf16_bits(static_cast<float>(std::exp2(rng.next_uniform() * 60.0 - 30.0))));
    if (b % 8 != 0) amax[b] = std::min(amax[b], amax[b - b % 8]);  // block 0 of a 128-block holds its max
  }
  float gmax = 0.0f;
  for (float a : amax) gmax = std::max(gmax, a);
  const fm::Nvfp4TeGlobal g = fm::nvfp4_te_global(gmax);
  std::vector<uint16_t> x(static_cast<size_t>(M * K));
  for (size_t b = 0; b < amax.size(); ++b) {
    float s;
    if (te) {
      s = fm::e4m3_decode(fm::nvfp4_te_block_scale(amax[b], g)) * g.s_dec;
    } else {
      const float so = fm::nvfp4_2level_outer_scale(amax[b - b % 8]);
      s = fm::nvfp4_2level_block_scale(fm::nvfp4_2level_inner_scale(amax[b], so), so);
    }
    x[16 * b] = f32_to_bf16_bits(amax[b]);
    for (int i = 1; i < 16; ++i) {
      constexpr float kDecision[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
      const float t = kDecision[rng.next_below(7)];
      const int d = static_cast<int>(rng.next_below(4)) - 1;
      const uint32_t pat = (float_as_u32(t * s) >> 16) + static_cast<uint32_t>(d);
      const float v = std::min(bf16_bits_to_f32(static_cast<uint16_t>(pat)), amax[b]);
      x[16 * b + i] = static_cast<uint16_t>(f32_to_bf16_bits(v) | (rng.next_below(2) ? 0x8000u : 0u));
    }
  }
  return x;
}

TEST(CudaVsCpu, Bf16PackedRtnPath) {
  NIB_REQUIRE_GPU();
  for (bool keep_nan : {false, true}) {
    SCOPED_TRACE(keep_nan ? "every BF16 pattern" : "every BF16 pattern, NaN -> 0");
    const auto x = every_bf16_pattern(keep_nan);
    check_te(x, 256, 256);
    check_2level(x, 256, 256);
  }
  {
    SCOPED_TRACE("round blocks");
    const auto x = round_blocks(96, 512, 5);
    check_te(x, 96, 512);
    check_2level(x, 96, 512);
  }
  SCOPED_TRACE("planted thresholds");
  check_te(planted_thresholds(64, 1024, true, 6), 64, 1024);
  check_2level(planted_thresholds(64, 1024, false, 7), 64, 1024);
}

template <typename In>
void check_mx(const std::vector<In>& xin, int64_t M, int64_t K) {
  const int64_t n = M * K;
  Dev<In> x(xin);
  for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil, MxScaleRule::kTeCeil}) {
    SCOPED_TRACE("rule " + std::to_string(static_cast<int>(rule)));
    for (int s = -1; s < 3; ++s) {
      SCOPED_TRACE(s < 0 ? std::string("rtn") : "sr seed " + std::to_string(kSeeds[s]));
      fm::SrKey key{s < 0 ? 0 : kSeeds[s], 13};
      const fm::SrKey* sr = s < 0 ? nullptr : &key;
      std::vector<uint8_t> c_ref(n / 2), s_ref(n / 32);
      fm::mxfp4_quantize_cpu(c_ref.data(), s_ref.data(), xin.data(), M, K, rule, sr);
      Dev<uint8_t> codes(n / 2), scales(n / 32);
      expect_ok(quantize_mxfp4(codes.get(), scales.get(), x.get(), M, K, rule, sr));
      EXPECT_TRUE(same_bits(codes.host(), c_ref));
      EXPECT_TRUE(same_bits(scales.host(), s_ref));
      if (s < 0) {
        std::vector<float> y_ref(n);
        fm::mxfp4_dequantize_cpu(y_ref.data(), c_ref.data(), s_ref.data(), M, K);
        Dev<float> y(n);
        expect_ok(dequantize_mxfp4(y.get(), codes.get(), scales.get(), M, K));
        EXPECT_TRUE(same_bits(y.host(), y_ref));
        Dev<uint16_t> yb(n);
        expect_ok(dequantize_mxfp4(yb.get(), codes.get(), scales.get(), M, K));
        EXPECT_TRUE(same_bits(as_bf16(yb.host()), as_bf16(to_bf16(y_ref))));
        std::vector<uint8_t> swz_ref(fm::swizzled_scale_bytes(M, K / 32));
        fm::scales_linear_to_swizzled(swz_ref.data(), s_ref.data(), M, K / 32);
        Dev<uint8_t> swz(swz_ref.size());
        expect_ok(quantize_mxfp4(codes.get(), swz.get(), x.get(), M, K, rule, nullptr, ScaleLayout::kSwizzled));
        EXPECT_TRUE(same_bits(swz.host(), swz_ref));
      }
    }
    if (rule == MxScaleRule::kTeCeil) continue;
    std::vector<uint8_t> e_ref(n), s_ref(n / 32);
    fm::mxfp8_quantize_cpu(e_ref.data(), s_ref.data(), xin.data(), M, K, rule);
    Dev<uint8_t> elems(n), scales(n / 32);
    expect_ok(quantize_mxfp8(elems.get(), scales.get(), x.get(), M, K, rule));
    EXPECT_TRUE(same_bits(elems.host(), e_ref));
    EXPECT_TRUE(same_bits(scales.host(), s_ref));
    std::vector<float> y_ref(n);
    fm::mxfp8_dequantize_cpu(y_ref.data(), e_ref.data(), s_ref.data(), M, K);
    Dev<float> y(n);
    expect_ok(dequantize_mxfp8(y.get(), elems.get(), scales.get(), M, K));
    EXPECT_TRUE(same_bits(y.host(), y_ref));
    Dev<uint16_t> yb(n);
    expect_ok(dequantize_mxfp8(yb.get(), elems.get(), scales.get(), M, K));
    EXPECT_TRUE(same_bits(as_bf16(yb.host()), as_bf16(to_bf16(y_ref))));
  }
}

TEST(CudaVsCpu, MxF32) {
  NIB_REQUIRE_GPU();
  for_inputs(kShapes32, [](const std::vector<float>& x, int64_t M, int64_t K) { check_mx(x, M, K); });
}
TEST(CudaVsCpu, MxBf16) {
  NIB_REQUIRE_GPU();
  for_inputs(kShapes32, [](const std::vector<float>& x, int64_t M, int64_t K) { check_mx(to_bf16(x), M, K); });
}

TEST(CudaVsCpu, Guided) {
  NIB_REQUIRE_GPU();
  for_inputs(kShapes16, [](const std::vector<float>& x, int64_t M, int64_t K) {
    const int64_t n = M * K, no = (K + 127) / 128;
    // The rollout quantized a nearby tensor (x + small noise); the trainer rounds x guided by it.
    std::vector<float> xr(x);
    PhiloxStream rng(7, 1);
    for (auto& v : xr) v = v + 0.05f * static_cast<float>(rng.next_normal());
    std::vector<uint8_t> rc(n / 2), rs(n / 16), ri(n / 16), rc2(n / 2), mb(n / 8), mb2(n / 8);
    std::vector<float> ro(M * no);
    float ramax = fm::nvfp4_te_quantize_cpu(rc.data(), rs.data(), xr.data(), M, K);
    fm::nvfp4_2level_quantize_cpu(rc2.data(), ri.data(), ro.data(), xr.data(), M, K);
    fm::e2m1_mantissa_bits_cpu(mb.data(), rc.data(), M, K);
    fm::e2m1_mantissa_bits_cpu(mb2.data(), rc2.data(), M, K);
    Dev<float> xd(x), ramax_d(std::vector<float>{ramax}), ro_d(ro);
    Dev<uint8_t> rs_d(rs), ri_d(ri), rc_d(rc), rc2_d(rc2), mb_d(mb), mb2_d(mb2), codes(n / 2);
    for (GuidanceKind kind : {GuidanceKind::kFull, GuidanceKind::kMantissaBit}) {
      SCOPED_TRACE(kind == GuidanceKind::kFull ? "full" : "mbit");
      const bool full = kind == GuidanceKind::kFull;
      std::vector<uint8_t> ref(n / 2);
      fm::nvfp4_te_quantize_guided_cpu(ref.data(), x.data(), M, K, rs.data(), ramax, full ? rc.data() : mb.data(), kind);
      expect_ok(quantize_nvfp4_te_guided(codes.get(), static_cast<const float*>(xd.get()), M, K, rs_d.get(),
                                         ramax_d.get(), full ? rc_d.get() : mb_d.get(), kind));
      EXPECT_TRUE(same_bits(codes.host(), ref));
      fm::nvfp4_2level_quantize_guided_cpu(ref.data(), x.data(), M, K, ri.data(), ro.data(), full ? rc2.data() : mb2.data(), kind);
      expect_ok(quantize_nvfp4_2level_guided(codes.get(), static_cast<const float*>(xd.get()), M, K, ri_d.get(),
                                             ro_d.get(), full ? rc2_d.get() : mb2_d.get(), kind));
      EXPECT_TRUE(same_bits(codes.host(), ref));
    }
  });
}

TEST(CudaVsCpu, RhtAndTranspose) {
  NIB_REQUIRE_GPU();
  for_inputs({{16, 16}, {48, 48}, {128, 256}, {80, 208}}, [](const std::vector<float>& x, int64_t M, int64_t K) {
    const int64_t n = M * K;
    // TE wgrad transform (bf16 in, bf16 out) and the one-call quantized operand, RTN and SR.
    auto xb = to_bf16(x);
    std::vector<uint16_t> yt_ref(n);
    fm::rht16_te_transpose_cpu(yt_ref.data(), xb.data(), M, K);
    Dev<uint16_t> xbd(xb), yt(n);
    expect_ok(rht16_transpose_bf16(yt.get(), xbd.get(), M, K, fm::kRhtTeSignMask));
    // NaN produced inside the transform (inf - inf) has a platform-defined sign (x86: negative
    // default NaN, CUDA: canonical positive NaN), so NaN compares by position.
    EXPECT_TRUE(same_bits(as_bf16(yt.host()), as_bf16(yt_ref)));
    for (int s = -1; s < 2; ++s) {
      fm::SrKey key{s < 0 ? 0 : kSeeds[s], 17};
      const fm::SrKey* sr = s < 0 ? nullptr : &key;
      std::vector<uint8_t> ct_ref(n / 2), st_ref(n / 16);
      std::vector<uint16_t> scratch(n);
      float at_ref = fm::nvfp4_te_quantize_rht_t_cpu(ct_ref.data(), st_ref.data(), scratch.data(), xb.data(), M, K, sr);
      Dev<uint8_t> ct(n / 2), st(n / 16);
      Dev<float> at(1);
      expect_ok(quantize_nvfp4_te_rht_t(ct.get(), st.get(), at.get(), yt.get(), xbd.get(), M, K, sr));
      EXPECT_TRUE(same_bits(ct.host(), ct_ref));
      EXPECT_TRUE(same_bits(st.host(), st_ref));
      EXPECT_TRUE(same_bits(at.host(), std::vector<float>{at_ref}));
    }
    // TetraJet-v2 random-sign transform along rows, f32.
    for (uint64_t seed : kSeeds) {
      uint32_t mask = fm::rht_random_sign_mask(seed, 3);
      std::vector<float> y_ref(n);
      fm::rht16_rows_f32_cpu(y_ref.data(), x.data(), M, K, mask);
      Dev<float> xd(x), y(n);
      expect_ok(rht16_rows_f32(y.get(), xd.get(), M, K, mask));
      EXPECT_TRUE(same_bits(y.host(), y_ref));
    }
    // Transpose.
    std::vector<float> t_ref(n);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) t_ref[k * M + m] = x[m * K + k];
    Dev<float> xd(x), t(n);
    expect_ok(transpose(t.get(), static_cast<const float*>(xd.get()), M, K));
    EXPECT_TRUE(same_bits(t.host(), t_ref));
  });
}

// Packed E2M1 codes equal nibble by nibble, except that where the value being quantized (`pre`,
// one per element) is NaN the sign bit may differ: 2-level codes take signbit(x), and a NaN made
// inside the RHT (inf - inf) has a platform-defined sign (x86 default NaN is negative, CUDA's
// canonical NaN positive). The magnitude must still match (NaN -> index 0 on both).
::testing::AssertionResult same_codes_nan_sign_free(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                                                    const std::vector<float>& pre) {
  size_t bad = 0, first = 0, nan_sign = 0;
  for (size_t i = 0; i < 2 * got.size(); ++i) {
    uint32_t g = (got[i / 2] >> (4 * (i % 2))) & 0xF, w = (want[i / 2] >> (4 * (i % 2))) & 0xF;
    bool eq = g == w || (std::isnan(pre[i]) && (g & 7) == (w & 7));
    nan_sign += g != w && eq;
    if (!eq && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess() << nan_sign << " NaN-sign differences";
  return ::testing::AssertionFailure() << bad << " of " << 2 * got.size() << " codes differ; first element " << first;
}

// kernel_util.cuh's nvfp4_2level_decode8 (the fused op's decode) against the definition: every
// code in every nibble position, for scales spanning the binary32 range (subnormal, huge, 0, Inf,
// NaN). out[j*128 + c] = decode8 of a word holding code c in position c % 8, scale j.
__global__ void decode8_kernel(uint32_t* out, const float* sps, int nsp) {
  const int j = blockIdx.x, c = threadIdx.x;  // c < 128: code c & 15 at nibble (c >> 4)
  if (j >= nsp || c >= 128) return;
  const int pos = c >> 4;
  const uint32_t w = (static_cast<uint32_t>(c & 15) << (4 * pos)) | (0x9u << (4 * ((pos + 3) & 7)));
  float y[8];
  nvfp4_2level_decode8(y, w, sps[j]);
  out[j * 128 + c] = __float_as_uint(y[pos]);
}

TEST(CudaVsCpu, Decode8EqualsDefinition) {
  NIB_REQUIRE_GPU();
  std::vector<float> sps = {0.0f, 1e-45f, 1e-40f, 0x1p-126f, 1.0f, 0.75f, 448.0f, 3e38f, INFINITY, NAN};
  PhiloxStream rng(31, 1);
  for (int i = 0; i < 200; ++i) sps.push_back(static_cast<float>(std::exp2(rng.next_uniform() * 250.0 - 140.0)));
  Dev<float> sd(sps);
  Dev<uint32_t> out(sps.size() * 128);
  decode8_kernel<<<static_cast<int>(sps.size()), 128>>>(out.get(), sd.get(), static_cast<int>(sps.size()));
  NIB_CUDA_CHECK_LAUNCH();
  const std::vector<uint32_t> got = out.host();
  for (size_t j = 0; j < sps.size(); ++j)
    for (uint32_t c = 0; c < 128; ++c) {
      const float want = fm::nvfp4_2level_decode(c & 15u, sps[j]);
      const uint32_t g = got[j * 128 + c];
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(u32_as_float(g))) << "code " << (c & 15u) << " sp " << sps[j];
      } else {
        ASSERT_EQ(g, float_as_u32(want)) << "code " << (c & 15u) << " sp " << sps[j];
      }
    }
}

// e2m1_decode8_mul (the table decode of the fused op and the dequantizers) against the
// definitions: random code words (every code lands in every nibble position many times), both sign
// tables (the second flips every code's sign: the RHT sign of a row), factors spanning the binary32
// range, negative, zero, subnormal, infinite and NaN ones included. Equal to fl(e2m1_decode(code) *
// factor) (TE, MXFP4) everywhere and to nvfp4_2level_decode for every finite factor.
// out[(j * 2 + flip) * nw * 8 + w * 8 + i].
__global__ void decode8_mul_kernel(float* out, const uint32_t* words, int nw, const float* sps) {
  const int j = blockIdx.x, flip = blockIdx.y;
  for (int w = threadIdx.x; w < nw; w += blockDim.x) {
    float y[8];
    e2m1_decode8_mul(y, words[w], sps[j], flip ? 0x7F7F7F7Fu : 0x80808080u);
    for (int i = 0; i < 8; ++i) out[((j * 2 + flip) * static_cast<int64_t>(nw) + w) * 8 + i] = y[i];
  }
}

TEST(CudaVsCpu, DecodeMulEqualsDefinitions) {
  NIB_REQUIRE_GPU();
  std::vector<float> sps = {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-40f, 0x1p-126f, 1.0f,      -1.0f,
                            0.75f, 448.0f, 3e38f, -3e38f, INFINITY, -INFINITY, NAN};
  PhiloxStream rng(32, 1);
  for (int i = 0; i < 100; ++i) {
    const float sp = static_cast<float>(std::exp2(rng.next_uniform() * 250.0 - 140.0));
    sps.push_back(i % 2 ? -sp : sp);
  }
  std::vector<uint32_t> words(2048);
  for (uint32_t& w : words) w = rng.next_u32();
  const int nw = static_cast<int>(words.size()), nsp = static_cast<int>(sps.size());
  Dev<uint32_t> wd(words);
  Dev<float> sd(sps), out(static_cast<size_t>(nsp) * 2 * nw * 8);
  decode8_mul_kernel<<<dim3(nsp, 2), 256>>>(out.get(), wd.get(), nw, sd.get());
  NIB_CUDA_CHECK_LAUNCH();
  const std::vector<float> got = out.host();
  for (int j = 0; j < nsp; ++j)
    for (int flip = 0; flip < 2; ++flip)
      for (int w = 0; w < nw; ++w)
        for (int i = 0; i < 8; ++i) {
          const uint32_t code = ((words[w] >> (4 * i)) & 15u) ^ (flip ? 8u : 0u);
          const float g = got[((static_cast<size_t>(j) * 2 + flip) * nw + w) * 8 + i];
          const float te = fm::e2m1_decode(code) * sps[j];
          if (std::isnan(te)) {
            ASSERT_TRUE(std::isnan(g)) << "code " << code << " factor " << sps[j];
          } else {
            ASSERT_EQ(float_as_u32(g), float_as_u32(te)) << "code " << code << " factor " << sps[j] << " flip " << flip;
          }
          if (std::isfinite(sps[j]))
            ASSERT_EQ(float_as_u32(g), float_as_u32(fm::nvfp4_2level_decode(code, sps[j])))
                << "code " << code << " sp " << sps[j] << " flip " << flip;
        }
}

// sign_nibbles8: the sign bits of 8 floats at bits 4i + 3, for random bit patterns (NaN, -0.0 and
// every sign combination among them).
__global__ void sign_nibbles8_kernel(uint32_t* out, const uint32_t* bits, int n8) {
  for (int w = blockIdx.x * blockDim.x + threadIdx.x; w < n8; w += gridDim.x * blockDim.x) {
    float v[8];
    for (int i = 0; i < 8; ++i) v[i] = __uint_as_float(bits[8 * w + i]);
    out[w] = sign_nibbles8(v);
  }
}

TEST(CudaVsCpu, SignNibbles8) {
  NIB_REQUIRE_GPU();
  PhiloxStream rng(33, 1);
  std::vector<uint32_t> bits(8 * 4096);
  for (uint32_t& b : bits) b = rng.next_u32();
  for (size_t i = 0; i < 8 * 256; ++i) bits[i] = ((i / 8) >> (i % 8) & 1u) ? 0x80000000u : 0u;  // +-0, all 256 sign sets
  Dev<uint32_t> bd(bits), out(bits.size() / 8);
  sign_nibbles8_kernel<<<16, 256>>>(out.get(), bd.get(), static_cast<int>(bits.size() / 8));
  NIB_CUDA_CHECK_LAUNCH();
  const std::vector<uint32_t> got = out.host();
  for (size_t w = 0; w < got.size(); ++w) {
    uint32_t want = 0;
    for (int i = 0; i < 8; ++i) want |= (bits[8 * w + i] >> 31) << (4 * i + 3);
    ASSERT_EQ(got[w], want) << "word " << w;
  }
}

// The fused op on one forward-quantized operand (codes, inner, outer of an [M, K] tensor) against
// the CPU reference (SR) and the unfused GPU chain (RTN and SR), for three seeds.
void check_fused(const std::vector<uint8_t>& c, const std::vector<uint8_t>& in, const std::vector<float>& o, int64_t M,
                 int64_t K) {
  const int64_t n = M * K;
  Dev<uint8_t> cd(c), ind(in);
  Dev<float> od(o);
  for (uint64_t seed : kSeeds) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const uint32_t mask = fm::rht_random_sign_mask(seed, 21);
    const fm::SrKey key{seed, 22};
    std::vector<uint8_t> ct_ref(n / 2), it_ref(n / 16);
    std::vector<float> ot_ref(K * (M / 128));
    fm::nvfp4_2level_backward_operand_cpu(ct_ref.data(), it_ref.data(), ot_ref.data(), c.data(), in.data(), o.data(), M,
                                          K, mask, key);
    Dev<uint8_t> ct(n / 2), it(n / 16);
    Dev<float> ot(K * (M / 128));
    expect_ok(nvfp4_2level_transpose_rht_requantize(ct.get(), it.get(), ot.get(), cd.get(), ind.get(), od.get(), M, K,
                                                    mask, &key));
    // The values the CPU quantizes: dequant -> transpose -> RHT (to know where they are NaN).
    std::vector<float> deq_cpu(n), pre(n);
    fm::nvfp4_2level_dequantize_cpu(deq_cpu.data(), c.data(), in.data(), o.data(), M, K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) pre[k * M + m] = deq_cpu[m * K + k];
    fm::rht16_rows_f32_cpu(pre.data(), pre.data(), K, M, mask);
    EXPECT_TRUE(same_codes_nan_sign_free(ct.host(), ct_ref, pre));
    EXPECT_TRUE(same_bits(it.host(), it_ref));
    EXPECT_TRUE(same_bits(ot.host(), ot_ref));
    // The unfused GPU chain gives the same bits (RTN here checks the kernel's RTN path too).
    Dev<float> deq(n), deq_t(n), rot(n);
    expect_ok(dequantize_nvfp4_2level(deq.get(), cd.get(), ind.get(), od.get(), M, K));
    expect_ok(transpose(deq_t.get(), static_cast<const float*>(deq.get()), M, K));
    expect_ok(rht16_rows_f32(rot.get(), deq_t.get(), K, M, mask));
    for (const fm::SrKey* sr : {static_cast<const fm::SrKey*>(nullptr), &key}) {
      Dev<uint8_t> c2(n / 2), i2(n / 16), c3(n / 2), i3(n / 16);
      Dev<float> o2(K * (M / 128)), o3(K * (M / 128));
      expect_ok(quantize_nvfp4_2level(c2.get(), i2.get(), o2.get(), static_cast<const float*>(rot.get()), K, M, sr));
      expect_ok(nvfp4_2level_transpose_rht_requantize(c3.get(), i3.get(), o3.get(), cd.get(), ind.get(), od.get(), M, K,
                                                      mask, sr));
      EXPECT_TRUE(same_bits(c3.host(), c2.host()));
      EXPECT_TRUE(same_bits(i3.host(), i2.host()));
      EXPECT_TRUE(same_bits(o3.host(), o2.host()));
    }
  }
}

TEST(CudaVsCpu, FusedBackwardOperand) {
  NIB_REQUIRE_GPU();
  for_inputs({{128, 16}, {128, 48}, {256, 128}, {128, 320}, {384, 272}}, [](const std::vector<float>& x, int64_t M, int64_t K) {
    const int64_t n = M * K, no = (K + 127) / 128;
    std::vector<uint8_t> c(n / 2), in(n / 16);
    std::vector<float> o(M * no);
    fm::nvfp4_2level_quantize_cpu(c.data(), in.data(), o.data(), x.data(), M, K);
    check_fused(c, in, o, M, K);
  });
}

// Operands no quantizer would write: random code bytes, random inner scale bytes (negative, and in
// the second round NaN E4M3 0x7F / 0xFF) and outer scales spread over 2^-140 .. 2^120 with either
// sign (second round: some 0, subnormal, Inf and NaN). Reaches the blocks the fast paths leave to
// the general ones: non-finite decode scales, RHT outputs below 2^-58 or above 2^62, NaN blocks,
// block scales out of [2^-60, 2^60]. The third round keeps every block scale in the kernel's tame
// range (0, or positive in [2^-33, 2^55]: inner bytes 0x00 .. 0x7E times outer scales in
// [2^-24, 2^46]) and spreads it over that whole range, so the tiles skip the per-block range test
// on the largest and smallest values the argument for skipping it allows.
TEST(CudaVsCpu, FusedBackwardOperandRawBytes) {
  NIB_REQUIRE_GPU();
  const int64_t M = 256, K = 208, no = (K + 127) / 128;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round == 0 ? "finite scales" : (round == 1 ? "any scales" : "tame scales at their bounds"));
    PhiloxStream rng(34 + round, 1);
    std::vector<uint8_t> c(M * K / 2), in(M * K / 16);
    std::vector<float> o(M * no);
    for (uint8_t& b : c) b = static_cast<uint8_t>(rng.next_u32());
    for (uint8_t& b : in) {
      b = static_cast<uint8_t>(rng.next_u32());
      if (round == 2) b &= 0x7F;
      if (round != 1 && (b & 0x7F) == 0x7F) b = 0x7E;
    }
    for (float& v : o) {
      const uint32_t r = rng.next_u32();
      if (round == 2) {
        v = static_cast<float>(std::exp2(rng.next_uniform() * 70.0 - 24.0));  // [2^-24, 2^46), and the edges:
        if (r % 8 == 0) v = 0x1p-24f;
        if (r % 8 == 1) v = std::nextafter(0x1p46f, 0.0f);
        continue;
      }
      v = static_cast<float>(std::exp2(rng.next_uniform() * 260.0 - 140.0)) * ((r & 1u) ? -1.0f : 1.0f);
      if (round == 1 && (r >> 1) % 16 == 0) {
        const float specials[] = {0.0f, 1e-42f, INFINITY, -INFINITY, NAN, -0.0f};
        v = specials[(r >> 5) % 6];
      }
    }
    check_fused(c, in, o, M, K);
  }
}

TEST(CudaApi, BadShapesReturnStatus) {
  NIB_REQUIRE_GPU();
  Dev<float> x(64), a(1), o(4);
  Dev<uint8_t> c(64), s(64);
  EXPECT_EQ(quantize_nvfp4_te(c.get(), s.get(), a.get(), x.get(), 2, 24).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(quantize_mxfp4(c.get(), s.get(), x.get(), 1, 48, MxScaleRule::kFloor).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(quantize_mxfp8(c.get(), s.get(), x.get(), 1, 32, MxScaleRule::kTeCeil).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(nvfp4_2level_transpose_rht_requantize(c.get(), s.get(), o.get(), c.get(), s.get(), o.get(), 64, 16, 0, nullptr).code(),
            StatusCode::kInvalidArgument);
}

TEST(CudaApi, TensorAllocatorRoundTrip) {
  NIB_REQUIRE_GPU();
  Tensor h = Tensor::from_floats({1.0f, -2.0f, 3.5f, NAN}, {2, 2});
  Tensor d = h.to(Device::kCUDA);
  EXPECT_EQ(d.device(), Device::kCUDA);
  Tensor back = d.to(Device::kCPU);
  EXPECT_EQ(std::memcmp(back.raw(), h.raw(), h.nbytes()), 0);
  auto info = device_info(0);
  ASSERT_TRUE(info.is_ok()) << info.status().message();
  std::printf("[cuda tests] %s\n", describe(*info).c_str());
}

// ---- bandwidth benchmark (disabled by default; scripts/gpu_check.sh runs it) ---------------------

TEST(CudaBench, DISABLED_QuantizeBandwidth) {
  NIB_REQUIRE_GPU();
  BandwidthBenchConfig cfg;
  if (const char* q = std::getenv("NIBBLE_BENCH_QUICK"); q && *q == '1') {
    cfg.shapes = {{4096, 4096}};
    cfg.repeats = 5;
  }
  auto rows = run_quantize_bandwidth_bench(cfg);
  ASSERT_TRUE(rows.is_ok()) << rows.status().message();
  std::string table = format_bandwidth_table(*rows);
  std::printf("%s", table.c_str());
  if (const char* out = std::getenv("NIBBLE_BENCH_OUT"); out && *out) {
    std::ofstream f(out);
    f << table;
  }
}

}  // namespace
}  // namespace nibble::cuda
