// Tests of the tetrajet-v2 recipe: forward/backward equal the six quantizers composed by hand
// from the formats drivers (explicit zero padding, plain dequantize-transpose-RHT-requantize in
// place of the fused op) bit for bit, with and without outlier channels; the aligned SR estimator
// is unbiased for the gradient of the forward actually computed (bounds from the sample variance
// and a computed saturation allowance); the switches change exactly what they should; padding;
// outlier selection; OsciReset on a constructed oscillation; state round trips.
#include "model/recipe_tetrajet_v2.h"

#include <cmath>
#include <cstring>
#include <numeric>

#include <gtest/gtest.h>

#include "backend/cpu/gemm.h"
#include "core/bits.h"
#include "core/philox.h"
#include "formats/quantize_cpu.h"

namespace nibble::model {
namespace {

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  PhiloxStream r(seed, 17);
  std::vector<float> v(n);
  for (auto& x : v) x = round_to_bf16(scale * static_cast<float>(r.next_normal()));
  return v;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

RecipeConfig tj(bool align = true, bool sr = true, bool rht = true) {
  RecipeConfig c;
  c.name = "tetrajet-v2";
  c.alignment = align;
  c.sr = sr;
  c.rht = rht;
  return c;
}
std::unique_ptr<TetraJetV2LinearRecipe> make_tj(const RecipeConfig& c, int64_t N, int64_t K) {
  LinearInfo info;
  info.N = N;
  info.K = K;
  info.num_blocks = 1;
  auto r = make_linear_recipe(c, info);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return std::unique_ptr<TetraJetV2LinearRecipe>(static_cast<TetraJetV2LinearRecipe*>(std::move(r).value().release()));
}

// deq (rows, cols) <- nvfp4-2level quantize-dequantize along cols.
void q2l(float* deq, const float* src, int64_t rows, int64_t cols, const formats::SrKey* sr) {
  std::vector<uint8_t> c(rows * cols / 2), in(rows * cols / 16);
  std::vector<float> o(rows * ((cols + 127) / 128));
  formats::nvfp4_2level_quantize_cpu(c.data(), in.data(), o.data(), src, rows, cols, sr);
  formats::nvfp4_2level_dequantize_cpu(deq, c.data(), in.data(), o.data(), rows, cols);
}
void qmx8(float* deq, const float* src, int64_t rows, int64_t cols) {
  std::vector<uint8_t> e(rows * cols), s(rows * cols / 32);
  formats::mxfp8_quantize_cpu(e.data(), s.data(), src, rows, cols, formats::MxScaleRule::kRceil);
  formats::mxfp8_dequantize_cpu(deq, e.data(), s.data(), rows, cols);
}
// dst (rows_p, cols) <- src (rows, cols) with zero rows appended.
std::vector<float> pad_rows(const std::vector<float>& src, int64_t rows, int64_t rows_p, int64_t cols) {
  std::vector<float> d(rows_p * cols, 0.0f);
  std::copy(src.begin(), src.begin() + rows * cols, d.begin());
  return d;
}
std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}
// columns `idx` of a (rows, K) into (rows, cols_p), zero-padded
std::vector<float> gather(const std::vector<float>& a, int64_t rows, int64_t K, const std::vector<int64_t>& idx, int64_t cols_p) {
  std::vector<float> d(rows * cols_p, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (size_t j = 0; j < idx.size(); ++j) d[r * cols_p + j] = a[r * K + idx[j]];
  return d;
}

// The BF16 GEMM operand of dequantized values (backend dequantize_bf16): each value rounded to
// the nearest BF16, ties to even. For nvfp4-2level this is the accepted rounding of the FP32
// outer scale (relative error <= 2^-8, BF16's unit roundoff; docs/architecture.md); MXFP8 values
// are exact. The
// re-quantizations (alignment) read the FP32 values, so only GEMM operands go through here.
std::vector<float> bf16_operand(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = round_to_bf16(v[i]);
  return r;
}

// The whole recipe composed from drivers. outliers: channel ids (ascending) or empty.
struct Ref {
  std::vector<float> y, dx, dw;
};
Ref reference(const RecipeConfig& cfg, const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& dy,
              int64_t M, int64_t N, int64_t K, const LinearCall& call, const std::vector<int64_t>& out) {
  const int64_t Mp = (M + 127) / 128 * 128, Np = (N + 127) / 128 * 128;
  std::vector<int64_t> main;
  for (int64_t k = 0; k < K; ++k)
    if (!std::binary_search(out.begin(), out.end(), k)) main.push_back(k);
  const int64_t nm = main.size(), Km = (nm + 15) / 16 * 16, no = out.size(), No = (no + 31) / 32 * 32;
  auto xm = gather(pad_rows(x, M, Mp, K), Mp, K, main, Km), wm = gather(pad_rows(w, N, Np, K), Np, K, main, Km);
  std::vector<float> xq(Mp * Km), wq(Np * Km), xoq(Mp * No), woq(N * No);
  q2l(xq.data(), xm.data(), Mp, Km, nullptr);
  q2l(wq.data(), wm.data(), Np, Km, nullptr);
  Ref r;
  r.y.assign(M * N, 0.0f);
  cpu::matmul_nt(r.y.data(), bf16_operand(xq).data(), bf16_operand(wq).data(), M, N, Km);
  auto xo = gather(pad_rows(x, M, Mp, K), Mp, K, out, No), wo = gather(w, N, K, out, No);
  if (no > 0) {
    qmx8(xoq.data(), xo.data(), Mp, No);
    qmx8(woq.data(), wo.data(), N, No);
    cpu::matmul_nt(r.y.data(), bf16_operand(xoq).data(), bf16_operand(woq).data(), M, N, No, true);
  }
  for (auto& v : r.y) v = round_to_bf16(v);
  // backward
  formats::SrKey k3{call.seed, linear_call_stream(call, kTetraStreamQ3)}, k4{call.seed, linear_call_stream(call, kTetraStreamQ4)};
  formats::SrKey k5{call.seed, linear_call_stream(call, kTetraStreamQ5)}, k6{call.seed, linear_call_stream(call, kTetraStreamQ6)};
  uint32_t sd = formats::rht_random_sign_mask(call.seed, linear_call_stream(call, kTetraStreamRhtDgrad));
  uint32_t sw = formats::rht_random_sign_mask(call.seed, linear_call_stream(call, kTetraStreamRhtWgrad));
  std::vector<float> dyp(Mp * Np, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) dyp[m * Np + n] = dy[m * N + n];
  // dgrad
  std::vector<float> a(dyp.begin(), dyp.begin() + M * Np), q3(M * Np);
  if (cfg.rht) formats::rht16_rows_f32_cpu(a.data(), a.data(), M, Np, sd);
  q2l(q3.data(), a.data(), M, Np, cfg.sr ? &k3 : nullptr);
  std::vector<float> wfull(Np * K, 0.0f);  // Ŵ (Np,K) from both parts, or BF16 W
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) wfull[n * K + k] = w[n * K + k];
  if (cfg.alignment) {
    std::fill(wfull.begin(), wfull.end(), 0.0f);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < nm; ++j) wfull[n * K + main[j]] = wq[n * Km + j];
      for (int64_t j = 0; j < no; ++j) wfull[n * K + out[j]] = woq[n * No + j];
    }
  }
  auto t4 = transpose(wfull, Np, K);
  if (cfg.rht) formats::rht16_rows_f32_cpu(t4.data(), t4.data(), K, Np, sd);
  std::vector<float> q4(K * Np);
  q2l(q4.data(), t4.data(), K, Np, cfg.sr ? &k4 : nullptr);
  r.dx.assign(M * K, 0.0f);
  cpu::matmul_nt(r.dx.data(), bf16_operand(q3).data(), bf16_operand(q4).data(), M, K, Np);
  for (auto& v : r.dx) v = round_to_bf16(v);
  // wgrad
  auto t5 = transpose(dyp, Mp, Np);
  if (cfg.rht) formats::rht16_rows_f32_cpu(t5.data(), t5.data(), Np, Mp, sw);
  std::vector<float> q5(Np * Mp);
  q2l(q5.data(), t5.data(), Np, Mp, cfg.sr ? &k5 : nullptr);
  r.dw.assign(N * K, 0.25f);
  auto t6 = transpose(cfg.alignment ? xq : xm, Mp, Km);
  if (cfg.rht) formats::rht16_rows_f32_cpu(t6.data(), t6.data(), Km, Mp, sw);
  std::vector<float> q6(Km * Mp), part(N * Km);
  q2l(q6.data(), t6.data(), Km, Mp, cfg.sr ? &k6 : nullptr);
  if (no == 0) {
    cpu::matmul_nt(r.dw.data(), bf16_operand(q5).data(), bf16_operand(q6).data(), N, K, Mp, true);
  } else {
    cpu::matmul_nt(part.data(), bf16_operand(q5).data(), bf16_operand(q6).data(), N, Km, Mp);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < nm; ++j) r.dw[n * K + main[j]] += part[n * Km + j];
    auto t7 = transpose(cfg.alignment ? xoq : xo, Mp, No);
    if (cfg.rht) formats::rht16_rows_f32_cpu(t7.data(), t7.data(), No, Mp, sw);
    std::vector<float> q7(No * Mp), p7(N * No);
    qmx8(q7.data(), t7.data(), No, Mp);
    cpu::matmul_nt(p7.data(), bf16_operand(q5).data(), bf16_operand(q7).data(), N, No, Mp);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < no; ++j) r.dw[n * K + out[j]] += p7[n * No + j];
  }
  return r;
}

