// Op tests of the format ops the recipes use, bit for bit against formats::*_cpu and core/bits.h
// on host vectors (the backends call the same host+device per-element functions, so any
// difference is a bug; SR gives the same bits for the same key): quantize / dequantize of every
// QuantFormat from F32 and BF16 inputs, RTN and SR where the format allows, the TE wgrad
// RHT-transpose operand, the TetraJet-v2 fused backward operand, the fused quantize + BF16 operand
// forms of all of these (the operand equals dequantize_bf16 of the parts, with and without the
// parts written), BF16 rounding and bits,
// channel gather / scatter, transposes, the RHT along rows and the calibration's column sums.
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/ops_test/ops_test_util.h"
#include "backend/ops_test/tolerance_util.h"
#include "core/bits.h"
#include "formats/quantize_cpu.h"

namespace nibble::backend::testing {
namespace {

namespace fm = ::nibble::formats;

// Normal values with a few zeros and one large outlier per 97 elements (scales see a spread).
std::vector<float> format_input(int64_t n, uint64_t seed) {
  std::vector<float> x = normal_vector(n, seed, 2.0);
  for (int64_t i = 0; i < n; i += 13) x[i] = 0.0f;
  for (int64_t i = 5; i < n; i += 97) x[i] *= 300.0f;
  return x;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16_bits(x[i]);
  return b;
}

std::vector<float> from_bf16(const std::vector<uint16_t>& b) {
  std::vector<float> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_bits_to_f32(b[i]);
  return x;
}

// The parts of a quantized tensor on the host.
struct HostQuant {
  std::vector<uint8_t> codes, scales;
  std::vector<float> outer;
};

class FormatOpsTest : public OpsTest {
 protected:
  HostQuant fetch(const QuantizedTensor& q) {
    HostQuant h;
    h.codes = download(q.codes, QuantizedTensor::code_bytes(q.format, q.rows, q.cols));
    h.scales = download(q.scales, QuantizedTensor::scale_bytes(q.format, q.rows, q.cols));
    const int64_t n_outer = QuantizedTensor::outer_count(q.format, q.rows, q.cols);
    if (n_outer > 0) h.outer = download(q.outer, n_outer);
    return h;
  }
  static void expect_same(const HostQuant& got, const HostQuant& ref, const std::string& where) {
    EXPECT_TRUE(bits_equal(got.codes, ref.codes)) << where << ": codes";
    EXPECT_TRUE(bits_equal(got.scales, ref.scales)) << where << ": scales";
    EXPECT_TRUE(bits_equal(got.outer, ref.outer)) << where << ": outer/amax";
  }
  // The BF16 GEMM operand dequantize_bf16 makes of q, on the host.
  std::vector<uint16_t> operand_of(const QuantizedTensor& q) {
    uint16_t* y = zeros<uint16_t>(q.rows * q.cols);
    be().dequantize_bf16(y, q);
    return download(y, q.rows * q.cols);
  }
  // n BF16 elements holding a NaN pattern no operand has (an unwritten element shows).
  uint16_t* unwritten_bf16(int64_t n) { return upload(std::vector<uint16_t>(static_cast<size_t>(n), 0x7FC1u)); }
  // Runs `fused(q, y)` into a fresh `format` (rows, cols) view, then again with the parts skipped:
  // y equals `want` (the unfused op's operand) both times, the parts equal `ref` (the TE amax too
  // when skipped).
  template <typename Fused>
  void check_fused(QuantFormat format, int64_t rows, int64_t cols, const HostQuant& ref,
                   const std::vector<uint16_t>& want, const std::string& where, const Fused& fused) {
    for (bool skip : {false, true}) {
      QuantizedBuffer fb;
      QuantizedTensor fq = fb.view(be(), format, rows, cols);
      if (skip) fq = Backend::operand_only(fq);
      uint16_t* y = unwritten_bf16(rows * cols);
      fused(fq, y);
      const std::string at = where + (skip ? ": fused, parts skipped" : ": fused");
      EXPECT_TRUE(same_bits(download(y, rows * cols), want)) << at << ": operand";
      if (!skip) {
        expect_same(fetch(fq), ref, at);
      } else if (fq.outer != nullptr) {
        EXPECT_TRUE(bits_equal(download(fq.outer, 1), ref.outer)) << at << ": amax";
      }
    }
  }

