// Op tests of the paged KV cache (Backend::kv_cache_write, Backend::paged_attention) on every
// backend that has Op::kPagedKvCache (the others skip, saying so): the write bit for bit (BF16
// RNE, F32 copies, FP8 against the codec's formula written out here, NVFP4 against the trainer's
// CPU quantizer formats::nvfp4_2level_quantize_cpu), so every backend stores the same bytes;
// attention against a readable double reference within a first-order FP32 bound; attention over
// FP8/NVFP4 pages against the exact F32 attention within a bound derived from the format's error;
// slots past a row's context never reach its output; batch invariance. Both attention precisions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "backend/kv_page_codec.h"
#include "backend/ops_test/ops_test_util.h"
#include "core/bits.h"
#include "core/philox.h"
#include "formats/quantize_cpu.h"

namespace nibble::backend::testing {
namespace {

constexpr double kU = 0x1.0p-24;  // binary32 unit roundoff

struct PagedCase {
  int64_t N, H, Hkv, D, page_size, pages;
  KvPageFormat format;
  AttentionPrecision precision = AttentionPrecision::kFp32;
  std::vector<int32_t> lens = {};  // each row's context length (empty: row 0 one position, the last
                                   // all pages * page_size, the others random)
};

// A cache of `pages` pages of random K/V written through kv_cache_write at every slot, and rows
// with block tables of shuffled page ids and context lengths 1 .. all slots.
struct FilledCache {
  std::vector<float> k, v, q;  // k, v: (slots, Hkv*D) f32 as given; q: (N,H,D)
  std::vector<int32_t> table, len;
  std::vector<uint8_t> kh, vh;  // the pages as stored
  void *kp = nullptr, *vp = nullptr;
};

class PagedKvOpsTest : public OpsTest {
 protected:
  void SetUp() override {
    OpsTest::SetUp();
    if (IsSkipped()) return;
    if (!be().supports(Op::kPagedKvCache))
      GTEST_SKIP() << "backend '" << be().name() << "' has no paged KV-cache ops yet (issue #15)";
  }
  // K/V, q, block tables and lengths for case c written to pages of `format` on this backend
  FilledCache fill_cache(const PagedCase& c, KvPageFormat format);
  // out (N,H,D) of paged_attention over fc's pages in c.format
  std::vector<float> attend(const PagedCase& c, const FilledCache& fc);
  // paged_attention of case c against reference() within twice its bound (see there)
  void expect_matches_reference(const PagedCase& c);
};

// Element d of kv head hk at `slot` of host pages (bytes) of `format`, as f32.
float decode(const std::vector<uint8_t>& pages, KvPageFormat f, int64_t Hkv, int64_t D, int64_t slot, int64_t hk,
             int64_t d) {
  const kv::TokenLayout L = kv::token_layout(f, Hkv, D);
  return kv::decode_element(pages.data() + slot * L.bytes, L, f, D, hk, d);
}

// The readable reference: for each row and head, gather the row's positions through its block
// table, softmax of scale q.k in double, sum of p v in double. Also returns the per-element
// error bound of an FP32 evaluation in any order (u = 2^-24; n = context length):
//   score s_j = scale q.k_j: es_j = (D + 2) u scale sum_d |q_d k_jd|
//   probabilities: relative error ep = 2 max_j es_j + u (2 max_j |s_j| + n + 8)
//   out_d = sum_j p_j v_jd: (ep + (n + 3) u) sum_j p_j |v_jd|
// kBf16 (q, k, v rounded to BF16 here too; P rounded to BF16 before P v): the reference rounds the
// exact p_j, an FP32 evaluation may round its p_j (relative error ep) to the neighbouring BF16
// value, so each p_j may be off by 2^-8 p_j more: out_d bound + 2^-8 sum_j p_j |v_jd|.
// The checks allow twice the bound: two FP32 evaluations, or one in the chunked form of CUDA's
// flash decoding (p_j = exp(s_j - M) / sum_c l_c exp(m_c - M): one more exp, argument
// |m_c - M| <= 2 max|s|, and product per chunk, i.e. ep grows by u (2 max_j |s_j| + 3) at most).
void reference(std::vector<double>* out, std::vector<double>* bound, const PagedCase& c, const std::vector<float>& q,
               const std::vector<uint8_t>& kh, const std::vector<uint8_t>& vh, const std::vector<int32_t>& table,
               int64_t max_blocks, const std::vector<int32_t>& len) {
  const int64_t group = c.H / c.Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  const bool bf = c.precision == AttentionPrecision::kBf16;
  auto rb = [&](double x) { return bf ? static_cast<double>(round_to_bf16(static_cast<float>(x))) : x; };
  out->assign(static_cast<size_t>(c.N * c.H * c.D), 0.0);
  bound->assign(out->size(), 0.0);
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t h = 0; h < c.H; ++h) {
      const int64_t hk = h / group, L = len[n];
      std::vector<double> s(L), es(L), p(L);
      double mx = -INFINITY, emax = 0, smax = 0;
      for (int64_t j = 0; j < L; ++j) {
        const int64_t slot = static_cast<int64_t>(table[n * max_blocks + j / c.page_size]) * c.page_size + j % c.page_size;
        double dot = 0, mag = 0;
        for (int64_t d = 0; d < c.D; ++d) {
          const double kv = rb(decode(kh, c.format, c.Hkv, c.D, slot, hk, d));
          const double qd = rb(q[(n * c.H + h) * c.D + d]);
          dot += qd * kv;
          mag += std::fabs(qd * kv);
        }
        s[j] = dot * scale;
        es[j] = (c.D + 2) * kU * scale * mag;
        mx = std::max(mx, s[j]);
        emax = std::max(emax, es[j]);
        smax = std::max(smax, std::fabs(s[j]));
      }
      double z = 0;
      for (int64_t j = 0; j < L; ++j) z += (p[j] = std::exp(s[j] - mx));
      const double ep = 2 * emax + kU * (2 * smax + static_cast<double>(L) + 8);
      for (int64_t d = 0; d < c.D; ++d) {
        double acc = 0, mag = 0;
        for (int64_t j = 0; j < L; ++j) {
          const int64_t slot =
              static_cast<int64_t>(table[n * max_blocks + j / c.page_size]) * c.page_size + j % c.page_size;
          const double vv = rb(decode(vh, c.format, c.Hkv, c.D, slot, hk, d));
          acc += rb(p[j] / z) * vv;
          mag += p[j] / z * std::fabs(vv);
        }
        (*out)[(n * c.H + h) * c.D + d] = acc;
        (*bound)[(n * c.H + h) * c.D + d] = (ep + (static_cast<double>(L) + 3) * kU + (bf ? 0x1.0p-8 : 0.0)) * mag;
      }
    }
}

// Per-element error bound of a quantized page format for x (D) of one (position, kv head) row,
// from the format's definition (kv_page_codec.h):
//   fp8: s = amax/448; |x/s| rounds to E4M3 with relative error <= 2^-4 in the normal range and
//        absolute error <= 2^-10 below 2^-6 (subnormal step 2^-9): |x^ - x| <= 2^-4 |x| + 2^-9 s
//        (2^-9 s covers the subnormal half step and the binary32 division and product).
//   nvfp4: a 16-block with amax b inside a 128-block with scale so = amax128/2688 gets sp =
//        e4m3(b/(6 so)) so. Normal E4M3 (relative error <= 2^-4): b/sp <= 6/(1 - 2^-4) = 6.4, so
//        values clamp at 6 by at most 0.4 sp, and the E2M1 rounding errs by at most one scaled
//        unit (the step 4 -> 6 is 2): |x^ - x| <= sp <= (1 + 2^-4) b/6 < 3/16 b. Subnormal E4M3
//        (b/(6 so) < 2^-6): sp is off by at most 2^-10 so, so the error is at most
//        (2^-6 + 2^-10) so + 6 * 2^-10 so < 2^-5 so. Together: 3/16 b + 2^-5 so.
std::vector<double> format_error_bound(KvPageFormat f, const float* x, int64_t D) {
  std::vector<double> e(static_cast<size_t>(D), 0.0);
  if (f == KvPageFormat::kFp8) {
    double amax = 0;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(double(x[d])));
    for (int64_t d = 0; d < D; ++d) e[d] = 0x1.0p-4 * std::fabs(double(x[d])) + 0x1.0p-9 * amax / 448;
  } else if (f == KvPageFormat::kNvfp4) {
    for (int64_t o = 0; o < D; o += 128) {
      double a128 = 0;
      for (int64_t d = o; d < std::min<int64_t>(D, o + 128); ++d) a128 = std::max(a128, std::fabs(double(x[d])));
      for (int64_t b = o; b < std::min<int64_t>(D, o + 128); b += 16) {
        double a16 = 0;
        for (int64_t d = b; d < b + 16; ++d) a16 = std::max(a16, std::fabs(double(x[d])));
        for (int64_t d = b; d < b + 16; ++d) e[d] = 3.0 / 16 * a16 + 0x1.0p-5 * a128 / 2688;
      }
    }
  }
  return e;
}