Ref run(LinearRecipe& r, const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& dy, int64_t M,
        int64_t N, int64_t K, const LinearCall& call) {
  Ref o;
  o.y.assign(M * N, 0);
  o.dx.assign(M * K, 0);
  o.dw.assign(N * K, 0.25f);
  r.forward(o.y.data(), x.data(), w.data(), M, N, K, call);
  r.backward(o.dx.data(), o.dw.data(), dy.data(), M, N, K, call);
  return o;
}

// M, N not multiples of 128: token and output padding; K = 256 two 128-blocks.
TEST(TetraJetV2, EqualsTheComposedQuantizersForEverySwitchSetting) {
  const int64_t M = 200, N = 144, K = 256;
  auto x = randn(M * K, 1), w = randn(N * K, 2, 0.05f), dy = randn(M * N, 3, 1e-3f);
  LinearCall call{11, 99, 4, 7, true};
  for (int mask = 0; mask < 8; ++mask) {
    RecipeConfig c = tj(mask & 1, mask & 2, mask & 4);
    auto r = make_tj(c, N, K);
    Ref got = run(*r, x, w, dy, M, N, K, call), want = reference(c, x, w, dy, M, N, K, call, {});
    EXPECT_TRUE(same_bits(got.y, want.y)) << "mask " << mask;
    EXPECT_TRUE(same_bits(got.dx, want.dx)) << "mask " << mask;
    EXPECT_TRUE(same_bits(got.dw, want.dw)) << "mask " << mask;
  }
}

