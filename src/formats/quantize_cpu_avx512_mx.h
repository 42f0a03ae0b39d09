// AVX-512 (F+BW) row kernels of the MX RTN drivers for BF16 input (mx.h): MXFP4 under all three
// scale rules, MXFP8 under floor and RCEIL. Included by quantize_cpu.cpp inside its anonymous
// namespace after quantize_cpu_avx512.h (whose BF16 maxima tree, search tables and threshold
// search this file reuses) and the 16-lane E8M0 rules (mx_scale_byte16). Every byte equals the
// per-block functions of mx.h (tested in quantize_cpu_avx512_test.cpp).
//
// Unit: a 512-group = 16 MX blocks of 32 elements; one 512-bit vector of BF16 words is one block.
// The MX element step multiplies by inv = 2^s, s = 127 - byte (e8m0_inverse; byte <= 253 for a
// finite block maximum under every rule), which is exact wherever it matters:
//  - MXFP4: index >= k iff fl(|x| * 2^s) > T_k (odd k) / >= T_k (even k), T_k = 0.25 0.75 1.25
//    1.75 2.5 3.5 5 (e2m1_rne_index). Next to T_k the product is a normal binary32, so exact, and
//    the real comparison |x| > T_k * 2^-s decides. T_k has at most 3 significant bits, so
//    T_k * 2^-s is a BF16 value (normal, or subnormal with the low bits zero: s <= 127 and
//    T_k >= 2^-2 keep it >= 2^-129) unless it overflows (never reached: C_k = 0x7FFF). So
//    C_k = pattern(T_k * 2^-s) + 1 (odd k) or pattern(T_k * 2^-s) (even k), in closed form:
//    exponent field E = E(T_k) - s; E >= 1: (E << 7) | mantissa(T_k); E in [-2, 0]: the
//    significand (0x80 | mantissa) >> (1 - E) (exact: its low 5 bits are 0).
//    te-ceil's sign bit (TE convention: fl(x * 2^s) < 0) needs |x| * 2^s > 2^-150 (a product of
//    2^-150 rounds to 0): C_0 = pattern(2^(-150 - s)) + 1 when 2^(-150 - s) >= 2^-133, else 1
//    (every nonzero BF16). floor and RCEIL use signbit(x).
//    The codes then come from quantize_cpu_avx512.h's search (bf16_threshold_codes) with one
//    table per block broadcast to the vector's four 128-bit lanes.
//  - MXFP8: e4m3_rne_sat(|x| * 2^s) from the BF16 bits, 32 words per instruction: for a normal
//    BF16 |x| = sig * 2^(E - 134) (sig = 0x80 | mantissa), with u = E - 121 + s (so that the E4M3
//    quantum of the product is 2^(E - 130 + s) when u >= 0, and the subnormal quantum 2^-9 when
//    u < 0): k = 4 + max(-u, 0), n = RNE(sig / 2^k), code = n + 8 * max(u, 0), saturated at 0x7E
//    (a carry n = 16 moves into the next binade exactly as the E4M3 bit pattern does). For
//    BF16-subnormal |x| and s <= 116 the product is below 2^-10 (code 0): the same formula gives 0
//    (sig < 128 and k >= 8). Zero magnitudes give 0. A group with a block whose byte is below 11
//    (s > 116) and maximum nonzero takes the per-block functions (such a block's subnormal
//    elements could round to a nonzero code), as does a group holding a NaN or Inf.
#pragma once

#if NIBBLE_FORMATS_AVX512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Block maxima of the 16 MX blocks of a 512-group (lane j = block j) as binary32 bits: the 16-block
// maxima of each half (avx512_bf16_block_maxima), then the max of adjacent lanes.
inline __m512i mx_bf16_group_maxima(const uint16_t* x) {
  __m512i a[8];
  __m512i m16[2];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 8; ++i) a[i] = _mm512_and_si512(_mm512_loadu_si512(x + 256 * h + 32 * i), _mm512_set1_epi16(0x7FFF));
    m16[h] = avx512_bf16_block_maxima(a);
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_max_epu32(_mm512_permutex2var_epi32(m16[0], even, m16[1]),
                          _mm512_permutex2var_epi32(m16[0], _mm512_add_epi32(even, _mm512_set1_epi32(1)), m16[1]));
}

