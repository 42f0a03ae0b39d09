// Sandbox (spec 06 principle 7) for nibble's BF16 tensor-core flash attention, issue #13: causal
// GQA attention, scale 1/sqrt(D), FlashAttention-2 structure on mma.m16n8k16 (bf16 in, f32
// accumulate), ldmatrix, cp.async double buffering. Forward + deterministic backward (dK/dV kernel
// per KV tile, dQ kernel per query tile, delta pre-pass), checked against a double CPU reference
// with the same BF16 roundings and timed at the OLMo-2 shapes. No dependency beyond CUDA:
//   nvcc -O3 -std=c++17 -arch=sm_90a dev/cuda/flash_attention_bf16.cu -o fa && ./fa
// Exits non-zero when a check fails. The kernels live in src/backend/cuda/flash_attention_bf16.cuh,
// which the backend (attention_bf16.cu) includes too. Other tile shapes are timed by defining the
// header's NIB_FA_* knobs (FwdShape, BwdShape), e.g. -DNIB_FA_FWD_MT=1 -DNIB_FA_FWD_MINB=4.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "sandbox_check.h"

// ================================ kernels (the backend's own header) ========================
#define NIB_FA_CHECK(expr) CK(expr)
#include "../../src/backend/cuda/flash_attention_bf16.cuh"
namespace fa = nibble::cuda::fa;

// ================================ CPU reference (double) ======================================
// Same contract: q, k, v, dout, out rounded to bf16; P = bf16(exp(s - lse)) enters P.V and dV;
// dS = bf16(P (dP - delta)) enters dQ and dK; everything else exact (double). Alongside each
// result, its magnitude: the same sum with every term replaced by its absolute value, which
// bounds the effect of one rounding disagreement per term (see check()).
static float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

struct Shape {
  int B, T, H, Hkv, D;
};

struct Ref {
  std::vector<double> out, out_mag, lse, lse_mag, dq, dq_mag, dk, dk_mag, dv, dv_mag;
};

static Ref reference(const Shape& s, const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& v, const std::vector<float>& dout, const std::vector<float>& out_in) {
  const int B = s.B, T = s.T, H = s.H, Hkv = s.Hkv, D = s.D, G = H / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto qi = [&](int b, int t, int h, int d) { return ((static_cast<size_t>(b) * T + t) * H + h) * D + d; };
  auto ki = [&](int b, int t, int h, int d) { return ((static_cast<size_t>(b) * T + t) * Hkv + h) * D + d; };
  Ref r;
  r.out.assign(q.size(), 0), r.out_mag.assign(q.size(), 0), r.dq.assign(q.size(), 0), r.dq_mag.assign(q.size(), 0);
  r.dk.assign(k.size(), 0), r.dk_mag.assign(k.size(), 0), r.dv.assign(k.size(), 0), r.dv_mag.assign(k.size(), 0);
  r.lse.assign(static_cast<size_t>(B) * H * T, 0), r.lse_mag.assign(r.lse.size(), 0);
  std::vector<double> sc(T), p(T), ds(T), dsabs(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int hk = h / G;
      for (int i = 0; i < T; ++i) {
        double mx = -1e300, qkabs = 0;
        for (int j = 0; j <= i; ++j) {
          double acc = 0, accabs = 0;
          for (int d = 0; d < D; ++d) {
            const double x = static_cast<double>(bf16r(q[qi(b, i, h, d)])) * bf16r(k[ki(b, j, hk, d)]);
            acc += x, accabs += std::fabs(x);
          }
          sc[j] = acc * scale, mx = std::max(mx, sc[j]), qkabs = std::max(qkabs, accabs * scale);
        }
        double l = 0;
        for (int j = 0; j <= i; ++j) l += std::exp(sc[j] - mx);
        const double lse = mx + std::log(l);
        r.lse[(static_cast<size_t>(b) * H + h) * T + i] = lse;
        r.lse_mag[(static_cast<size_t>(b) * H + h) * T + i] = std::fabs(lse) + qkabs + 1;
        double delta = 0;
        for (int d = 0; d < D; ++d)
          delta += static_cast<double>(bf16r(dout[qi(b, i, h, d)])) * bf16r(out_in[qi(b, i, h, d)]);
        for (int j = 0; j <= i; ++j) p[j] = std::exp(sc[j] - lse);
        for (int j = 0; j <= i; ++j) {
          double dp = 0, dpabs = 0;
          for (int d = 0; d < D; ++d) {
            const double x = static_cast<double>(bf16r(dout[qi(b, i, h, d)])) * bf16r(v[ki(b, j, hk, d)]);
            dp += x, dpabs += std::fabs(x);
          }
          ds[j] = bf16r(static_cast<float>(p[j] * (dp - delta)));
          // 0.25 ~ 2^-11 / kRel: P and dP - delta carry f32 error <= 2^-11 of p (dpabs + |delta|)
          // before the rounding; check() multiplies mag by kRel.
          dsabs[j] = std::fabs(ds[j]) + 0.25 * p[j] * (dpabs + std::fabs(delta));
        }
        for (int d = 0; d < D; ++d) {
          double o = 0, omag = 0, g = 0, gmag = 0;
          for (int j = 0; j <= i; ++j) {
            const double pb = bf16r(static_cast<float>(p[j]));
            const double vv = bf16r(v[ki(b, j, hk, d)]), kk = bf16r(k[ki(b, j, hk, d)]);
            o += pb * vv, omag += p[j] * std::fabs(vv);
            g += ds[j] * kk, gmag += dsabs[j] * std::fabs(kk);
          }
          r.out[qi(b, i, h, d)] = o, r.out_mag[qi(b, i, h, d)] = omag;
          r.dq[qi(b, i, h, d)] = g * scale, r.dq_mag[qi(b, i, h, d)] = gmag * scale;
        }
        for (int j = 0; j <= i; ++j) {
          const double pb = bf16r(static_cast<float>(p[j]));
          for (int d = 0; d < D; ++d) {
            const double doo = bf16r(dout[qi(b, i, h, d)]), qq = bf16r(q[qi(b, i, h, d)]);
            r.dv[ki(b, j, hk, d)] += pb * doo, r.dv_mag[ki(b, j, hk, d)] += p[j] * std::fabs(doo);
            r.dk[ki(b, j, hk, d)] += ds[j] * qq * scale, r.dk_mag[ki(b, j, hk, d)] += dsabs[j] * std::fabs(qq) * scale;
          }
        }
      }
    }
  return r;
}