  // The CPU drivers' result for one format (x: F32 values; BF16 inputs are exact in F32 except
  // where a driver takes the bits, which `xb` then gives).
  static HostQuant reference(QuantFormat f, int64_t M, int64_t K, const std::vector<float>& x,
                             const std::vector<uint16_t>* xb, const fm::SrKey* sr) {
    HostQuant h;
    h.codes.resize(static_cast<size_t>(QuantizedTensor::code_bytes(f, M, K)));
    h.scales.resize(static_cast<size_t>(QuantizedTensor::scale_bytes(f, M, K)));
    h.outer.resize(static_cast<size_t>(QuantizedTensor::outer_count(f, M, K)));
    switch (f) {
      case QuantFormat::kNvfp4Te:
        h.outer[0] = xb ? fm::nvfp4_te_quantize_cpu(h.codes.data(), h.scales.data(), xb->data(), M, K, sr)
                        : fm::nvfp4_te_quantize_cpu(h.codes.data(), h.scales.data(), x.data(), M, K, sr);
        break;
      case QuantFormat::kNvfp4Te2d:
        h.outer[0] = fm::nvfp4_te_quantize_2d_cpu(h.codes.data(), h.scales.data(), nullptr, nullptr, x.data(), M, K);
        break;
      case QuantFormat::kNvfp4TwoLevel:
        if (xb)
          fm::nvfp4_2level_quantize_cpu(h.codes.data(), h.scales.data(), h.outer.data(), xb->data(), M, K, sr);
        else
          fm::nvfp4_2level_quantize_cpu(h.codes.data(), h.scales.data(), h.outer.data(), x.data(), M, K, sr);
        break;
      case QuantFormat::kMxfp8:
        if (xb)
          fm::mxfp8_quantize_cpu(h.codes.data(), h.scales.data(), xb->data(), M, K, fm::MxScaleRule::kRceil);
        else
          fm::mxfp8_quantize_cpu(h.codes.data(), h.scales.data(), x.data(), M, K, fm::MxScaleRule::kRceil);
        break;
    }
    return h;
  }

  static std::vector<float> dequantize_reference(QuantFormat f, int64_t M, int64_t K, const HostQuant& h) {
    std::vector<float> y(static_cast<size_t>(M * K));
    switch (f) {
      case QuantFormat::kNvfp4Te:
      case QuantFormat::kNvfp4Te2d:
        fm::nvfp4_te_dequantize_cpu(y.data(), h.codes.data(), h.scales.data(), h.outer[0], M, K);
        break;
      case QuantFormat::kNvfp4TwoLevel:
        fm::nvfp4_2level_dequantize_cpu(y.data(), h.codes.data(), h.scales.data(), h.outer.data(), M, K);
        break;
      case QuantFormat::kMxfp8:
        fm::mxfp8_dequantize_cpu(y.data(), h.codes.data(), h.scales.data(), M, K);
        break;
    }
    return y;
  }

