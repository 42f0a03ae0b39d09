// Op tests of the MoE routing ops (Backend::moe_*) on every backend against backend/cpu/moe.h:
// router forward (probs, top-k ids and weights bit for bit, lse within two logf roundings), with
// exact ties, underflowing rows, NaN/Inf rows, forced (R3) sets and norm_topk_prob on and off;
// replaying the router's own sets gives its weights bit for bit (norm_topk_prob on and off);
// bad forced sets throw; router backward (aux-loss extra, z-loss) and combine backward's dtopk_w
// within derived summation-order bounds; the dispatch plan bit for bit; gather, gather backward,
// combine and dye bit for bit; the load sums. Shapes (N,E,k) = (1,4,1), (37,8,2), (512,64,8),
// (300,128,8), C = 64, 96 (and 67 for the scalar path). Also glibc_expf against std::exp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/moe.h"
#include "backend/glibc_expf.h"
#include "backend/ops_test/ops_test_util.h"
#include "core/bits.h"
#include "core/check.h"
#include "core/philox.h"

namespace nibble::backend::testing {
namespace {

constexpr double kU = 0x1.0p-24;  // binary32 unit roundoff
constexpr double kUd = 0x1.0p-53;  // binary64 unit roundoff

struct MoeShape {
  int64_t N, E, k;
};
const MoeShape kShapes[] = {{1, 4, 1}, {37, 8, 2}, {512, 64, 8}, {300, 128, 8}};

std::string shape_name(const MoeShape& s) { return fmt::format("N={} E={} k={}", s.N, s.E, s.k); }

// Router logits ~ N(0, 2^2), with rows that stress the selection: n % 5 == 1 rounded to halves
// (exact ties), n % 7 == 3 scaled by 40 (most probs underflow to 0: zero ties at the k boundary),
// n % 11 == 4 all equal, n % 13 == 6 a NaN logit, n % 17 == 8 a +Inf logit.
std::vector<float> router_logits(const MoeShape& s, uint64_t seed) {
  std::vector<float> l = normal_vector(s.N * s.E, seed, 2.0);
  for (int64_t n = 0; n < s.N; ++n) {
    float* r = l.data() + n * s.E;
    for (int64_t i = 0; i < s.E; ++i) {
      if (n % 5 == 1) r[i] = std::round(r[i] * 2.0f) / 2.0f;
      if (n % 7 == 3) r[i] *= 40.0f;
      if (n % 11 == 4) r[i] = 0.5f;
    }
    if (n % 13 == 6) r[(n * 7) % s.E] = std::numeric_limits<float>::quiet_NaN();
    if (n % 17 == 8) r[(n * 5) % s.E] = std::numeric_limits<float>::infinity();
  }
  return l;
}

// k distinct experts per token (a partial Fisher-Yates shuffle per row).
std::vector<int32_t> forced_sets(const MoeShape& s, uint64_t seed) {
  PhiloxStream rng(seed, 1);
  std::vector<int32_t> out(s.N * s.k), perm(s.E);
  for (int64_t n = 0; n < s.N; ++n) {
    for (int64_t i = 0; i < s.E; ++i) perm[i] = static_cast<int32_t>(i);
    for (int64_t j = 0; j < s.k; ++j) {
      const int64_t pick = j + static_cast<int64_t>(rng.next_u32() % static_cast<uint32_t>(s.E - j));
      std::swap(perm[j], perm[pick]);
      out[n * s.k + j] = perm[j];
    }
  }
  return out;
}

template <typename T>
::testing::AssertionResult ints_equal(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return ::testing::AssertionFailure() << "first difference at index " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

// Bitwise equal, or both NaN (NaN payloads differ between x86 and CUDA arithmetic).
::testing::AssertionResult same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (float_as_u32(a[i]) != float_as_u32(b[i]))
      return ::testing::AssertionFailure() << fmt::format("first difference at index {}: {} ({:#010x}) vs {} ({:#010x})", i,
                                                          a[i], float_as_u32(a[i]), b[i], float_as_u32(b[i]));
  }
  return ::testing::AssertionSuccess();
}

// |a - ref| <= tol elementwise (NaN must match NaN).
::testing::AssertionResult within(const std::vector<float>& a, const std::vector<float>& ref,
                                  const std::vector<double>& tol) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(ref[i])) {
      if (std::isnan(a[i]) != std::isnan(ref[i]))
        return ::testing::AssertionFailure() << "NaN mismatch at " << i << ": " << a[i] << " vs " << ref[i];
      continue;
    }
    const double d = std::fabs(static_cast<double>(a[i]) - ref[i]);
    if (!(d <= tol[i]))
      return ::testing::AssertionFailure() << fmt::format("index {}: {} vs reference {} (|diff| {:.3g} > tol {:.3g})", i,
                                                          a[i], ref[i], d, tol[i]);
  }
  return ::testing::AssertionSuccess();
}