// Tolerance, elementwise: |gpu - ref| <= kRel * mag + kAbs, where mag is the reference's sum with
// absolute values. Derivation: the GPU rounds the same bf16 inputs (bitwise equal) and forms
// products exactly (bf16 x bf16 fits in f32); its P (online softmax, f32 exp2) and dS differ from
// the reference's before rounding only by f32 error (relative <= (T + D + 8) 2^-24 < 2^-11 for
// T <= 4096 incl. the exp2/log2 approximations), so each of their bf16 roundings lands within
// one bf16 ulp (2^-7 relative) of the reference's. A sum of such terms is then within
// 2^-7 * sum|term| = 2^-7 * mag; the f32 accumulation adds at most 2^-11 * mag. kRel = 2^-7 + 2^-10
// covers both. In forward, the GPU rounds exp(s - m_run) before dividing by l: still one rounding
// (2^-8) each side, so the same bound. For lse: f32 error only, kRel = 2^-11 against
// mag = |lse| + scale * max_j sum_d |q_d k_jd| + 1. kAbs = 1e-6 absorbs f32 underflow to 0 of
// probabilities below 2^-126.
static bool check(const char* what, const std::vector<float>& got, const std::vector<double>& ref,
                  const std::vector<double>& mag, double rel) {
  const double kAbs = 1e-6;
  double max_err = 0, max_ratio = 0;
  size_t bad = 0, worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double tol = rel * mag[i] + kAbs;
    if (!(err <= tol)) ++bad;  // NaN counts as bad
    if (!(err <= max_err)) max_err = err, worst = i;
    max_ratio = std::max(max_ratio, err / tol);
  }
  std::printf("  %-4s max|err| %.3e  max err/tol %.3f  (at %zu: got %.6f ref %.6f)  %s\n", what, max_err, max_ratio,
              worst, got[worst], ref[worst], bad ? "FAIL" : "ok");
  return bad == 0;
}

