// AVX-512 (F+BW) row kernels of the RTN drivers in quantize_cpu.cpp, included there inside its
// anonymous namespace after the GCC-vector helpers (e4m3_rne_sat_magnitude16, e4m3_decode16).
// Scales mirror nvfp4.h/e2m1.h step by step (same binary32 operations, same order), so every byte
// equals the per-block functions; quantize_test.cpp and quantize_cpu_avx512_test.cpp check this.
// Unit: 256 elements (16 blocks of 16; two 128-blocks for 2-level). TE and 2-level F32: split
// even/odd as split32 does, element steps as in nvfp4.h. BF16 (2-level and TE): per block the 7
// exact decision thresholds C_k as BF16 patterns (2-level: closed form; TE: a window checked with
// the reference multiply; arguments below), then per element a 3-step search on the 16-bit words
// (32 per instruction); quantize_cpu_avx512_mx.h reuses the search for MXFP4. Also the F32
// dequantizers' table decode (avx512_decode_blocks).
// A 256-group whose inputs leave the range the streamlined steps assume is quantized by the
// per-block functions of nvfp4.h instead: NaN; for 2-level F32 also Inf, |x| > 2^60,
// 0 < |x| < 2^-60, or a block scale outside [2^-60, 2^60] other than 0; for 2-level BF16 Inf or
// such a block scale (no per-element condition); for TE BF16 only single irregular blocks.
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

// nvfp4_te_block_scale / nvfp4_te_block_enc on 16 lanes (the same steps) from the NaN-free block
// maxima bm (binary32 bits, lane b = block b): writes the 16 scale bytes, returns enc.
inline __m512 te_scales16(uint8_t* scales, __m512i bm, const Nvfp4TeGlobal& g) {
  v16f t = (v16f)(_mm512_castsi512_ps(bm)) * g.m;
  t = t < 448.0f ? t : 448.0f;
  const v16u s = e4m3_rne_sat_magnitude16(t);
  v16f enc = 1.0f / (e4m3_decode16(s) * g.s_dec);
  enc = enc < kFltMax ? enc : kFltMax;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), _mm512_cvtepi32_epi8((__m512i)(s)));
  return (__m512)(enc);
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
  const __m512 encv = te_scales16(scales, bm, g), zero = _mm512_setzero_ps();
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

// e4m3_rne_sat_magnitude_bits (e4m3.h) of 16 lanes t in [0, 448] (not NaN), and the E4M3 value
// of the result as binary32 (= e4m3_decode of the byte, exact). The same integer/float steps:
// subnormal range t < 2^-6: q = fl(t * 2^9 + 2^23) - 2^23 (RNE to an integer, exact), value
// q * 2^-9; normal range: ur = bits(t) + 0x7FFFF + bit 20 (RNE at bit 20, carry into the
// exponent), byte = (ur >> 20) - (120 << 3) (= ((exp - 120) << 3) | mantissa, exp >= 121), value
// = ur with the low 20 bits cleared (the rounded binary32 itself); t <= 448 keeps byte <= 0x7E.
inline __m512i avx512_e4m3_rne_magnitude(__m512 t, __m512& value) {
  const __mmask16 sub = _mm512_cmp_ps_mask(t, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
  const __m512 r = _mm512_add_ps(_mm512_mul_ps(t, _mm512_set1_ps(512.0f)), _mm512_set1_ps(8388608.0f));
  const __m512i q = _mm512_sub_epi32(_mm512_castps_si512(r), _mm512_set1_epi32(0x4B000000));
  const __m512 qv = _mm512_mul_ps(_mm512_sub_ps(r, _mm512_set1_ps(8388608.0f)), _mm512_set1_ps(0.001953125f));
  const __m512i u = _mm512_castps_si512(t);
  const __m512i ur = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFFF)),
                                      _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1)));
  const __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(ur, 20), _mm512_set1_epi32(120 << 3));
  const __m512 v = _mm512_castsi512_ps(_mm512_and_si512(ur, _mm512_set1_epi32(static_cast<int>(0xFFF00000u))));
  value = _mm512_mask_blend_ps(sub, v, qv);
  return _mm512_mask_blend_epi32(sub, code, q);
}

