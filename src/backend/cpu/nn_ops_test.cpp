// Tests of the CPU per-token ops (nn_ops.h) and GEMMs (gemm.h): every backward against central
// finite differences in double (tolerance derived in grad_check_test_util.h), and forward values
// against direct formulas (HF RMSNorm, rotate_half RoPE, SwiGLU, cross-entropy with z-loss).
#include "backend/cpu/nn_ops.h"

#include <cmath>

#include <gtest/gtest.h>

#include "backend/cpu/gemm.h"
#include "backend/cpu/grad_check_test_util.h"
#include "core/check.h"

namespace nibble::cpu {
namespace {

using testing::dot;
using testing::expect_grad_matches_fd;
using testing::random_vector;

TEST(Gemm, ThreeProductsMatchNaiveLoops) {
  const int64_t M = 5, N = 7, K = 3;
  auto x = random_vector(M * K, 1), w = random_vector(N * K, 2), dy = random_vector(M * N, 3);
  std::vector<double> y(M * N), dx(M * K), dw(N * K, 1.0);
  matmul_nt(y.data(), x.data(), w.data(), M, N, K);
  matmul_nn(dx.data(), dy.data(), w.data(), M, K, N);
  matmul_tn(dw.data(), dy.data(), x.data(), N, K, M, /*accumulate=*/true);
  // Exact up to summation order: |error| <= K * eps * sum|terms| ~ 3 * 2.2e-16 * 10 < 1e-13.
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      EXPECT_NEAR(y[m * N + n], s, 1e-13);
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += dy[m * N + n] * w[n * K + k];
      EXPECT_NEAR(dx[m * K + k], s, 1e-13);
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double s = 1.0;
      for (int64_t m = 0; m < M; ++m) s += dy[m * N + n] * x[m * K + k];
      EXPECT_NEAR(dw[n * K + k], s, 1e-13);
    }
}

TEST(Embedding, BackwardScattersRepeatedTokens) {
  const int64_t N = 6, V = 4, C = 3;
  std::vector<int32_t> tok = {1, 3, 1, 0, 1, 2};
  auto wte = random_vector(V * C, 4), r = random_vector(N * C, 5);
  std::vector<double> out(N * C), dwte(V * C, 0.0);
  embedding_forward(out.data(), tok.data(), wte.data(), N, V, C);
  EXPECT_EQ(out[2 * C + 1], wte[1 * C + 1]);
  embedding_backward(dwte.data(), r.data(), tok.data(), N, V, C);
  expect_grad_matches_fd(wte, dwte, [&] {
    embedding_forward(out.data(), tok.data(), wte.data(), N, V, C);
    return dot(out, r);
  }, "dwte");
}

TEST(Embedding, BadTokenIdsThrowCatchably) {
  // with several threads too: the check runs before the parallel region
  std::vector<int32_t> tok(1000, 1);
  tok[777] = 4;
  std::vector<float> wte(4 * 8), out(1000 * 8);
  EXPECT_THROW(embedding_forward(out.data(), tok.data(), wte.data(), 1000, 4, 8), CheckError);
  tok[777] = -1;
  EXPECT_THROW(embedding_forward(out.data(), tok.data(), wte.data(), 1000, 4, 8), CheckError);
  std::vector<float> logits(1000 * 4), lse(1000), ce(1000);
  tok[777] = 4;  // as a target: >= V
  EXPECT_THROW(cross_entropy_forward(lse.data(), ce.data(), logits.data(), tok.data(), 1000, 4), CheckError);
  EXPECT_THROW(cross_entropy_forward_backward(logits.data(), lse.data(), ce.data(), logits.data(), tok.data(), 1000, 4,
                                              1.0, 0.0),
               CheckError);
}

TEST(RmsNorm, ForwardIsHfFormulaAndBackwardMatchesFd) {
  const int64_t R = 3, C = 8;
  const double eps = 1e-5;
  auto x = random_vector(R * C, 6), w = random_vector(C, 7), r = random_vector(R * C, 8);
  for (auto& v : w) v += 1.0;
  std::vector<double> out(R * C), rstd(R), dx(R * C), dw(C, 0.0);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), R, C, eps);
  for (int64_t i = 0; i < R; ++i) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[i * C + c] * x[i * C + c] / C;
    for (int64_t c = 0; c < C; ++c) EXPECT_NEAR(out[i * C + c], w[c] * x[i * C + c] / std::sqrt(ms + eps), 1e-14);
  }
  rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), R, C);
  auto loss = [&] {
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), R, C, eps);
    return dot(out, r);
  };
  expect_grad_matches_fd(x, dx, loss, "dx");
  expect_grad_matches_fd(w, dw, loss, "dw");
}