// (rows, cols) values with a spread of magnitudes: N(0, 3) times 2^(-8 .. 7) per 16-block, and an
// all-zero row (scale 0 -> 1) when there are several rows.
std::vector<float> spread_vector(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<float> x = normal_vector(rows * cols, seed, 3.0);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = std::ldexp(x[i], static_cast<int>((i / 16 * 7) % 16) - 8);
  if (rows > 1)
    for (int64_t c = 0; c < cols; ++c) x[cols + c] = 0.0f;
  return x;
}

TEST_P(PagedKvOpsTest, WriteStoresTheFormatBitForBit) {
  struct Shape {
    int64_t Hkv, D;
  };
  for (KvPageFormat f : {KvPageFormat::kBf16, KvPageFormat::kF32, KvPageFormat::kFp8, KvPageFormat::kNvfp4})
    for (Shape sh : {Shape{2, 16}, Shape{3, 160}}) {  // D 160: an outer 128-block and a partial one
      SCOPED_TRACE(fmt::format("{} Hkv={} D={}", kv_page_format_name(f), sh.Hkv, sh.D));
      const int64_t Hkv = sh.Hkv, D = sh.D, W = Hkv * D, slots_total = 24, N = 5;
      const kv::TokenLayout L = kv::token_layout(f, Hkv, D);
      ASSERT_EQ(kv_token_bytes(f, Hkv, D), L.bytes);
      std::vector<float> k = spread_vector(N * Hkv, D, 11), v = spread_vector(N * Hkv, D, 12);
      const std::vector<int32_t> slots{7, 0, 23, 12, 13};
      const int64_t TB = L.bytes;
      auto* kp = zeros<uint8_t>(slots_total * TB);
      auto* vp = zeros<uint8_t>(slots_total * TB);
      be().kv_cache_write(kp, vp, f, upload(k), upload(v), upload(slots), N, Hkv, D);
      const std::vector<uint8_t> kh = download(kp, slots_total * TB), vh = download(vp, slots_total * TB);
      for (int pass = 0; pass < 2; ++pass) {
        const std::vector<float>& x = pass == 0 ? k : v;
        const std::vector<uint8_t>& got = pass == 0 ? kh : vh;
        // the expected record of each row, built independently of the codec
        std::vector<uint8_t> want(static_cast<size_t>(N * TB), 0);
        if (f == KvPageFormat::kNvfp4) {  // the trainer's quantizer over the (N*Hkv, D) matrix
          const int64_t no = (D + 127) / 128;
          std::vector<uint8_t> codes(N * W / 2), inner(N * W / 16);
          std::vector<float> outer(N * Hkv * no);
          formats::nvfp4_2level_quantize_cpu(codes.data(), inner.data(), outer.data(), x.data(), N * Hkv, D);
          for (int64_t n = 0; n < N; ++n) {
            std::memcpy(&want[n * TB], &outer[n * Hkv * no], 4 * Hkv * no);
            std::memcpy(&want[n * TB + 4 * Hkv * no], &inner[n * W / 16], W / 16);
            std::memcpy(&want[n * TB + 4 * Hkv * no + W / 16], &codes[n * W / 2], W / 2);
          }
        } else {
          for (int64_t n = 0; n < N; ++n)
            for (int64_t hk = 0; hk < Hkv; ++hk) {
              const float* xr = &x[n * W + hk * D];
              uint8_t* rec = &want[n * TB];
              if (f == KvPageFormat::kF32) {
                std::memcpy(rec + 4 * hk * D, xr, 4 * D);
              } else if (f == KvPageFormat::kBf16) {
                for (int64_t d = 0; d < D; ++d) {
                  const uint16_t b = f32_to_bf16_bits(xr[d]);
                  std::memcpy(rec + 2 * (hk * D + d), &b, 2);
                }
              } else {  // fp8: [Hkv f32 scales][(Hkv, D) codes]
                float amax = 0;
                for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(xr[d]));
                float s = amax * 0x1.24924Ap-9f;  // fl(1/448)
                if (s == 0.0f) s = 1.0f;
                std::memcpy(rec + 4 * hk, &s, 4);
                for (int64_t d = 0; d < D; ++d) rec[4 * Hkv + hk * D + d] = formats::e4m3_rne_sat(xr[d] / s);
              }
            }
        }
        for (int64_t n = 0; n < N; ++n)
          for (int64_t b = 0; b < TB; ++b)
            ASSERT_EQ(got[slots[n] * TB + b], want[n * TB + b]) << (pass ? "v" : "k") << " row " << n << " byte " << b;
        // decoded values within the format's error bound (exact for f32)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t hk = 0; hk < Hkv; ++hk) {
            const float* xr = &x[n * W + hk * D];
            const std::vector<double> e = format_error_bound(f, xr, D);
            for (int64_t d = 0; d < D; ++d) {
              const double err = std::fabs(double(decode(got, f, Hkv, D, slots[n], hk, d)) - xr[d]);
              const double lim = f == KvPageFormat::kBf16 ? 0x1.0p-8 * std::fabs(double(xr[d])) : e[d];  // BF16: u = 2^-8
              ASSERT_LE(err, lim) << "row " << n << " head " << hk << " elem " << d << " x " << xr[d];
            }
          }
      }
      // untouched slots stay zero
      for (int64_t s = 0; s < slots_total; ++s) {
        if (std::find(slots.begin(), slots.end(), s) != slots.end()) continue;
        for (int64_t b = 0; b < TB; ++b) ASSERT_EQ(kh[s * TB + b], 0) << "slot " << s;
      }
    }
}

