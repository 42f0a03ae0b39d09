// Op tests of causal GQA attention (Backend::attention_forward/backward) on every backend:
// forward out + lse and backward dq, dk, dv against the CPU reference in double
// (cpu::attention_*<double>), each element within a first-order FP32 error bound derived from
// the data (attention_error_bounds below: every dot product, exponential and sum written as
// terms times (n u)); causality (a new last key changes no earlier row, bit for bit) and run-to-run
// bit equality. Shapes cover T of one row, T not a multiple of any tile, GQA groups 1..4, D 8..256.
// BF16 precision (AttentionPrecision::kBf16): every backend against the readable reference
// cpu::attention_*_bf16 within a bound derived from one BF16 rounding disagreement per term
// (bf16_attention_magnitudes below); causality and bit-repeatability as for FP32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/attention.h"
#include "backend/ops_test/ops_test_util.h"
#include "core/bits.h"

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

// ---- BF16 precision ------------------------------------------------------------------------------
// Tolerance of a BF16 attention result against the readable reference (cpu::attention_*_bf16):
// |got - ref| <= kBf16Rel * mag + kBf16Abs elementwise, mag = the reference's sum with every term
// replaced by its absolute value. Derivation: both sides round the same inputs to the same BF16
// values and form BF16 x BF16 products exactly (in FP32 or double); a backend's P (online softmax
// in FP32 exp2, or recomputed from lse) and dS = P (dP - delta) differ from the reference's before
// their BF16 rounding only by FP32 error, relative <= (T + D + 8) 2^-24 < 2^-11 for T <= 4096
// (dot products, the T-term softmax sum, exp2/log2 approximations). Two values that close round
// to BF16 values at most one BF16 ulp apart (2^-7 relative; a forward rounding P relative to the
// running max before dividing by the row sum is still one rounding, 2^-8, each side). So a sum
// of such terms is off by <= 2^-7 mag, plus the FP32 accumulation's <= 2^-11 mag: kBf16Rel =
// 2^-7 + 2^-10. The dS magnitude carries the FP32 error of P and dP - delta before its rounding:
// 2^-11 p (sum_d |dout v| + |delta|), written as 0.25 p (...) since it is multiplied by kBf16Rel.
// lse: FP32 error only, 2^-11 (|lse| + max_j scale sum_d |q k_j| + 1). kBf16Abs = 1e-6 absorbs
// probabilities below FP32's normal range. A wrong fragment, mask, scale, head mapping or tile
// edge moves a result by a sizeable fraction of mag (2^-7 is under 1% of it).
constexpr double kBf16Rel = 1.0 / 128 + 1.0 / 1024, kBf16RelLse = 1.0 / 2048, kBf16Abs = 1e-6;

struct Bf16Magnitudes {
  std::vector<double> out, lse, dq, dk, dv;
};

// Magnitudes of the reference's sums for inputs q, k, v, dout, out_f and lse_f (the backward's
// inputs; lse_f also stands in for the forward's lse), with the BF16 roundings of the contract.
Bf16Magnitudes bf16_attention_magnitudes(const AttentionShape& s, const std::vector<float>& q,
                                         const std::vector<float>& k, const std::vector<float>& v,
                                         const std::vector<float>& dout, const std::vector<float>& out_f,
                                         const std::vector<float>& lse_f) {
  const int64_t B = s.B, T = s.Tn, H = s.H, Hkv = s.Hkv, D = s.D, G = H / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto bf = [](float x) { return static_cast<double>(round_to_bf16(x)); };
  Bf16Magnitudes m;
  m.out.assign(q.size(), 0), m.dq.assign(q.size(), 0), m.lse.assign(lse_f.size(), 0);
  m.dk.assign(k.size(), 0), m.dv.assign(v.size(), 0);
  std::vector<double> p(T), dsabs(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / G;
      auto kv = [&](const std::vector<float>& x, int64_t j, int64_t d) {
        return bf(x[((b * T + j) * Hkv + hk) * D + d]);
      };
      for (int64_t i = 0; i < T; ++i) {
        const int64_t qi = ((b * T + i) * H + h) * D;
        const double lse_i = lse_f[(b * H + h) * T + i];
        double delta = 0, qk_max = 0;
        for (int64_t d = 0; d < D; ++d) delta += bf(dout[qi + d]) * bf(out_f[qi + d]);
        for (int64_t j = 0; j <= i; ++j) {
          double sc = 0, qk = 0, dp = 0, dpabs = 0;
          for (int64_t d = 0; d < D; ++d) {
            sc += bf(q[qi + d]) * kv(k, j, d), qk += std::fabs(bf(q[qi + d]) * kv(k, j, d));
            dp += bf(dout[qi + d]) * kv(v, j, d), dpabs += std::fabs(bf(dout[qi + d]) * kv(v, j, d));
          }
          p[j] = std::exp(sc * scale - lse_i);
          qk_max = std::max(qk_max, qk * scale);
          const double ds = round_to_bf16(static_cast<float>(p[j] * (dp - delta)));
          dsabs[j] = std::fabs(ds) + 0.25 * p[j] * (dpabs + std::fabs(delta));
        }
        m.lse[(b * H + h) * T + i] = std::fabs(lse_i) + qk_max + 1;
        for (int64_t d = 0; d < D; ++d) {
          double o = 0, g = 0;
          for (int64_t j = 0; j <= i; ++j) o += p[j] * std::fabs(kv(v, j, d)), g += dsabs[j] * std::fabs(kv(k, j, d));
          m.out[qi + d] = o, m.dq[qi + d] = g * scale;
        }
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t d = 0; d < D; ++d) {
            m.dk[((b * T + j) * Hkv + hk) * D + d] += dsabs[j] * std::fabs(bf(q[qi + d])) * scale;
            m.dv[((b * T + j) * Hkv + hk) * D + d] += p[j] * std::fabs(bf(dout[qi + d]));
          }
      }
    }
  return m;
}