// 2-level scales of one 256-group from its 16 block maxima bm (binary32 bits of the NaN-free,
// Inf-free block amax, lane b = block b): nvfp4_2level_outer_scale of lanes 0-7 and 8-15,
// nvfp4_2level_inner_scale, nvfp4_2level_block_scale, the same binary32 steps in the same order.
// Writes outer (2) and inner (16); returns sp (lane b = block b).
inline __m512 avx512_twolevel_scales(float* outer, uint8_t* inner, __m512i bm) {
  const __m512 bamax = _mm512_castsi512_ps(bm);
  // Max of non-negative non-NaN values: any order. Butterfly over lanes 0-7 and 8-15.
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i am = bm;
  for (int h = 1; h < 8; h <<= 1)
    am = _mm512_max_epu32(am, _mm512_permutexvar_epi32(_mm512_xor_si512(lane, _mm512_set1_epi32(h)), am));
  __m512 so = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(am), _mm512_set1_ps(kRecip448)), _mm512_set1_ps(kRecip6));
  so = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(so, _mm512_setzero_ps(), _CMP_EQ_OQ), so, _mm512_set1_ps(1.0f));
  // t = min(fl(fl(bamax / so) * R6), 448) (`<` as in nvfp4_2level_inner_scale: NaN -> 448).
  __m512 t = _mm512_mul_ps(_mm512_div_ps(bamax, so), _mm512_set1_ps(kRecip6));
  t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, _mm512_set1_ps(448.0f), _CMP_LT_OQ), _mm512_set1_ps(448.0f), t);
  __m512 siv;
  const __m512i si = avx512_e4m3_rne_magnitude(t, siv);
  outer[0] = _mm512_cvtss_f32(so);
  outer[1] = _mm512_cvtss_f32(_mm512_castps128_ps512(_mm512_extractf32x4_ps(so, 2)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(inner), _mm512_cvtepi32_epi8(si));
  return _mm512_mul_ps(siv, so);
}

// 2-level RTN, one 256-group (two 128-blocks): codes (128 bytes), inner (16), outer (2) <- x
// (256). False outside the fast range (see the top comment): codes not written, inner/outer
// possibly (the caller's per-block fallback rewrites all three). Used for F32 input; BF16 takes
// twolevel_row_bf16_avx512 below.
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
  const __m512 spv = avx512_twolevel_scales(outer, inner, bm);
  const __mmask16 in_range = _mm512_cmp_ps_mask(spv, _mm512_set1_ps(0x1p-60f), _CMP_GE_OQ) &
                             _mm512_cmp_ps_mask(spv, _mm512_set1_ps(0x1p60f), _CMP_LE_OQ);
  const __mmask16 zero_sp = _mm512_cmp_ps_mask(spv, _mm512_setzero_ps(), _CMP_EQ_OQ);
  // sp == 0 (r = 0): the fma steps below give +0 for every finite a, = the definition's 0.
  if (static_cast<__mmask16>(in_range | zero_sp) != 0xFFFF) return false;
  const __m512 rv = _mm512_maskz_div_ps(in_range, _mm512_set1_ps(1.0f), spv);
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

// ---- dequantization to F32 ------------------------------------------------------------------------

// e4m3_decode of 16 scale bytes (any byte: e4m3_decode16 is for the magnitudes a quantizer writes):
// the magnitude, the sign bit 0x80, and for 0x7F / 0xFF the NaN e4m3_decode_bits gives.
inline v16f e4m3_decode16_nan(v16u byte) {
  const v16u sign = (byte & 0x80u) << 24;
  const v16u d = (v16u)(e4m3_decode16(byte & 0x7Fu)) | sign;
  return (v16f)((byte & 0x7Fu) == 0x7Fu ? (sign | 0x7FC00000u) : d);
}

// 16 bytes, zero-extended to 16 lanes.
inline v16u avx512_load_bytes16(const uint8_t* p) {
  return (v16u)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// y (16 nblocks elements) <- the E2M1 codes of nblocks 16-blocks (8 bytes each) times f[b]:
// kSignAfter false: e2m1_decode(code) * f (nvfp4_te_decode); true: +-(magnitude * f) with the sign
// applied after the product (nvfp4_2level_decode; equal unless f is NaN). nblocks is even.
template <bool kSignAfter>
inline void avx512_decode_blocks(float* y, const uint8_t* codes, const float* f, int64_t nblocks) {
  const __m512 tbl = kSignAfter ? _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0.0f, 0.5f, 1.0f, 1.5f,
                                                 2.0f, 3.0f, 4.0f, 6.0f)
                                : _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f,
                                                 -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t b = 0; b < nblocks; b += 2) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 8 * b));
    const __m128i lo = _mm_and_si128(c, nib), hi = _mm_and_si128(_mm_srli_epi16(c, 4), nib);
    const __m128i blk[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};  // codes in element order
    for (int h = 0; h < 2; ++h) {
      const __m512i w = _mm512_cvtepu8_epi32(blk[h]);
      __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(w, tbl), _mm512_set1_ps(f[b + h]));
      if (kSignAfter)  // bit 3 of the code -> bit 31: v ^ (w << 28 & sign), ternary table 0x78
        v = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(v), _mm512_slli_epi32(w, 28), sign, 0x78));
      _mm512_storeu_ps(y + 16 * (b + h), v);
    }
  }
}

