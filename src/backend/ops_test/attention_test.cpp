// Op tests of causal GQA attention (Backend::attention_forward/backward) on every backend:
// forward out + lse and backward dq, dk, dv against the CPU reference in double
// (cpu::attention_*<double>), each element within a first-order FP32 error bound derived from
// the data (attention_error_bounds below: every dot product, exponential and sum written as
// terms times (n u)); causality (a new last key changes no earlier row, bit for bit) and run-to-run
// bit equality. Shapes cover T of one row, T not a multiple of any tile, GQA groups 1..4, D 8..256.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/attention.h"
#include "backend/ops_test/ops_test_util.h"

namespace nibble::backend::testing {
namespace {

struct AttentionShape {
  int64_t B, Tn, H, Hkv, D;
};

std::vector<double> to_double(const std::vector<float>& x) { return {x.begin(), x.end()}; }
std::vector<float> to_float(const std::vector<double>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = static_cast<float>(x[i]);
  return y;
}

// Per-element bounds on |FP32 result - exact| for inputs q, k, v (B,T,Hkv,D layout as the op),
// the forward outputs out_f, lse_f given to the backward, and dout, all FP32 values read as
// double. u = 2^-24 (FP32 unit roundoff); a sum of n terms x_t in any order is off by at most
// n u sum |x_t| (gamma_n, FMA or not), a D-term dot product likewise. Per query row i (n = i + 1
// keys j <= i), s_ij = scale q_i.k_j:
//   es_ij  = (D + 2) u scale sum_d |q_id k_jd|                   score error (dot, scale)
//   forward probabilities exp(s - m) / l: relative error ep_i = 2 max_j es_ij + u (2 max_j |s_ij| + n + 8)
//     (the score and the running max / lse each carry a score error; the subtraction before exp;
//      exp, the n-term sum l; a flash forward's rescaling by exp(m_old - m_new), once per key
//      tile, adds n / 32 + 1 roundings more, inside the 2x margin below)
//   out_id: (ep_i + (n + 3) u) sum_j p_ij |v_jd|             lse_i: 2 ep_i + u (|lse_i| + 8)
// Backward (p recomputed from the given lse: relative error eb_ij = es_ij + u (|s_ij| + |lse_i| + 4)):
//   delta_i = dout_i.out_i: ed_i = D u sum_d |dout out|;  dp_ij = dout_i.v_j: edp_ij = D u sum_d |dout v|
//   ds_ij = p (dp - delta) scale: eds_ij = (eb_ij + 3u) |ds_ij| + p scale (edp_ij + ed_i)
//   dq_id = sum_{j<=i} ds_ij k_jd:     sum_j eds_ij |k_jd| + n u sum_j |ds_ij k_jd|
//   dk_jd = sum_{h in group, i>=j} ds_ij q_id (N_j = G (T - j) terms): sum eds_ij |q_id| + N_j u sum |ds q|
//   dv_jd = sum p_ij dout_id: sum (eb_ij + N_j u) p_ij |dout_id|
// These are worst-case first-order bounds (typical errors are ~sqrt(n) smaller: the CPU FP32 path
// reaches 0.1-7% of them on these shapes); the checks allow twice the bound for second-order
// terms. A wrong mask, scale, head mapping or tile edge moves results by O(p) = O(1/T) or more,
// far above these bounds for the tested shapes.
struct AttentionBounds {
  std::vector<double> out, lse, dq, dk, dv;
};

AttentionBounds attention_error_bounds(const AttentionShape& s, const std::vector<float>& q,
                                       const std::vector<float>& k, const std::vector<float>& v,
                                       const std::vector<float>& out_f, const std::vector<float>& lse_f,
                                       const std::vector<float>& dout) {
  const int64_t B = s.B, T = s.Tn, H = s.H, Hkv = s.Hkv, D = s.D, G = H / Hkv;
  const double u = std::ldexp(1.0, -24), scale = 1.0 / std::sqrt(static_cast<double>(D));
  AttentionBounds e;
  e.out.assign(q.size(), 0), e.lse.assign(static_cast<size_t>(B * H * T), 0), e.dq.assign(q.size(), 0);
  e.dk.assign(k.size(), 0), e.dv.assign(v.size(), 0);
  std::vector<double> sc(T), es(T), p(T), ds(T), eds(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t n = i + 1;
        const float* qi = &q[((b * T + i) * H + h) * D];
        const float* doi = &dout[((b * T + i) * H + h) * D];
        const float* oi = &out_f[((b * T + i) * H + h) * D];
        auto kv_row = [&](const std::vector<float>& x, int64_t j) { return &x[((b * T + j) * Hkv + hk) * D]; };
        double es_max = 0, s_max = 0, mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const float* kj = kv_row(k, j);
          double dot = 0, mag = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(qi[d]) * kj[d], mag += std::fabs(double(qi[d]) * kj[d]);
          sc[j] = dot * scale;
          es[j] = double(D + 2) * u * scale * mag;
          es_max = std::max(es_max, es[j]), s_max = std::max(s_max, std::fabs(sc[j])), mx = std::max(mx, sc[j]);
        }
        // forward, with the exact probabilities of this row
        double l = 0;
        for (int64_t j = 0; j <= i; ++j) l += (p[j] = std::exp(sc[j] - mx));
        const double lse_exact = mx + std::log(l);
        const double ep = 2 * es_max + u * (2 * s_max + double(n) + 8);
        for (int64_t d = 0; d < D; ++d) {
          double mag = 0;
          for (int64_t j = 0; j <= i; ++j) mag += p[j] / l * std::fabs(double(kv_row(v, j)[d]));
          e.out[((b * T + i) * H + h) * D + d] = (ep + double(n + 3) * u) * mag;
        }
        const double lse_i = lse_f[(b * H + h) * T + i];
        e.lse[(b * H + h) * T + i] = 2 * ep + u * (std::fabs(lse_exact) + 8);
        // backward, probabilities recomputed from the given lse
        double delta = 0, ed = 0;
        for (int64_t d = 0; d < D; ++d) delta += double(doi[d]) * oi[d], ed += std::fabs(double(doi[d]) * oi[d]);
        ed *= double(D) * u;
        for (int64_t j = 0; j <= i; ++j) {
          const float* vj = kv_row(v, j);
          double dp = 0, edp = 0;
          for (int64_t d = 0; d < D; ++d) dp += double(doi[d]) * vj[d], edp += std::fabs(double(doi[d]) * vj[d]);
          edp *= double(D) * u;
          p[j] = std::exp(sc[j] - lse_i);
          ds[j] = p[j] * (dp - delta) * scale;
          const double eb = es[j] + u * (std::fabs(sc[j]) + std::fabs(lse_i) + 4);
          eds[j] = (eb + 3 * u) * std::fabs(ds[j]) + p[j] * scale * (edp + ed);
          const double nkv = double(G * (T - j)) * u;
          double* ek = &e.dk[((b * T + j) * Hkv + hk) * D];
          double* ev = &e.dv[((b * T + j) * Hkv + hk) * D];
          for (int64_t d = 0; d < D; ++d) {
            ek[d] += (eds[j] + nkv * std::fabs(ds[j])) * std::fabs(double(qi[d]));
            ev[d] += (eb + nkv) * p[j] * std::fabs(double(doi[d]));
          }
        }
        double* eq = &e.dq[((b * T + i) * H + h) * D];
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j)
            acc += (eds[j] + double(n) * u * std::fabs(ds[j])) * std::fabs(double(kv_row(k, j)[d]));
          eq[d] = acc;
        }
      }
    }
  return e;
}

