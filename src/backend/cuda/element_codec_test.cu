// Exhaustive GPU checks of the element steps of src/formats/ against their former formulations
// (the `_ref` oracles below: 7-compare E2M1 RNE chain, SR step dividing by the gap, NaN-skipping
// max by compare), and e2m1_rne_index_bits_min3 against e2m1_rne_index: every binary32
// input (2^32 patterns; the min3 form for v < 7; SR at three u per input, two of them on
// the rounding boundary). The division-free nvfp4-2level quotient against the IEEE division: all
// 2^30 (BF16 mantissa x binary32 sp mantissa) pairs, 2^34 random binary32 pairs over the whole
// fast range, and edge exponents. The sm_89+ hardware E4M3 conversions against the bit
// manipulation (every binary32 in [0, +Inf], every byte). Plus the production kernels vs the CPU
// drivers (BF16 input, TE / 2-level / fused, RTN and SR). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/element_codec.cuh"
#include "backend/cuda/quantize.h"
#include "core/philox.h"
#include "formats/e2m1.h"
#include "formats/e4m3.h"
#include "formats/quantize_cpu.h"
#include "formats/rht.h"

namespace nibble::cuda {
namespace {

namespace fm = ::nibble::formats;

bool gpu_ok() {
  static bool ok = init().is_ok();
  return ok;
}

__device__ uint32_t e2m1_rne_index_ref(float a) {
  return static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) + static_cast<uint32_t>(a > 1.25f) +
         static_cast<uint32_t>(a >= 1.75f) + static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
         static_cast<uint32_t>(a > 5.0f);
}
__device__ uint32_t e2m1_sr_index_ref(float a, float u) {
  uint32_t di = static_cast<uint32_t>(a >= 0.5f) + static_cast<uint32_t>(a >= 1.0f) + static_cast<uint32_t>(a >= 1.5f) +
                static_cast<uint32_t>(a >= 2.0f) + static_cast<uint32_t>(a >= 3.0f) + static_cast<uint32_t>(a >= 4.0f) +
                static_cast<uint32_t>(a >= 6.0f);
  const float down = fm::e2m1_magnitude(di);
  const float gap = di < 4u ? 0.5f : (di < 6u ? 1.0f : 2.0f);
  const float frac = (a - down) / gap;
  return di + ((di < 7u && u < frac) ? 1u : 0u);
}
__device__ float amax_update_ref(float m, float x) {
  const float a = __uint_as_float(__float_as_uint(x) & 0x7FFFFFFFu);
  return a > m ? a : m;
}

// Mismatch counters of a check kernel: kN counts and, per count, the bits of one failing input.
// launch(mismatches, first) starts the kernel; the counters start at zero.
template <int kN>
struct Mismatches {
  unsigned long long count[kN];
  unsigned int first[kN];
};
template <int kN, typename Launch>
Mismatches<kN> run_check(const Launch& launch) {
  unsigned long long* mism;
  unsigned int* first;
  NIB_CUDA_CHECK(cudaMalloc(&mism, kN * sizeof(unsigned long long)));
  NIB_CUDA_CHECK(cudaMalloc(&first, kN * sizeof(unsigned int)));
  NIB_CUDA_CHECK(cudaMemset(mism, 0, kN * sizeof(unsigned long long)));
  NIB_CUDA_CHECK(cudaMemset(first, 0, kN * sizeof(unsigned int)));
  launch(mism, first);
  NIB_CUDA_CHECK_LAUNCH();
  Mismatches<kN> r;
  NIB_CUDA_CHECK(cudaMemcpy(r.count, mism, sizeof r.count, cudaMemcpyDeviceToHost));
  NIB_CUDA_CHECK(cudaMemcpy(r.first, first, sizeof r.first, cudaMemcpyDeviceToHost));
  cudaFree(mism);
  cudaFree(first);
  return r;
}

// mismatches[0]: rne index, [1]: SR index (float u and half-word h forms), [2]: amax step,
// [3]: e2m1_rne_index_bits_min3 (v < 7), [4]: e2m1_sr_index_ru (element_codec.cuh; a >= 0 or NaN),
// [5]: e2m1_rne_index_biased (v >= 0 or +Inf), [6]: e2m1_sr_index_top_byte capped at 7 (a in
// [0, 64)), [7]: sr_carry_term of a Philox block's half-word; first[]: one failing bit pattern.
__global__ void exhaustive_kernel(unsigned long long* mismatches, unsigned int* first, uint64_t base, uint64_t count) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t bits = static_cast<uint32_t>(base + i);
    const float a = __uint_as_float(bits);
    if (fm::e2m1_rne_index(a) != e2m1_rne_index_ref(a)) {
      atomicAdd(&mismatches[0], 1ull);
      first[0] = bits;
    }
    // SR: a random u, and u just at / below the up-probability (the decision boundary).
    const uint32_t di = e2m1_sr_index_ref(a, 1.0f);  // u = 1 never rounds up: the floor index
    const float down = fm::e2m1_magnitude(di);
    const float gap = di < 4u ? 0.5f : (di < 6u ? 1.0f : 2.0f);
    const float frac = (a - down) / gap;
    const float us[3] = {fm::sr_uniform(fm::SrKey{12345, 0}, bits), frac, nextafterf(frac, 0.0f)};
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (fm::e2m1_sr_index(a, us[j]) != e2m1_sr_index_ref(a, us[j])) {
        atomicAdd(&mismatches[1], 1ull);
        first[1] = bits;
      }
    }
    // Half-word form: h = 0, 65535, a random h, and the h just below / at / above p * 2^16.
    const float pf = frac == frac && frac > 0.0f ? (frac < 1.0f ? frac : 1.0f) : 0.0f;
    const uint32_t hb = min(static_cast<uint32_t>(pf * 65536.0f), 65535u);
    const uint32_t hs[6] = {0u, 65535u, bits >> 16, hb > 0u ? hb - 1u : 0u, hb, min(hb + 1u, 65535u)};
