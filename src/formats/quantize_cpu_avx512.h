// AVX-512 (F+BW) row kernels of the RTN drivers in quantize_cpu.cpp, included there inside its
// anonymous namespace after the GCC-vector helpers (e4m3_rne_sat_magnitude16, e4m3_decode16).
// They mirror nvfp4.h/e2m1.h step by step (same binary32 operations, same order), so every byte
// equals the per-block functions; quantize_test.cpp checks this on random and edge inputs.
// Unit: 256 elements (16 blocks of 16; two 128-blocks for 2-level) split even/odd as split32 does.
// A 256-group whose inputs leave the range the streamlined steps assume (NaN; for 2-level also
// Inf, |x| > 2^60, 0 < |x| < 2^-60, or a block scale outside [2^-60, 2^60] other than 0) is
// quantized by the per-block functions of nvfp4.h instead.
#pragma once

// (quantize_cpu.cpp includes <immintrin.h> at file scope.)
#if defined(__AVX512F__) && defined(__AVX512BW__) && NIBBLE_FORMATS_VEC16
#define NIBBLE_FORMATS_AVX512 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's intrinsic headers trip -Wuninitialized on _mm512_undefined_epi32 (GCC PR105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Even/odd split of 32 consecutive elements (lane j of ea: |element 2j|; of oa: |element 2j+1|;
// lanes 0-7 = first 16-block, 8-15 = second) as binary32 bits, their sign bits se/so, and pm
// whose high 16 bits (BF16; all 32 bits for F32) are max(|even|, |odd|) as bits: an unsigned max
// of |.| bits is the float max for non-NaN values, and NaN bits exceed every non-NaN |.|, so a
// NaN shows up in the block maxima and the group takes the fallback. mn: running unsigned minimum
// of |.| bits - 1 (BF16: of the 16-bit halves) for the 2^-60 range check.
struct Avx512Pair {
  __m512i ea, oa, pm;
  __mmask16 se, so;
};
inline Avx512Pair avx512_load_pair(const uint16_t* x, __m512i& mn) {
  const __m512i w = _mm512_loadu_si512(x);
  const __m512i wabs = _mm512_and_si512(w, _mm512_set1_epi32(0x7FFF7FFF));
  Avx512Pair p;
  p.ea = _mm512_slli_epi32(wabs, 16);
  p.oa = _mm512_and_si512(wabs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  p.se = _mm512_test_epi32_mask(w, _mm512_set1_epi32(0x8000));
  p.so = _mm512_test_epi32_mask(w, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  p.pm = _mm512_max_epu16(wabs, p.ea);  // high half: max(|odd|, |even|); low half: |even| (ignored)
  mn = _mm512_min_epu16(mn, _mm512_sub_epi16(wabs, _mm512_set1_epi16(1)));
  return p;
}
inline Avx512Pair avx512_load_pair(const float* x, __m512i& mn) {
  const __m512i a = _mm512_loadu_si512(x), b = _mm512_loadu_si512(x + 16);
  const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i ev = _mm512_permutex2var_epi32(a, ie, b);
  const __m512i od = _mm512_permutex2var_epi32(a, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), b);
  const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
  Avx512Pair p;
  p.ea = _mm512_and_si512(ev, absm);
  p.oa = _mm512_and_si512(od, absm);
  p.se = _mm512_cmplt_epi32_mask(ev, _mm512_setzero_si512());
  p.so = _mm512_cmplt_epi32_mask(od, _mm512_setzero_si512());
  p.pm = _mm512_max_epu32(p.ea, p.oa);
  mn = _mm512_min_epu32(mn, _mm512_min_epu32(_mm512_sub_epi32(p.ea, one), _mm512_sub_epi32(p.oa, one)));
  return p;
}
// The block maxima as binary32 bits from the merged pm (BF16: drop the low halves).
inline __m512i avx512_clean_maxima(__m512i bm, const uint16_t*) {
  return _mm512_and_si512(bm, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
inline __m512i avx512_clean_maxima(__m512i bm, const float*) { return bm; }
// Some nonzero |x| of the group < 2^-60 (bits 0x21800000; BF16: 0x2180)?
inline bool avx512_has_tiny(__m512i mn, const uint16_t*) {
  return _mm512_cmplt_epu16_mask(mn, _mm512_set1_epi16(0x2180 - 1)) != 0;
}
inline bool avx512_has_tiny(__m512i mn, const float*) {
  return _mm512_cmplt_epu32_mask(mn, _mm512_set1_epi32(0x21800000 - 1)) != 0;
}

// Block maxima of 8 pair vectors (lane b of the result = block b of the 16), the merge tree of
// hmax16x16_from_pairs on unsigned bits.
inline __m512i avx512_merge_max(__m512i a, __m512i b, __m512i lo, int step) {
  const __m512i l = _mm512_permutex2var_epi32(a, lo, b);
  const __m512i h = _mm512_permutex2var_epi32(a, _mm512_add_epi32(lo, _mm512_set1_epi32(step)), b);
  return _mm512_max_epu32(l, h);
}
inline __m512i avx512_block_maxima(const __m512i* pm) {
  const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  __m512i l2[4], l3[2];
  for (int i = 0; i < 4; ++i) l2[i] = avx512_merge_max(pm[2 * i], pm[2 * i + 1], lo2, 4);
  for (int i = 0; i < 2; ++i) l3[i] = avx512_merge_max(l2[2 * i], l2[2 * i + 1], lo3, 2);
  return avx512_merge_max(l3[0], l3[1], lo4, 1);
}
// Lanes 0-7 = v[2i], lanes 8-15 = v[2i+1].
inline __m512 avx512_pair_broadcast(__m512 v, int i) {
  return _mm512_permutexvar_ps(
      _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_set1_epi32(2 * i)), v);
}
// e2m1_rne_index16 for a >= 0 that is not NaN (Inf allowed): clamp to 6, e' = max(exponent, 0),
// C = 2^(e'+22), idx = bits(a + C) - bits(C) + 2e'. a <= 6 leaves three cases e' = 0, 1, 2
// (biased exponent 127 / 128 / 129 after the max), so C and bits(C) - 2e' come from 16-entry tables
// indexed by the low four exponent bits (15, 0, 1).
inline __m512i avx512_e2m1_index(__m512 a) {
  a = _mm512_min_ps(a, _mm512_set1_ps(6.0f));  // a not NaN: min(+Inf, 6) = 6
  __m512i e = _mm512_max_epu32(_mm512_srli_epi32(_mm512_castps_si512(a), 23), _mm512_set1_epi32(127));
  const float c0 = 4194304.0f, c1 = 8388608.0f, c2 = 16777216.0f;  // 2^22, 2^23, 2^24
  const __m512 tc = _mm512_setr_ps(c1, c2, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0);
  const int d0 = 0x4A800000, d1 = 0x4B000000 - 2, d2 = 0x4B800000 - 4;
  const __m512i td = _mm512_setr_epi32(d1, d2, d0, d0, d0, d0, d0, d0, d0, d0, d0, d0, d0, d0, d0, d0);
  const __m512 sum = _mm512_add_ps(a, _mm512_permutexvar_ps(e, tc));
  return _mm512_sub_epi32(_mm512_castps_si512(sum), _mm512_permutexvar_epi32(e, td));
}
// 16 even codes + 16 odd codes -> 16 packed bytes.
inline void avx512_store_codes(uint8_t* out, __m512i ce, __m512i co) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_or_si512(ce, _mm512_slli_epi32(co, 4))));
}