  void check_format(QuantFormat f, int64_t M, int64_t K, bool bf16_input, const fm::SrKey* sr, uint64_t seed) {
    const std::string where = fmt::format("{} {}x{} {} {}", quant_format_name(f), M, K, bf16_input ? "bf16" : "f32",
                                          sr ? "sr" : "rtn");
    std::vector<float> x = format_input(M * K, seed);
    std::vector<uint16_t> xb = to_bf16(x);
    if (bf16_input) x = from_bf16(xb);
    const HostQuant ref = reference(f, M, K, x, bf16_input ? &xb : nullptr, sr);
    QuantizedBuffer qb;
    QuantizedTensor q = qb.view(be(), f, M, K);
    if (bf16_input)
      be().quantize(q, upload(xb), sr);
    else
      be().quantize(q, upload(x), sr);
    expect_same(fetch(q), ref, where);
    float* y = zeros<float>(M * K);
    be().dequantize(y, q);
    const std::vector<float> deq = dequantize_reference(f, M, K, ref);
    EXPECT_TRUE(bits_equal(download(y, M * K), deq)) << where << ": dequantize";
    // the BF16 GEMM operand: equal bits to the definition, and its accuracy as backend.h states
    uint16_t* yb = zeros<uint16_t>(M * K);
    be().dequantize_bf16(yb, q);
    const std::vector<uint16_t> got = download(yb, M * K);
    int wrong = 0;
    for (int64_t i = 0; i < M * K; ++i) {
      const float v = bf16_bits_to_f32(got[i]);
      if (f == QuantFormat::kNvfp4Te || f == QuantFormat::kNvfp4Te2d) {
        // code × E4M3 scale, exactly (the widened BF16 equals the FP32 product), no amax factor
        const float exact = fm::nvfp4_te_bf16_operand(fm::e2m1_unpack(ref.codes.data(), i), ref.scales[i / 16]);
        wrong += float_as_u32(v) != float_as_u32(exact);
      } else {
        // RNE of the FP32 dequantization; |error| <= 2^-8 |value| (BF16's unit roundoff: 8 significant
        // bits), exact for MXFP8's E4M3 × 2^k here
        wrong += got[i] != f32_to_bf16_bits(deq[i]);
        const double bound = f == QuantFormat::kMxfp8 ? 0.0 : 0x1p-8 * std::fabs(double(deq[i]));
        wrong += !(std::fabs(double(v) - double(deq[i])) <= bound);
      }
    }
    EXPECT_EQ(wrong, 0) << where << ": dequantize_bf16";
    // the fused quantize + BF16 operand: the same parts, and the operand just checked, bit for bit
    const float* xf = bf16_input ? nullptr : upload(x);
    const uint16_t* xh = bf16_input ? upload(xb) : nullptr;
    check_fused(f, M, K, ref, got, where, [&](QuantizedTensor& fq, uint16_t* y) {
      if (bf16_input) be().quantize_operand(fq, y, xh, sr);
      else be().quantize_operand(fq, y, xf, sr);
    });
  }
};

// The TE GEMM alpha on the device equals the host definition bit for bit, and alpha × the BF16
// operand reproduces the FP32 dequantization: the split rounds once (fl(amax/2688)), the
// dequantization three times (s·amax, /2688, × code), so they differ by <= 4 u of the value.
TEST_P(FormatOpsTest, Nvfp4TeAlphaOfTwoOperands) {
  const std::vector<float> amax = {3.5f, 0.0123f, 448.0f * 6.0f, 1e-30f, 0.0f};
  const float* ad = upload(amax);
  float* alpha = zeros<float>(amax.size() * amax.size());
  for (size_t i = 0; i < amax.size(); ++i)
    for (size_t j = 0; j < amax.size(); ++j) be().nvfp4_te_alpha(alpha + i * amax.size() + j, ad + i, ad + j);
  const std::vector<float> got = download(alpha, static_cast<int64_t>(amax.size() * amax.size()));
  for (size_t i = 0; i < amax.size(); ++i)
    for (size_t j = 0; j < amax.size(); ++j) {
      const float want = (amax[i] * fm::kRecip2688) * (amax[j] * fm::kRecip2688);
      EXPECT_EQ(float_as_u32(got[i * amax.size() + j]), float_as_u32(want)) << i << " " << j;
    }
  // one operand's share, every code and scale byte of a normal range
  for (float a : {3.5f, 0.0123f, 1000.0f})
    for (uint32_t sb = 8; sb < 0x7F; sb += 3)
      for (uint32_t code = 0; code < 16; ++code) {
        const double split = double(fm::nvfp4_te_bf16_operand(code, sb)) * double(a * fm::kRecip2688);
        const double deq = double(fm::nvfp4_te_decode(code, fm::nvfp4_te_dequant_factor(sb, a)));
        ASSERT_LE(std::fabs(split - deq), 4.5 * kUnitRoundoff * std::fabs(deq)) << a << " " << sb << " " << code;
      }
}

TEST_P(FormatOpsTest, QuantizeDequantizeEveryFormat) {
  const fm::SrKey key{0x5EED, 3};
  uint64_t seed = 1;
  for (bool bf16 : {false, true}) {
    for (auto [M, K] : {std::pair<int64_t, int64_t>{7, 48}, {33, 160}, {1, 16}}) {
      check_format(QuantFormat::kNvfp4Te, M, K, bf16, nullptr, ++seed);
      check_format(QuantFormat::kNvfp4Te, M, K, bf16, &key, ++seed);
    }
    for (auto [M, K] : {std::pair<int64_t, int64_t>{19, 64}, {16, 32}, {3, 16}})  // any M: last tile row padded
      check_format(QuantFormat::kNvfp4Te2d, M, K, bf16, nullptr, ++seed);
    for (auto [M, K] : {std::pair<int64_t, int64_t>{5, 272}, {3, 128}, {9, 48}}) {  // 272: a partial outer block
      check_format(QuantFormat::kNvfp4TwoLevel, M, K, bf16, nullptr, ++seed);
      check_format(QuantFormat::kNvfp4TwoLevel, M, K, bf16, &key, ++seed);
    }
    for (auto [M, K] : {std::pair<int64_t, int64_t>{9, 96}, {1, 32}})
      check_format(QuantFormat::kMxfp8, M, K, bf16, nullptr, ++seed);
  }
}

// Two SR keys differ (the key reaches the kernel), the same key repeats (the test can fail).
TEST_P(FormatOpsTest, StochasticRoundingFollowsTheKey) {
  const int64_t M = 4, K = 256;
  std::vector<float> x = format_input(M * K, 77);
  const float* xd = upload(x);
  QuantizedBuffer a, b;
  QuantizedTensor qa = a.view(be(), QuantFormat::kNvfp4TwoLevel, M, K), qb = b.view(be(), QuantFormat::kNvfp4TwoLevel, M, K);
  const fm::SrKey k1{1, 0}, k2{2, 0};
  be().quantize(qa, xd, &k1);
  be().quantize(qb, xd, &k2);
  EXPECT_FALSE(bits_equal(fetch(qa).codes, fetch(qb).codes));
  be().quantize(qb, xd, &k1);
  EXPECT_TRUE(bits_equal(fetch(qa).codes, fetch(qb).codes));
}

TEST_P(FormatOpsTest, TeRhtTransposeOperand) {
  const fm::SrKey key{9, 1};
  for (auto shape : {std::pair<int64_t, int64_t>{32, 48}, {16, 16}, {48, 80}}) {
    const int64_t M = shape.first, K = shape.second;  // named copies: lambdas capture them (clang 14)
    std::vector<uint16_t> x = to_bf16(format_input(M * K, 90 + M));
    for (const fm::SrKey* sr : {static_cast<const fm::SrKey*>(nullptr), &key}) {
      HostQuant ref;
      ref.codes.resize(static_cast<size_t>(K * M / 2));
      ref.scales.resize(static_cast<size_t>(K * M / 16));
      std::vector<uint16_t> yt_ref(static_cast<size_t>(K * M));
      ref.outer = {fm::nvfp4_te_quantize_rht_t_cpu(ref.codes.data(), ref.scales.data(), yt_ref.data(), x.data(), M, K, sr)};
      QuantizedBuffer qb;
      QuantizedTensor q = qb.view(be(), QuantFormat::kNvfp4Te, K, M);
      uint16_t* yt = zeros<uint16_t>(K * M);
      be().quantize_te_rht_transpose(q, yt, upload(x), M, K, sr);
      const std::string where = fmt::format("M={} K={} sr={}", M, K, sr != nullptr);
      expect_same(fetch(q), ref, where);
      EXPECT_TRUE(same_bits(download(yt, K * M), yt_ref)) << where << ": y_t";
      const uint16_t* xd = upload(x);
      check_fused(QuantFormat::kNvfp4Te, K, M, ref, operand_of(q), where, [&](QuantizedTensor& fq, uint16_t* y) {
        be().quantize_te_rht_transpose_operand(fq, y, zeros<uint16_t>(K * M), xd, M, K, sr);
      });
    }
  }
}

TEST_P(FormatOpsTest, TwoLevelBackwardOperand) {
  for (auto [M, K] : {std::pair<int64_t, int64_t>{128, 48}, {256, 144}}) {
    std::vector<float> x = format_input(M * K, 110 + K);
    HostQuant in;
    in.codes.resize(static_cast<size_t>(M * K / 2));
    in.scales.resize(static_cast<size_t>(M * K / 16));
    in.outer.resize(static_cast<size_t>(M * ((K + 127) / 128)));
    fm::nvfp4_2level_quantize_cpu(in.codes.data(), in.scales.data(), in.outer.data(), x.data(), M, K, nullptr);
    const fm::SrKey sr{0xABC, 7};
    const uint32_t mask = 0xB5A3u;
    HostQuant ref;
    ref.codes.resize(static_cast<size_t>(K * M / 2));
    ref.scales.resize(static_cast<size_t>(K * M / 16));
    ref.outer.resize(static_cast<size_t>(K * (M / 128)));
    fm::nvfp4_2level_backward_operand_cpu(ref.codes.data(), ref.scales.data(), ref.outer.data(), in.codes.data(),
                                          in.scales.data(), in.outer.data(), M, K, mask, sr);
    QuantizedTensor qin;
    qin.format = QuantFormat::kNvfp4TwoLevel, qin.rows = M, qin.cols = K;
    qin.codes = upload(in.codes), qin.scales = upload(in.scales), qin.outer = upload(in.outer);
    QuantizedBuffer ob;
    QuantizedTensor out = ob.view(be(), QuantFormat::kNvfp4TwoLevel, K, M);
    be().backward_operand_two_level(out, qin, mask, sr);
    const std::string where = fmt::format("M={} K={}", M, K);
    expect_same(fetch(out), ref, where);
    check_fused(QuantFormat::kNvfp4TwoLevel, K, M, ref, operand_of(out), where,
                [&](QuantizedTensor& fq, uint16_t* y) { be().backward_operand_two_level_bf16(fq, y, qin, mask, sr); });
  }
}

TEST_P(FormatOpsTest, Bf16RoundingAndBits) {
  std::vector<float> x = normal_vector(1001, 120, 100.0);
  // Ties (a bf16 value plus half an ulp, odd and even), NaN, infinities, subnormals, -0.
  x[0] = u32_as_float(0x3F808000u), x[1] = u32_as_float(0x3F818000u), x[2] = std::nanf("");
  x[3] = INFINITY, x[4] = -INFINITY, x[5] = u32_as_float(0x00000123u), x[6] = -0.0f, x[7] = u32_as_float(0x7F7FFFFFu);
  std::vector<float> ref(x.size());
  std::vector<uint16_t> bits_ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) ref[i] = round_to_bf16(x[i]), bits_ref[i] = f32_to_bf16_bits(x[i]);
  const int64_t n = static_cast<int64_t>(x.size());
  float* xd = upload(x);
  float* y = zeros<float>(n);
  be().round_to_bf16(y, xd, n);
  EXPECT_TRUE(bits_equal(download(y, n), ref));
  uint16_t* b = zeros<uint16_t>(n);
  be().to_bf16_bits(b, xd, n);
  EXPECT_TRUE(same_bits(download(b, n), bits_ref));
  // widening the bits back gives the rounded values, NaN payloads and -0 included
  float* w = zeros<float>(n);
  be().from_bf16_bits(w, b, n);
  EXPECT_TRUE(bits_equal(download(w, n), ref));
  be().round_to_bf16(xd, xd, n);  // in place
  EXPECT_TRUE(bits_equal(download(xd, n), ref));
}

TEST_P(FormatOpsTest, GatherColumnsBf16PadsWithZeros) {
  const int64_t rows = 5, rows_p = 8, src_cols = 13;
  std::vector<float> src = normal_vector(rows * src_cols, 130, 10.0);
  const float* sd = upload(src);
  const std::vector<int64_t> idx{12, 0, 7, 3};
  for (bool with_idx : {true, false}) {
    const int64_t n_idx = with_idx ? 4 : src_cols, cols_p = with_idx ? 6 : 16;
    std::vector<float> ref(static_cast<size_t>(rows_p * cols_p), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n_idx; ++j) ref[r * cols_p + j] = round_to_bf16(src[r * src_cols + (with_idx ? idx[j] : j)]);
    float* dst = upload(std::vector<float>(static_cast<size_t>(rows_p * cols_p), 5.0f));  // stale values
    be().gather_columns_bf16(dst, sd, rows, rows_p, src_cols, with_idx ? upload(idx) : nullptr, n_idx, cols_p);
    EXPECT_TRUE(bits_equal(download(dst, rows_p * cols_p), ref)) << "idx " << with_idx;
  }
}

TEST_P(FormatOpsTest, ScatterColumnsAddAndSet) {
  const int64_t N = 6, K = 13, ld = 5;
  const std::vector<int64_t> idx{11, 2, 5, 0};  // distinct channels, n_idx = 4 < ld
  const int64_t n_idx = 4;
  std::vector<float> t = normal_vector(N * ld, 140), dw = normal_vector(N * K, 141);
  std::vector<float> add_ref = dw, set_ref = dw;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < n_idx; ++j) {
      add_ref[n * K + idx[j]] += t[n * ld + j];
      set_ref[n * K + idx[j]] = t[n * ld + j];
    }
  const float* td = upload(t);
  const int64_t* id = upload(idx);
  float* a = upload(dw);
  be().scatter_add_columns(a, td, N, K, id, n_idx, ld);
  EXPECT_TRUE(bits_equal(download(a, N * K), add_ref));
  float* s = upload(dw);
  be().scatter_columns(s, td, N, K, id, n_idx, ld);
  EXPECT_TRUE(bits_equal(download(s, N * K), set_ref));
}

