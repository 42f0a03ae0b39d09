// glibc_expf(x): glibc's binary32 exp (sysdeps/ieee754/flt-32/e_expf.c, glibc >= 2.27, the
// x86-64 FMA variant __expf_fma that the ifunc picks on every AVX2+FMA CPU) written out step by
// step with explicit fma(), so that host and device give its bits exactly. The CUDA MoE router
// uses it for the softmax numerators: with the CPU's std::exp (glibc) and IEEE float sum and
// division, the GPU's router probabilities, hence its top-k ids and weights, equal the CPU's bit
// for bit (CUDA's own expf differs by up to 2 ulp, which can reorder near-tied experts). Checked
// against std::exp over all negative floats (backend/ops_test/moe_test.cpp; the exhaustive run is
// MoeGlibcExpf.DISABLED_EveryNegativeFloat).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/bits.h"
#include "core/host_device.h"

namespace nibble::backend {

// 2^(i/32) as double bits, minus i << 47 (glibc's __exp2f_data.tab, EXP2F_TABLE_BITS = 5).
#define NIB_GLIBC_EXP2F_TABLE                                                                        \
  {                                                                                                 \
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,     \
        0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull, \
        0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull, \
        0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull, \
        0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull, \
        0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull, \
        0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull, \
        0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull  \
  }
inline constexpr uint64_t kGlibcExp2fTable[32] = NIB_GLIBC_EXP2F_TABLE;
#if defined(__CUDACC__)
// The kernels' copy in constant memory (a table local to the function would be rebuilt in each
// thread's stack frame).
static __constant__ const uint64_t kGlibcExp2fTableDevice[32] = NIB_GLIBC_EXP2F_TABLE;
#endif

NIB_HOST_DEVICE uint64_t glibc_exp2f_table(uint32_t i) {
#if NIB_ON_DEVICE
  return kGlibcExp2fTableDevice[i & 31u];
#else
  return kGlibcExp2fTable[i & 31u];
#endif
}

NIB_HOST_DEVICE uint64_t double_as_u64(double d) {
#if NIB_ON_DEVICE
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}

NIB_HOST_DEVICE double u64_as_double(uint64_t u) {
#if NIB_ON_DEVICE
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

// exp(x) rounded as glibc's expf rounds it, for every x (NaN, infinities, overflow and the
// underflow cut-offs included). Every double operation below is one IEEE operation (fma() a fused
// one), so the result does not depend on the compiler's contraction settings.
NIB_HOST_DEVICE float glibc_expf(float x) {
  constexpr double kInvLn2N = 0x1.71547652b82fep+5;  // 32 / ln 2
  constexpr double kShift = 0x1.8p+52;               // round-to-int shift
  constexpr double kC0 = 0x1.c6af84b912394p-20, kC1 = 0x1.ebfce50fac4f3p-13, kC2 = 0x1.62e42ff0c52d6p-6;
  const uint32_t ix = float_as_u32(x);
  const uint32_t abstop = (ix >> 20) & 0x7ffu;
  if (abstop >= 0x42bu) {  // |x| >= 88, or NaN / Inf
    if (ix == 0xff800000u) return 0.0f;                 // -Inf
    if (abstop >= 0x7f8u) return x + x;                 // +Inf, NaN
    if (x > 0x1.62e42ep6f) return INFINITY;             // __math_oflowf: 0x1p97f * 0x1p97f
    if (x < -0x1.9fe368p6f) return 0.0f;                // __math_uflowf: 0x1p-95f * 0x1p-95f
    if (x < -0x1.9d1d9ep6f) return 0x1p-149f;           // __math_may_uflowf: 0x1.4p-75f^2 -> 2^-149
  }
  const double xd = static_cast<double>(x);
  double kd = fma(kInvLn2N, xd, kShift);  // k = round(x * 32 / ln 2) in the low bits
  const uint64_t ki = double_as_u64(kd);
  kd -= kShift;
  const double r = fma(kInvLn2N, xd, -kd);  // x * 32 / ln 2 - k, in [-1/2, 1/2]
  const double s = u64_as_double(glibc_exp2f_table(static_cast<uint32_t>(ki)) + (ki << 47));  // 2^(k/32)
  const double z = fma(r, kC0, kC1);
  const double r2 = r * r;
  double y = fma(r, kC2, 1.0);
  y = fma(z, r2, y);
  y = y * s;
  return static_cast<float>(y);
}

}  // namespace nibble::backend