class MoeOpsTest : public OpsTest {
 protected:
  struct RouterOut {
    std::vector<float> probs, lse, w;
    std::vector<int32_t> idx;
  };
  RouterOut cpu_router(const std::vector<float>& logits, const std::vector<int32_t>* forced, const MoeShape& s,
                       bool norm) {
    RouterOut r{std::vector<float>(s.N * s.E), std::vector<float>(s.N), std::vector<float>(s.N * s.k),
                std::vector<int32_t>(s.N * s.k)};
    cpu::moe_router_forward(r.probs.data(), r.lse.data(), r.idx.data(), r.w.data(), logits.data(),
                            forced ? forced->data() : nullptr, s.N, s.E, s.k, norm);
    return r;
  }
  RouterOut backend_router(const std::vector<float>& logits, const std::vector<int32_t>* forced, const MoeShape& s,
                           bool norm) {
    float* probs = zeros<float>(s.N * s.E);
    float* lse = zeros<float>(s.N);
    float* w = zeros<float>(s.N * s.k);
    int32_t* idx = zeros<int32_t>(s.N * s.k);
    be().moe_router_forward(probs, lse, idx, w, upload(logits), forced ? upload(*forced) : nullptr, s.N, s.E, s.k,
                            norm);
    return {download(probs, s.N * s.E), download(lse, s.N), download(w, s.N * s.k), download(idx, s.N * s.k)};
  }
  // The router forward on the backend against the CPU: probs, ids and weights are the same bits
  // (glibc_expf, the CPU's sum order, IEEE division). lse = mx + log(sum) with a different logf
  // (CUDA's is within 1 ulp, glibc's within 1 ulp): |diff| <= 2 ulp(log sum) + 1 ulp(lse) <=
  // 2^-22 |log sum| + 2^-23 |lse|; checked against twice that.
  void check_router(const std::vector<float>& logits, const std::vector<int32_t>* forced, const MoeShape& s,
                    bool norm) {
    SCOPED_TRACE(fmt::format("{} norm_topk={} forced={}", shape_name(s), norm, forced != nullptr));
    RouterOut ref = cpu_router(logits, forced, s, norm);
    RouterOut got = backend_router(logits, forced, s, norm);
    EXPECT_TRUE(ints_equal(got.idx, ref.idx));
    EXPECT_TRUE(same_floats(got.probs, ref.probs));
    EXPECT_TRUE(same_floats(got.w, ref.w));
    std::vector<double> tol(s.N);
    for (int64_t n = 0; n < s.N; ++n) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < s.E; ++i) mx = logits[n * s.E + i] > mx ? logits[n * s.E + i] : mx;
      const double log_sum = static_cast<double>(ref.lse[n]) - mx;
      tol[n] = 2.0 * (0x1.0p-22 * std::fabs(log_sum) + 0x1.0p-23 * std::fabs(ref.lse[n]));
    }
    EXPECT_TRUE(within(got.lse, ref.lse, tol));
  }
};

TEST_P(MoeOpsTest, RouterForwardMatchesCpuBitwise) {
  for (const MoeShape& s : kShapes) {
    const std::vector<float> logits = router_logits(s, 100 + s.E);
    const std::vector<int32_t> forced = forced_sets(s, 200 + s.E);
    for (bool norm : {false, true})
      for (bool use_forced : {false, true}) check_router(logits, use_forced ? &forced : nullptr, s, norm);
  }
}

