// Op tests of the paged KV cache (Backend::kv_cache_write, Backend::paged_attention) on every
// backend that has Op::kPagedKvCache (the others skip, saying so): the write bit for bit (BF16
// round-to-nearest-even of core/bits.h, F32 copies); attention against a readable double
// reference that walks the block table position by position, within a first-order FP32 bound
// derived beside the check; the values in slots past a row's context never reach its output
// (they are NaN here); a row gives the same bits alone as in a batch (batch invariance). Both
// attention precisions (FP32; BF16 as Backend::attention_forward's kBf16).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "backend/ops_test/ops_test_util.h"
#include "core/bits.h"
#include "core/philox.h"

namespace nibble::backend::testing {
namespace {

constexpr double kU = 0x1.0p-24;  // binary32 unit roundoff

class PagedKvOpsTest : public OpsTest {
 protected:
  void SetUp() override {
    OpsTest::SetUp();
    if (IsSkipped()) return;
    if (!be().supports(Op::kPagedKvCache))
      GTEST_SKIP() << "backend '" << be().name() << "' has no paged KV-cache ops yet (issue #15)";
  }
};

struct PagedCase {
  int64_t N, H, Hkv, D, page_size, pages;
  KvPageFormat format;
  AttentionPrecision precision = AttentionPrecision::kFp32;
};

// Host pages as f32 values of `format` (what the backend stores, decoded).
float decode(const std::vector<uint16_t>& b16, const std::vector<float>& f32, KvPageFormat f, int64_t i) {
  return f == KvPageFormat::kF32 ? f32[i] : bf16_bits_to_f32(b16[i]);
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
void reference(std::vector<double>* out, std::vector<double>* bound, const PagedCase& c, const std::vector<float>& q,
               const std::vector<uint16_t>& kb, const std::vector<float>& kf, const std::vector<uint16_t>& vb,
               const std::vector<float>& vf, const std::vector<int32_t>& table, int64_t max_blocks,
               const std::vector<int32_t>& len) {
  const int64_t group = c.H / c.Hkv, W = c.Hkv * c.D;
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
          const double kv = rb(decode(kb, kf, c.format, slot * W + hk * c.D + d));
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
          const double vv = rb(decode(vb, vf, c.format, slot * W + hk * c.D + d));
          acc += rb(p[j] / z) * vv;
          mag += p[j] / z * std::fabs(vv);
        }
        (*out)[(n * c.H + h) * c.D + d] = acc;
        (*bound)[(n * c.H + h) * c.D + d] = (ep + (static_cast<double>(L) + 3) * kU + (bf ? 0x1.0p-8 : 0.0)) * mag;
      }
    }
}

// A filled cache: `pages` pages of random K/V written through kv_cache_write at every slot,
// rows with context lengths 1 .. max and block tables of shuffled page ids (rows of one
// "sequence" share a table prefix). Slots past a row's context are NaN in the f32 case.
struct Filled {
  std::vector<float> q;
  std::vector<int32_t> table, len;
  int64_t max_blocks = 0;
  void *k = nullptr, *v = nullptr;
  std::vector<uint16_t> kb, vb;
  std::vector<float> kf, vf;
};

TEST_P(PagedKvOpsTest, WriteRoundsToTheFormatBitForBit) {
  for (KvPageFormat f : {KvPageFormat::kBf16, KvPageFormat::kF32}) {
    const int64_t Hkv = 2, D = 8, W = Hkv * D, slots_total = 24, N = 5;
    std::vector<float> k = normal_vector(N * W, 11, 3.0), v = normal_vector(N * W, 12, 3.0);
    const std::vector<int32_t> slots{7, 0, 23, 12, 13};
    const int64_t eb = kv_page_element_bytes(f);
    auto* kp = zeros<uint8_t>(slots_total * W * eb);
    auto* vp = zeros<uint8_t>(slots_total * W * eb);
    be().kv_cache_write(kp, vp, f, upload(k), upload(v), upload(slots), N, Hkv, D);
    std::vector<uint8_t> kh = download(kp, slots_total * W * eb), vh = download(vp, slots_total * W * eb);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < W; ++i) {
        const int64_t at = (slots[n] * W + i) * eb;
        if (f == KvPageFormat::kF32) {
          float kg, vg;
          std::memcpy(&kg, &kh[at], 4);
          std::memcpy(&vg, &vh[at], 4);
          ASSERT_EQ(float_as_u32(kg), float_as_u32(k[n * W + i])) << "row " << n << " elem " << i;
          ASSERT_EQ(float_as_u32(vg), float_as_u32(v[n * W + i])) << "row " << n << " elem " << i;
        } else {
          uint16_t kg, vg;
          std::memcpy(&kg, &kh[at], 2);
          std::memcpy(&vg, &vh[at], 2);
          ASSERT_EQ(kg, f32_to_bf16_bits(k[n * W + i])) << "row " << n << " elem " << i;
          ASSERT_EQ(vg, f32_to_bf16_bits(v[n * W + i])) << "row " << n << " elem " << i;
        }
      }
    // untouched slots stay zero
    for (int64_t s = 0; s < slots_total; ++s) {
      if (std::find(slots.begin(), slots.end(), s) != slots.end()) continue;
      for (int64_t b = 0; b < W * eb; ++b) ASSERT_EQ(kh[s * W * eb + b], 0) << "slot " << s;
    }
  }
}