// amax_update over p[0, n) with n % 128 == 0: the NaN-skipping max of |x| as an unsigned max of
// |x| bits (equal to the float max for non-NaN values; NaN lanes, bits > Inf, are masked out).
inline float avx512_amax(const uint16_t* p, int64_t n) {
  const __m512i absm = _mm512_set1_epi16(0x7FFF), inf = _mm512_set1_epi16(0x7F80);
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int64_t i = 0; i < n; i += 128)
    for (int j = 0; j < 4; ++j) {
      const __m512i t = _mm512_and_si512(_mm512_loadu_si512(p + i + 32 * j), absm);
      acc[j] = _mm512_mask_max_epu16(acc[j], _mm512_cmple_epu16_mask(t, inf), acc[j], t);
    }
  __m512i m = _mm512_max_epu16(_mm512_max_epu16(acc[0], acc[1]), _mm512_max_epu16(acc[2], acc[3]));
  m = _mm512_max_epu16(m, _mm512_srli_epi32(m, 16));  // low half of each lane: max of both halves
  const uint32_t bits = _mm512_reduce_max_epu32(_mm512_and_si512(m, _mm512_set1_epi32(0xFFFF))) << 16;
  return u32_as_float(bits);
}
inline float avx512_amax(const float* p, int64_t n) {
  const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int64_t i = 0; i < n; i += 64)
    for (int j = 0; j < 4; ++j) {
      const __m512i t = _mm512_and_si512(_mm512_loadu_si512(p + i + 16 * j), absm);
      acc[j] = _mm512_mask_max_epu32(acc[j], _mm512_cmple_epu32_mask(t, inf), acc[j], t);
    }
  const __m512i m = _mm512_max_epu32(_mm512_max_epu32(acc[0], acc[1]), _mm512_max_epu32(acc[2], acc[3]));
  return u32_as_float(_mm512_reduce_max_epu32(m));
}