// ---- 2-level RTN, BF16 input: exact decision thresholds in BF16 space ---------------------------
//
// For a block with sp > 0 the reference code of x is e2m1_rne_index(fl(|x| / sp)) | signbit(x)<<3
// (nvfp4_2level_scaled_magnitude is the correctly rounded quotient, by the fma steps or by the
// division). The index is a nondecreasing function of |x| (correctly rounded division and
// e2m1_rne_index are both monotone), so with
//   C_k = the smallest BF16 magnitude pattern b with e2m1_rne_index(fl(b / sp)) >= k  (k = 1..7)
// the index of x is #{k : |x|_bits >= C_k} (BF16 patterns of non-negative values are ordered like
// the values). C_k in closed form: T_k = 0.25 0.75 1.25 1.75 2.5 3.5 5 are the steps of
// e2m1_rne_index (index >= k iff v > T_k for odd k, v >= T_k for even k: ties to the even code).
// Each T_k has at most 3 significant bits, so its last significand bit is 0 and a quotient
// exactly halfway between T_k and a binary32 neighbour rounds to T_k. With h_k = 2^(e_k - 24),
// e_k = floor(log2 T_k) (half an ulp above T_k; for even k, T_k = 0.75 1.75 3.5 is not a power of
// two, so also half an ulp below):
//   odd k:  fl(q) > T_k  <=>  q > T_k + h_k   <=>  |x| > Y_k = T_k*sp + h_k*sp
//   even k: fl(q) >= T_k <=>  q >= T_k - h_k  <=>  |x| >= Y_k = T_k*sp - h_k*sp
// (sp > 0; q = |x| / sp real; RNE is monotone). For sp in [2^-60, 2^60], h_k*sp is exact (a power
// of two times a normal binary32, >= 2^-86), so one fma with a directed rounding gives the exact
// RD or RU of the real Y_k, and since BF16 values are binary32 values:
//   odd k:  C_k = (bits(RD(Y_k)) >> 16) + 1          (the BF16 after RD_bf16(Y_k) = trunc(RD(Y_k)))
//   even k: C_k = (bits(RU(Y_k)) + 0xFFFF) >> 16      (RU_bf16(Y_k) = the BF16 ceiling of RU(Y_k))
// Y_k lies in [2^-63, 2^63] (normal, finite), so both are finite positive patterns below 0x7FFF.
// sp == 0: the reference quotient is 0, index 0: C_k = 0x7FFF (above every non-NaN magnitude).
// No per-element range condition is needed (tiny, huge or subnormal |x| compare like any other);
// the group takes the fallback only for NaN/Inf inputs or a nonzero sp outside [2^-60, 2^60].
// Tested bit-exact against the per-block functions (quantize_cpu_avx512_test.cpp): C_k - 1 and
// C_k for every nonzero block scale the path can see (every BF16 outer amax in range x every inner
// byte), every BF16 magnitude that fits under the block maximum for ~320 scales, specials.
//
// Element step (32 BF16 words w = 2 blocks per vector; 128-bit lane L holds 8 words of block
// 2i + (L >= 2)): a branch-free binary search over the 7 thresholds by vpshufb lookups (in-lane
// byte shuffles) into a per-vector table whose every lane holds its block's C_1..C_7 (+ filler)
// as 8 low bytes then 8 high bytes; the word index of slot q is bytes (q, 8 + q). With
// a = |x| bits:
//   stage 1: q = 3 (C_4), m1 = a >= C_4;  stage 2: q = 4*m1 + 1 (C_{4m1+2}), m2;
//   stage 3: q = 4*m1 + 2*m2 (C_{4m1+2m2+1}), m3;  idx = 4*m1 + 2*m2 + m3 = q + m3,
// code = idx + 8*signbit(x) in the low byte of the final index word.