// |got - ref| <= 2 bound elementwise (bound from attention_error_bounds; NaN fails).
::testing::AssertionResult within_bounds(const std::vector<float>& got, const std::vector<double>& ref,
                                         const std::vector<double>& bound, const char* what) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(double(got[i]) - ref[i]), tol = 2 * bound[i];
    if (!(diff <= tol))
      return ::testing::AssertionFailure()
             << fmt::format("{}[{}]: {} vs reference {} (|diff| {:.3g} > 2 x bound {:.3g})", what, i, got[i], ref[i],
                            diff, bound[i]);
  }
  return ::testing::AssertionSuccess();
}

class AttentionOpsTest : public OpsTest {};

TEST_P(AttentionOpsTest, MatchesDoubleReferenceWithinDerivedBounds) {
  const AttentionShape shapes[] = {{1, 1, 1, 1, 8},     {2, 17, 4, 2, 24},  {1, 128, 8, 2, 64},
                                   {2, 300, 4, 4, 128}, {1, 1024, 4, 1, 64}, {1, 70, 2, 1, 256}};
  uint64_t seed = 1300;
  for (const AttentionShape& s : shapes) {
    SCOPED_TRACE(fmt::format("B={} T={} H={} Hkv={} D={}", s.B, s.Tn, s.H, s.Hkv, s.D));
    const int64_t nq = s.B * s.Tn * s.H * s.D, nkv = s.B * s.Tn * s.Hkv * s.D, nl = s.B * s.H * s.Tn;
    const std::vector<float> q = normal_vector(nq, seed++), k = normal_vector(nkv, seed++),
                             v = normal_vector(nkv, seed++), dout = normal_vector(nq, seed++);
    // reference forward in double; its outputs rounded to FP32 are the backward's inputs everywhere
    const std::vector<double> qd = to_double(q), kd = to_double(k), vd = to_double(v), dod = to_double(dout);
    std::vector<double> out_ref(nq), lse_ref(nl);
    cpu::attention_forward<double>(out_ref.data(), lse_ref.data(), qd.data(), kd.data(), vd.data(), s.B, s.Tn, s.H,
                                   s.Hkv, s.D);
    const std::vector<float> out_f = to_float(out_ref), lse_f = to_float(lse_ref);
    const std::vector<double> out_fd = to_double(out_f), lse_fd = to_double(lse_f);
    std::vector<double> dq_ref(nq), dk_ref(nkv), dv_ref(nkv);
    cpu::attention_backward<double>(dq_ref.data(), dk_ref.data(), dv_ref.data(), dod.data(), out_fd.data(),
                                    lse_fd.data(), qd.data(), kd.data(), vd.data(), s.B, s.Tn, s.H, s.Hkv, s.D);
    const AttentionBounds bound = attention_error_bounds(s, q, k, v, out_f, lse_f, dout);

    const float *q_b = upload(q), *k_b = upload(k), *v_b = upload(v), *dout_b = upload(dout);
    float *out_b = zeros<float>(nq), *lse_b = zeros<float>(nl);
    be().attention_forward(out_b, lse_b, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D);
    EXPECT_TRUE(within_bounds(download(out_b, nq), out_ref, bound.out, "out"));
    EXPECT_TRUE(within_bounds(download(lse_b, nl), lse_ref, bound.lse, "lse"));

    const float *out_in = upload(out_f), *lse_in = upload(lse_f);
    float *dq_b = zeros<float>(nq), *dk_b = zeros<float>(nkv), *dv_b = zeros<float>(nkv);
    be().attention_backward(dq_b, dk_b, dv_b, dout_b, out_in, lse_in, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D);
    EXPECT_TRUE(within_bounds(download(dq_b, nq), dq_ref, bound.dq, "dq"));
    EXPECT_TRUE(within_bounds(download(dk_b, nkv), dk_ref, bound.dk, "dk"));
    EXPECT_TRUE(within_bounds(download(dv_b, nkv), dv_ref, bound.dv, "dv"));
  }
}

