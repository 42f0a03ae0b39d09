// Tests of the MoE routing ops (moe.h): top-k selection and weights against direct formulas,
// router backward (plain, norm_topk_prob, forced set, aux-loss extra, router z-loss) and the
// dispatch/combine backward against central finite differences in double; forced routing with
// the router's own top-k reproduces the normal path, weights renormalised or not (norm_topk_prob).
#include "backend/cpu/moe.h"

#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include "backend/cpu/grad_check_test_util.h"
#include "core/check.h"

namespace nibble::cpu {
namespace {

using testing::dot;
using testing::expect_grad_matches_fd;
using testing::random_vector;

constexpr int64_t N = 5, E = 6, K = 2;

TEST(MoeRouter, TopKSelectionAndWeights) {
  auto logits = random_vector(N * E, 31);
  std::vector<double> p(N * E), lse(N), w(N * K), wn(N * K);
  std::vector<int32_t> idx(N * K), idxn(N * K);
  moe_router_forward(p.data(), lse.data(), idx.data(), w.data(), logits.data(), nullptr, N, E, K, false);
  moe_router_forward(p.data(), lse.data(), idxn.data(), wn.data(), logits.data(), nullptr, N, E, K, true);
  EXPECT_EQ(idx, idxn);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int> order(E);
    for (int i = 0; i < E; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[n * E + a] > logits[n * E + b]; });
    EXPECT_EQ(idx[n * K + 0], order[0]);
    EXPECT_EQ(idx[n * K + 1], order[1]);
    double z = 0;
    for (int i = 0; i < E; ++i) z += std::exp(logits[n * E + i]);
    double p0 = std::exp(logits[n * E + order[0]]) / z, p1 = std::exp(logits[n * E + order[1]]) / z;
    EXPECT_NEAR(w[n * K + 0], p0, 1e-15);
    EXPECT_NEAR(wn[n * K + 0], p0 / (p0 + p1), 1e-15);
    EXPECT_NEAR(wn[n * K + 1], p1 / (p0 + p1), 1e-15);
  }
  // ties go to the lower expert id
  std::vector<double> tie(E, 0.0);
  std::vector<double> pt(E), lt(1), wt(K);
  std::vector<int32_t> it(K);
  moe_router_forward(pt.data(), lt.data(), it.data(), wt.data(), tie.data(), nullptr, 1, E, K, true);
  EXPECT_EQ(it[0], 0);
  EXPECT_EQ(it[1], 1);
}

// loss = r . topk_w + sum_e extra_e sum_n p[n,e] + zc * sum_n lse_n^2 (what the model builds)
void check_router_backward(bool norm_topk, bool forced) {
  auto logits = random_vector(N * E, 32);
  auto r = random_vector(N * K, 33);
  auto extra = random_vector(E, 34);
  const double zc = 0.05;
  std::vector<int32_t> fixed = {0, 5, 2, 3, 4, 1, 1, 0, 3, 2};  // a forced set per token
  std::vector<double> p(N * E), lse(N), w(N * K), dl(N * E);
  std::vector<int32_t> idx(N * K);
  const int32_t* f = forced ? fixed.data() : nullptr;
  moe_router_forward(p.data(), lse.data(), idx.data(), w.data(), logits.data(), f, N, E, K, norm_topk);
  if (forced) {
    EXPECT_EQ(idx, fixed);
  }
  moe_router_backward(dl.data(), r.data(), p.data(), lse.data(), idx.data(), w.data(), extra.data(), zc, N, E, K,
                      norm_topk);
  std::vector<int32_t> idx0 = idx;
  expect_grad_matches_fd(logits, dl, [&] {
    moe_router_forward(p.data(), lse.data(), idx.data(), w.data(), logits.data(), f, N, E, K, norm_topk);
    EXPECT_EQ(idx, idx0);  // the step must not change the selection (random logits: gaps >> 1e-5)
    double s = dot(r, w);
    for (int64_t n = 0; n < N; ++n) {
      s += zc * lse[n] * lse[n];
      for (int64_t e = 0; e < E; ++e) s += extra[e] * p[n * E + e];
    }
    return s;
  }, "dlogits");
}

TEST(MoeRouter, BackwardPlain) { check_router_backward(false, false); }
TEST(MoeRouter, BackwardNormTopk) { check_router_backward(true, false); }
TEST(MoeRouter, BackwardForced) { check_router_backward(false, true); }
TEST(MoeRouter, BackwardForcedNormTopk) { check_router_backward(true, true); }