FilledCache PagedKvOpsTest::fill_cache(const PagedCase& c, KvPageFormat format) {
  FilledCache fc;
  const int64_t W = c.Hkv * c.D, slots_total = c.pages * c.page_size, TB = kv_token_bytes(format, c.Hkv, c.D);
  fc.k = normal_vector(slots_total * W, 21, 2.0);  // scale 2: scores of a few units
  fc.v = normal_vector(slots_total * W, 22, 1.0);
  std::vector<int32_t> all(static_cast<size_t>(slots_total));
  for (int64_t s = 0; s < slots_total; ++s) all[s] = static_cast<int32_t>(s);
  fc.kp = zeros<uint8_t>(slots_total * TB);
  fc.vp = zeros<uint8_t>(slots_total * TB);
  be().kv_cache_write(fc.kp, fc.vp, format, upload(fc.k), upload(fc.v), upload(all), slots_total, c.Hkv, c.D);
  fc.kh = download(static_cast<uint8_t*>(fc.kp), slots_total * TB);
  fc.vh = download(static_cast<uint8_t*>(fc.vp), slots_total * TB);
  fc.table.resize(static_cast<size_t>(c.N * c.pages));
  fc.len.resize(static_cast<size_t>(c.N));
  PhiloxStream rng(5, 0);
  for (int64_t n = 0; n < c.N; ++n) {
    std::vector<int32_t> perm(static_cast<size_t>(c.pages));
    for (int64_t i = 0; i < c.pages; ++i) perm[i] = static_cast<int32_t>(i);
    for (int64_t i = c.pages - 1; i > 0; --i) std::swap(perm[i], perm[rng.next_u32() % (i + 1)]);
    std::copy(perm.begin(), perm.end(), fc.table.begin() + n * c.pages);
    fc.len[n] = n == 0 ? 1 : static_cast<int32_t>(1 + rng.next_u32() % slots_total);
  }
  fc.len[c.N - 1] = static_cast<int32_t>(slots_total);  // one row reads every slot
  if (!c.lens.empty()) fc.len = c.lens;
  fc.q = normal_vector(c.N * c.H * c.D, 23, 1.0);
  return fc;
}