#pragma unroll
    for (int j = 0; j < 6; ++j) {
      if (fm::e2m1_sr_index_h(a, hs[j]) != e2m1_sr_index_ref(a, static_cast<float>(hs[j]) * 1.52587890625e-05f)) {
        atomicAdd(&mismatches[1], 1ull);
        first[1] = bits;
      }
      if ((bits >> 31) == 0u && e2m1_sr_index_ru(a, hs[j]) != fm::e2m1_sr_index_h(a, hs[j])) {  // a >= 0 or NaN
        atomicAdd(&mismatches[4], 1ull);
        first[4] = bits;
      }
      if (bits < 0x42800000u &&  // a in [0, 64)
          min(e2m1_sr_index_top_byte(a, sr_carry_term(hs[j])) >> 24, 7u) != fm::e2m1_sr_index_h(a, hs[j])) {
        atomicAdd(&mismatches[6], 1ull);
        first[6] = bits;
      }
    }
    // The carry term from a Philox block's half-word j (one byte permute) against its definition.
    const Philox4x32 words{{bits, ~bits, bits * 2654435761u, bits ^ 0x5A5A5A5Au}};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (sr_carry_term(words, j) != sr_carry_term(fm::sr_halfword(words, j))) {
        atomicAdd(&mismatches[7], 1ull);
        first[7] = bits;
      }
    }
    // The min3 index form (formats/e2m1.h) for every v in [0, 7).
    if (bits < 0x40E00000u && fm::e2m1_rne_index_bits_min3(a) - 0x4B000000u != fm::e2m1_rne_index(a)) {
      atomicAdd(&mismatches[3], 1ull);
      first[3] = bits;
    }
    // Its capped form (element_codec.cuh) for every v >= 0, +Inf included.
    if (bits <= 0x7F800000u && e2m1_rne_index_biased(a) - kRtnIndexBias != fm::e2m1_rne_index(a)) {
      atomicAdd(&mismatches[5], 1ull);
      first[5] = bits;
    }
    const float ms[4] = {0.0f, 1.0f, 3.0e38f, 1e-42f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (__float_as_uint(fm::amax_update(ms[j], a)) != __float_as_uint(amax_update_ref(ms[j], a))) {
        atomicAdd(&mismatches[2], 1ull);
        first[2] = bits;
      }
    }
  }
}