// Block maxima of 8 vectors of 32 |x| words (vector i: blocks 2i, 2i+1) as binary32 bits (lane b
// = block b): three vpermt2w merge levels, each halving the words per block, then the pair max.
// Level lv keeps g = 8 >> lv words per block: output word l <- word (l / g) * 2g + l % g (lo) or
// that + g (hi) of the two concatenated sources (64 words).
alignas(64) inline constexpr uint16_t kBf16MaxIdx[6][32] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23, 32, 33, 34, 35, 36, 37, 38, 39, 48, 49, 50, 51, 52, 53, 54, 55},
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31, 40, 41, 42, 43, 44, 45, 46, 47, 56, 57, 58, 59, 60, 61, 62, 63},
    {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27, 32, 33, 34, 35, 40, 41, 42, 43, 48, 49, 50, 51, 56, 57, 58, 59},
    {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31, 36, 37, 38, 39, 44, 45, 46, 47, 52, 53, 54, 55, 60, 61, 62, 63},
    {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29, 32, 33, 36, 37, 40, 41, 44, 45, 48, 49, 52, 53, 56, 57, 60, 61},
    {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31, 34, 35, 38, 39, 42, 43, 46, 47, 50, 51, 54, 55, 58, 59, 62, 63}};
inline __m512i avx512_bf16_block_maxima(const __m512i* a) {
  __m512i lo[3], hi[3];
  for (int lv = 0; lv < 3; ++lv) {
    lo[lv] = _mm512_load_si512(kBf16MaxIdx[2 * lv]);
    hi[lv] = _mm512_load_si512(kBf16MaxIdx[2 * lv + 1]);
  }
  __m512i u[4], v[2];
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_max_epu16(_mm512_permutex2var_epi16(a[2 * i], lo[0], a[2 * i + 1]),
                            _mm512_permutex2var_epi16(a[2 * i], hi[0], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_max_epu16(_mm512_permutex2var_epi16(u[2 * i], lo[1], u[2 * i + 1]),
                            _mm512_permutex2var_epi16(u[2 * i], hi[1], u[2 * i + 1]));
  const __m512i z = _mm512_max_epu16(_mm512_permutex2var_epi16(v[0], lo[2], v[1]),
                                     _mm512_permutex2var_epi16(v[0], hi[2], v[1]));
  return _mm512_slli_epi32(_mm512_max_epu16(z, _mm512_srli_epi32(z, 16)), 16);
}

// T_i (see above) for i = 0..7 from the byte-split thresholds r[j] (128-bit lane L of r[j] =
// block 4L + j): blocks 2i, 2i+1 = lane i/2 of r[2(i%2)], r[2(i%2)+1], each in two lanes.
template <int I>
inline __m512i avx512_bf16_table(const __m512i* r) {
  constexpr int L = I / 2, J = 2 * (I % 2);
  return _mm512_shuffle_i32x4(r[J], r[J + 1], L * 0x55);
}

// Phase 1 of a 256-group x: the 16 block maxima as binary32 bits (lane b = block b; NaN shows as
// bits > 0x7F800000).
inline __m512i bf16_group_maxima(const uint16_t* x) {
  __m512i a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm512_and_si512(_mm512_loadu_si512(x + 32 * i), _mm512_set1_epi16(0x7FFF));
  return avx512_bf16_block_maxima(a);
}

// Phase 2: scales from the maxima bm (inner 16 bytes and outer 2 floats written), sp (lane b =
// block b). False for NaN/Inf inputs or a nonzero sp outside [2^-60, 2^60] (the group then takes
// the per-block functions, which rewrite inner and outer).
inline bool twolevel_bf16_scales(float* outer, uint8_t* inner, __m512i bm, __m512& sp) {
  const __mmask16 nonfinite = _mm512_cmpgt_epu32_mask(bm, _mm512_set1_epi32(0x7F7FFFFF));  // NaN or Inf
  sp = avx512_twolevel_scales(outer, inner, bm);
  const __mmask16 in_range = _mm512_cmp_ps_mask(sp, _mm512_set1_ps(0x1p-60f), _CMP_GE_OQ) &
                             _mm512_cmp_ps_mask(sp, _mm512_set1_ps(0x1p60f), _CMP_LE_OQ);
  const __mmask16 zero_sp = _mm512_cmp_ps_mask(sp, _mm512_setzero_ps(), _CMP_EQ_OQ);
  return nonfinite == 0 && static_cast<__mmask16>(in_range | zero_sp) == 0xFFFF;
}

// The thresholds of 16 blocks paired as 16-bit halves, lane b = block b: pr[j] = C_{2j+1} |
// C_{2j+2} << 16 (slot 7, the high half of pr[3], is never searched: 2-level fills it with 0x7FFF,
// TE puts its sign threshold C_0 there), rearranged per block: 128-bit lane L of rs[j] holds block
// 4L + j's 8 words as 8 low bytes then 8 high bytes (the vpshufb table layout).
inline void bf16_split_tables(__m512i* rs, const __m512i* pr) {
  // 4x4 dword transpose inside each 128-bit lane: r[j] lane L = the 4 pairs of block 4L + j.
  const __m512i t0 = _mm512_unpacklo_epi32(pr[0], pr[1]), t1 = _mm512_unpackhi_epi32(pr[0], pr[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(pr[2], pr[3]), t3 = _mm512_unpackhi_epi32(pr[2], pr[3]);
  const __m512i r[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                        _mm512_unpackhi_epi64(t1, t3)};
  const __m512i split = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  for (int j = 0; j < 4; ++j) rs[j] = _mm512_shuffle_epi8(r[j], split);
}
// The 8 search tables tab of 16 16-blocks (vector i: blocks 2i, 2i+1) from their thresholds pr.
inline void bf16_search_tables(__m512i* tab, const __m512i* pr) {
  __m512i rs[4];
  bf16_split_tables(rs, pr);
  tab[0] = avx512_bf16_table<0>(rs);
  tab[1] = avx512_bf16_table<1>(rs);
  tab[2] = avx512_bf16_table<2>(rs);
  tab[3] = avx512_bf16_table<3>(rs);
  tab[4] = avx512_bf16_table<4>(rs);
  tab[5] = avx512_bf16_table<5>(rs);
  tab[6] = avx512_bf16_table<6>(rs);
  tab[7] = avx512_bf16_table<7>(rs);
}

// Phase 3: the thresholds C_k of the 16 blocks (block scales sp, in range or 0) and the 8 search
// tables tab (vector i: blocks 2i, 2i+1). Meaningless (and unused) for a group that failed phase 2.
inline void twolevel_bf16_tables(__m512i* tab, __m512 sp) {
  const __mmask16 zero_sp = _mm512_cmp_ps_mask(sp, _mm512_setzero_ps(), _CMP_EQ_OQ);
  // Thresholds, lane b = block b, paired as 16-bit halves: pr[j] = C_{2j+1} | C_{2j+2} << 16
  // (pr[3] high half: filler 0x7FFF). RD/RU: one fma rounded toward -inf / +inf (see above).
  constexpr int kRD = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC, kRU = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC;
  const __m512i one32 = _mm512_set1_epi32(1), ru16 = _mm512_set1_epi32(0xFFFF);
  const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // odd k: C = (bits(RD(T*sp + h*sp)) >> 16) + 1, in the low half.
  auto odd_c = [&](float T, float h) {
    const __m512 y = _mm512_fmadd_round_ps(_mm512_set1_ps(T), sp, _mm512_mul_ps(sp, _mm512_set1_ps(h)), kRD);
    return _mm512_add_epi32(_mm512_srli_epi32(_mm512_castps_si512(y), 16), one32);
  };
  // even k: C = (bits(RU(T*sp - h*sp)) + 0xFFFF) >> 16, placed in the high half, or'ed with lo.
  auto even_pair = [&](__m512i lo, float T, float h) {
    const __m512 y = _mm512_fmsub_round_ps(_mm512_set1_ps(T), sp, _mm512_mul_ps(sp, _mm512_set1_ps(h)), kRU);
    // (A & B) | C with A = bits + 0xFFFF, B = 0xFFFF0000, C = lo: ternary-logic table 0xEA.
    return _mm512_ternarylogic_epi32(_mm512_add_epi32(_mm512_castps_si512(y), ru16), hi16, lo, 0xEA);
  };
  const __m512i never = _mm512_set1_epi32(0x7FFF7FFF);
  __m512i pr[4];
  pr[0] = even_pair(odd_c(0.25f, 0x1p-26f), 0.75f, 0x1p-25f);
  pr[1] = even_pair(odd_c(1.25f, 0x1p-24f), 1.75f, 0x1p-24f);
  pr[2] = even_pair(odd_c(2.5f, 0x1p-23f), 3.5f, 0x1p-23f);
  pr[3] = _mm512_or_si512(odd_c(5.0f, 0x1p-22f), _mm512_set1_epi32(0x7FFF0000));
  for (int j = 0; j < 4; ++j) pr[j] = _mm512_mask_mov_epi32(pr[j], zero_sp, never);
  bf16_search_tables(tab, pr);
}

// Phase 4: codes (16 kVectors bytes) of 32 kVectors elements x, vector i searched with table
// tab[i] (each 128-bit lane: the table of its 8 words' block). Sign bit: kTeSign false (2-level,
// MX floor/RCEIL) signbit(x); kTeSign true (TE, MX te-ceil) x < 0 and |x| >= C_0 (slot 7), i.e. the
// scaled value is negative.
template <bool kTeSign, int kVectors = 8>
inline void bf16_threshold_codes(uint8_t* codes, const uint16_t* x, const __m512i* tab) {
  // Index words for slot q: low byte q, high byte 8 + q (257 q + 0x0800).
  const __m512i q3 = _mm512_set1_epi16(0x0B03), q1 = _mm512_set1_epi16(0x0901), q0 = _mm512_set1_epi16(0x0800);
  const __m512i q7 = _mm512_set1_epi16(0x0F07);
  const __m512i s4 = _mm512_set1_epi16(0x0404), s2 = _mm512_set1_epi16(0x0202);
  const __m512i one = _mm512_set1_epi16(1), eight = _mm512_set1_epi16(8);
  const __m512i weights = _mm512_set1_epi32(0x00100001);  // words (1, 16): even + 16 * odd
  for (int i = 0; i < kVectors; ++i) {
    const __m512i w = _mm512_loadu_si512(x + 32 * i);
    const __m512i a = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
    __mmask32 neg = _mm512_movepi16_mask(w);
    if constexpr (kTeSign) neg = _mm512_mask_cmpge_epu16_mask(neg, a, _mm512_shuffle_epi8(tab[i], q7));
    const __mmask32 m1 = _mm512_cmpge_epu16_mask(a, _mm512_shuffle_epi8(tab[i], q3));
    const __m512i j2 = _mm512_mask_add_epi16(q1, m1, q1, s4);
    const __m512i b3 = _mm512_mask_add_epi16(q0, m1, q0, s4);
    const __mmask32 m2 = _mm512_cmpge_epu16_mask(a, _mm512_shuffle_epi8(tab[i], j2));
    const __m512i j3 = _mm512_mask_add_epi16(b3, m2, b3, s2);
    const __mmask32 m3 = _mm512_cmpge_epu16_mask(a, _mm512_shuffle_epi8(tab[i], j3));
    __m512i c = _mm512_mask_add_epi16(j3, m3, j3, one);  // low byte: idx = 4 m1 + 2 m2 + m3
    c = _mm512_mask_add_epi16(c, neg, c, eight);           // low byte: code
    // Dword = even word | odd word << 16: even + 16 * odd has the packed byte in its low 8 bits
    // (the high bytes of the words only reach bits >= 8).
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * i), _mm512_cvtepi32_epi8(_mm512_madd_epi16(c, weights)));
  }
}

// Software prefetch of the `bytes` bytes (a multiple of 64) 16 KiB after p, the input of the group
// 16 KiB ahead (for a BF16 256-group: 32 groups ahead; the next row's start at a row's end, which a
// row-major caller quantizes next): the row kernels' later phases touch only L1, so the hardware
// prefetchers alone leave memory idle meanwhile. A prefetch never faults (the address is formed as
// an integer: it may lie past the caller's buffer).
inline void prefetch_group_ahead(const void* p, int bytes) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(p) + 16384;
  for (int l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + l), _MM_HINT_T0);
}