std::vector<float> PagedKvOpsTest::attend(const PagedCase& c, const FilledCache& fc) {
  float* out = zeros<float>(c.N * c.H * c.D);
  be().paged_attention(out, upload(fc.q), fc.kp, fc.vp, c.format, upload(fc.table), c.pages, upload(fc.len),
                         c.N, c.H, c.Hkv, c.D, c.page_size, c.precision);
  return download(out, c.N * c.H * c.D);
}

void PagedKvOpsTest::expect_matches_reference(const PagedCase& c) {
  SCOPED_TRACE(fmt::format("N={} H={} Hkv={} D={} page={} {} {}", c.N, c.H, c.Hkv, c.D, c.page_size,
                           kv_page_format_name(c.format),
                           c.precision == AttentionPrecision::kBf16 ? "bf16 attention" : "fp32 attention"));
  const FilledCache fc = fill_cache(c, c.format);
  const std::vector<float> got = attend(c, fc);
  std::vector<double> ref, bound;
  reference(&ref, &bound, c, fc.q, fc.kh, fc.vh, fc.table, c.pages, fc.len);
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::fabs(got[i] - ref[i]), 2 * bound[i] + 1e-30) << "element " << i << " got " << got[i] << " ref " << ref[i];
}

TEST_P(PagedKvOpsTest, AttentionMatchesTheReferenceWithinTheDerivedBound) {
  const PagedCase cases[] = {
      {1, 1, 1, 8, 4, 1, KvPageFormat::kF32},     // one row, one position
      {6, 4, 2, 16, 4, 12, KvPageFormat::kBf16},  // GQA 2, lengths across page edges
      {5, 6, 1, 32, 16, 8, KvPageFormat::kF32},   // MQA, a long page
      {7, 8, 8, 64, 8, 20, KvPageFormat::kBf16},  // MHA, D 64
      {6, 4, 2, 16, 4, 12, KvPageFormat::kBf16, AttentionPrecision::kBf16},  // the BF16 attention
      {5, 6, 1, 32, 16, 8, KvPageFormat::kF32, AttentionPrecision::kBf16},   // BF16 over F32 pages
      {6, 4, 2, 16, 4, 12, KvPageFormat::kFp8},                              // FP8 pages
      {5, 4, 2, 32, 8, 6, KvPageFormat::kNvfp4},                             // NVFP4 pages
      {4, 4, 1, 160, 4, 5, KvPageFormat::kNvfp4},                            // two outer blocks per head
      {5, 6, 2, 32, 8, 6, KvPageFormat::kFp8, AttentionPrecision::kBf16},    // BF16 attention, FP8 pages
      {5, 4, 2, 32, 8, 6, KvPageFormat::kNvfp4, AttentionPrecision::kBf16},  // BF16 attention, NVFP4 pages
  };
  for (const PagedCase& c : cases) expect_matches_reference(c);
}