// R3 replaying the sets the backend's router picks anyway changes nothing on that backend: the
// same ids and the same weight bits, with norm_topk_prob off (weights p, not renormalised over the
// forced set) and on. NaN/Inf rows included (their own picks are valid distinct ids too).
TEST_P(MoeOpsTest, RouterForcedWithOwnSetsEqualsUnforced) {
  for (const MoeShape& s : kShapes) {
    const std::vector<float> logits = router_logits(s, 150 + s.E);
    for (bool norm : {false, true}) {
      SCOPED_TRACE(fmt::format("{} norm_topk={}", shape_name(s), norm));
      const RouterOut own = backend_router(logits, nullptr, s, norm);
      const RouterOut replayed = backend_router(logits, &own.idx, s, norm);
      EXPECT_TRUE(ints_equal(replayed.idx, own.idx));
      EXPECT_TRUE(same_floats(replayed.w, own.w));
      EXPECT_TRUE(same_floats(replayed.probs, own.probs));
    }
  }
}

// 2^20 arguments of the softmax exponential spread over [-110, 0] (underflow cut-offs included):
// equal probabilities say the device's glibc_expf gave glibc's bits.
TEST_P(MoeOpsTest, RouterForwardExpArgumentsSpanTheRange) {
  const MoeShape s{1024, 1024, 8};
  PhiloxStream rng(300, 0);
  std::vector<float> logits(s.N * s.E);
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t i = 0; i < s.E; ++i) logits[n * s.E + i] = i == 0 ? 0.0f : -110.0f * rng.next_uniform();
  check_router(logits, nullptr, s, true);
}

TEST_P(MoeOpsTest, RouterForwardRejectsBadForcedSets) {
  const MoeShape s{5, 6, 2};
  const std::vector<float> logits = normal_vector(s.N * s.E, 39);
  std::vector<int32_t> forced(s.N * s.k, 0);
  for (int64_t n = 0; n < s.N; ++n) forced[n * s.k + 1] = 1;
  forced[7] = 0;  // token 3 gets {0, 0}
  forced[9] = 0;  // token 4 too: the first bad token is named
  try {
    backend_router(logits, &forced, s, true);
    ADD_FAILURE() << "a repeated forced id was accepted";
  } catch (const CheckError& e) {
    EXPECT_NE(std::string(e.what()).find("forced expert id 0 repeated for token 3"), std::string::npos) << e.what();
  }
  forced[7] = static_cast<int32_t>(s.E);
  try {
    backend_router(logits, &forced, s, true);
    ADD_FAILURE() << "an out-of-range forced id was accepted";
  } catch (const CheckError& e) {
    EXPECT_NE(std::string(e.what()).find("forced expert id 6 (token 3) outside [0, 6)"), std::string::npos) << e.what();
  }
}

