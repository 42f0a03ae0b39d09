// Op tests of the per-token layers (embedding, RMSNorm, RoPE, SwiGLU, cross-entropy with z-loss)
// and the elementwise helpers against backend/cpu/nn_ops.h on host vectors, odd shapes, fixed
// seeds. Bit-exact where the backends share the order of every operation (gathers, RoPE, the
// embedding gradient summed in token order, add, copy); elsewhere a per-element bound from the
// formula's rounding analysis, written beside each case (u = 2^-24; expf may differ from the
// C library's exp by up to 3 ulp between backends: CUDA's expf is within 2 ulp, glibc's within 1).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/nn_ops.h"
#include "backend/ops_test/ops_test_util.h"
#include "backend/ops_test/tolerance_util.h"
#include "core/philox.h"

namespace nibble::backend::testing {
namespace {

constexpr double u = kUnitRoundoff;

std::vector<int32_t> ids(int64_t n, int64_t lo, int64_t hi, uint64_t seed) {  // uniform in [lo, hi)
  PhiloxStream rng(seed, 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(lo + static_cast<int64_t>(rng.next_u32() % uint32_t(hi - lo)));
  return v;
}

class NnOpsTest : public OpsTest {};

TEST_P(NnOpsTest, EmbeddingForwardIsAGather) {
  const int64_t N = 37, V = 23, C = 19;
  std::vector<int32_t> tok = ids(N, 0, V, 1);
  std::vector<float> wte = normal_vector(V * C, 2);
  std::vector<float> ref(static_cast<size_t>(N * C));
  cpu::embedding_forward(ref.data(), tok.data(), wte.data(), N, V, C);
  float* out = zeros<float>(N * C);
  be().embedding_forward(out, upload(tok), upload(wte), N, V, C);
  EXPECT_TRUE(bits_equal(download(out, N * C), ref));
}

// Both backends add each vocab row's dout rows in token order n: the same bits. Many repeats
// (V = 7) and a vocab row no token uses (id 6 excluded) that must stay unchanged; a GPT-2 sized
// vocabulary (16-bit keys: several radix passes) with 5000 tokens.
TEST_P(NnOpsTest, EmbeddingBackwardSumsInTokenOrder) {
  for (auto [N, V, C] : {std::tuple<int64_t, int64_t, int64_t>{300, 7, 33}, {1, 5, 1}, {64, 1000, 70}, {5000, 50257, 8}}) {
    std::vector<int32_t> tok = ids(N, 0, V == 7 ? 6 : V, 3 + N);
    std::vector<float> dwte = normal_vector(V * C, 4), dout = normal_vector(N * C, 5, 10.0);
    std::vector<float> ref = dwte;
    cpu::embedding_backward(ref.data(), dout.data(), tok.data(), N, V, C);
    float* d = upload(dwte);
    be().embedding_backward(d, upload(dout), upload(tok), N, V, C);
    EXPECT_TRUE(bits_equal(download(d, V * C), ref)) << "N=" << N << " V=" << V << " C=" << C;
  }
}

// ss = sum x^2 (C positive terms) has relative error <= (C-1)u on either backend whatever the
// order; rstd = 1/sqrt(ss/C + eps) halves it and adds 4 roundings, out = w (x s) 2 more, on each
// side: |out - ref| <= (C + 16) u |ref|, likewise rstd.
TEST_P(NnOpsTest, RmsNormForward) {
  for (auto [R, C] : {std::pair<int64_t, int64_t>{13, 77}, {5, 1000}, {1, 1}}) {
    std::vector<float> x = normal_vector(R * C, 10 + C, 3.0), w = normal_vector(C, 11);
    std::vector<float> ref(static_cast<size_t>(R * C)), rstd_ref(static_cast<size_t>(R));
    cpu::rmsnorm_forward(ref.data(), rstd_ref.data(), x.data(), w.data(), R, C, 1e-6);
    float* out = zeros<float>(R * C);
    float* rstd = zeros<float>(R);
    be().rmsnorm_forward(out, rstd, upload(x), upload(w), R, C, 1e-6);
    std::vector<double> bo(ref.size()), br(rstd_ref.size());
    for (size_t i = 0; i < ref.size(); ++i) bo[i] = double(C + 16) * u * std::fabs(double(ref[i]));
    for (size_t i = 0; i < br.size(); ++i) br[i] = double(C + 16) * u * std::fabs(double(rstd_ref[i]));
    EXPECT_TRUE(within_bound(download(out, R * C), ref, bo)) << "R=" << R << " C=" << C;
    EXPECT_TRUE(within_bound(download(rstd, R), rstd_ref, br)) << "R=" << R << " C=" << C;
  }
}

// dx = s (d w) - k x with k = s^3 (sum_c d_c w_c x_c) / C: the dot's terms have mixed signs, so
// its error is bounded by (C+2) u sum |d w x| on each side; with the few roundings after it,
// |dx - ref| <= (C + 16) u (s |d w| + s^3 sum|d w x| / C |x|). dw += sum over R rows of d (x s):
// each side within (R + 4) u (|dw0| + sum_r |d x s|) of the exact sum; the bound is twice that.
TEST_P(NnOpsTest, RmsNormBackward) {
  for (auto [R, C] : {std::pair<int64_t, int64_t>{130, 77}, {3, 300}, {64, 5}}) {
    std::vector<float> x = normal_vector(R * C, 20 + R, 2.0), w = normal_vector(C, 21), dout = normal_vector(R * C, 22);
    std::vector<float> dw0 = normal_vector(C, 23);
    std::vector<float> y(static_cast<size_t>(R * C)), rstd(static_cast<size_t>(R));
    cpu::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), R, C, 1e-5);
    std::vector<float> dx_ref(static_cast<size_t>(R * C)), dw_ref = dw0;
    cpu::rmsnorm_backward(dx_ref.data(), dw_ref.data(), dout.data(), x.data(), w.data(), rstd.data(), R, C);
    float* dx = zeros<float>(R * C);
    float* dw = upload(dw0);
    be().rmsnorm_backward(dx, dw, upload(dout), upload(x), upload(w), upload(rstd), R, C);
    std::vector<double> bdx(dx_ref.size()), bdw(dw_ref.size());
    for (int64_t r = 0; r < R; ++r) {
      const double s = rstd[r];
      double dot_abs = 0;
      for (int64_t c = 0; c < C; ++c) dot_abs += std::fabs(double(dout[r * C + c]) * w[c] * x[r * C + c]);
      const double k_abs = s * s * s * dot_abs / double(C);
      for (int64_t c = 0; c < C; ++c)
        bdx[r * C + c] = double(C + 16) * u * (s * std::fabs(double(dout[r * C + c]) * w[c]) + k_abs * std::fabs(double(x[r * C + c])));
    }
    for (int64_t c = 0; c < C; ++c) {
      double mag = std::fabs(double(dw0[c]));
      for (int64_t r = 0; r < R; ++r) mag += std::fabs(double(dout[r * C + c]) * x[r * C + c] * rstd[r]);
      bdw[c] = 2.0 * double(R + 4) * u * mag;
    }
    EXPECT_TRUE(within_bound(download(dx, R * C), dx_ref, bdx)) << "R=" << R << " C=" << C;
    EXPECT_TRUE(within_bound(download(dw, C), dw_ref, bdw)) << "R=" << R << " C=" << C;
  }
}

// The rotation is the same two products and a sum per element on both backends: same bits,
// with and without explicit positions, and in place (out == x).
TEST_P(NnOpsTest, RopeForwardBackwardExact) {
  const int64_t B = 2, Tn = 5, H = 3, D = 10, P = 16;
  std::vector<float> cos(static_cast<size_t>(P * D / 2)), sin(cos.size());
  cpu::rope_table(cos.data(), sin.data(), P, D, 10000.0);
  std::vector<float> x = normal_vector(B * Tn * H * D, 30);
  std::vector<int32_t> pos = ids(B * Tn, 0, P, 31);
  const float* cd = upload(cos);
  const float* sd = upload(sin);
  for (bool with_pos : {false, true}) {
    const int32_t* p_host = with_pos ? pos.data() : nullptr;
    const int32_t* p_dev = with_pos ? upload(pos) : nullptr;
    std::vector<float> fwd(x.size()), bwd(x.size());
    cpu::rope_forward(fwd.data(), x.data(), cos.data(), sin.data(), p_host, B, Tn, H, D);
    cpu::rope_backward(bwd.data(), x.data(), cos.data(), sin.data(), p_host, B, Tn, H, D);
    const float* xd = upload(x);
    float* out = zeros<float>(B * Tn * H * D);
    be().rope_forward(out, xd, cd, sd, p_dev, B, Tn, H, D);
    EXPECT_TRUE(bits_equal(download(out, B * Tn * H * D), fwd)) << "forward, positions " << with_pos;
    be().rope_backward(out, xd, cd, sd, p_dev, B, Tn, H, D);
    EXPECT_TRUE(bits_equal(download(out, B * Tn * H * D), bwd)) << "backward, positions " << with_pos;
    float* inplace = upload(x);
    be().rope_forward(inplace, inplace, cd, sd, p_dev, B, Tn, H, D);
    EXPECT_TRUE(bits_equal(download(inplace, B * Tn * H * D), fwd)) << "in place, positions " << with_pos;
  }
}

// sg = 1/(1 + exp(-g)): exp differs by <= 3 ulp (6u relative), 1 + e and the division add 2u
// per side, so sg differs by <= 10u relative; out = g sg u two more roundings per side:
// |out - ref| <= 32u |ref|. Backward: du = d silu likewise 32u |du|; dg = d u sg (1 + g (1 - sg))
// where 1 - sg may cancel: its absolute error <= 12u, times |g|, so
// |dg - ref| <= 64u |d u| (sg (1 + |g|) + |sg (1 + g (1 - sg))|).
TEST_P(NnOpsTest, SwigluForwardBackward) {
  const int64_t N = 7, I = 45;
  std::vector<float> gu = normal_vector(N * 2 * I, 40, 3.0), dout = normal_vector(N * I, 41);
  std::vector<float> out_ref(static_cast<size_t>(N * I)), dgu_ref(gu.size());
  cpu::swiglu_forward(out_ref.data(), gu.data(), N, I);
  cpu::swiglu_backward(dgu_ref.data(), dout.data(), gu.data(), N, I);
  const float* gd = upload(gu);
  float* out = zeros<float>(N * I);
  float* dgu = zeros<float>(N * 2 * I);
  be().swiglu_forward(out, gd, N, I);
  be().swiglu_backward(dgu, upload(dout), gd, N, I);
  std::vector<double> bo(out_ref.size()), bd(dgu_ref.size());
  for (size_t i = 0; i < bo.size(); ++i) bo[i] = 32 * u * std::fabs(double(out_ref[i]));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < I; ++i) {
      const double g = gu[n * 2 * I + i], up = gu[n * 2 * I + I + i], d = dout[n * I + i];
      const double sg = 1.0 / (1.0 + std::exp(-g));
      bd[n * 2 * I + i] = 64 * u * std::fabs(d * up) * (sg * (1 + std::fabs(g)) + std::fabs(sg * (1 + g * (1 - sg))));
      bd[n * 2 * I + I + i] = 32 * u * std::fabs(double(dgu_ref[n * 2 * I + I + i]));
    }
  EXPECT_TRUE(within_bound(download(out, N * I), out_ref, bo));
  EXPECT_TRUE(within_bound(download(dgu, N * 2 * I), dgu_ref, bd));
}