TEST_P(FormatOpsTest, TransposeFloatAndHalfWords) {
  for (auto [R, C] : {std::pair<int64_t, int64_t>{37, 29}, {1, 70}, {64, 33}}) {
    std::vector<float> x = normal_vector(R * C, 150 + R);
    std::vector<uint16_t> h = to_bf16(x);
    std::vector<float> xt(x.size());
    std::vector<uint16_t> ht(h.size());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) xt[c * R + r] = x[r * C + c], ht[c * R + r] = h[r * C + c];
    float* y = zeros<float>(R * C);
    be().transpose(y, upload(x), R, C);
    EXPECT_TRUE(bits_equal(download(y, R * C), xt)) << R << "x" << C;
    uint16_t* yh = zeros<uint16_t>(R * C);
    be().transpose(yh, upload(h), R, C);
    EXPECT_TRUE(same_bits(download(yh, R * C), ht)) << R << "x" << C;
  }
}

TEST_P(FormatOpsTest, Rht16RowsOutOfPlaceAndInPlace) {
  const int64_t rows = 7, cols = 48;
  const uint32_t mask = 0xA5C3u;
  std::vector<float> x = format_input(rows * cols, 160), ref(x.size());
  fm::rht16_rows_f32_cpu(ref.data(), x.data(), rows, cols, mask);
  float* xd = upload(x);
  float* y = zeros<float>(rows * cols);
  be().rht16_rows(y, xd, rows, cols, mask);
  EXPECT_TRUE(bits_equal(download(y, rows * cols), ref));
  be().rht16_rows(xd, xd, rows, cols, mask);
  EXPECT_TRUE(bits_equal(download(xd, rows * cols), ref));
}

// Both backends add each column's squares in row order in double: the same bits.
TEST_P(FormatOpsTest, ColumnSumsOfSquaresAccumulate) {
  for (auto [M, K] : {std::pair<int64_t, int64_t>{37, 29}, {9, 300}, {1, 1}}) {
    std::vector<float> x = normal_vector(M * K, 170 + M, 3.0);
    std::vector<double> sums(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k) sums[k] = 0.25 * double(k);
    std::vector<double> ref = sums;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) {
        const double v = x[m * K + k];
        ref[k] += v * v;
      }
    double* sd = upload(sums);
    be().column_sumsq_accumulate(sd, upload(x), M, K);
    EXPECT_TRUE(same_bits(download(sd, K), ref)) << M << "x" << K;
  }
}

NIB_INSTANTIATE_OPS_TEST(FormatOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