// The BF16 row kernels' chunk loop: ngroups 256-groups of x in chunks of up to 16, one phase at a
// time over a chunk (each phase of one group is a long dependency chain: tree, division or
// reciprocal, E4M3 rounding, ...; the independent groups of a phase loop overlap in the core).
// Phase 1, the block maxima, is here; rest(g0, n, bm) runs the others on groups g0 .. g0 + n - 1.
template <typename Rest>
inline void bf16_row_in_chunks(const uint16_t* x, int64_t ngroups, const Rest& rest) {
  constexpr int64_t kChunk = 16;
  __m512i bm[kChunk];
  for (int64_t g0 = 0; g0 < ngroups; g0 += kChunk) {
    const int64_t n = ngroups - g0 < kChunk ? ngroups - g0 : kChunk;
    for (int64_t j = 0; j < n; ++j) bm[j] = bf16_group_maxima(x + 256 * (g0 + j));
    rest(g0, n, bm);
  }
}

// 2-level RTN of ngroups consecutive 256-groups of a BF16 row (codes 128, inner 16, outer 2 per
// group), phase by phase over chunks (bf16_row_in_chunks). A group outside the fast range takes
// the per-block functions of nvfp4.h.
inline void twolevel_row_bf16_avx512(uint8_t* codes, uint8_t* inner, float* outer, const uint16_t* x, int64_t ngroups) {
  bf16_row_in_chunks(x, ngroups, [&](int64_t g0, int64_t n, const __m512i* bm) {
    __m512i tab[16][8];
    __m512 sp[16];
    bool ok[16];
    for (int64_t g = 0; g < n; ++g)
      ok[g] = twolevel_bf16_scales(outer + 2 * (g0 + g), inner + 16 * (g0 + g), bm[g], sp[g]);
    for (int64_t g = 0; g < n; ++g) twolevel_bf16_tables(tab[g], sp[g]);
    for (int64_t g = 0; g < n; ++g) {
      const int64_t o = 2 * (g0 + g);  // first 128-block of the group
      prefetch_group_ahead(x + 128 * o, 512);
      if (ok[g])
        bf16_threshold_codes<false>(codes + 64 * o, x + 128 * o, tab[g]);
      else
        for (int64_t b = o; b < o + 2; ++b)
          outer[b] = nvfp4_2level_quantize_block128(codes + 64 * b, inner + 8 * b, x + 128 * b, 128);
    }
  });
}
// ---- TE RTN, BF16 input: the same search, thresholds from a checked window --------------------
//
// TE's element step is a product, not a quotient: the index of x is e2m1_rne_index(fl(|x| * enc))
// (enc = nvfp4_te_block_enc: finite, > 0) and its sign bit is set iff fl(x * enc) < 0, i.e. x < 0
// and fl(|x| * enc) > 0 (nvfp4_te_encode_rtn). Both are nondecreasing in |x|, so per block the
// search of the 2-level kernel applies with C_k = the smallest BF16 magnitude pattern b with P_k(b):
//   P_k(b): fl(b * enc) > T_k (odd k), >= T_k (even k), k = 1..7;   P_0(b): fl(b * enc) > 0,
// C_1..C_7 in slots 0-6, C_0 (the sign threshold) in slot 7. P_k(b) holds iff the real b lies
// above (or at) a boundary R_k = (T_k +- h_k) / enc, h_k half a binary32 ulp of T_k (as above).
// "Regular" blocks have enc in (2^-17, 2^64]. There d = fl(1 / enc) and r_k = fl(T_k * d) are
// normal binary32 values within relative 2^-22 of R_k, far inside the gap between neighbouring
// BF16 values (relative >= 2^-8). So with t the BF16 truncation of r_k (t <= r_k < t + 1 as
// patterns), t - 1 lies below R_k and t + 2 above it, and
//   C_k = t + [not P_k(t)] + [not P_k(t + 1)],
// with P_k evaluated by the reference's own binary32 multiply (t, t + 1 normal; the products lie
// next to T_k: no subnormal operand or result anywhere, which would cost microcode assists).
// C_0 = 1 (every nonzero magnitude): fl(2^-133 * enc) > 0 iff 2^-133 * enc > 2^-150 iff enc > 2^-17.
// An all-zero block (block max 0) is searched with enc = 1: its elements are +-0, below every
// threshold (index 0, no sign: -0.0 -> 0x0), as the reference gives. The other blocks, rare in practice (block max below about 2^-18.8 of the tensor amax, where the
// scale rounds to 0 and enc = FLT_MAX, or below about 6 * 2^-64; or block max above about
// 6 * 2^17), go through the search with enc = 1 (no subnormals) and are then quantized again by the
// per-block function, which overwrites their codes. Inf inputs stay on this path (Inf * enc = Inf:
// index 7); a group holding a NaN takes the per-block functions. Tested byte-equal to the per-block
// functions in quantize_cpu_avx512_test.cpp (every threshold of every block scale for many tensor
// amax values, planted at C_k - 1 and C_k; irregular and special blocks).