// MXFP4 thresholds of 16 blocks (scale bytes, lane j = block j) paired as 16-bit halves
// (pr[j] = C_{2j+1} | C_{2j+2} << 16, pr[3] = C_7 | C_0 << 16; C_0 = 0x7FFF unless te_sign).
inline void mx4_bf16_thresholds(__m512i* pr, __m512i byte, bool te_sign) {
  const __m512i m = _mm512_sub_epi32(byte, _mm512_set1_epi32(127));  // -s: T * 2^-s = T * 2^m
  const __m512i one = _mm512_set1_epi32(1), never = _mm512_set1_epi32(0x7FFF);
  // pattern(T * 2^m) (+ 1 for odd k) for T with BF16 exponent field e_t and mantissa mant.
  auto c = [&](int e_t, int mant, int odd) {
    const __m512i e = _mm512_add_epi32(m, _mm512_set1_epi32(e_t));
    const __m512i normal = _mm512_or_si512(_mm512_slli_epi32(e, 7), _mm512_set1_epi32(mant));
    const __m512i sub = _mm512_srlv_epi32(_mm512_set1_epi32(0x80 | mant), _mm512_sub_epi32(one, e));
    const __mmask16 is_normal = _mm512_cmpgt_epi32_mask(e, _mm512_setzero_si512());
    const __mmask16 overflow = _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(254));
    const __m512i p = _mm512_add_epi32(_mm512_mask_blend_epi32(is_normal, sub, normal), _mm512_set1_epi32(odd));
    return _mm512_mask_blend_epi32(overflow, p, never);
  };
  auto pair = [](__m512i lo, __m512i hi) { return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)); };
  __m512i c0 = never;
  if (te_sign) {  // C_0 = pattern(2^q) + 1, q = -150 - s = byte - 277, or 1 when q < -133
    const __m512i q = _mm512_sub_epi32(byte, _mm512_set1_epi32(277));
    const __m512i normal = _mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(127)), 7);
    const __m512i sub = _mm512_sllv_epi32(one, _mm512_add_epi32(q, _mm512_set1_epi32(133)));
    const __m512i p = _mm512_mask_blend_epi32(_mm512_cmpge_epi32_mask(q, _mm512_set1_epi32(-126)), sub, normal);
    c0 = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(q, _mm512_set1_epi32(-133)), _mm512_add_epi32(p, one), one);
  }
  // T = 0.25 0.75 1.25 1.75 2.5 3.5 5: BF16 0x3E80 0x3F40 0x3FA0 0x3FE0 0x4020 0x4060 0x40A0.
  pr[0] = pair(c(125, 0x00, 1), c(126, 0x40, 0));
  pr[1] = pair(c(127, 0x20, 1), c(127, 0x60, 0));
  pr[2] = pair(c(128, 0x20, 1), c(128, 0x60, 0));
  pr[3] = pair(c(129, 0x20, 1), c0);
}

// The 16 search tables of a 512-group (table j in all four 128-bit lanes of tab[j]: block j).
inline void mx_bf16_search_tables(__m512i* tab, const __m512i* pr) {
  __m512i rs[4];
  bf16_split_tables(rs, pr);
  for (int q = 0; q < 4; ++q) {  // block j = 4L + q sits in lane L of rs[q]
    tab[q] = _mm512_shuffle_i32x4(rs[q], rs[q], 0x00);
    tab[4 + q] = _mm512_shuffle_i32x4(rs[q], rs[q], 0x55);
    tab[8 + q] = _mm512_shuffle_i32x4(rs[q], rs[q], 0xAA);
    tab[12 + q] = _mm512_shuffle_i32x4(rs[q], rs[q], 0xFF);
  }
}