// Cross-entropy bounds (per row, ls = lse, lt = target logit): the exps differ by <= 6u relative,
// so sum and log(sum) differ by <= 6u (absolute, for the log); ls = mx + f32(log) adds a rounding
// of |log| = |ls - mx| and one of |ls| per side: |dlse| <= 8u + 4u (|ls| + |ls - mx|) =: e_ls.
// ce = ls - lt: e_ls + 2u |ce|.
// dlogits = (cs + 2 zs ls) / sum * exp(l - mx) - cs [v == t]: relative errors 6u (exp) + 6u (sum)
// + 4 roundings on each side, and 2 zs e_ls from ls: |dd| <= 32u (|cs| + 2|zs||ls|) p_v
// + 2|zs| e_ls p_v + 2u |ref|. The sums: |dce_sum| <= sum of the ce bounds, |dz_sum| <= sum of
// (2|ls| + e_ls) e_ls, plus the double sums' own rounding (negligible: 2N 2^-53 of the sum).
struct CeRef {
  std::vector<float> lse, ce, d;
  cpu::CrossEntropySums sums;
};

class CrossEntropyOpsTest : public OpsTest {
 protected:
  void check(int64_t N, int64_t V, bool backward, bool alias, uint64_t seed) {
    std::vector<float> logits = normal_vector(N * V, seed, 4.0);
    std::vector<int32_t> tgt = ids(N, 0, V, seed + 1);
    for (int64_t n = 0; n < N; n += 3) tgt[n] = -100;  // ignored rows
    const double cs = 1.0 / 7.0, zs = 1e-4 / 7.0;
    CeRef r;
    r.lse.resize(N), r.ce.resize(N), r.d.resize(static_cast<size_t>(N * V));
    if (backward)
      r.sums = cpu::cross_entropy_forward_backward(r.d.data(), r.lse.data(), r.ce.data(), logits.data(), tgt.data(), N,
                                                   V, cs, zs);
    else
      r.sums = cpu::cross_entropy_forward(r.lse.data(), r.ce.data(), logits.data(), tgt.data(), N, V);
    float* ld = upload(logits);
    float* lse = zeros<float>(N);
    float* ce = zeros<float>(N);
    float* d = alias ? ld : zeros<float>(N * V);
    const int32_t* td = upload(tgt);
    backend::CrossEntropySums s = backward ? be().cross_entropy_forward_backward(d, lse, ce, ld, td, N, V, cs, zs)
                                           : be().cross_entropy_forward(lse, ce, ld, td, N, V);
    std::vector<double> b_lse(N), b_ce(N), b_d(static_cast<size_t>(N * V));
    double b_ce_sum = 0, b_z_sum = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double mx = *std::max_element(logits.begin() + n * V, logits.begin() + (n + 1) * V);
      const double ls = r.lse[n], e_ls = 8 * u + 4 * u * (std::fabs(ls) + std::fabs(ls - mx));
      b_lse[n] = e_ls;
      b_ce[n] = e_ls + 2 * u * std::fabs(double(r.ce[n]));
      if (tgt[n] >= 0) b_ce_sum += b_ce[n], b_z_sum += (2 * std::fabs(ls) + e_ls) * e_ls;
      for (int64_t v = 0; v < V; ++v) {
        const double p = std::exp(double(logits[n * V + v]) - ls);
        b_d[n * V + v] = tgt[n] < 0 ? 0.0
                                    : 32 * u * (cs + 2 * zs * std::fabs(ls)) * p + 2 * zs * e_ls * p +
                                          2 * u * std::fabs(double(r.d[n * V + v]));
      }
    }
    const std::string where = fmt::format("N={} V={} backward={} alias={}", N, V, backward, alias);
    EXPECT_TRUE(within_bound(download(lse, N), r.lse, b_lse)) << where;
    EXPECT_TRUE(within_bound(download(ce, N), r.ce, b_ce)) << where;
    if (backward) {
      EXPECT_TRUE(within_bound(download(d, N * V), r.d, b_d)) << where;
    }
    EXPECT_EQ(s.n_valid, r.sums.n_valid) << where;
    EXPECT_LE(std::fabs(s.ce_sum - r.sums.ce_sum), b_ce_sum + 1e-12 * std::fabs(r.sums.ce_sum)) << where;
    EXPECT_LE(std::fabs(s.z_sum - r.sums.z_sum), b_z_sum + 1e-12 * std::fabs(r.sums.z_sum)) << where;
    // the same op with its sums left in backend memory: exactly the sums returned above
    double* sums = upload(std::vector<double>(4, -1.0));
    float* ld2 = upload(logits);
    float* d2 = alias ? ld2 : zeros<float>(N * V);
    if (backward)
      be().cross_entropy_forward_backward_sums(sums, d2, zeros<float>(N), zeros<float>(N), ld2, td, N, V, cs, zs);
    else
      be().cross_entropy_forward_sums(sums, zeros<float>(N), zeros<float>(N), ld2, td, N, V);
    const std::vector<double> got = download(sums, 4);
    EXPECT_EQ(got[0], s.ce_sum) << where << ": device ce_sum";
    EXPECT_EQ(got[1], s.z_sum) << where << ": device z_sum";
    EXPECT_EQ(got[2], static_cast<double>(s.n_valid)) << where << ": device n_valid";
    EXPECT_EQ(got[3], 0.0) << where;
  }
};