// dlogits = p (g - P) + zc p with g = dL/dp (the same bits on every backend: the CPU's order) and
// P = sum_i p_i g_i, whose order is the backend's: |dP| <= 2 E u sum_i |p_i g_i| (two E-term sums).
// Propagated: |d dlogits_i| <= p_i |dP| + 6u p_i (|g_i| + |P|) + 2u |zc| p_i (the subtraction,
// product and sum rounding on each side), plus 2^-148 for results in the subnormal range (the
// product and the sum round to multiples of 2^-149 there, off by up to 2^-150 each, both sides);
// checked against twice that.
TEST_P(MoeOpsTest, RouterBackwardWithinSummationOrderBound) {
  const double z_scale = 1e-3;
  for (const MoeShape& s : kShapes) {
    const std::vector<float> logits = router_logits(s, 400 + s.E);
    const std::vector<int32_t> forced = forced_sets(s, 500 + s.E);
    const std::vector<float> dw = normal_vector(s.N * s.k, 600 + s.E);
    const std::vector<float> extra = normal_vector(s.E, 700 + s.E, 0.1);
    for (bool norm : {false, true})
      for (bool use_forced : {false, true})
        for (bool use_extra : {false, true}) {
          SCOPED_TRACE(fmt::format("{} norm_topk={} forced={} extra={}", shape_name(s), norm, use_forced, use_extra));
          const bool renorm = norm;  // the model's rule, forced (R3) or not
          RouterOut f = cpu_router(logits, use_forced ? &forced : nullptr, s, norm);
          std::vector<float> ref(s.N * s.E);
          cpu::moe_router_backward(ref.data(), dw.data(), f.probs.data(), f.lse.data(), f.idx.data(), f.w.data(),
                                   use_extra ? extra.data() : nullptr, z_scale, s.N, s.E, s.k, renorm);
          float* d_dl = zeros<float>(s.N * s.E);
          const float* d_dw = upload(dw);
          const float* d_p = upload(f.probs);
          const float* d_lse = upload(f.lse);
          const int32_t* d_idx = upload(f.idx);
          const float* d_w = upload(f.w);
          const float* d_extra = use_extra ? upload(extra) : nullptr;
          be().moe_router_backward(d_dl, d_dw, d_p, d_lse, d_idx, d_w, d_extra, z_scale, s.N, s.E, s.k, renorm);
          const std::vector<float> got = download(d_dl, s.N * s.E);
          std::vector<double> tol(s.N * s.E);
          for (int64_t n = 0; n < s.N; ++n) {
            const float* p = f.probs.data() + n * s.E;
            std::vector<double> g(s.E, 0.0);
            for (int64_t i = 0; i < s.E; ++i) g[i] = use_extra ? extra[i] : 0.0;
            double sel = 0, dww = 0;
            for (int64_t j = 0; j < s.k; ++j) sel += p[f.idx[n * s.k + j]], dww += double(dw[n * s.k + j]) * f.w[n * s.k + j];
            for (int64_t j = 0; j < s.k; ++j)
              g[f.idx[n * s.k + j]] += renorm ? (dw[n * s.k + j] - dww) / sel : dw[n * s.k + j];
            double P = 0, abs_pg = 0;
            for (int64_t i = 0; i < s.E; ++i) P += p[i] * g[i], abs_pg += std::fabs(p[i] * g[i]);
            const double dP = 2.0 * s.E * kU * abs_pg;
            const double zc = 2.0 * z_scale * f.lse[n];
            for (int64_t i = 0; i < s.E; ++i)
              tol[n * s.E + i] = 2.0 * (p[i] * dP + 6 * kU * p[i] * (std::fabs(g[i]) + std::fabs(P)) +
                                        2 * kU * std::fabs(zc) * p[i] + 0x1.0p-148);
          }
          EXPECT_TRUE(within(got, ref, tol));
          be().moe_router_backward(d_dl, d_dw, d_p, d_lse, d_idx, d_w, d_extra, z_scale, s.N, s.E, s.k, renorm);
          EXPECT_TRUE(same_floats(download(d_dl, s.N * s.E), got)) << "a second run gave other bits";
        }
  }
}

// The plan is a stable counting sort: offsets, row_of_slot and token_of_row equal the CPU's (host
// offsets, and moe_dispatch_plan_device's in backend memory).
// Ids from the router (ties and all), and skewed ids (u^3 E: most slots on few experts, repeats
// within a token) on more slots, so the CUDA plan runs over many chunks.
TEST_P(MoeOpsTest, DispatchPlanMatchesCpuExactly) {
  std::vector<std::pair<MoeShape, std::vector<int32_t>>> cases;
  for (const MoeShape& s : kShapes) cases.push_back({s, cpu_router(router_logits(s, 800 + s.E), nullptr, s, true).idx});
  for (const MoeShape& s : {MoeShape{4096, 64, 8}, MoeShape{3001, 128, 8}, MoeShape{700, 4, 3}}) {
    PhiloxStream rng(900 + s.E, 0);
    std::vector<int32_t> ids(s.N * s.k);
    for (auto& id : ids) {
      const double u = rng.next_uniform_double();
      id = static_cast<int32_t>(u * u * u * s.E);
    }
    cases.push_back({s, ids});
  }
  for (const auto& [s, ids] : cases) {
    SCOPED_TRACE(shape_name(s));
    std::vector<int64_t> ref_off(s.E + 1), off(s.E + 1, -1);
    std::vector<int32_t> ref_row(s.N * s.k), ref_tok(s.N * s.k);
    cpu::moe_dispatch_plan(ref_off.data(), ref_row.data(), ref_tok.data(), ids.data(), s.N, s.E, s.k);
    int32_t* row = zeros<int32_t>(s.N * s.k);
    int32_t* tok = zeros<int32_t>(s.N * s.k);
    be().moe_dispatch_plan(off.data(), row, tok, upload(ids), s.N, s.E, s.k);
    EXPECT_TRUE(ints_equal(off, ref_off));
    EXPECT_TRUE(ints_equal(download(row, s.N * s.k), ref_row));
    EXPECT_TRUE(ints_equal(download(tok, s.N * s.k), ref_tok));
    // the same plan with the offsets left in backend memory (the grouped experts' path)
    int64_t* off_dev = upload(std::vector<int64_t>(s.E + 1, -1));
    int32_t* row2 = zeros<int32_t>(s.N * s.k);
    int32_t* tok2 = zeros<int32_t>(s.N * s.k);
    be().moe_dispatch_plan_device(off_dev, row2, tok2, upload(ids), s.N, s.E, s.k);
    EXPECT_TRUE(ints_equal(download(off_dev, s.E + 1), ref_off));
    EXPECT_TRUE(ints_equal(download(row2, s.N * s.k), ref_row));
    EXPECT_TRUE(ints_equal(download(tok2, s.N * s.k), ref_tok));
  }
}