// |got - ref| <= rel * mag + kBf16Abs elementwise (NaN fails).
::testing::AssertionResult within_bf16_bound(const std::vector<float>& got, const std::vector<float>& ref,
                                             const std::vector<double>& mag, double rel, const char* what) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(double(got[i]) - double(ref[i])), tol = rel * mag[i] + kBf16Abs;
    if (!(diff <= tol))
      return ::testing::AssertionFailure() << fmt::format("{}[{}]: {} vs reference {} (|diff| {:.3g} > bound {:.3g})",
                                                          what, i, got[i], ref[i], diff, tol);
  }
  return ::testing::AssertionSuccess();
}

class AttentionOpsTest : public OpsTest {};

// BF16 precision on every backend against the readable reference (the CPU backend runs that
// reference, so there it matches bit for bit; CUDA runs the tensor-core kernels). Shapes: one
// row; T not a multiple of the 64/128 tiles; GQA groups 1..4; B > 1; D = 32, 64, 128 and D = 24
// (zero-padded to 32 on CUDA). The FP32 op on the same inputs must differ (the precision is used).
TEST_P(AttentionOpsTest, Bf16MatchesReadableReferenceWithinDerivedBounds) {
  const AttentionShape shapes[] = {{1, 1, 1, 1, 32},   {2, 77, 4, 2, 32}, {1, 150, 4, 1, 64},
                                   {2, 64, 2, 2, 64},  {1, 67, 2, 1, 128}, {1, 40, 3, 1, 24}};
  uint64_t seed = 2600;
  for (const AttentionShape& s : shapes) {
    SCOPED_TRACE(fmt::format("B={} T={} H={} Hkv={} D={}", s.B, s.Tn, s.H, s.Hkv, s.D));
    const int64_t nq = s.B * s.Tn * s.H * s.D, nkv = s.B * s.Tn * s.Hkv * s.D, nl = s.B * s.H * s.Tn;
    const std::vector<float> q = normal_vector(nq, seed++), k = normal_vector(nkv, seed++),
                             v = normal_vector(nkv, seed++), dout = normal_vector(nq, seed++);
    std::vector<float> out_ref(nq), lse_ref(nl), dq_ref(nq), dk_ref(nkv), dv_ref(nkv);
    cpu::attention_forward_bf16(out_ref.data(), lse_ref.data(), q.data(), k.data(), v.data(), s.B, s.Tn, s.H, s.Hkv,
                                s.D);
    // the reference forward is the backward's input everywhere
    cpu::attention_backward_bf16(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), out_ref.data(),
                                 lse_ref.data(), q.data(), k.data(), v.data(), s.B, s.Tn, s.H, s.Hkv, s.D);
    const Bf16Magnitudes mag = bf16_attention_magnitudes(s, q, k, v, dout, out_ref, lse_ref);

    const float *q_b = upload(q), *k_b = upload(k), *v_b = upload(v), *dout_b = upload(dout);
    float *out_b = zeros<float>(nq), *lse_b = zeros<float>(nl);
    be().attention_forward(out_b, lse_b, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D, AttentionPrecision::kBf16);
    const std::vector<float> out_got = download(out_b, nq);
    EXPECT_TRUE(within_bf16_bound(out_got, out_ref, mag.out, kBf16Rel, "out"));
    EXPECT_TRUE(within_bf16_bound(download(lse_b, nl), lse_ref, mag.lse, kBf16RelLse, "lse"));

    const float *out_in = upload(out_ref), *lse_in = upload(lse_ref);
    float *dq_b = zeros<float>(nq), *dk_b = zeros<float>(nkv), *dv_b = zeros<float>(nkv);
    be().attention_backward(dq_b, dk_b, dv_b, dout_b, out_in, lse_in, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D,
                            AttentionPrecision::kBf16);
    EXPECT_TRUE(within_bf16_bound(download(dq_b, nq), dq_ref, mag.dq, kBf16Rel, "dq"));
    EXPECT_TRUE(within_bf16_bound(download(dk_b, nkv), dk_ref, mag.dk, kBf16Rel, "dk"));
    EXPECT_TRUE(within_bf16_bound(download(dv_b, nkv), dv_ref, mag.dv, kBf16Rel, "dv"));

    if (s.Tn > 1) {  // one key: out = v either way, bf16(v) vs v may or may not differ
      be().attention_forward(out_b, lse_b, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D, AttentionPrecision::kFp32);
      EXPECT_FALSE(bits_equal(download(out_b, nq), out_got)) << "kBf16 ran the FP32 op";
    }
  }
}

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
// Both precisions (BF16: the determinism of the tensor-core backward, no atomics).
TEST_P(AttentionOpsTest, LastKeyChangesNoEarlierRowAndRunsRepeatBitwise) {
  for (const AttentionPrecision precision : {AttentionPrecision::kFp32, AttentionPrecision::kBf16}) {
  SCOPED_TRACE(precision == AttentionPrecision::kBf16 ? "bf16" : "fp32");
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
    be().attention_forward(out_b, lse_b, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D, precision);
    if (out_in == nullptr) out_in = out_b, lse_in = lse_b;
    float *dq_b = zeros<float>(nq), *dk_b = zeros<float>(nkv), *dv_b = zeros<float>(nkv);
    be().attention_backward(dq_b, dk_b, dv_b, dout_b, out_in, lse_in, q_b, k_b, v_b, s.B, s.Tn, s.H, s.Hkv, s.D,
                            precision);
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
}

NIB_INSTANTIATE_OPS_TEST(AttentionOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