TEST(Rope, RotateHalfConventionAndBackward) {
  const int64_t B = 2, Tn = 3, H = 2, D = 8, half = D / 2;
  const double theta = 10000.0;
  std::vector<double> cs(Tn * half), sn(Tn * half);
  rope_table(cs.data(), sn.data(), Tn, D, theta);
  // position 2, pair j=1: angle = 2 * 10000^(-2/8) computed in f32 like transformers.
  float ang = 2.0f * (1.0f / std::pow(10000.0f, 0.25f));
  EXPECT_EQ(cs[2 * half + 1], static_cast<double>(std::cos(ang)));
  auto x = random_vector(B * Tn * H * D, 9), r = random_vector(B * Tn * H * D, 10);
  std::vector<double> out(x.size()), dx(x.size());
  rope_forward(out.data(), x.data(), cs.data(), sn.data(), nullptr, B, Tn, H, D);
  // element (b=1, t=2, h=1): out[j] = x[j] cos - x[j+half] sin; out[j+half] = x[j+half] cos + x[j] sin
  int64_t base = ((1 * Tn + 2) * H + 1) * D;
  for (int64_t j = 0; j < half; ++j) {
    double c = cs[2 * half + j], s = sn[2 * half + j];
    EXPECT_NEAR(out[base + j], x[base + j] * c - x[base + j + half] * s, 1e-15);
    EXPECT_NEAR(out[base + j + half], x[base + j + half] * c + x[base + j] * s, 1e-15);
  }
  // position 0 is the identity
  for (int64_t j = 0; j < D; ++j) EXPECT_EQ(out[j], x[j]);
  rope_backward(dx.data(), r.data(), cs.data(), sn.data(), nullptr, B, Tn, H, D);
  expect_grad_matches_fd(x, dx, [&] {
    rope_forward(out.data(), x.data(), cs.data(), sn.data(), nullptr, B, Tn, H, D);
    return dot(out, r);
  }, "dx");
  // explicit positions equal to t reproduce the default
  std::vector<int32_t> pos(B * Tn);
  for (int64_t i = 0; i < B * Tn; ++i) pos[i] = static_cast<int32_t>(i % Tn);
  std::vector<double> out2(x.size());
  rope_forward(out2.data(), x.data(), cs.data(), sn.data(), pos.data(), B, Tn, H, D);
  rope_forward(out.data(), x.data(), cs.data(), sn.data(), nullptr, B, Tn, H, D);
  EXPECT_EQ(out, out2);
}

TEST(SwiGlu, ForwardAndBackward) {
  const int64_t N = 4, I = 5;
  auto gu = random_vector(N * 2 * I, 11, 2.0), r = random_vector(N * I, 12);
  std::vector<double> out(N * I), dgu(N * 2 * I);
  swiglu_forward(out.data(), gu.data(), N, I);
  double g = gu[2 * 2 * I + 3], u = gu[2 * 2 * I + I + 3];
  EXPECT_NEAR(out[2 * I + 3], g / (1 + std::exp(-g)) * u, 1e-15);
  swiglu_backward(dgu.data(), r.data(), gu.data(), N, I);
  expect_grad_matches_fd(gu, dgu, [&] {
    swiglu_forward(out.data(), gu.data(), N, I);
    return dot(out, r);
  }, "dgu");
}

TEST(CrossEntropy, ZLossIgnoreIndexAndBackward) {
  const int64_t N = 5, V = 7;
  const double zc = 0.3;  // large so the z-loss term is visible in the check
  auto logits = random_vector(N * V, 13, 2.0);
  std::vector<int32_t> tgt = {3, -100, 0, 6, -100};
  std::vector<double> lse(N), tok(N), dl(N * V);
  auto s = cross_entropy_forward(lse.data(), tok.data(), logits.data(), tgt.data(), N, V);
  EXPECT_EQ(s.n_valid, 3);
  double ce = 0, z = 0;
  for (int64_t n = 0; n < N; ++n) {
    double m = 0;
    for (int64_t v = 0; v < V; ++v) m += std::exp(logits[n * V + v]);
    double ls = std::log(m);
    EXPECT_NEAR(lse[n], ls, 1e-13);
    if (tgt[n] < 0) {
      EXPECT_EQ(tok[n], 0.0);
      continue;
    }
    ce += ls - logits[n * V + tgt[n]];
    z += ls * ls;
  }
  EXPECT_NEAR(s.ce_sum, ce, 1e-12);
  EXPECT_NEAR(s.z_sum, z, 1e-12);
  cross_entropy_backward(dl.data(), logits.data(), lse.data(), tgt.data(), N, V, 1.0 / 3, zc / 3);
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(dl[1 * V + v], 0.0);
  expect_grad_matches_fd(logits, dl, [&] {
    auto s2 = cross_entropy_forward(lse.data(), tok.data(), logits.data(), tgt.data(), N, V);
    return (s2.ce_sum + zc * s2.z_sum) / s2.n_valid;
  }, "dlogits");
  // in-place backward (dlogits aliasing logits) gives the same values
  std::vector<double> inplace = logits;
  cross_entropy_backward(inplace.data(), inplace.data(), lse.data(), tgt.data(), N, V, 1.0 / 3, zc / 3);
  EXPECT_EQ(inplace, dl);
  // the fused one-pass op: same sums and lse bit for bit, dlogits equal up to a few roundings
  // (exp(l - max) / sum instead of exp(l - lse): relative difference <= ~4 eps = 1e-15)
  std::vector<double> fused = logits, lse2(N), tok2(N);
  auto s3 = cross_entropy_forward_backward(fused.data(), lse2.data(), tok2.data(), fused.data(), tgt.data(), N, V,
                                           1.0 / 3, zc / 3);
  auto s4 = cross_entropy_forward(lse.data(), tok.data(), logits.data(), tgt.data(), N, V);
  EXPECT_EQ(s3.ce_sum, s4.ce_sum);
  EXPECT_EQ(s3.z_sum, s4.z_sum);
  EXPECT_EQ(s3.n_valid, s4.n_valid);
  EXPECT_EQ(lse2, lse);
  EXPECT_EQ(tok2, tok);
  for (size_t i = 0; i < dl.size(); ++i) EXPECT_NEAR(fused[i], dl[i], 1e-14 * std::fabs(dl[i]) + 1e-17) << i;
}

}  // namespace
}  // namespace nibble::cpu