// Phase 2 (TE): the 16 scale bytes (written), the search's enc (lane b = block b; 1 in irregular
// and all-zero lanes) and the mask of irregular blocks, from the maxima bm; the steps of
// nvfp4_te_block_scale / nvfp4_te_block_enc. False (nothing written) for a NaN.
inline bool te_bf16_scales(uint8_t* scales, __m512i bm, const Nvfp4TeGlobal& g, __m512& enc_out, __mmask16& irregular) {
  if (_mm512_cmpgt_epu32_mask(bm, _mm512_set1_epi32(0x7F800000)) != 0) return false;
  const __m512 e = te_scales16(scales, bm, g);
  const __mmask16 regular = _mm512_cmp_ps_mask(e, _mm512_set1_ps(0x1p-17f), _CMP_GT_OQ) &
                            _mm512_cmp_ps_mask(e, _mm512_set1_ps(0x1p64f), _CMP_LE_OQ);
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(bm, _mm512_setzero_si512());
  irregular = static_cast<__mmask16>(~(regular | zero));
  enc_out = _mm512_mask_blend_ps(regular, _mm512_set1_ps(1.0f), e);
  return true;
}

// Phase 3 (TE): the thresholds C_0..C_7 of the 16 blocks (search enc) and the search tables.
inline void te_bf16_tables(__m512i* tab, __m512 enc) {
  const __m512 d = _mm512_div_ps(_mm512_set1_ps(1.0f), enc);
  const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), step = _mm512_set1_epi32(0x10000);
  // C_k as binary32 bits (pattern << 16): t + [not P(t)] + [not P(t + 1)], t from r = fl(T * d).
  auto threshold = [&](float T, auto cmp) {
    const __m512 r = _mm512_mul_ps(_mm512_set1_ps(T), d);
    const __m512i b0 = _mm512_and_si512(_mm512_castps_si512(r), hi16);
    const __m512i b1 = _mm512_add_epi32(b0, step);
    const __mmask16 p0 = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_castsi512_ps(b0), enc), _mm512_set1_ps(T), decltype(cmp)::value);
    const __mmask16 p1 = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_castsi512_ps(b1), enc), _mm512_set1_ps(T), decltype(cmp)::value);
    const __m512i c = _mm512_mask_add_epi32(b0, static_cast<__mmask16>(~p0), b0, step);
    return _mm512_mask_add_epi32(c, static_cast<__mmask16>(~p1), c, step);
  };
  const std::integral_constant<int, _CMP_GT_OQ> odd;  // index >= k iff fl(|x| * enc) > T_k
  const std::integral_constant<int, _CMP_GE_OQ> even;  // ... >= T_k (ties to the even code)
  // pr[j] = C_{2j+1} | C_{2j+2} << 16; pr[3] = C_7 | C_0 << 16 with C_0 = 1.
  auto pair = [](__m512i lo_bits, __m512i hi_bits) { return _mm512_or_si512(_mm512_srli_epi32(lo_bits, 16), hi_bits); };
  const __m512i pr[4] = {pair(threshold(0.25f, odd), threshold(0.75f, even)), pair(threshold(1.25f, odd), threshold(1.75f, even)),
                         pair(threshold(2.5f, odd), threshold(3.5f, even)), pair(threshold(5.0f, odd), _mm512_set1_epi32(0x10000))};
  bf16_search_tables(tab, pr);
}