TEST(TetraJetV2, SwitchesChangeTheBackwardOnlyAndSeedsAreDeterministic) {
  const int64_t M = 128, N = 128, K = 128;
  auto x = randn(M * K, 4), w = randn(N * K, 5, 0.05f), dy = randn(M * N, 6, 1e-3f);
  LinearCall call{1, 5, 0, 0, true};
  auto base = run(*make_tj(tj(), N, K), x, w, dy, M, N, K, call);
  auto again = run(*make_tj(tj(), N, K), x, w, dy, M, N, K, call);
  EXPECT_TRUE(same_bits(base.dx, again.dx));
  EXPECT_TRUE(same_bits(base.dw, again.dw));
  for (auto c : {tj(false, true, true), tj(true, false, true), tj(true, true, false)}) {
    auto o = run(*make_tj(c, N, K), x, w, dy, M, N, K, call);
    EXPECT_TRUE(same_bits(o.y, base.y));  // the forward never changes
    EXPECT_FALSE(same_bits(o.dx, base.dx));
    EXPECT_FALSE(same_bits(o.dw, base.dw));
  }
  LinearCall other = call;
  other.seed = 6;
  auto o = run(*make_tj(tj(), N, K), x, w, dy, M, N, K, other);
  EXPECT_TRUE(same_bits(o.y, base.y));
  EXPECT_FALSE(same_bits(o.dx, base.dx));
  // sr off: the backward no longer depends on the seed when the RHT is off too
  auto a = run(*make_tj(tj(true, false, false), N, K), x, w, dy, M, N, K, call);
  auto b = run(*make_tj(tj(true, false, false), N, K), x, w, dy, M, N, K, other);
  EXPECT_TRUE(same_bits(a.dx, b.dx));
  EXPECT_TRUE(same_bits(a.dw, b.dw));
}