static bool run_check(const Shape& s, uint64_t seed) {
  std::printf("check B=%d T=%d H=%d Hkv=%d D=%d\n", s.B, s.T, s.H, s.Hkv, s.D);
  const size_t nq = static_cast<size_t>(s.B) * s.T * s.H * s.D, nk = static_cast<size_t>(s.B) * s.T * s.Hkv * s.D;
  const size_t nl = static_cast<size_t>(s.B) * s.H * s.T;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(nq), k(nk), v(nk), dout(nq);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (auto& x : dout) x = nd(rng);
  // Backward consumes an `out`: take the reference's, so both sides see the same input.
  std::vector<float> out_in(nq, 0.f);
  {
    const Ref r0 = reference(s, q, k, v, dout, out_in);
    for (size_t i = 0; i < nq; ++i) out_in[i] = static_cast<float>(r0.out[i]);
  }
  const Ref r = reference(s, q, k, v, dout, out_in);

  float *dq_, *dk_, *dv_, *dout_, *out_, *lse_, *q_, *k_, *v_, *outg_;
  void* ws;
  CK(cudaMalloc(&q_, nq * 4)); CK(cudaMalloc(&k_, nk * 4)); CK(cudaMalloc(&v_, nk * 4));
  CK(cudaMalloc(&dout_, nq * 4)); CK(cudaMalloc(&out_, nq * 4)); CK(cudaMalloc(&outg_, nq * 4));
  CK(cudaMalloc(&lse_, nl * 4)); CK(cudaMalloc(&dq_, nq * 4));
  CK(cudaMalloc(&dk_, nk * 4)); CK(cudaMalloc(&dv_, nk * 4));
  CK(cudaMalloc(&ws, fa::workspace_bytes(s.B, s.T, s.H, s.Hkv, s.D, true)));
  CK(cudaMemcpy(q_, q.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k_, k.data(), nk * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v_, v.data(), nk * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dout_, dout.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(out_, out_in.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(outg_, 0xff, nq * 4));  // NaN: catches unwritten outputs
  CK(cudaMemset(dq_, 0xff, nq * 4)); CK(cudaMemset(dk_, 0xff, nk * 4)); CK(cudaMemset(dv_, 0xff, nk * 4));
  fa::run_forward(outg_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0);
  // backward reads the lse computed by the GPU forward (as the model does)
  fa::run_backward(dq_, dk_, dv_, dout_, out_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0);
  CK(cudaDeviceSynchronize());
  std::vector<float> out_g(nq), lse_g(nl), dq_g(nq), dk_g(nk), dv_g(nk);
  CK(cudaMemcpy(out_g.data(), outg_, nq * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse_g.data(), lse_, nl * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dq_g.data(), dq_, nq * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dk_g.data(), dk_, nk * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dv_g.data(), dv_, nk * 4, cudaMemcpyDeviceToHost));
  const double kRel = 1.0 / 128 + 1.0 / 1024, kRelLse = 1.0 / 2048;
  bool ok = true;
  ok &= check("out", out_g, r.out, r.out_mag, kRel);
  ok &= check("lse", lse_g, r.lse, r.lse_mag, kRelLse);
  ok &= check("dq", dq_g, r.dq, r.dq_mag, kRel);
  ok &= check("dk", dk_g, r.dk, r.dk_mag, kRel);
  ok &= check("dv", dv_g, r.dv, r.dv_mag, kRel);
  // Determinism: a second backward is bitwise equal.
  fa::run_backward(dq_, dk_, dv_, dout_, out_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0);
  std::vector<float> dq2(nq), dk2(nk), dv2(nk);
  CK(cudaMemcpy(dq2.data(), dq_, nq * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dk2.data(), dk_, nk * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(dv2.data(), dv_, nk * 4, cudaMemcpyDeviceToHost));
  const bool det = std::memcmp(dq2.data(), dq_g.data(), nq * 4) == 0 &&
                   std::memcmp(dk2.data(), dk_g.data(), nk * 4) == 0 &&
                   std::memcmp(dv2.data(), dv_g.data(), nk * 4) == 0;
  std::printf("  backward bitwise repeatable: %s\n", det ? "ok" : "FAIL");
  ok &= det;
  cudaFree(q_), cudaFree(k_), cudaFree(v_), cudaFree(dout_), cudaFree(out_), cudaFree(outg_), cudaFree(lse_);
  cudaFree(dq_), cudaFree(dk_), cudaFree(dv_), cudaFree(ws);
  return ok;
}

static void run_timing(const Shape& s) {
  const size_t nq = static_cast<size_t>(s.B) * s.T * s.H * s.D, nk = static_cast<size_t>(s.B) * s.T * s.Hkv * s.D;
  const size_t nl = static_cast<size_t>(s.B) * s.H * s.T;
  float *q_, *k_, *v_, *out_, *lse_, *dout_, *dq_, *dk_, *dv_;
  void* ws;
  CK(cudaMalloc(&q_, nq * 4)); CK(cudaMalloc(&k_, nk * 4)); CK(cudaMalloc(&v_, nk * 4)); CK(cudaMalloc(&out_, nq * 4));
  CK(cudaMalloc(&dout_, nq * 4)); CK(cudaMalloc(&lse_, nl * 4)); CK(cudaMalloc(&dq_, nq * 4));
  CK(cudaMalloc(&dk_, nk * 4)); CK(cudaMalloc(&dv_, nk * 4));
  CK(cudaMalloc(&ws, fa::workspace_bytes(s.B, s.T, s.H, s.Hkv, s.D, true)));
  std::vector<float> h(nq);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) x = nd(rng);
  CK(cudaMemcpy(q_, h.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dout_, h.data(), nq * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k_, h.data(), nk * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v_, h.data() + (nq - nk), nk * 4, cudaMemcpyHostToDevice));
  const fa::Workspace w = fa::carve(ws, s.B, s.T, s.H, s.Hkv, s.D, true);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto median_ms = [&](auto&& fn) {
    fn();  // warm-up
    std::vector<float> ms;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0));
      fn();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float x;
      CK(cudaEventElapsedTime(&x, e0, e1));
      ms.push_back(x);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double fwd_flop = 2.0 * s.B * s.H * static_cast<double>(s.T) * s.T * s.D, bwd_flop = 2.5 * fwd_flop;
  auto fwd_op = [&] { fa::run_forward(out_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0); };
  auto bwd_op = [&] {
    fa::run_backward(dq_, dk_, dv_, dout_, out_, lse_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0);
  };
  auto fwd_k = [&] { fa::forward_kernels<64>(out_, lse_, w, s.B, s.T, s.H, s.Hkv, s.D, 0); };
  auto bwd_k = [&] { fa::backward_kernels<64>(dq_, dk_, dv_, lse_, w, s.B, s.T, s.H, s.Hkv, s.D, 0); };
  const float t_fo = median_ms(fwd_op), t_bo = median_ms(bwd_op);  // bwd_op leaves w filled for bwd_k
  auto dkdv_k = [&] { fa::backward_kernel_dkdv<64>(dk_, dv_, lse_, w, s.B, s.T, s.H, s.Hkv, s.D, 0); };
  auto dq_k = [&] { fa::backward_kernel_dq<64>(dq_, lse_, w, s.B, s.T, s.H, s.Hkv, s.D, 0); };
  auto pre_k = [&] { fa::run_backward_prepass(dout_, out_, q_, k_, v_, s.B, s.T, s.H, s.Hkv, s.D, ws, 0); };
  const float t_fk = median_ms(fwd_k), t_bk = median_ms(bwd_k);
  const float t_dkdv = median_ms(dkdv_k), t_dq = median_ms(dq_k), t_pre = median_ms(pre_k);
  std::printf("time B=%d T=%d H=%d D=%d (median of 7)\n", s.B, s.T, s.H, s.D);
  std::printf("  fwd kernel %8.3f ms %6.1f TFLOP/s | op incl. bf16 pre-pass %8.3f ms %6.1f TFLOP/s\n", t_fk,
              fwd_flop / t_fk * 1e-9, t_fo, fwd_flop / t_fo * 1e-9);
  std::printf("  bwd kernels %7.3f ms %6.1f TFLOP/s | op incl. pre-pass      %8.3f ms %6.1f TFLOP/s\n", t_bk,
              bwd_flop / t_bk * 1e-9, t_bo, bwd_flop / t_bo * 1e-9);
  std::printf("  bwd split: dK/dV kernel %.3f ms, dQ kernel %.3f ms, pre-passes (bf16 q k v dout, delta) %.3f ms\n",
              t_dkdv, t_dq, t_pre);
  cudaFree(q_), cudaFree(k_), cudaFree(v_), cudaFree(out_), cudaFree(dout_), cudaFree(lse_), cudaFree(dq_);
  cudaFree(dk_), cudaFree(dv_), cudaFree(ws);
}

int main(int argc, char** argv) {
  const bool check_only = argc > 1 && std::strcmp(argv[1], "--check") == 0;
  const Shape checks[] = {
      {1, 64, 1, 1, 64},     // one tile
      {2, 77, 4, 2, 32},     // T not a multiple of the tile, GQA, D = 32
      {2, 200, 4, 1, 64},    // several tiles, odd T, GQA group 4, D = 64
      {1, 300, 6, 2, 64},    // query block of 128 over several K/V tiles, 44-row tail
      {1, 131, 2, 2, 128},   // D = 128
      {2, 70, 4, 2, 24},     // D = 24: padded to 32 with zero columns
      {1, 33, 3, 1, 6},      // D = 6 (odd tiles, padded to 16), one GQA group of 3
  };
  bool ok = true;
  uint64_t seed = 1;
  for (const Shape& s : checks) ok &= run_check(s, seed++);
  std::printf("%s\n", ok ? "ALL CHECKS PASSED" : "CHECKS FAILED");
  if (!ok) return 1;
  if (!check_only) {
    run_timing({16, 4096, 8, 8, 64});
    run_timing({8, 4096, 16, 16, 64});
  }
  return 0;
}