// MXFP8 elements of one block (32 BF16 words x) with s = 127 - byte: 32 bytes (see the top).
inline void mx8_bf16_block(uint8_t* out, const uint16_t* x, int s) {
  const __m512i w = _mm512_loadu_si512(x);
  const __m512i a = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
  const __m512i e = _mm512_srli_epi16(a, 7);
  const __m512i mant = _mm512_and_si512(a, _mm512_set1_epi16(0x7F));
  const __m512i sig = _mm512_mask_add_epi16(mant, _mm512_test_epi16_mask(e, e), mant, _mm512_set1_epi16(0x80));
  const __m512i u = _mm512_add_epi16(_mm512_max_epi16(e, _mm512_set1_epi16(1)), _mm512_set1_epi16(static_cast<int16_t>(s - 121)));
  const __m512i up = _mm512_max_epi16(u, _mm512_setzero_si512());
  const __m512i k = _mm512_add_epi16(_mm512_sub_epi16(up, u), _mm512_set1_epi16(4));  // 4 + max(-u, 0)
  // RNE(sig / 2^k): (sig + 2^(k-1) - 1 + bit k of sig) >> k (counts >= 16 shift to 0).
  const __m512i half_m1 = _mm512_sub_epi16(_mm512_sllv_epi16(_mm512_set1_epi16(1), _mm512_sub_epi16(k, _mm512_set1_epi16(1))),
                                           _mm512_set1_epi16(1));
  const __m512i odd = _mm512_and_si512(_mm512_srlv_epi16(sig, k), _mm512_set1_epi16(1));
  const __m512i n = _mm512_srlv_epi16(_mm512_add_epi16(_mm512_add_epi16(sig, half_m1), odd), k);
  __m512i code = _mm512_min_epu16(_mm512_add_epi16(n, _mm512_slli_epi16(up, 3)), _mm512_set1_epi16(0x7E));
  code = _mm512_maskz_mov_epi16(_mm512_test_epi16_mask(a, a), code);                    // zero -> 0
  code = _mm512_or_si512(code, _mm512_srli_epi16(_mm512_andnot_si512(a, w), 8));           // sign -> bit 7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi16_epi8(code));
}

// MX RTN of ngroups consecutive 512-groups of a BF16 row: MXFP4 codes (256 bytes per group) or
// MXFP8 elements (512), scales (16 per group). Groups go in chunks of 4, one phase at a time over
// the chunk (as twolevel_row_bf16_avx512: the phases of one group form a long dependency chain).
// A group holding a NaN or Inf (and for MXFP8 a nonzero block with byte < 11) takes the per-block
// functions of mx.h.
inline void mx_row_bf16_avx512(uint8_t* out, uint8_t* scales, const uint16_t* x, int64_t ngroups, MxScaleRule rule,
                               bool fp8) {
  constexpr int64_t kChunk = 4;
  __m512i byte[kChunk], tab[kChunk][16];
  bool ok[kChunk];
  const bool te_sign = rule == MxScaleRule::kTeCeil;
  for (int64_t g0 = 0; g0 < ngroups; g0 += kChunk) {
    const int64_t n = ngroups - g0 < kChunk ? ngroups - g0 : kChunk;
    for (int64_t j = 0; j < n; ++j) {
      const __m512i bm = mx_bf16_group_maxima(x + 512 * (g0 + j));
      byte[j] = (__m512i)mx_scale_byte16((v16f)_mm512_castsi512_ps(bm), rule, fp8);
      ok[j] = _mm512_cmpge_epu32_mask(bm, _mm512_set1_epi32(0x7F800000)) == 0;  // no NaN / Inf
      if (fp8)  // a nonzero block maximum with byte < 11: subnormal elements may count
        ok[j] = ok[j] && (_mm512_cmplt_epi32_mask(byte[j], _mm512_set1_epi32(11)) & _mm512_test_epi32_mask(bm, bm)) == 0;
    }
    if (!fp8)
      for (int64_t j = 0; j < n; ++j) {
        __m512i pr[4];
        mx4_bf16_thresholds(pr, byte[j], te_sign);
        mx_bf16_search_tables(tab[j], pr);
      }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t gi = g0 + j;
      const uint16_t* xg = x + 512 * gi;
      uint8_t* sg = scales + 16 * gi;
      prefetch_group_ahead(xg, 1024);
      if (!ok[j]) {
        for (int b = 0; b < 16; ++b)
          sg[b] = static_cast<uint8_t>(fp8 ? mxfp8_quantize_block32(out + 512 * gi + 32 * b, xg + 32 * b, rule)
                                           : mxfp4_quantize_block32(out + 256 * gi + 16 * b, xg + 32 * b, rule));
        continue;
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sg), _mm512_cvtepi32_epi8(byte[j]));
      if (fp8) {
        alignas(64) int32_t s[16];
        _mm512_store_si512(s, _mm512_sub_epi32(_mm512_set1_epi32(127), byte[j]));
        for (int b = 0; b < 16; ++b) mx8_bf16_block(out + 512 * gi + 32 * b, xg + 32 * b, s[b]);
      } else if (te_sign) {
        bf16_threshold_codes<true, 16>(out + 256 * gi, xg, tab[j]);
      } else {
        bf16_threshold_codes<false, 16>(out + 256 * gi, xg, tab[j]);
      }
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