// Padding: M = 200 tokens gives the same results as the same data explicitly padded to 256
// tokens with zero rows (zero rows add nothing, SR indices are those of the padded layout).
TEST(TetraJetV2, TokenPaddingIsExplicitZeroRows) {
  const int64_t M = 200, Mp = 256, N = 128, K = 128;
  auto x = randn(M * K, 7), w = randn(N * K, 8, 0.05f), dy = randn(M * N, 9, 1e-3f);
  LinearCall call{2, 3, 1, 1, true};
  auto a = run(*make_tj(tj(), N, K), x, w, dy, M, N, K, call);
  auto b = run(*make_tj(tj(), N, K), pad_rows(x, M, Mp, K), w, pad_rows(dy, M, Mp, N), Mp, N, K, call);
  EXPECT_TRUE(same_bits(a.dw, b.dw));
  // y: the quantized operands of the first M rows are identical, but OpenBLAS may sum in another
  // order for another M; both FP32 sums are within K 2^-24 sum|x||w| of each other (far below a
  // BF16 ulp), so after the BF16 output rounding they differ by at most one BF16 ulp (2^-7 rel).
  for (int64_t i = 0; i < M * N; ++i) ASSERT_LE(std::fabs(a.y[i] - b.y[i]), 0x1p-7f * std::fabs(b.y[i])) << i;
  EXPECT_EQ(0, std::memcmp(a.dx.data(), b.dx.data(), M * K * sizeof(float)));
}

// Inputs for which no SR block saturates without RHT: in every 16-block along either axis one
// element has the 128-block's maximum magnitude (a "diagonal" of +-1 per 16x16 tile), so every
// inner scale is 448 and the largest scaled value is 6 up to one FP32 rounding (bias <= 1e-6 rel).
std::vector<float> diag_matrix(int64_t rows, int64_t cols, uint64_t seed, float scale) {
  PhiloxStream r(seed, 23);
  std::vector<float> v(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      float u = static_cast<float>(r.next_u32() >> 8) * 0x1p-24f;  // [0,1)
      float mag = (i - j) % 16 == 0 ? 1.0f : 0.9f * u;
      v[i * cols + j] = round_to_bf16(scale * ((r.next_u32() & 1) ? -mag : mag));
    }
  return v;
}

// Sum over seeds; check |mean - target| <= 6 sd/sqrt(S) + allow (6 sigma: false failure
// probability < 2e-9 per element) for every element; returns the number of failing elements.
int unbiased_failures(const std::vector<double>& sum, const std::vector<double>& sum2, const std::vector<double>& target,
                      const std::vector<double>& allow, int S) {
  int fails = 0;
  for (size_t i = 0; i < sum.size(); ++i) {
    double mean = sum[i] / S, var = std::max(0.0, sum2[i] / S - mean * mean) * S / (S - 1);
    fails += std::fabs(mean - target[i]) > 6 * std::sqrt(var / S) + allow[i];
  }
  return fails;
}

// Both GEMM operands are rounded to BF16 (relative error <= 2^-8 each) after SR: a deterministic
// function of the SR outcome, so it may bias the mean by up to ((1 + 2^-8)^2 - 1) E|q_a q_b| per
// product, and E|q_a q_b| = |a| |b| (the SR draws of the two operands are independent and never
// change a sign).
constexpr double kBf16OperandBias = 0x1p-7 + 0x1p-16;