TEST(ElementCodec, ExhaustiveAgainstFormerFormulations) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  const Mismatches<8> m = run_check<8>([](unsigned long long* mism, unsigned int* first) {
    exhaustive_kernel<<<132 * 16, 256>>>(mism, first, 0, uint64_t{1} << 32);
  });
  EXPECT_EQ(m.count[0], 0u) << "e2m1 rne index differs, e.g. bits 0x" << std::hex << m.first[0];
  EXPECT_EQ(m.count[1], 0u) << "e2m1 SR index differs, e.g. bits 0x" << std::hex << m.first[1];
  EXPECT_EQ(m.count[2], 0u) << "amax step differs, e.g. bits 0x" << std::hex << m.first[2];
  EXPECT_EQ(m.count[3], 0u) << "e2m1 min3 index differs, e.g. bits 0x" << std::hex << m.first[3];
  EXPECT_EQ(m.count[4], 0u) << "e2m1 SR round-up form differs, e.g. bits 0x" << std::hex << m.first[4];
  EXPECT_EQ(m.count[5], 0u) << "e2m1 capped min3 index differs, e.g. bits 0x" << std::hex << m.first[5];
  EXPECT_EQ(m.count[6], 0u) << "e2m1 SR top-byte form differs, e.g. bits 0x" << std::hex << m.first[6];
  EXPECT_EQ(m.count[7], 0u) << "SR carry term of a Philox half-word differs, e.g. word 0x" << std::hex << m.first[7];
}

// The sm_89+ hardware E4M3 conversions behind e4m3_rne_sat_magnitude / e4m3_decode on the device
// against the bit manipulation the CPU uses: every binary32 in [0, +Inf] and every byte.
__global__ void e4m3_hw_kernel(unsigned long long* mismatches, unsigned int* first, uint64_t count) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t bits = static_cast<uint32_t>(i);
    const float a = __uint_as_float(bits);
    if (fm::e4m3_rne_sat_magnitude(a) != fm::e4m3_rne_sat_magnitude_bits(a)) {
      atomicAdd(&mismatches[0], 1ull);
      first[0] = bits;
    }
    if (i < 256 && __float_as_uint(fm::e4m3_decode(bits)) != __float_as_uint(fm::e4m3_decode_bits(bits))) {
      atomicAdd(&mismatches[1], 1ull);
      first[1] = bits;
    }
  }
}

TEST(ElementCodec, HardwareE4m3EqualsBitManipulation) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  const Mismatches<2> m = run_check<2>([](unsigned long long* mism, unsigned int* first) {
    e4m3_hw_kernel<<<132 * 16, 256>>>(mism, first, uint64_t{0x7F800000} + 1);
  });
  EXPECT_EQ(m.count[0], 0u) << "E4M3 encode differs, e.g. bits 0x" << std::hex << m.first[0];
  EXPECT_EQ(m.count[1], 0u) << "E4M3 decode differs, e.g. byte 0x" << std::hex << m.first[1];
}

__device__ bool quotient_ok(float a, float sp) {
  const float got = fm::nvfp4_2level_scaled_magnitude(a, sp, fm::nvfp4_2level_block_reciprocal(sp));
  const float want = fm::nvfp4_2level_scaled_magnitude(a, sp);  // IEEE division (-prec-div=true)
  return want != want ? got != got : __float_as_uint(got) == __float_as_uint(want);
}

// mode 0: all (BF16 mantissa of a, binary32 mantissa of sp) pairs, a and sp in [1, 2) scaled by
// per-pair exponents 2^ea, 2^es with (ea, es) cycling over the fast range's corners and middle
// (the steps scale exactly by powers of two inside [2^-60, 2^60], so the mantissa pair decides).
// mode 1: random binary32 a (any bits) and sp (random mantissa, exponent in [-70, 70]).
__global__ void quotient_kernel(unsigned long long* mismatches, unsigned int* first, int mode, uint64_t count) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    float a, sp;
    if (mode == 0) {
      const uint32_t ma = static_cast<uint32_t>(i >> 23) & 0x7Fu, ms = static_cast<uint32_t>(i) & 0x7FFFFFu;
      const int sel = static_cast<int>((i * 0x9E3779B97F4A7C15ull) >> 61);  // 0..7
      const int ea[8] = {0, -60, 59, -60, 59, 0, -30, 30}, es[8] = {0, -60, 59, 59, -60, 30, 0, -30};
      a = __uint_as_float(((127u + ea[sel]) << 23) | (ma << 16));
      sp = __uint_as_float(((127u + es[sel]) << 23) | ms);
    } else {
      const Philox4x32 r = philox_block(99, 5, i);
      a = __uint_as_float(r.v[0] & 0x7FFFFFFFu);
      sp = __uint_as_float(((57u + r.v[2] % 141u) << 23) | (r.v[1] & 0x7FFFFFu));
    }
    if (!quotient_ok(a, sp)) {
      atomicAdd(mismatches, 1ull);
      first[0] = __float_as_uint(a);
      first[1] = __float_as_uint(sp);
    }
  }
}