// A new last key/value (t = T-1, every batch and kv head) leaves every earlier row of out, lse
// and dq, and dk/dv of every earlier key, bit-identical (the backward gets the same out, lse and
// dout both times), while the last rows do change; a repeated call gives the same bits.
TEST_P(AttentionOpsTest, LastKeyChangesNoEarlierRowAndRunsRepeatBitwise) {
  const AttentionShape s{2, 70, 4, 2, 64};  // 70: partial tiles of 32, 64 and 16 rows
  const int64_t nq = s.B * s.Tn * s.H * s.D, nkv = s.B * s.Tn * s.Hkv * s.D, nl = s.B * s.H * s.Tn;
  const std::vector<float> q = normal_vector(nq, 41), k = normal_vector(nkv, 42), v = normal_vector(nkv, 43),
                           dout = normal_vector(nq, 44), fresh = normal_vector(2 * nkv, 45);
  std::vector<float> k2 = k, v2 = v;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t e = 0; e < s.Hkv * s.D; ++e) {
      const int64_t at = (b * s.Tn + s.Tn - 1) * s.Hkv * s.D + e;
      k2[at] = fresh[at], v2[at] = fresh[nkv + at];
    }
  struct Results {
    std::vector<float> out, lse, dq, dk, dv;
  };
  const float* q_b = upload(q);
  const float* dout_b = upload(dout);
  const float *out_in = nullptr, *lse_in = nullptr;  // the first run's forward, input of every backward
  auto run = [&](const std::vector<float>& kk, const std::vector<float>& vv) {
    const float *k_b = upload(kk), *v_b = upload(vv);
    float *out_b = zeros<float>(nq), *lse_b = zeros<float>(nl);
    be().attention_forward(out_b, lse_b, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D);
    if (out_in == nullptr) out_in = out_b, lse_in = lse_b;
    float *dq_b = zeros<float>(nq), *dk_b = zeros<float>(nkv), *dv_b = zeros<float>(nkv);
    be().attention_backward(dq_b, dk_b, dv_b, dout_b, out_in, lse_in, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D);
    return Results{download(out_b, nq), download(lse_b, nl), download(dq_b, nq), download(dk_b, nkv),
                   download(dv_b, nkv)};
  };
  const Results a = run(k, v), again = run(k, v), c = run(k2, v2);
  EXPECT_TRUE(bits_equal(again.out, a.out));
  EXPECT_TRUE(bits_equal(again.lse, a.lse));
  EXPECT_TRUE(bits_equal(again.dq, a.dq));
  EXPECT_TRUE(bits_equal(again.dk, a.dk));
  EXPECT_TRUE(bits_equal(again.dv, a.dv));

  // rows of (B,T,X,D) tensors with t < T-1, and their last rows
  auto split_rows = [&](const std::vector<float>& x, int64_t X, bool last) {
    std::vector<float> r;
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t t = last ? s.Tn - 1 : 0; t < (last ? s.Tn : s.Tn - 1); ++t)
        r.insert(r.end(), x.begin() + (b * s.Tn + t) * X * s.D, x.begin() + (b * s.Tn + t + 1) * X * s.D);
    return r;
  };
  auto split_lse = [&](const std::vector<float>& x, bool last) {  // (B,H,T)
    std::vector<float> r;
    for (int64_t bh = 0; bh < s.B * s.H; ++bh)
      for (int64_t t = last ? s.Tn - 1 : 0; t < (last ? s.Tn : s.Tn - 1); ++t) r.push_back(x[bh * s.Tn + t]);
    return r;
  };
  EXPECT_TRUE(bits_equal(split_rows(c.out, s.H, false), split_rows(a.out, s.H, false)));
  EXPECT_TRUE(bits_equal(split_lse(c.lse, false), split_lse(a.lse, false)));
  EXPECT_TRUE(bits_equal(split_rows(c.dq, s.H, false), split_rows(a.dq, s.H, false)));
  EXPECT_TRUE(bits_equal(split_rows(c.dk, s.Hkv, false), split_rows(a.dk, s.Hkv, false)));
  EXPECT_TRUE(bits_equal(split_rows(c.dv, s.Hkv, false), split_rows(a.dv, s.Hkv, false)));
  // the new key is seen by the last query row (it does take part)
  EXPECT_FALSE(bits_equal(split_rows(c.out, s.H, true), split_rows(a.out, s.H, true)));
  EXPECT_FALSE(bits_equal(split_lse(c.lse, true), split_lse(a.lse, true)));
  EXPECT_FALSE(bits_equal(split_rows(c.dq, s.H, true), split_rows(a.dq, s.H, true)));
  EXPECT_FALSE(bits_equal(split_rows(c.dk, s.Hkv, true), split_rows(a.dk, s.Hkv, true)));
  EXPECT_FALSE(bits_equal(split_rows(c.dv, s.Hkv, true), split_rows(a.dv, s.Hkv, true)));
}

NIB_INSTANTIATE_OPS_TEST(AttentionOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