// E[dX] = dY Ŵ and E[dW] = dY^T X̂: the gradient of the forward actually computed (alignment),
// RHT off so that no block saturates (see diag_matrix). Allowances: dX is written in BF16
// (|rounding| <= 2^-9 |dX| per sample, so the mean moves by <= 2^-9 mean|dX|); FP32 sums differ
// from the double target by <= 1e-5 * (|A||B|). With SR off the same check must fail: it shows
// the test has the power to see the RTN bias.
TEST(TetraJetV2, AlignedSrEstimatorIsUnbiasedForTheComputedForward) {
  const int64_t M = 128, N = 128, K = 128;
  auto x = diag_matrix(M, K, 1, 1.0f), w = diag_matrix(N, K, 2, 0.05f), dy = diag_matrix(M, N, 3, 1e-3f);
  auto check = [&](bool sr) {
    auto r = make_tj(tj(true, sr, false), N, K);
    const int S = sr ? 120 : 3;  // without SR the estimate is deterministic: 3 samples show the bias
    std::vector<double> sx(M * K, 0), sx2(M * K, 0), sw(N * K, 0), sw2(N * K, 0), absx(M * K, 0);
    for (int s = 0; s < S; ++s) {
      LinearCall call{0, static_cast<uint64_t>(1000 + s), 0, 0, true};
      auto o = run(*r, x, w, dy, M, N, K, call);
      for (int64_t i = 0; i < M * K; ++i) sx[i] += o.dx[i], sx2[i] += double(o.dx[i]) * o.dx[i], absx[i] += std::fabs(o.dx[i]);
      for (int64_t i = 0; i < N * K; ++i) {
        double g = double(o.dw[i]) - 0.25;
        sw[i] += g, sw2[i] += g * g;
      }
    }
    // the forward's X̂, Ŵ
    std::vector<float> xq(M * K), wq(N * K);
    q2l(xq.data(), x.data(), M, K, nullptr);
    q2l(wq.data(), w.data(), N, K, nullptr);
    std::vector<double> tx(M * K, 0), ax(M * K, 0), tw(N * K, 0), aw(N * K, 0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          double a = double(dy[m * N + n]) * wq[n * K + k], b = double(dy[m * N + n]) * xq[m * K + k];
          tx[m * K + k] += a, ax[m * K + k] += std::fabs(a);
          tw[n * K + k] += b, aw[n * K + k] += std::fabs(b);
        }
    for (int64_t i = 0; i < M * K; ++i) ax[i] = (1e-5 + kBf16OperandBias) * ax[i] + 0x1p-9 * absx[i] / S;
    for (int64_t i = 0; i < N * K; ++i) aw[i] *= 1e-5 + kBf16OperandBias;
    return std::make_pair(unbiased_failures(sx, sx2, tx, ax, S), unbiased_failures(sw, sw2, tw, aw, S));
  };
  auto with_sr = check(true);
  EXPECT_EQ(with_sr.first, 0);
  EXPECT_EQ(with_sr.second, 0);
  auto rtn = check(false);
  EXPECT_GT(rtn.first, 1000);
  EXPECT_GT(rtn.second, 1000);
}

// With the RHT on, blocks may saturate (a scaled maximum up to one E4M3 half-ulp above 6). Per
// seed the exact conditional bias of each operand element is -sign(v) max(0, |v| - 6 sp), known
// from the RTN scales of the transformed operand (SR uses the same RNE scales); the allowance is
// the bias it induces in the product, (d_A |B| + |A| d_B + d_A d_B) summed over N, averaged over
// seeds. Checked on dX (the dgrad pair Q3, Q4).
TEST(TetraJetV2, AlignedSrEstimatorWithRhtIsUnbiasedUpToSaturation) {
  const int64_t M = 128, N = 128, K = 128;
  auto x = randn(M * K, 11), w = randn(N * K, 12, 0.05f), dy = randn(M * N, 13, 1e-3f);
  auto r = make_tj(tj(), N, K);
  std::vector<float> wq(N * K);
  q2l(wq.data(), w.data(), N, K, nullptr);
  auto wqt = transpose(wq, N, K);  // (K,N)
  // sat gap d (rows, cols) of v (rows, cols) along cols
  auto sat_gap = [](const std::vector<float>& v, int64_t rows, int64_t cols) {
    std::vector<uint8_t> c(rows * cols / 2), in(rows * cols / 16);
    std::vector<float> o(rows * cols / 128), d(rows * cols);
    formats::nvfp4_2level_quantize_cpu(c.data(), in.data(), o.data(), v.data(), rows, cols);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        float sp = formats::nvfp4_2level_block_scale(in[i * cols / 16 + j / 16], o[i * cols / 128 + j / 128]);
        d[i * cols + j] = std::max(0.0f, std::fabs(v[i * cols + j]) - 6.0f * sp);
      }
    return d;
  };
  const int S = 80;
  std::vector<double> sx(M * K, 0), sx2(M * K, 0), allow(M * K, 0), absx(M * K, 0);
  for (int s = 0; s < S; ++s) {
    LinearCall call{0, static_cast<uint64_t>(5000 + s), 0, 0, true};
    auto o = run(*r, x, w, dy, M, N, K, call);
    for (int64_t i = 0; i < M * K; ++i) sx[i] += o.dx[i], sx2[i] += double(o.dx[i]) * o.dx[i], absx[i] += std::fabs(o.dx[i]);
    uint32_t sd = formats::rht_random_sign_mask(call.seed, linear_call_stream(call, kTetraStreamRhtDgrad));
    std::vector<float> a(dy), b(wqt);
    formats::rht16_rows_f32_cpu(a.data(), a.data(), M, N, sd);
    formats::rht16_rows_f32_cpu(b.data(), b.data(), K, N, sd);
    auto da = sat_gap(a, M, N), db = sat_gap(b, K, N);
    for (auto& v : a) v = std::fabs(v);
    for (auto& v : b) v = std::fabs(v);
    std::vector<float> t1(M * K), t2(M * K), t3(M * K), t4(M * K);
    cpu::matmul_nt(t1.data(), da.data(), b.data(), M, K, N);
    cpu::matmul_nt(t2.data(), a.data(), db.data(), M, K, N);
    cpu::matmul_nt(t3.data(), da.data(), db.data(), M, K, N);
    cpu::matmul_nt(t4.data(), a.data(), b.data(), M, K, N);  // the BF16 operand rounding's share
    for (int64_t i = 0; i < M * K; ++i)
      allow[i] += ((double(t1[i]) + t2[i] + t3[i]) * 1.001 + kBf16OperandBias * 1.001 * t4[i]) / S;
  }
  std::vector<double> tx(M * K, 0), ax(M * K, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        double p = double(dy[m * N + n]) * wq[n * K + k];
        tx[m * K + k] += p, ax[m * K + k] += std::fabs(p);
      }
  for (int64_t i = 0; i < M * K; ++i) allow[i] += 1e-5 * ax[i] + 0x1p-9 * absx[i] / S;
  EXPECT_EQ(unbiased_failures(sx, sx2, tx, allow, S), 0);
}