// The shapes of the flash-decoding kernel (CUDA: chunks of 64 positions, GQA groups read
// together, 8-element runs per lane): GQA groups 1, 2, 4, 8; head dims 64 and 128; contexts 1,
// 17, 65 (one past a chunk), 300, 512, 520 and past 4096 (65 chunks, the last partial) in one batch
// with rows of other lengths; page size 16; every page format; both precisions.
TEST_P(PagedKvOpsTest, FlashDecodingShapesMatchTheReferenceWithinTheDerivedBound) {
  using F = KvPageFormat;
  using P = AttentionPrecision;
  const PagedCase cases[] = {
      {3, 4, 4, 128, 16, 33, F::kBf16, P::kFp32, {1, 17, 512}},    // MHA D 128 (the 1B shape's head)
      {3, 4, 4, 128, 16, 33, F::kBf16, P::kBf16, {512, 1, 17}},    // the rollout's default precision
      {3, 8, 2, 64, 16, 33, F::kFp8, P::kBf16, {17, 512, 1}},      // GQA 4, FP8 pages
      {2, 8, 1, 128, 16, 33, F::kNvfp4, P::kFp32, {512, 65}},      // GQA 8, D 128, NVFP4 pages
      {2, 8, 1, 64, 16, 260, F::kBf16, P::kBf16, {4160, 1}},       // GQA 8, 4096+ (65 chunks)
      {2, 4, 1, 64, 16, 33, F::kF32, P::kFp32, {520, 17}},         // GQA 4, F32 pages, a partial chunk
      {2, 4, 2, 64, 16, 260, F::kNvfp4, P::kBf16, {4113, 300}},    // GQA 2, 4096+, NVFP4
  };
  for (const PagedCase& c : cases) expect_matches_reference(c);
}

