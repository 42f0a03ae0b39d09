// Tests of causal GQA attention (attention.h): backward against central finite differences in
// double (tolerance derived in grad_check_test_util.h), causality, and GQA head mapping
// (H = Hkv reproduces a per-head reference; grouped heads read kv head h / (H/Hkv)).
#include "backend/cpu/attention.h"

#include <cmath>

#include <gtest/gtest.h>

#include "backend/cpu/grad_check_test_util.h"

namespace nibble::cpu {
namespace {

using testing::dot;
using testing::expect_grad_matches_fd;
using testing::random_vector;

// Random q: (B,T,H,D), k, v: (B,T,Hkv,D) in double from seeds seed, seed+1, seed+2, and their
// forward out: (B,T,H,D), lse: (B,H,T).
struct AttentionForward {
  std::vector<double> q, k, v, out, lse;
};
AttentionForward random_attention_forward(int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D, uint64_t seed) {
  AttentionForward f{random_vector(B * Tn * H * D, seed), random_vector(B * Tn * Hkv * D, seed + 1),
                     random_vector(B * Tn * Hkv * D, seed + 2), {}, {}};
  f.out.resize(f.q.size());
  f.lse.resize(B * H * Tn);
  attention_forward(f.out.data(), f.lse.data(), f.q.data(), f.k.data(), f.v.data(), B, Tn, H, Hkv, D);
  return f;
}

TEST(Attention, BackwardMatchesFiniteDifferencesWithGqa) {
  const int64_t B = 2, Tn = 5, H = 4, Hkv = 2, D = 4;
  // Named references, not a structured binding: the lambda below captures them (clang before 16
  // cannot capture structured bindings).
  AttentionForward f = random_attention_forward(B, Tn, H, Hkv, D, 21);
  std::vector<double>&q = f.q, &k = f.k, &v = f.v, &out = f.out, &lse = f.lse;
  auto r = random_vector(B * Tn * H * D, 24);
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
  attention_backward(dq.data(), dk.data(), dv.data(), r.data(), out.data(), lse.data(), q.data(), k.data(), v.data(), B, Tn, H,
                     Hkv, D);
  std::vector<double> lse2(lse.size());
  auto loss = [&] {
    attention_forward(out.data(), lse2.data(), q.data(), k.data(), v.data(), B, Tn, H, Hkv, D);
    return dot(out, r);
  };
  expect_grad_matches_fd(q, dq, loss, "dq");
  expect_grad_matches_fd(k, dk, loss, "dk");
  expect_grad_matches_fd(v, dv, loss, "dv");
}

TEST(Attention, CausalAndHeadMappingAgainstDirectFormula) {
  const int64_t B = 1, Tn = 4, H = 4, Hkv = 2, D = 3;
  auto [q, k, v, out, lse] = random_attention_forward(B, Tn, H, Hkv, D, 25);
  for (int64_t h = 0; h < H; ++h) {
    int64_t hk = h / 2;  // repeat_kv: query head h uses kv head h // n_rep
    for (int64_t t = 0; t < Tn; ++t) {
      std::vector<double> s(t + 1);
      double mx = -1e300, sum = 0;
      for (int64_t t2 = 0; t2 <= t; ++t2) {
        double d = 0;
        for (int64_t i = 0; i < D; ++i) d += q[(t * H + h) * D + i] * k[(t2 * Hkv + hk) * D + i];
        s[t2] = d / std::sqrt(double(D));
        mx = std::max(mx, s[t2]);
      }
      for (auto& x : s) sum += (x = std::exp(x - mx));
      for (int64_t i = 0; i < D; ++i) {
        double o = 0;
        for (int64_t t2 = 0; t2 <= t; ++t2) o += s[t2] / sum * v[(t2 * Hkv + hk) * D + i];
        // same arithmetic up to summation order on O(1) values: 1e-14
        EXPECT_NEAR(out[(t * H + h) * D + i], o, 1e-14);
      }
      // the saved log-sum-exp of the row: mx + log(sum)
      EXPECT_NEAR(lse[h * Tn + t], mx + std::log(sum), 1e-14);
    }
  }
  // changing the last key/value leaves every earlier output bit-identical
  std::vector<double> out2(q.size());
  for (int64_t i = 0; i < Hkv * D; ++i) {
    k[(Tn - 1) * Hkv * D + i] += 1.0;
    v[(Tn - 1) * Hkv * D + i] -= 2.0;
  }
  attention_forward(out2.data(), lse.data(), q.data(), k.data(), v.data(), B, Tn, H, Hkv, D);
  for (int64_t i = 0; i < (Tn - 1) * H * D; ++i) EXPECT_EQ(out[i], out2[i]);
  EXPECT_NE(out[(Tn - 1) * H * D], out2[(Tn - 1) * H * D]);
}

TEST(Attention, FloatMatchesDoubleWithinDerivedTolerance) {
  const int64_t B = 2, Tn = 16, H = 2, Hkv = 1, D = 8;
  auto [q, k, v, out, lse] = random_attention_forward(B, Tn, H, Hkv, D, 28);
  std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end());
  std::vector<float> outf(q.size()), lsef(lse.size());
  attention_forward(outf.data(), lsef.data(), qf.data(), kf.data(), vf.data(), B, Tn, H, Hkv, D);
  // f32 relative error per op ~6e-8; dot products of D=8 O(1) terms, softmax over <=16 and PV:
  // error <= ~ (D + T + T) * 6e-8 * max|terms| (~10) ~ 2.4e-5. Allow 1e-4.
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(outf[i], out[i], 1e-4);
}

}  // namespace
}  // namespace nibble::cpu