// Planted outliers: 32 input channels 20x larger. fraction 0.1 of 256 = 25.6 -> 26 -> round_to
// 32 -> 32 channels, selected at the first forward after the calibration window [2, 3]; the
// forward and backward are then the split MXFP8 / nvfp4-2level GEMMs composed by hand.
TEST(TetraJetV2, OutlierSelectionFindsPlantedChannelsAndUsesMxfp8ForThem) {
  const int64_t M = 128, N = 128, K = 256;
  RecipeConfig c = tj();
  c.outliers.enabled = true;
  c.outliers.fraction = 0.1;
  c.outliers.round_to = 32;
  c.outliers.calibration_start = 2;
  c.outliers.calibration_end = 3;
  auto r = make_tj(c, N, K);
  std::vector<int64_t> planted;
  for (int64_t k = 5; k < K && planted.size() < 32; k += 7) planted.push_back(k);
  auto x = randn(M * K, 21), w = randn(N * K, 22, 0.05f), dy = randn(M * N, 23, 1e-3f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k : planted) x[m * K + k] = round_to_bf16(20.0f * x[m * K + k]);
  std::vector<float> y(M * N);
  for (int64_t step = 1; step <= 3; ++step) {
    r->forward(y.data(), x.data(), w.data(), M, N, K, LinearCall{step, 1, 0, step, true});
    EXPECT_FALSE(r->outliers_selected());
  }
  LinearCall call{4, 77, 0, 4, true};
  auto got = run(*r, x, w, dy, M, N, K, call);
  ASSERT_TRUE(r->outliers_selected());
  EXPECT_EQ(r->outlier_channels(), planted);
  EXPECT_EQ(r->stats().at("outliers.channels"), 32.0);
  auto want = reference(c, x, w, dy, M, N, K, call, planted);
  EXPECT_TRUE(same_bits(got.y, want.y));
  EXPECT_TRUE(same_bits(got.dx, want.dx));
  EXPECT_TRUE(same_bits(got.dw, want.dw));
  // Q(w): MXFP8 values on exactly the planted channels, nvfp4-2level on the rest
  std::vector<float> wq(N * K), sc(N * K);
  r->fake_quantize_weight(wq.data(), sc.data(), w.data());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      bool is_out = std::binary_search(planted.begin(), planted.end(), k);
      ASSERT_EQ(sc[n * K + k] == 0.0f, is_out);
    }
  // checkpoint round trip: a fresh recipe with the loaded state computes the same bits
  auto st = r->state();
  auto r2 = make_tj(c, N, K);
  ASSERT_TRUE(r2->load_state(st).is_ok());
  EXPECT_EQ(r2->outlier_channels(), planted);
  auto again = run(*r2, x, w, dy, M, N, K, call);
  EXPECT_TRUE(same_bits(again.y, got.y));
  EXPECT_TRUE(same_bits(again.dw, got.dw));
  // bad state is an error, not a crash
  auto bad = st;
  bad["outliers.channels"] = Tensor(DType::kI64, Shape{2});
  bad["outliers.channels"].data<int64_t>()[0] = 3;
  bad["outliers.channels"].data<int64_t>()[1] = 3;
  EXPECT_FALSE(make_tj(c, N, K)->load_state(bad).is_ok());
}