TEST_P(CrossEntropyOpsTest, ForwardOddShapes) {
  check(9, 1000, false, false, 50);
  check(4, 3, false, false, 51);
  check(2, 5000, false, false, 52);
}

TEST_P(CrossEntropyOpsTest, ForwardBackwardAndInPlace) {
  check(9, 1000, true, false, 60);
  check(9, 1000, true, true, 61);
  check(5, 3, true, true, 62);
  check(3, 4099, true, false, 63);
}

TEST_P(NnOpsTest, ElementwiseExact) {
  const int64_t n = 1003;
  std::vector<float> a = normal_vector(n, 70), b = normal_vector(n, 71);
  std::vector<float> sum_ref(n), inplace_ref = a;
  cpu::add(sum_ref.data(), a.data(), b.data(), n);
  cpu::add_inplace(inplace_ref.data(), b.data(), n);
  const float* ad = upload(a);
  const float* bd = upload(b);
  float* y = zeros<float>(n);
  be().add(y, ad, bd, n);
  EXPECT_TRUE(bits_equal(download(y, n), sum_ref));
  float* acc = upload(a);
  be().add_inplace(acc, bd, n);
  EXPECT_TRUE(bits_equal(download(acc, n), inplace_ref));
  std::vector<float> scaled = a;
  for (float& v : scaled) v *= 0.3f;
  float* sd = upload(a);
  be().scale(sd, n, 0.3f);
  EXPECT_TRUE(bits_equal(download(sd, n), scaled));
}