// Attention over FP8 / NVFP4 pages against the exact attention over the unquantized K/V (double),
// within the propagation of the format's per-element bound e (format_error_bound): a score moves
// by at most delta_j = scale sum_d |q_d| e(k_jd), so each softmax weight moves by a factor in
// [exp(-2 delta), exp(2 delta)] (delta = max_j delta_j) and sum_j |p^_j - p_j| <= exp(2 delta) - 1;
// out_d = sum_j p_j v_jd then moves by at most max_j e(v_jd) + (exp(2 delta) - 1) max_j |v_jd|,
// plus the FP32 evaluation bound of the reference (twice, as above).
TEST_P(PagedKvOpsTest, QuantizedPagesAttendWithinTheFormatErrorOfExactAttention) {
  const PagedCase cases[] = {
      {6, 4, 2, 16, 4, 12, KvPageFormat::kFp8},
      {5, 4, 2, 32, 8, 6, KvPageFormat::kNvfp4},
  };
  for (const PagedCase& c : cases) {
    SCOPED_TRACE(kv_page_format_name(c.format));
    const FilledCache fc = fill_cache(c, c.format);
    const std::vector<float> got = attend(c, fc);
    PagedCase exact = c;
    exact.format = KvPageFormat::kF32;
    const FilledCache fe = fill_cache(exact, KvPageFormat::kF32);  // the same K/V, q, tables
    std::vector<double> ref, bound;
    reference(&ref, &bound, exact, fe.q, fe.kh, fe.vh, fe.table, c.pages, fe.len);
    const int64_t W = c.Hkv * c.D, group = c.H / c.Hkv;
    const double scale = 1.0 / std::sqrt(double(c.D));
    for (int64_t n = 0; n < c.N; ++n)
      for (int64_t h = 0; h < c.H; ++h) {
        const int64_t hk = h / group;
        double delta = 0;
        std::vector<double> ev_max(static_cast<size_t>(c.D), 0.0), v_max(static_cast<size_t>(c.D), 0.0);
        for (int64_t j = 0; j < fe.len[n]; ++j) {
          const int64_t slot = static_cast<int64_t>(fe.table[n * c.pages + j / c.page_size]) * c.page_size + j % c.page_size;
          const std::vector<double> ek = format_error_bound(c.format, &fe.k[slot * W + hk * c.D], c.D);
          const std::vector<double> ev = format_error_bound(c.format, &fe.v[slot * W + hk * c.D], c.D);
          double dj = 0;
          for (int64_t d = 0; d < c.D; ++d) {
            dj += std::fabs(double(fe.q[(n * c.H + h) * c.D + d])) * ek[d];
            ev_max[d] = std::max(ev_max[d], ev[d]);
            v_max[d] = std::max(v_max[d], std::fabs(double(fe.v[slot * W + hk * c.D + d])));
          }
          delta = std::max(delta, dj * scale);
        }
        for (int64_t d = 0; d < c.D; ++d) {
          const size_t i = static_cast<size_t>((n * c.H + h) * c.D + d);
          const double lim = ev_max[d] + std::expm1(2 * delta) * v_max[d] + 2 * bound[i] + 1e-6;
          ASSERT_LE(std::fabs(got[i] - ref[i]), lim) << "row " << n << " head " << h << " d " << d;
        }
      }
  }
}