// OsciReset on a constructed case. W (16,128): every 16-block holds a 6.0 (so every block scale
// is sp = 448 * s_o, s_o = fl(fl(6 R448) R6), i.e. sp ~ 1) and elsewhere values on the E2M1 grid
// (score 0, never crossing). Element E oscillates 2.48 <-> 2.52 across the 2.5 rounding
// threshold (BF16 keeps both sides: 2.484375 / 2.515625): per step |dw| = 0.04, |dQ| = 1 ->
// risk 25 >= 8. Others: a slow drift that stays in its bin (dist_Q = 0), a big oscillation
// 2 <-> 3 (risk 1), a single crossing with large steps (risk 0.5/0.2 = 2.5). Schedule P = 10,
// T = 4, start 0: snapshot at 10, accumulate 11..14, reset at 15 only E; the next window (20..25)
// resets nothing because E sits on its grid point afterwards.
struct OsciCase {
  static constexpr int64_t N = 16, K = 128;
  static constexpr int64_t E = 3 * K + 20, DRIFT = 5 * K + 40, BIG = 7 * K + 50, CROSS = 9 * K + 70;
  std::vector<float> w;
  OsciCase() : w(N * K) {
    const float grid[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f};
    for (int64_t i = 0; i < N * K; ++i) w[i] = (i % 16 == 0) ? 6.0f : grid[i % 7] * ((i % 3) ? 1.0f : -1.0f);
    w[E] = 2.48f;
    w[DRIFT] = 1.0f;
    w[BIG] = 2.0f;
    w[CROSS] = 1.15f;
  }
  // the "optimizer" update of step t (applied before the hook)
  void update(int64_t t) {
    w[E] += (t % 2) ? 0.04f : -0.04f;
    w[DRIFT] += 0.01f;
    w[BIG] += (t % 2) ? 1.0f : -1.0f;
    if (t == 12) w[CROSS] += 0.2f;
  }
};

void osci_schedule(const std::string& variant) {
  RecipeConfig c = tj();
  c.oscireset.enabled = true;
  c.oscireset.start_step = 0;
  c.oscireset.period = 10;
  c.oscireset.window = 4;
  c.oscireset.variant = variant;
  c.oscireset.tracked_fraction = 0.05;
  auto r = make_tj(c, OsciCase::N, OsciCase::K);
  OsciCase with, without;
  for (int64_t t = 1; t <= 26; ++t) {
    with.update(t);
    without.update(t);
    r->after_optimizer_step(with.w.data(), OsciCase::N, OsciCase::K, t);
    int64_t resets = r->oscireset().decisions() > 0 && t == 15 ? r->oscireset().resets_last() : 0;
    if (t == 15) {
      EXPECT_EQ(resets, 1) << variant;
      std::vector<float> q(OsciCase::N * OsciCase::K);
      r->fake_quantize_weight(q.data(), nullptr, without.w.data());
      EXPECT_EQ(with.w[OsciCase::E], q[OsciCase::E]);  // moved onto its grid point
      EXPECT_NE(with.w[OsciCase::E], without.w[OsciCase::E]);
      without.w[OsciCase::E] = with.w[OsciCase::E];  // the reference follows from there
    }
    if (t == 12 && variant == "tracked") {
      EXPECT_EQ(r->oscireset().tracked(), static_cast<int64_t>(std::ceil(0.05 * OsciCase::N * OsciCase::K)));
    }
    for (int64_t i = 0; i < OsciCase::N * OsciCase::K; ++i) ASSERT_EQ(with.w[i], without.w[i]) << "step " << t << " i " << i;
    EXPECT_EQ(r->oscireset().active(), (t >= 10 && t < 15) || (t >= 20 && t < 25)) << "step " << t;
  }
  EXPECT_EQ(r->oscireset().decisions(), 2);
  EXPECT_EQ(r->oscireset().resets_total(), 1);
  EXPECT_EQ(r->oscireset().resets_last(), 0);
}