// TE RTN, one 256-group (16 blocks): codes (128 bytes), scales (16) <- x (256). False (nothing
// written) if the group holds a NaN.
template <typename In>
inline bool te_group256_avx512(uint8_t* codes, uint8_t* scales, const In* x, const Nvfp4TeGlobal& g) {
  Avx512Pair p[8];
  __m512i pm[8], mn = _mm512_set1_epi32(-1);
  for (int i = 0; i < 8; ++i) {
    p[i] = avx512_load_pair(x + 32 * i, mn);
    pm[i] = p[i].pm;
  }
  const __m512i bm = avx512_clean_maxima(avx512_block_maxima(pm), x);
  if (_mm512_cmpgt_epu32_mask(bm, _mm512_set1_epi32(0x7F800000)) != 0) return false;  // NaN
  // nvfp4_te_block_scale / nvfp4_te_block_enc on 16 lanes (the same steps).
  v16f t = (v16f)(_mm512_castsi512_ps(bm)) * g.m;
  t = t < 448.0f ? t : 448.0f;
  const v16u s = e4m3_rne_sat_magnitude16(t);
  v16f enc = 1.0f / (e4m3_decode16(s) * g.s_dec);
  enc = enc < kFltMax ? enc : kFltMax;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), _mm512_cvtepi32_epi8((__m512i)(s)));
  const __m512 encv = (__m512)(enc), zero = _mm512_setzero_ps();
  const __m512i eight = _mm512_set1_epi32(8);
  for (int i = 0; i < 8; ++i) {
    const __m512 e2 = avx512_pair_broadcast(encv, i);
    // nvfp4_te_encode_rtn: v = x*enc, |v| = |x|*enc (rounding is sign-symmetric); index of |v|;
    // sign bit iff v < 0, i.e. x < 0 and |v| > 0 (x is not NaN here).
    const __m512 ae = _mm512_mul_ps(_mm512_castsi512_ps(p[i].ea), e2);
    const __m512 ao = _mm512_mul_ps(_mm512_castsi512_ps(p[i].oa), e2);
    const __mmask16 ne = _mm512_mask_cmp_ps_mask(p[i].se, ae, zero, _CMP_GT_OQ);
    const __mmask16 no = _mm512_mask_cmp_ps_mask(p[i].so, ao, zero, _CMP_GT_OQ);
    __m512i ce = avx512_e2m1_index(ae), co = avx512_e2m1_index(ao);
    ce = _mm512_mask_or_epi32(ce, ne, ce, eight);
    co = _mm512_mask_or_epi32(co, no, co, eight);
    avx512_store_codes(codes + 16 * i, ce, co);
  }
  return true;
}