TEST_P(PagedKvOpsTest, SlotsPastTheContextNeverReachTheOutputAndRowsAreBatchInvariant) {
  const int64_t H = 4, Hkv = 2, D = 16, page = 4, pages = 6, W = Hkv * D, slots_total = pages * page;
  // F32 pages: every slot NaN, then the slots of positions < 10 of page order {3, 0, 5} written
  std::vector<float> nan(slots_total * W, std::numeric_limits<float>::quiet_NaN());
  float* kp = upload(nan);
  float* vp = upload(nan);
  const std::vector<int32_t> pages_of_seq{3, 0, 5};
  std::vector<int32_t> slots;
  for (int64_t j = 0; j < 10; ++j) slots.push_back(static_cast<int32_t>(pages_of_seq[j / page] * page + j % page));
  std::vector<float> k = normal_vector(10 * W, 31), v = normal_vector(10 * W, 32);
  be().kv_cache_write(kp, vp, KvPageFormat::kF32, upload(k), upload(v), upload(slots), 10, Hkv, D);
  // rows at positions 0..9 of that sequence (lengths 1..10), then each row alone
  const int64_t N = 10, max_blocks = 3;
  std::vector<int32_t> table, len;
  for (int64_t n = 0; n < N; ++n) {
    table.insert(table.end(), pages_of_seq.begin(), pages_of_seq.end());
    len.push_back(static_cast<int32_t>(n + 1));
  }
  std::vector<float> q = normal_vector(N * H * D, 33);
  float* out = zeros<float>(N * H * D);
  be().paged_attention(out, upload(q), kp, vp, KvPageFormat::kF32, upload(table), max_blocks, upload(len), N, H, Hkv,
                       D, page);
  std::vector<float> batch = download(out, N * H * D);
  for (float x : batch) ASSERT_TRUE(std::isfinite(x)) << "a NaN slot past a row's context was read";
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> q1(q.begin() + n * H * D, q.begin() + (n + 1) * H * D);
    std::vector<int32_t> t1(pages_of_seq), l1{len[n]};
    float* o1 = zeros<float>(H * D);
    be().paged_attention(o1, upload(q1), kp, vp, KvPageFormat::kF32, upload(t1), max_blocks, upload(l1), 1, H, Hkv, D,
                         page);
    std::vector<float> alone = download(o1, H * D);
    std::vector<float> in_batch(batch.begin() + n * H * D, batch.begin() + (n + 1) * H * D);
    ASSERT_TRUE(bits_equal(alone, in_batch)) << "row " << n;
  }
}

NIB_INSTANTIATE_OPS_TEST(PagedKvOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