TEST(OsciReset, ResetsExactlyTheOscillatingElementFullVariant) { osci_schedule("full"); }
TEST(OsciReset, ResetsExactlyTheOscillatingElementTrackedVariant) { osci_schedule("tracked"); }

TEST(OsciReset, SkipsOutlierChannelsAndRoundTripsMidWindow) {
  RecipeConfig c = tj();
  c.outliers.enabled = true;
  c.oscireset.enabled = true;
  c.oscireset.start_step = 0;
  c.oscireset.period = 10;
  c.oscireset.window = 4;
  // E's channel (column 20) is an outlier channel: kept in MXFP8, never reset
  auto r = make_tj(c, OsciCase::N, OsciCase::K);
  std::map<std::string, Tensor> st;
  st["outliers.selected"] = Tensor(DType::kI64, Shape{1});
  st["outliers.selected"].data<int64_t>()[0] = 1;
  std::vector<int64_t> chans;
  for (int64_t k = 0; k < 32; ++k) chans.push_back(k);  // includes column 20
  st["outliers.channels"] = Tensor(DType::kI64, Shape{32});
  std::memcpy(st["outliers.channels"].data<int64_t>(), chans.data(), 32 * sizeof(int64_t));
  ASSERT_TRUE(r->load_state(st).is_ok());
  OsciCase a;
  for (int64_t t = 1; t <= 16; ++t) {
    a.update(t);
    r->after_optimizer_step(a.w.data(), OsciCase::N, OsciCase::K, t);
  }
  EXPECT_EQ(r->oscireset().resets_total(), 0);
  // mid-window checkpoint: two trackers, one restored at step 12, agree afterwards
  RecipeConfig d = tj();
  d.oscireset = c.oscireset;
  auto p = make_tj(d, OsciCase::N, OsciCase::K);
  OsciCase b;
  for (int64_t t = 1; t <= 12; ++t) {
    b.update(t);
    p->after_optimizer_step(b.w.data(), OsciCase::N, OsciCase::K, t);
  }
  auto q = make_tj(d, OsciCase::N, OsciCase::K);
  ASSERT_TRUE(q->load_state(p->state()).is_ok());
  OsciCase b2 = b;
  for (int64_t t = 13; t <= 15; ++t) {
    b.update(t);
    b2.update(t);
    p->after_optimizer_step(b.w.data(), OsciCase::N, OsciCase::K, t);
    q->after_optimizer_step(b2.w.data(), OsciCase::N, OsciCase::K, t);
  }
  EXPECT_EQ(p->oscireset().resets_total(), 1);
  EXPECT_EQ(q->oscireset().resets_total(), 1);
  EXPECT_EQ(b.w, b2.w);
}

TEST(OsciReset, StartStepFromFractionAndScores) {
  OsciResetConfig c;
  c.enabled = true;
  c.start_fraction = 0.65;
  OsciReset o(c);
  EXPECT_EQ(o.start_step(), -1);  // total unknown: never runs
  o.set_total_steps(1000);
  EXPECT_EQ(o.start_step(), 650);
  EXPECT_EQ(OsciReset::threshold_score(2.5f, 1.0f), 0.5f);  // on the 2|3 threshold
  EXPECT_EQ(OsciReset::threshold_score(3.0f, 1.0f), 0.0f);  // on the grid
  EXPECT_EQ(OsciReset::threshold_score(1.125f, 1.0f), 0.25f);
  EXPECT_EQ(OsciReset::threshold_score(7.0f, 1.0f), 0.0f);  // saturated
}

TEST(TetraJetV2, FactoryRejectsBadShapesAndNvidiaOnlyOptions) {
  LinearInfo info;
  info.N = 64;
  info.K = 40;
  EXPECT_FALSE(make_linear_recipe(tj(), info).is_ok());
  info.K = 64;
  RecipeConfig c = tj();
  c.bf16_last_blocks = 1;
  EXPECT_FALSE(make_linear_recipe(c, info).is_ok());
}

}  // namespace
}  // namespace nibble::model