// gather, gather backward, combine and dye are copies and sums over j in the CPU's order: the same
// bits. dtopk_w = dout[n] . ye[r] in the backend's order: two C-term sums differ by at most
// 2 C u sum_c |dout_c ye_c| (+ C 2^-149 for roundings in the subnormal range, absolute).
TEST_P(MoeOpsTest, GatherCombineMatchCpu) {
  for (const MoeShape& s : kShapes)
    for (int64_t C : {64, 96, 67}) {
      SCOPED_TRACE(fmt::format("{} C={}", shape_name(s), C));
      const int64_t rows = s.N * s.k;
      RouterOut f = cpu_router(router_logits(s, 1000 + s.E), nullptr, s, true);
      std::vector<int64_t> off(s.E + 1);
      std::vector<int32_t> row_of_slot(rows), token_of_row(rows);
      cpu::moe_dispatch_plan(off.data(), row_of_slot.data(), token_of_row.data(), f.idx.data(), s.N, s.E, s.k);
      for (float& w : f.w)
        if (std::isnan(w)) w = 0.25f;  // the NaN/Inf rows' weights: keep dye and out finite
      const std::vector<float> x = normal_vector(s.N * C, 1100 + C);
      const std::vector<float> ye = normal_vector(rows * C, 1200 + C);
      const std::vector<float> dxe = normal_vector(rows * C, 1300 + C);
      const std::vector<float> dout = normal_vector(s.N * C, 1400 + C);

      std::vector<float> xe(rows * C), dx(s.N * C), out(s.N * C), dye(rows * C), dtw(rows);
      cpu::moe_gather(xe.data(), x.data(), token_of_row.data(), rows, C);
      cpu::moe_gather_backward(dx.data(), dxe.data(), row_of_slot.data(), s.N, s.k, C);
      cpu::moe_combine(out.data(), ye.data(), f.w.data(), row_of_slot.data(), s.N, s.k, C);
      cpu::moe_combine_backward(dye.data(), dtw.data(), dout.data(), ye.data(), f.w.data(), row_of_slot.data(), s.N,
                                s.k, C);

      const int32_t* d_ros = upload(row_of_slot);
      const int32_t* d_tor = upload(token_of_row);
      const float* d_w = upload(f.w);
      const float* d_ye = upload(ye);
      float* d_xe = zeros<float>(rows * C);
      float* d_dx = zeros<float>(s.N * C);
      float* d_out = zeros<float>(s.N * C);
      float* d_dye = zeros<float>(rows * C);
      float* d_dtw = zeros<float>(rows);
      be().moe_gather(d_xe, upload(x), d_tor, rows, C);
      be().moe_gather_backward(d_dx, upload(dxe), d_ros, s.N, s.k, C);
      be().moe_combine(d_out, d_ye, d_w, d_ros, s.N, s.k, C);
      be().moe_combine_backward(d_dye, d_dtw, upload(dout), d_ye, d_w, d_ros, s.N, s.k, C);
      EXPECT_TRUE(bits_equal(download(d_xe, rows * C), xe));
      EXPECT_TRUE(bits_equal(download(d_dx, s.N * C), dx));
      EXPECT_TRUE(bits_equal(download(d_out, s.N * C), out));
      EXPECT_TRUE(bits_equal(download(d_dye, rows * C), dye));
      std::vector<double> tol(rows);
      for (int64_t slot = 0; slot < rows; ++slot) {
        double a = 0;
        for (int64_t c = 0; c < C; ++c)
          a += std::fabs(double(dout[(slot / s.k) * C + c]) * ye[int64_t(row_of_slot[slot]) * C + c]);
        tol[slot] = 2.0 * C * kU * a + C * 0x1.0p-149;
      }
      EXPECT_TRUE(within(download(d_dtw, rows), dtw, tol));
    }
}