// A (rows, cols) block between matrices of different leading dimensions; the rest of dst keeps its values.
TEST_P(NnOpsTest, Copy2dStridedBlock) {
  const int64_t rows = 7, cols = 5, src_ld = 13, dst_ld = 9;
  std::vector<float> src = normal_vector(rows * src_ld, 80), dst = normal_vector(rows * dst_ld, 81);
  std::vector<float> ref = dst;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) ref[r * dst_ld + c + 2] = src[r * src_ld + c + 3];
  float* d = upload(dst);
  be().copy_2d(d + 2, dst_ld, upload(src) + 3, src_ld, rows, cols);
  EXPECT_TRUE(bits_equal(download(d, rows * dst_ld), ref));
}

// The reductions' orders are fixed by the shapes: a second run gives the same bits (the step is
// deterministic, so a resume reproduces the losses).
TEST_P(NnOpsTest, ReductionsRepeatBitForBit) {
  const int64_t R = 300, C = 130, V = 777;
  std::vector<float> x = normal_vector(R * C, 90, 2.0), w = normal_vector(C, 91), dout = normal_vector(R * C, 92);
  std::vector<float> logits = normal_vector(R * V, 93, 3.0);
  std::vector<int32_t> tgt = ids(R, 0, V, 94);
  const float* xd = upload(x);
  const float* wd = upload(w);
  const float* dd = upload(dout);
  const float* ld = upload(logits);
  const int32_t* td = upload(tgt);
  std::vector<float> first[4];
  double first_ce = 0;
  for (int run = 0; run < 2; ++run) {
    float* y = zeros<float>(R * C);
    float* rstd = zeros<float>(R);
    float* dx = zeros<float>(R * C);
    float* dw = zeros<float>(C);
    float* dl = zeros<float>(R * V);
    float* lse = zeros<float>(R);
    float* ce = zeros<float>(R);
    be().rmsnorm_forward(y, rstd, xd, wd, R, C, 1e-6);
    be().rmsnorm_backward(dx, dw, dd, xd, wd, rstd, R, C);
    const CrossEntropySums s = be().cross_entropy_forward_backward(dl, lse, ce, ld, td, R, V, 1.0 / R, 1e-4 / R);
    std::vector<float> got[4] = {download(y, R * C), download(dx, R * C), download(dw, C), download(dl, R * V)};
    if (run == 0) {
      for (int i = 0; i < 4; ++i) first[i] = got[i];
      first_ce = s.ce_sum;
      continue;
    }
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(bits_equal(got[i], first[i])) << "output " << i;
    EXPECT_EQ(std::memcmp(&s.ce_sum, &first_ce, sizeof first_ce), 0);
  }
}

NIB_INSTANTIATE_OPS_TEST(NnOpsTest);
NIB_INSTANTIATE_OPS_TEST(CrossEntropyOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