// R3 replaying the set the router picks anyway changes nothing, with norm_topk_prob off (weights
// p, not renormalised over the forced set) and on (p / sum over the set).
TEST(MoeRouter, ForcedWithOwnTopKEqualsNormalPath) {
  auto logits = random_vector(N * E, 35);
  for (bool norm_topk : {false, true}) {
    SCOPED_TRACE(norm_topk ? "norm_topk_prob" : "no norm_topk_prob");
    std::vector<double> p(N * E), lse(N), w(N * K), w2(N * K);
    std::vector<int32_t> idx(N * K), idx2(N * K);
    moe_router_forward(p.data(), lse.data(), idx.data(), w.data(), logits.data(), nullptr, N, E, K, norm_topk);
    moe_router_forward(p.data(), lse.data(), idx2.data(), w2.data(), logits.data(), idx.data(), N, E, K, norm_topk);
    EXPECT_EQ(idx, idx2);
    EXPECT_EQ(w, w2);  // the same arithmetic in the same order: bit-identical
    double wsum = 0;
    for (double v : w) wsum += v;
    // the weights of N tokens sum to N only when renormalised (top-2 of 6 experts: well below 1 each)
    EXPECT_EQ(std::fabs(wsum - static_cast<double>(N)) < 1e-12, norm_topk) << wsum;
  }
}

TEST(MoeRouter, BadForcedIdsThrowCatchably) {
  auto logits = random_vector(N * E, 39);
  std::vector<double> p(N * E), lse(N), w(N * K);
  std::vector<int32_t> idx(N * K), forced(N * K, 0);
  for (int64_t n = 0; n < N; ++n) forced[n * K + 1] = 1;
  forced[7] = 0;  // token 3 gets {0, 0}: repeated
  EXPECT_THROW(moe_router_forward(p.data(), lse.data(), idx.data(), w.data(), logits.data(), forced.data(), N, E, K, true),
               CheckError);
  forced[7] = E;  // out of range
  EXPECT_THROW(moe_router_forward(p.data(), lse.data(), idx.data(), w.data(), logits.data(), forced.data(), N, E, K, true),
               CheckError);
}

TEST(MoeDispatch, PlanIsAStableSortAndCombineBackwardMatchesFd) {
  const int64_t C = 3;
  std::vector<int32_t> idx = {2, 0, 0, 2, 1, 2, 2, 0, 0, 1};  // (N=5, K=2)
  std::vector<int64_t> off(E + 1);
  std::vector<int32_t> row_of_slot(N * K), token_of_row(N * K);
  moe_dispatch_plan(off.data(), row_of_slot.data(), token_of_row.data(), idx.data(), N, E, K);
  EXPECT_EQ(off, (std::vector<int64_t>{0, 4, 6, 10, 10, 10, 10}));
  EXPECT_EQ(token_of_row, (std::vector<int32_t>{0, 1, 3, 4, 2, 4, 0, 1, 2, 3}));
  for (int64_t s = 0; s < N * K; ++s) EXPECT_EQ(token_of_row[row_of_slot[s]], s / K);

  auto x = random_vector(N * C, 36), w = random_vector(N * K, 37), r = random_vector(N * C, 38);
  // a nonlinear per-row "expert" so the combine/gather chain is tested end to end: ye = xe^2 + row
  std::vector<double> xe(N * K * C), ye(N * K * C), out(N * C);
  auto forward = [&] {
    moe_gather(xe.data(), x.data(), token_of_row.data(), N * K, C);
    for (int64_t i = 0; i < N * K * C; ++i) ye[i] = xe[i] * xe[i] + double(i / C);
    moe_combine(out.data(), ye.data(), w.data(), row_of_slot.data(), N, K, C);
    return dot(out, r);
  };
  forward();
  std::vector<double> dye(N * K * C), dw(N * K), dxe(N * K * C), dx(N * C);
  moe_combine_backward(dye.data(), dw.data(), r.data(), ye.data(), w.data(), row_of_slot.data(), N, K, C);
  for (int64_t i = 0; i < N * K * C; ++i) dxe[i] = 2 * xe[i] * dye[i];
  moe_gather_backward(dx.data(), dxe.data(), row_of_slot.data(), N, K, C);
  expect_grad_matches_fd(x, dx, forward, "dx");
  expect_grad_matches_fd(w, dw, forward, "dtopk_w");

  std::vector<double> count(E, 0.0), psum(E, 0.0), probs(N * E, 1.0 / E);
  moe_accumulate_load(count.data(), psum.data(), probs.data(), idx.data(), N, E, K);
  EXPECT_EQ(count, (std::vector<double>{4, 2, 4, 0, 0, 0}));
  EXPECT_NEAR(psum[3], N * (1.0 / E), 1e-15);
}

}  // namespace
}  // namespace nibble::cpu