TEST(ElementCodec, DivisionFreeQuotientEqualsIeeeDivision) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  for (int mode = 0; mode < 2; ++mode) {
    // count[0]: mismatches; first[0], first[1]: the a and sp bits of one.
    const Mismatches<2> m = run_check<2>([mode](unsigned long long* mism, unsigned int* first) {
      quotient_kernel<<<132 * 16, 256>>>(mism, first, mode, mode == 0 ? (uint64_t{1} << 30) : (uint64_t{1} << 34));
    });
    EXPECT_EQ(m.count[0], 0u) << "mode " << mode << ": e.g. a bits 0x" << std::hex << m.first[0] << " sp bits 0x"
                              << m.first[1];
  }
}

template <typename T>
struct DevVec {
  T* p = nullptr;
  size_t n;
  explicit DevVec(size_t n_) : n(n_) {
    NIB_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    NIB_CUDA_CHECK(cudaMemset(p, 0xA5, std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit DevVec(const std::vector<T>& h) : DevVec(h.size()) {
    NIB_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DevVec() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    NIB_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

TEST(ElementCodec, KernelsMatchCpu) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  const int64_t M = 256, K = 384, n = M * K;
  PhiloxStream rng(77, 0);
  std::vector<uint16_t> xb(n);
  std::vector<float> xf(n);
  for (int64_t i = 0; i < n; ++i) {
    float v = static_cast<float>(rng.next_normal() * std::exp(2.0 * rng.next_normal()));
    if (i % 97 == 0) v = 0.0f;
    if (i % 89 == 0) v = -0.0f;
    xb[i] = f32_to_bf16_bits(v);
    xf[i] = bf16_bits_to_f32(xb[i]);
  }
  DevVec<uint16_t> x(xb);
  for (int s = 0; s < 2; ++s) {
    fm::SrKey key{static_cast<uint64_t>(s) + 5, 2};
    const fm::SrKey* sr = s ? &key : nullptr;
    std::vector<uint8_t> c(n / 2), sc(n / 16);
    float amax = fm::nvfp4_te_quantize_cpu(c.data(), sc.data(), xb.data(), M, K, sr);
    DevVec<uint8_t> cd(n / 2), sd(n / 16);
    DevVec<float> ad(1);
    ASSERT_TRUE(quantize_nvfp4_te(cd.p, sd.p, ad.p, x.p, M, K, sr, AmaxMode::kCompute, ScaleLayout::kLinear, nullptr).is_ok());
    EXPECT_EQ(cd.host(), c);
    EXPECT_EQ(sd.host(), sc);
    EXPECT_EQ(ad.host()[0], amax);
    std::vector<uint8_t> ti(n / 16);
    std::vector<float> to(n / 128);
    fm::nvfp4_2level_quantize_cpu(c.data(), ti.data(), to.data(), xb.data(), M, K, sr);
    DevVec<float> od(n / 128);
    ASSERT_TRUE(quantize_nvfp4_2level(cd.p, sd.p, od.p, x.p, M, K, sr, ScaleLayout::kLinear, nullptr).is_ok());
    EXPECT_EQ(cd.host(), c);
    EXPECT_EQ(sd.host(), ti);
    EXPECT_EQ(od.host(), to);
    if (s) {  // fused op (CPU reference is SR only)
      const uint32_t mask = fm::rht_random_sign_mask(9, 9);
      std::vector<uint8_t> ct(n / 2), it(n / 16);
      std::vector<float> ot(n / 128);
      fm::nvfp4_2level_backward_operand_cpu(ct.data(), it.data(), ot.data(), c.data(), ti.data(), to.data(), M, K, mask, key);
      DevVec<uint8_t> ctd(n / 2), itd(n / 16);
      DevVec<float> otd(n / 128);
      ASSERT_TRUE(nvfp4_2level_transpose_rht_requantize(ctd.p, itd.p, otd.p, cd.p, sd.p, od.p, M, K, mask, &key,
                                                                  nullptr).is_ok());
      EXPECT_EQ(ctd.host(), ct);
      EXPECT_EQ(itd.host(), it);
      EXPECT_EQ(otd.host(), ot);
    }
  }
}

}  // namespace
}  // namespace nibble::cuda
