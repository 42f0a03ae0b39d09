// Tests of causal GQA attention (attention.h): backward against central finite differences in
// double (tolerance derived in grad_check_test_util.h), causality, and GQA head mapping
// (H = Hkv reproduces a per-head reference; grouped heads read kv head h / (H/Hkv)). The BF16
// reference: rounds its inputs, and is exact attention up to its roundings of P and dS.
#include "backend/cpu/attention.h"

#include <cmath>

#include <gtest/gtest.h>

#include "backend/cpu/grad_check_test_util.h"
#include "core/bits.h"

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

// ---- BF16 precision reference ------------------------------------------------------------------

std::vector<float> bf16_rounded(const std::vector<double>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = round_to_bf16(static_cast<float>(x[i]));
  return r;
}
std::vector<double> as_double(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// The reference rounds its inputs: raw FP32 inputs give bit-identical results to inputs rounded
// to BF16 beforehand (forward and backward, dout and out included).
TEST(Attention, Bf16ReferenceRoundsItsInputs) {
  const int64_t B = 1, Tn = 9, H = 2, Hkv = 1, D = 8, nq = B * Tn * H * D, nkv = B * Tn * Hkv * D;
  const std::vector<double> qd = random_vector(nq, 31), kd = random_vector(nkv, 32), vd = random_vector(nkv, 33),
                            dod = random_vector(nq, 34);
  const std::vector<float> q(qd.begin(), qd.end()), k(kd.begin(), kd.end()), v(vd.begin(), vd.end()),
      dout(dod.begin(), dod.end());
  const std::vector<float> qr = bf16_rounded(qd), kr = bf16_rounded(kd), vr = bf16_rounded(vd), dor = bf16_rounded(dod);
  ASSERT_NE(q, qr);  // the inputs are not BF16 numbers already
  std::vector<float> out(nq), lse(B * H * Tn), out_r(nq), lse_r(B * H * Tn);
  attention_forward_bf16(out.data(), lse.data(), q.data(), k.data(), v.data(), B, Tn, H, Hkv, D);
  attention_forward_bf16(out_r.data(), lse_r.data(), qr.data(), kr.data(), vr.data(), B, Tn, H, Hkv, D);
  EXPECT_EQ(out, out_r);
  EXPECT_EQ(lse, lse_r);
  std::vector<float> out_x = out;  // an `out` that is not BF16: the backward rounds it for delta
  for (auto& x : out_x) x *= 1.0f + 1e-3f;
  const std::vector<float> out_xr = bf16_rounded(as_double(out_x));
  std::vector<float> dq(nq), dk(nkv), dv(nkv), dq_r(nq), dk_r(nkv), dv_r(nkv);
  attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), out_x.data(), lse.data(), q.data(), k.data(),
                          v.data(), B, Tn, H, Hkv, D);
  attention_backward_bf16(dq_r.data(), dk_r.data(), dv_r.data(), dor.data(), out_xr.data(), lse.data(), qr.data(),
                          kr.data(), vr.data(), B, Tn, H, Hkv, D);
  EXPECT_EQ(dq, dq_r);
  EXPECT_EQ(dk, dk_r);
  EXPECT_EQ(dv, dv_r);
}