// count: integers, exact. prob_sum and lse2: double sums of N terms (lse^2 is exact in double),
// two orders differ by at most 2 N u_d sum |terms| (plus the initial value once).
TEST_P(MoeOpsTest, AccumulateLoadSums) {
  for (const MoeShape& s : kShapes) {
    SCOPED_TRACE(shape_name(s));
    RouterOut f = cpu_router(normal_vector(s.N * s.E, 1500 + s.E, 2.0), nullptr, s, false);
    std::vector<double> ref_count(s.E, 3.0), ref_psum(s.E, 0.25), count(s.E, 3.0), psum(s.E, 0.25);
    cpu::moe_accumulate_load(ref_count.data(), ref_psum.data(), f.probs.data(), f.idx.data(), s.N, s.E, s.k);
    double ref_lse2 = 0, abs_lse2 = 0;
    for (int64_t n = 0; n < s.N; ++n) ref_lse2 += double(f.lse[n]) * f.lse[n], abs_lse2 += double(f.lse[n]) * f.lse[n];
    const double lse2 = be().moe_accumulate_load(count.data(), psum.data(), upload(f.probs), upload(f.lse),
                                                 upload(f.idx), s.N, s.E, s.k);
    EXPECT_EQ(count, ref_count);
    for (int64_t e = 0; e < s.E; ++e) {
      double a = 0.25;
      for (int64_t n = 0; n < s.N; ++n) a += f.probs[n * s.E + e];
      EXPECT_NEAR(psum[e], ref_psum[e], 2.0 * (s.N + 1) * kUd * a) << "expert " << e;
    }
    EXPECT_NEAR(lse2, ref_lse2, 2.0 * s.N * kUd * abs_lse2);
  }
}

NIB_INSTANTIATE_OPS_TEST(MoeOpsTest);

// glibc_expf against the C library's expf (glibc's): bitwise, NaN for NaN. Every 4099th bit
// pattern (~1M floats of every sign and exponent) plus the branch edges; the exhaustive run over
// all 2^32 patterns is the disabled test below (a few minutes).
bool expf_agrees(float x) {
  const float a = std::exp(x), b = glibc_expf(x);
  return (std::isnan(a) && std::isnan(b)) || float_as_u32(a) == float_as_u32(b);
}

TEST(MoeGlibcExpf, MatchesStdExpOnStridedAndEdgeFloats) {
  int64_t bad = 0;
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 4099) bad += !expf_agrees(u32_as_float(static_cast<uint32_t>(u)));
  EXPECT_EQ(bad, 0);
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 88.0f, -88.0f, 0x1.62e42ep6f, 0x1.62e430p6f, -0x1.9fe368p6f, -0x1.9fe36ap6f,
                  -0x1.9d1d9ep6f, -0x1.9d1da0p6f, -0x1.9d1d9cp6f, -103.0f, -104.0f, 1e-30f, -1e-30f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()})
    EXPECT_TRUE(expf_agrees(x)) << fmt::format("x = {:a}: std::exp {:a}, glibc_expf {:a}", x, std::exp(x), glibc_expf(x));
}

TEST(MoeGlibcExpf, DISABLED_EveryFloat) {
  int64_t bad = 0;
  for (uint64_t u = 0; u < (uint64_t(1) << 32); ++u) bad += !expf_agrees(u32_as_float(static_cast<uint32_t>(u)));
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace nibble::backend::testing