TEST_P(PagedKvOpsTest, AttentionMatchesTheReferenceWithinTheDerivedBound) {
  const PagedCase cases[] = {
      {1, 1, 1, 8, 4, 1, KvPageFormat::kF32},     // one row, one position
      {6, 4, 2, 16, 4, 12, KvPageFormat::kBf16},  // GQA 2, lengths across page edges
      {5, 6, 1, 32, 16, 8, KvPageFormat::kF32},   // MQA, a long page
      {7, 8, 8, 64, 8, 20, KvPageFormat::kBf16},  // MHA, D 64
      {6, 4, 2, 16, 4, 12, KvPageFormat::kBf16, AttentionPrecision::kBf16},  // the BF16 attention
      {5, 6, 1, 32, 16, 8, KvPageFormat::kF32, AttentionPrecision::kBf16},   // BF16 over F32 pages
  };
  for (const PagedCase& c : cases) {
    SCOPED_TRACE(fmt::format("N={} H={} Hkv={} D={} page={} {} {}", c.N, c.H, c.Hkv, c.D, c.page_size,
                             kv_page_format_name(c.format),
                             c.precision == AttentionPrecision::kBf16 ? "bf16 attention" : "fp32 attention"));
    const int64_t W = c.Hkv * c.D, slots_total = c.pages * c.page_size;
    // every slot written from random K/V (scale 2: scores of a few units)
    std::vector<float> k = normal_vector(slots_total * W, 21, 2.0), v = normal_vector(slots_total * W, 22, 1.0);
    std::vector<int32_t> all(static_cast<size_t>(slots_total));
    for (int64_t s = 0; s < slots_total; ++s) all[s] = static_cast<int32_t>(s);
    const int64_t eb = kv_page_element_bytes(c.format);
    auto* kp = zeros<uint8_t>(slots_total * W * eb);
    auto* vp = zeros<uint8_t>(slots_total * W * eb);
    be().kv_cache_write(kp, vp, c.format, upload(k), upload(v), upload(all), slots_total, c.Hkv, c.D);
    std::vector<uint8_t> kh = download(kp, slots_total * W * eb), vh = download(vp, slots_total * W * eb);
    std::vector<uint16_t> kb, vb;
    std::vector<float> kf, vf;
    if (c.format == KvPageFormat::kF32) {
      kf.resize(slots_total * W), vf.resize(slots_total * W);
      std::memcpy(kf.data(), kh.data(), kh.size()), std::memcpy(vf.data(), vh.data(), vh.size());
    } else {
      kb.resize(slots_total * W), vb.resize(slots_total * W);
      std::memcpy(kb.data(), kh.data(), kh.size()), std::memcpy(vb.data(), vh.data(), vh.size());
    }
    // block tables: a pseudo-random permutation of the pages per row; lengths 1 .. all pages
    const int64_t max_blocks = c.pages;
    std::vector<int32_t> table(static_cast<size_t>(c.N * max_blocks)), len(static_cast<size_t>(c.N));
    PhiloxStream rng(5, 0);
    for (int64_t n = 0; n < c.N; ++n) {
      std::vector<int32_t> perm(static_cast<size_t>(c.pages));
      for (int64_t i = 0; i < c.pages; ++i) perm[i] = static_cast<int32_t>(i);
      for (int64_t i = c.pages - 1; i > 0; --i) std::swap(perm[i], perm[rng.next_u32() % (i + 1)]);
      std::copy(perm.begin(), perm.end(), table.begin() + n * max_blocks);
      len[n] = n == 0 ? 1 : static_cast<int32_t>(1 + rng.next_u32() % slots_total);
    }
    len[c.N - 1] = static_cast<int32_t>(slots_total);  // one row reads every slot
    std::vector<float> q = normal_vector(c.N * c.H * c.D, 23, 1.0);
    float* out = zeros<float>(c.N * c.H * c.D);
    be().paged_attention(out, upload(q), kp, vp, c.format, upload(table), max_blocks, upload(len), c.N, c.H, c.Hkv,
                         c.D, c.page_size, c.precision);
    std::vector<float> got = download(out, c.N * c.H * c.D);
    std::vector<double> ref, bound;
    reference(&ref, &bound, c, q, kb, kf, vb, vf, table, max_blocks, len);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_LE(std::fabs(got[i] - ref[i]), 2 * bound[i] + 1e-30) << "element " << i << " got " << got[i] << " ref " << ref[i];
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