// TE RTN of ngroups consecutive 256-groups of a BF16 row (codes 128, scales 16 per group), phase by
// phase over chunks (bf16_row_in_chunks). A group holding a NaN, and an irregular block (above),
// take the per-block functions of nvfp4.h.
inline void te_row_bf16_avx512(uint8_t* codes, uint8_t* scales, const uint16_t* x, int64_t ngroups,
                               const Nvfp4TeGlobal& g) {
  bf16_row_in_chunks(x, ngroups, [&](int64_t g0, int64_t n, const __m512i* bm) {
    __m512i tab[16][8];
    __m512 enc[16];
    __mmask16 irregular[16];
    bool ok[16];
    for (int64_t j = 0; j < n; ++j) ok[j] = te_bf16_scales(scales + 16 * (g0 + j), bm[j], g, enc[j], irregular[j]);
    for (int64_t j = 0; j < n; ++j)
      if (ok[j]) te_bf16_tables(tab[j], enc[j]);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = 16 * (g0 + j);  // first 16-block of the group
      prefetch_group_ahead(x + 16 * b, 512);
      uint32_t redo = 0xFFFFu;  // blocks for the per-block function
      if (ok[j]) {
        bf16_threshold_codes<true>(codes + 8 * b, x + 16 * b, tab[j]);
        redo = irregular[j];
      }
      for (; redo != 0; redo &= redo - 1) {
        const int64_t k = b + __builtin_ctz(redo);
        scales[k] = static_cast<uint8_t>(nvfp4_te_quantize_block16(codes + 8 * k, x + 16 * k, block_amax(x + 16 * k, 16), g));
      }
    }
  });
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