// 2-level RTN, one 256-group (two 128-blocks): codes (128 bytes), inner (16), outer (2) <- x
// (256). False (nothing written) outside the fast range (see the top comment).
template <typename In>
inline bool twolevel_group256_avx512(uint8_t* codes, uint8_t* inner, float* outer, const In* x) {
  Avx512Pair p[8];
  __m512i pm[8], mn = _mm512_set1_epi32(-1);
  for (int i = 0; i < 8; ++i) {
    p[i] = avx512_load_pair(x + 32 * i, mn);
    pm[i] = p[i].pm;
  }
  const __m512i bm = avx512_clean_maxima(avx512_block_maxima(pm), x);
  // Every |x| <= 2^60 (also excludes NaN, Inf) and no nonzero |x| < 2^-60.
  if (_mm512_cmpgt_epu32_mask(bm, _mm512_set1_epi32(0x5D800000)) != 0 || avx512_has_tiny(mn, x)) return false;
  const v16f bamax = (v16f)(_mm512_castsi512_ps(bm));
  // nvfp4_2level_outer_scale of lanes 0-7 and 8-15 (max of non-negative non-NaN values: any order).
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i am = bm;
  for (int h = 1; h < 8; h <<= 1)
    am = _mm512_max_epu32(am, _mm512_permutexvar_epi32(_mm512_xor_si512(lane, _mm512_set1_epi32(h)), am));
  v16f so = ((v16f)(_mm512_castsi512_ps(am)) * kRecip448) * kRecip6;
  so = so == 0.0f ? 1.0f : so;
  // nvfp4_2level_inner_scale, nvfp4_2level_block_scale, nvfp4_2level_block_reciprocal.
  v16f t = (bamax / so) * kRecip6;
  t = t < 448.0f ? t : 448.0f;
  const v16u si = e4m3_rne_sat_magnitude16(t);
  const v16f sp = e4m3_decode16(si) * so;
  const __m512 spv = (__m512)(sp);
  const __mmask16 in_range = _mm512_cmp_ps_mask(spv, _mm512_set1_ps(0x1p-60f), _CMP_GE_OQ) &
                             _mm512_cmp_ps_mask(spv, _mm512_set1_ps(0x1p60f), _CMP_LE_OQ);
  const __mmask16 zero_sp = _mm512_cmp_ps_mask(spv, _mm512_setzero_ps(), _CMP_EQ_OQ);
  // sp == 0 (r = 0): the fma steps below give +0 for every finite a, = the definition's 0.
  if (static_cast<__mmask16>(in_range | zero_sp) != 0xFFFF) return false;
  const __m512 rv = _mm512_maskz_div_ps(in_range, _mm512_set1_ps(1.0f), spv);
  outer[0] = so[0];
  outer[1] = so[8];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(inner), _mm512_cvtepi32_epi8((__m512i)(si)));
  const __m512i eight = _mm512_set1_epi32(8);
  for (int i = 0; i < 8; ++i) {
    const __m512 p2 = avx512_pair_broadcast(spv, i), r2 = avx512_pair_broadcast(rv, i);
    __m512i c[2];
    const __m512i as[2] = {p[i].ea, p[i].oa};
    const __mmask16 sg[2] = {p[i].se, p[i].so};
    for (int k = 0; k < 2; ++k) {
      // nvfp4_2level_quotient_fma (fnmadd(q, sp, a) = fma(-q, sp, a): negation is exact).
      const __m512 a = _mm512_castsi512_ps(as[k]);
      const __m512 q0 = _mm512_mul_ps(a, r2);
      const __m512 e0 = _mm512_fnmadd_ps(q0, p2, a);
      const __m512 q1 = _mm512_fmadd_ps(e0, r2, q0);
      const __m512 e1 = _mm512_fnmadd_ps(q1, p2, a);
      const __m512 v = _mm512_fmadd_ps(e1, r2, q1);
      // nvfp4_2level_code_rtn: sign bit = signbit(x) (x is not NaN here).
      const __m512i idx = avx512_e2m1_index(v);
      c[k] = _mm512_mask_or_epi32(idx, sg[k], idx, eight);
    }
    avx512_store_codes(codes + 16 * i, c[0], c[1]);
  }
  return true;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