// With inputs that are BF16 numbers, the BF16 reference differs from exact (double) attention only
// by its roundings of P (forward, dv) and dS (dq, dk) to BF16, each within 2^-8 relative, and the
// final rounding to float (2^-24): |bf16 - exact| <= 2^-8 sum_terms |P or dS| |other factor| +
// 2^-24 |exact|, with a 1% margin for the double arithmetic. It does round: some results differ.
TEST(Attention, Bf16ReferenceIsExactAttentionUpToPAndDsRounding) {
  const int64_t B = 2, Tn = 21, H = 4, Hkv = 2, D = 16, G = H / Hkv, nq = B * Tn * H * D, nkv = B * Tn * Hkv * D;
  const std::vector<float> q = bf16_rounded(random_vector(nq, 41)), k = bf16_rounded(random_vector(nkv, 42)),
                           v = bf16_rounded(random_vector(nkv, 43)), dout = bf16_rounded(random_vector(nq, 44));
  const std::vector<double> qd = as_double(q), kd = as_double(k), vd = as_double(v), dod = as_double(dout);
  std::vector<double> out_x(nq), lse_x(B * H * Tn);
  attention_forward(out_x.data(), lse_x.data(), qd.data(), kd.data(), vd.data(), B, Tn, H, Hkv, D);
  std::vector<float> out(nq), lse(B * H * Tn);
  attention_forward_bf16(out.data(), lse.data(), q.data(), k.data(), v.data(), B, Tn, H, Hkv, D);
  // the backward of both from the same BF16-valued out and the same lse
  const std::vector<float> out_in = bf16_rounded(out_x);
  const std::vector<float> lse_in(lse_x.begin(), lse_x.end());
  const std::vector<double> out_ind = as_double(out_in), lse_ind = as_double(lse_in);
  std::vector<double> dq_x(nq), dk_x(nkv), dv_x(nkv);
  attention_backward(dq_x.data(), dk_x.data(), dv_x.data(), dod.data(), out_ind.data(), lse_ind.data(), qd.data(),
                     kd.data(), vd.data(), B, Tn, H, Hkv, D);
  std::vector<float> dq(nq), dk(nkv), dv(nkv);
  attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), out_in.data(), lse_in.data(), q.data(),
                          k.data(), v.data(), B, Tn, H, Hkv, D);

  // magnitudes: sum_j p |v| (out), sum p |dout| (dv), scale sum |dS| |k| (dq), scale sum |dS| |q| (dk)
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> m_out(nq, 0), m_dq(nq, 0), m_dk(nkv, 0), m_dv(nkv, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Tn; ++i) {
        const int64_t qi = ((b * Tn + i) * H + h) * D;
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += dod[qi + d] * out_ind[qi + d];
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t kj = ((b * Tn + j) * Hkv + h / G) * D;
          double s = 0, dp = 0;
          for (int64_t d = 0; d < D; ++d) s += qd[qi + d] * kd[kj + d], dp += dod[qi + d] * vd[kj + d];
          const double p_fwd = std::exp(s * scale - lse_x[(b * H + h) * Tn + i]);
          const double p = std::exp(s * scale - lse_ind[(b * H + h) * Tn + i]);
          const double ds = std::fabs(p * (dp - delta));
          for (int64_t d = 0; d < D; ++d) {
            m_out[qi + d] += p_fwd * std::fabs(vd[kj + d]);
            m_dq[qi + d] += scale * ds * std::fabs(kd[kj + d]);
            m_dk[kj + d] += scale * ds * std::fabs(qd[qi + d]);
            m_dv[kj + d] += p * std::fabs(dod[qi + d]);
          }
        }
      }
  const double u_bf16 = std::ldexp(1.0, -8), u_f32 = std::ldexp(1.0, -24);
  auto check = [&](const std::vector<float>& got, const std::vector<double>& exact, const std::vector<double>& mag,
                   const char* what) {
    bool differs = false;
    for (size_t i = 0; i < got.size(); ++i) {
      const double tol = 1.01 * u_bf16 * mag[i] + u_f32 * std::fabs(exact[i]);
      EXPECT_LE(std::fabs(got[i] - exact[i]), tol) << what << "[" << i << "]";
      differs |= std::fabs(got[i] - exact[i]) > 2 * u_f32 * std::fabs(exact[i]);
    }
    EXPECT_TRUE(differs) << what << ": no BF16 rounding visible";
  };
  check(out, out_x, m_out, "out");
  check(dq, dq_x, m_dq, "dq");
  check(dk, dk_x, m_dk, "dk");
  check(dv, dv_x, m_dv, "dv");
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], lse_x[i], 2 * u_f32 * (std::fabs(lse_x[i]) + 1));
}

}  // namespace
}  // namespace nibble::cpu
