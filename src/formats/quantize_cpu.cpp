// CPU drivers of quantize_cpu.h: loop over the host+device per-element/per-block functions of
// nvfp4.h, mx.h, rht.h and guided.h, threaded over rows with parallel_for. The hot RTN paths
// (TE and 2-level, f32/bf16 input) process blocks structure-of-arrays (all block maxima, then
// all scales, then all elements) so GCC vectorises each loop; they call the very same scalar
// functions, so results are bit-identical to the per-block functions the GPU runs.
#include "formats/quantize_cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/parallel.h"
#include "formats/rht.h"

namespace nibble::formats {
namespace {

// Rows per parallel chunk so that a chunk holds at least ~64K elements.
int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1)); }

#if defined(__GNUC__) && !defined(NIBBLE_FORMATS_SCALAR_ONLY) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
// GCC/Clang vector extensions (portable C++ with a scalar fallback below): 16 lanes of the same
// IEEE binary32 operations as the scalar functions in nvfp4.h/e2m1.h, so the bits are identical
// (checked by formats_test against the per-block functions).
#define NIBBLE_FORMATS_VEC16 1
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint64_t v8q __attribute__((vector_size(64)));
typedef uint8_t v8b __attribute__((vector_size(8)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16f load16(const uint16_t* p) {  // BF16 bits -> binary32 (exact)
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  return (v16f)(u);
}
inline v16f vabs(v16f v) {
  v16u u = (v16u)(v) & 0x7FFFFFFFu;
  return (v16f)(u);
}
inline v16u vsignbit(v16f v) { return (v16u)(v) >> 31; }
// max over lanes of |values| with NaN lanes ignored (= the sequential amax_update result).
inline float hmax_abs16(v16f a) {
  a = vabs(a);
  a = a == a ? a : 0.0f;
  v8f lo, hi;
  std::memcpy(&lo, &a, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + 32, 32);
  v8f m8 = lo > hi ? lo : hi;
  v4f l4, h4;
  std::memcpy(&l4, &m8, 16);
  std::memcpy(&h4, reinterpret_cast<const char*>(&m8) + 16, 16);
  v4f m4 = l4 > h4 ? l4 : h4;
  float m = 0.0f;
  for (int i = 0; i < 4; ++i) m = m4[i] > m ? m4[i] : m;
  return m;
}
// e2m1_rne_index on 16 lanes (a >= 0 or NaN).
inline v16u e2m1_rne_index16(v16f a) {
  v16i s = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return (v16u)(-s);
}
// 16 codes -> 8 packed bytes (even element low nibble); little-endian lane pairing.
inline void pack16(uint8_t* out, v16u code) {
  v8q q = (v8q)(code);
  v8q p = (q & 0xFu) | ((q >> 32) << 4);
  v8b b = __builtin_convertvector(p, v8b);
  std::memcpy(out, &b, 8);
}
#endif

template <typename In>
float amax_impl(const In* x, int64_t n) {
  constexpr int64_t kChunk = int64_t{1} << 16;
  int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<float> part(static_cast<size_t>(std::max<int64_t>(chunks, 1)), 0.0f);
  parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const In* p = x + c * kChunk;
      int64_t len = std::min(kChunk, n - c * kChunk);
      // 16 independent lanes so the reduction vectorises (max is order-independent).
      float lane[16] = {};
      int64_t i = 0;
      for (; i + 16 <= len; i += 16)
        for (int j = 0; j < 16; ++j) lane[j] = amax_update(lane[j], load_f32(p[i + j]));
      float m = 0.0f;
      for (; i < len; ++i) m = amax_update(m, load_f32(p[i]));
      for (int j = 0; j < 16; ++j) m = amax_update(m, lane[j]);
      part[static_cast<size_t>(c)] = m;
    }
  });
  float m = 0.0f;
  for (float v : part) m = amax_update(m, v);
  return m;
}

// ---- TE ----------------------------------------------------------------------------------------

// One row of K elements, RTN.
#if NIBBLE_FORMATS_VEC16
template <typename In>
void te_row_rtn(uint8_t* codes, uint8_t* scales, const In* x, int64_t K, const Nvfp4TeGlobal& g) {
  for (int64_t b = 0; b < K / 16; ++b) {
    v16f xv = load16(x + 16 * b);
    uint32_t s = nvfp4_te_block_scale(hmax_abs16(xv), g);
    float enc = nvfp4_te_block_enc(s, g);
    v16f v = xv * enc;
    v16i neg = v < 0.0f;
    v16u code = e2m1_rne_index16(vabs(v)) | ((v16u)(neg) & 8u);
    pack16(codes + 8 * b, code);
    scales[b] = static_cast<uint8_t>(s);
  }
}
#else
template <typename In>
void te_row_rtn(uint8_t* codes, uint8_t* scales, const In* x, int64_t K, const Nvfp4TeGlobal& g) {
  constexpr int kGroup = 16;
  int64_t nb = K / 16;
  for (int64_t b0 = 0; b0 < nb; b0 += kGroup) {
    int gb = static_cast<int>(std::min<int64_t>(kGroup, nb - b0));
    const In* xg = x + b0 * 16;
    float bamax[kGroup];
    for (int b = 0; b < gb; ++b) {
      float m = 0.0f;
      for (int i = 0; i < 16; ++i) m = amax_update(m, load_f32(xg[16 * b + i]));
      bamax[b] = m;
    }
    float enc[kGroup];
    uint8_t s[kGroup];
    for (int b = 0; b < gb; ++b) {
      uint32_t sb = nvfp4_te_block_scale(bamax[b], g);
      s[b] = static_cast<uint8_t>(sb);
      enc[b] = nvfp4_te_block_enc(sb, g);
    }
    for (int b = 0; b < gb; ++b) scales[b0 + b] = s[b];
    uint8_t* cg = codes + b0 * 8;
    for (int b = 0; b < gb; ++b) {
      float e = enc[b];
      for (int i = 0; i < 8; ++i) {
        uint32_t lo = nvfp4_te_encode_rtn(load_f32(xg[16 * b + 2 * i]), e);
        uint32_t hi = nvfp4_te_encode_rtn(load_f32(xg[16 * b + 2 * i + 1]), e);
        cg[8 * b + i] = e2m1_pack(lo, hi);
      }
    }
  }
}

#endif

template <typename In>
void te_quantize_impl(uint8_t* codes, uint8_t* scales, const In* x, int64_t M, int64_t K, float amax,
                      const SrKey* sr) {
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4: K={} must be a multiple of 16", K);
  Nvfp4TeGlobal g = nvfp4_te_global(amax);
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const In* xr = x + r * K;
      uint8_t* cr = codes + r * (K / 2);
      uint8_t* sr_row = scales + r * (K / 16);
      if (sr == nullptr) {
        te_row_rtn(cr, sr_row, xr, K, g);
      } else {
        for (int64_t b = 0; b < K / 16; ++b)
          sr_row[b] = static_cast<uint8_t>(
              nvfp4_te_quantize_block16(cr + 8 * b, xr + 16 * b, block_amax(xr + 16 * b, 16), g, sr, r * K + 16 * b));
      }
    }
  });
}

// ---- 2-level -------------------------------------------------------------------------------------

#if NIBBLE_FORMATS_VEC16
// RTN row of whole 128-blocks (K % 128 == 0), vectorised; bit-identical to twolevel_row.
template <typename In>
void twolevel_row_rtn_vec(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t K) {
  for (int64_t o = 0; o < K / 128; ++o) {
    v16f xv[8];
    float bamax[8];
    float amax = 0.0f;
    for (int b = 0; b < 8; ++b) {
      xv[b] = load16(x + 128 * o + 16 * b);
      bamax[b] = hmax_abs16(xv[b]);
      amax = amax_update(amax, bamax[b]);
    }
    float so = nvfp4_2level_outer_scale(amax);
    outer[o] = so;
    for (int b = 0; b < 8; ++b) {
      uint32_t si = nvfp4_2level_inner_scale(bamax[b], so);
      inner[8 * o + b] = static_cast<uint8_t>(si);
      float sp = nvfp4_2level_block_scale(si, so);
      v16u sign = vsignbit(xv[b]) << 3;
      v16u code = sp == 0.0f ? sign : (e2m1_rne_index16(vabs(xv[b]) / sp) | sign);
      pack16(codes + 64 * o + 8 * b, code);
    }
  }
}
#endif

template <typename In>
void twolevel_row(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t K, const SrKey* sr,
                  uint64_t index0) {
  int64_t nb = K / 16;
  for (int64_t o = 0; o * 128 < K; ++o) {
    int64_t b0 = o * 8;
    int gb = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const In* xg = x + b0 * 16;
    float bamax[8];
    float amax = 0.0f;
    for (int b = 0; b < gb; ++b) {
      float m = 0.0f;
      for (int i = 0; i < 16; ++i) m = amax_update(m, load_f32(xg[16 * b + i]));
      bamax[b] = m;
      amax = amax_update(amax, m);
    }
    float so = nvfp4_2level_outer_scale(amax);
    outer[o] = so;
    float sp[8];
    for (int b = 0; b < gb; ++b) {
      uint32_t si = nvfp4_2level_inner_scale(bamax[b], so);
      inner[b0 + b] = static_cast<uint8_t>(si);
      sp[b] = nvfp4_2level_block_scale(si, so);
    }
    uint8_t* cg = codes + b0 * 8;
    if (sr == nullptr) {
      for (int b = 0; b < gb; ++b) {
        float p = sp[b];
        for (int i = 0; i < 8; ++i) {
          uint32_t lo = nvfp4_2level_encode_rtn(load_f32(xg[16 * b + 2 * i]), p);
          uint32_t hi = nvfp4_2level_encode_rtn(load_f32(xg[16 * b + 2 * i + 1]), p);
          cg[8 * b + i] = e2m1_pack(lo, hi);
        }
      }
    } else {
      for (int b = 0; b < gb; ++b) {
        float p = sp[b];
        uint64_t i0 = index0 + static_cast<uint64_t>((b0 + b) * 16);
        for (int i = 0; i < 8; ++i) {
          uint32_t lo = nvfp4_2level_encode_sr(load_f32(xg[16 * b + 2 * i]), p, sr_uniform(*sr, i0 + 2 * i));
          uint32_t hi = nvfp4_2level_encode_sr(load_f32(xg[16 * b + 2 * i + 1]), p, sr_uniform(*sr, i0 + 2 * i + 1));
          cg[8 * b + i] = e2m1_pack(lo, hi);
        }
      }
    }
  }
}

template <typename In>
void twolevel_quantize_impl(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t M, int64_t K,
                            const SrKey* sr) {
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4-2level: K={} must be a multiple of 16", K);
  int64_t no = (K + 127) / 128;
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#if NIBBLE_FORMATS_VEC16
      if (sr == nullptr && K % 128 == 0) {
        twolevel_row_rtn_vec(codes + r * (K / 2), inner + r * (K / 16), outer + r * no, x + r * K, K);
        continue;
      }
#endif
      twolevel_row(codes + r * (K / 2), inner + r * (K / 16), outer + r * no, x + r * K, K, sr,
                   static_cast<uint64_t>(r * K));
    }
  });
}

// ---- MX -----------------------------------------------------------------------------------------

template <typename In>
void mxfp4_quantize_impl(uint8_t* codes, uint8_t* scales, const In* x, int64_t M, int64_t K, MxScaleRule rule,
                         const SrKey* sr) {
  NIB_CHECK_MSG(K % 32 == 0, "mxfp4: K={} must be a multiple of 32", K);
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / 32; ++b)
        scales[r * (K / 32) + b] = static_cast<uint8_t>(
            mxfp4_quantize_block32(codes + r * (K / 2) + 16 * b, x + r * K + 32 * b, rule, sr,
                                   static_cast<uint64_t>(r * K + 32 * b)));
  });
}

template <typename In>
void mxfp8_quantize_impl(uint8_t* elems, uint8_t* scales, const In* x, int64_t M, int64_t K, MxScaleRule rule) {
  NIB_CHECK_MSG(K % 32 == 0, "mxfp8: K={} must be a multiple of 32", K);
  NIB_CHECK_MSG(rule != MxScaleRule::kTeCeil, "mxfp8: the te-ceil rule is MXFP4 only");
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / 32; ++b)
        scales[r * (K / 32) + b] =
            static_cast<uint8_t>(mxfp8_quantize_block32(elems + r * K + 32 * b, x + r * K + 32 * b, rule));
  });
}

}  // namespace

float amax_cpu(const float* x, int64_t n) { return amax_impl(x, n); }
float amax_cpu(const uint16_t* x_bf16, int64_t n) { return amax_impl(x_bf16, n); }

void nvfp4_te_quantize_with_amax_cpu(uint8_t* codes, uint8_t* scales, const float* x, int64_t M, int64_t K, float amax,
                                     const SrKey* sr) {
  te_quantize_impl(codes, scales, x, M, K, amax, sr);
}
void nvfp4_te_quantize_with_amax_cpu(uint8_t* codes, uint8_t* scales, const uint16_t* x, int64_t M, int64_t K,
                                     float amax, const SrKey* sr) {
  te_quantize_impl(codes, scales, x, M, K, amax, sr);
}
float nvfp4_te_quantize_cpu(uint8_t* codes, uint8_t* scales, const float* x, int64_t M, int64_t K, const SrKey* sr) {
  float amax = amax_cpu(x, M * K);
  te_quantize_impl(codes, scales, x, M, K, amax, sr);
  return amax;
}
float nvfp4_te_quantize_cpu(uint8_t* codes, uint8_t* scales, const uint16_t* x, int64_t M, int64_t K,
                            const SrKey* sr) {
  float amax = amax_cpu(x, M * K);
  te_quantize_impl(codes, scales, x, M, K, amax, sr);
  return amax;
}

void nvfp4_te_dequantize_cpu(float* y, const uint8_t* codes, const uint8_t* scales, float amax, int64_t M, int64_t K) {
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4: K={} must be a multiple of 16", K);
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / 16; ++b)
        nvfp4_te_dequantize_block16(y + r * K + 16 * b, codes + r * (K / 2) + 8 * b, scales[r * (K / 16) + b], amax);
  });
}

float nvfp4_te_quantize_2d_cpu(uint8_t* codes, uint8_t* scales, uint8_t* codes_t, uint8_t* scales_t, const float* x,
                               int64_t M, int64_t K) {
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4 2-D: K={} must be a multiple of 16", K);
  NIB_CHECK_MSG(codes_t == nullptr || M % 2 == 0, "nvfp4 2-D: columnwise codes need an even M, got {}", M);
  float amax = amax_cpu(x, M * K);
  Nvfp4TeGlobal g = nvfp4_te_global(amax);
  int64_t tr = (M + 15) / 16, tc = K / 16, mt = (M + 15) / 16;
  std::vector<uint8_t> tile_scale(static_cast<size_t>(tr * tc));
  parallel_for(tr, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t rows = std::min<int64_t>(16, M - 16 * t);
      for (int64_t j = 0; j < tc; ++j) {
        float m = 0.0f;  // zero padding does not change the tile amax
        for (int64_t r = 0; r < rows; ++r) m = amax_update(m, block_amax(x + (16 * t + r) * K + 16 * j, 16));
        uint32_t s = nvfp4_te_block_scale(m, g);
        tile_scale[static_cast<size_t>(t * tc + j)] = static_cast<uint8_t>(s);
        float enc = nvfp4_te_block_enc(s, g);
        for (int64_t r = 0; r < rows; ++r) {
          int64_t row = 16 * t + r;
          scales[row * tc + j] = static_cast<uint8_t>(s);
          for (int i = 0; i < 8; ++i)
            codes[row * (K / 2) + 8 * j + i] = e2m1_pack(nvfp4_te_encode_rtn(x[row * K + 16 * j + 2 * i], enc),
                                                         nvfp4_te_encode_rtn(x[row * K + 16 * j + 2 * i + 1], enc));
        }
      }
    }
  });
  if (codes_t != nullptr || scales_t != nullptr) {
    parallel_for(K, row_grain(M), [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        int64_t j = k / 16;
        if (scales_t != nullptr)
          for (int64_t t = 0; t < mt; ++t) scales_t[k * mt + t] = tile_scale[static_cast<size_t>(t * tc + j)];
        if (codes_t != nullptr)
          for (int64_t m = 0; m < M; m += 2) {
            float e0 = nvfp4_te_block_enc(tile_scale[static_cast<size_t>((m / 16) * tc + j)], g);
            float e1 = nvfp4_te_block_enc(tile_scale[static_cast<size_t>(((m + 1) / 16) * tc + j)], g);
            codes_t[k * (M / 2) + m / 2] =
                e2m1_pack(nvfp4_te_encode_rtn(x[m * K + k], e0), nvfp4_te_encode_rtn(x[(m + 1) * K + k], e1));
          }
      }
    });
  }
  return amax;
}

void nvfp4_2level_quantize_cpu(uint8_t* codes, uint8_t* inner, float* outer, const float* x, int64_t M, int64_t K,
                               const SrKey* sr) {
  twolevel_quantize_impl(codes, inner, outer, x, M, K, sr);
}
void nvfp4_2level_quantize_cpu(uint8_t* codes, uint8_t* inner, float* outer, const uint16_t* x, int64_t M, int64_t K,
                               const SrKey* sr) {
  twolevel_quantize_impl(codes, inner, outer, x, M, K, sr);
}
void nvfp4_2level_dequantize_cpu(float* y, const uint8_t* codes, const uint8_t* inner, const float* outer, int64_t M,
                                 int64_t K) {
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4-2level: K={} must be a multiple of 16", K);
  int64_t no = (K + 127) / 128;
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = 0; o < no; ++o) {
        int n = static_cast<int>(std::min<int64_t>(128, K - 128 * o));
        nvfp4_2level_dequantize_block128(y + r * K + 128 * o, codes + r * (K / 2) + 64 * o, inner + r * (K / 16) + 8 * o,
                                         outer[r * no + o], n);
      }
  });
}

void mxfp4_quantize_cpu(uint8_t* codes, uint8_t* scales, const float* x, int64_t M, int64_t K, MxScaleRule rule,
                        const SrKey* sr) {
  mxfp4_quantize_impl(codes, scales, x, M, K, rule, sr);
}
void mxfp4_quantize_cpu(uint8_t* codes, uint8_t* scales, const uint16_t* x, int64_t M, int64_t K, MxScaleRule rule,
                        const SrKey* sr) {
  mxfp4_quantize_impl(codes, scales, x, M, K, rule, sr);
}
void mxfp4_dequantize_cpu(float* y, const uint8_t* codes, const uint8_t* scales, int64_t M, int64_t K) {
  NIB_CHECK_MSG(K % 32 == 0, "mxfp4: K={} must be a multiple of 32", K);
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / 32; ++b)
        mxfp4_dequantize_block32(y + r * K + 32 * b, codes + r * (K / 2) + 16 * b, scales[r * (K / 32) + b]);
  });
}
void mxfp8_quantize_cpu(uint8_t* elems, uint8_t* scales, const float* x, int64_t M, int64_t K, MxScaleRule rule) {
  mxfp8_quantize_impl(elems, scales, x, M, K, rule);
}
void mxfp8_quantize_cpu(uint8_t* elems, uint8_t* scales, const uint16_t* x, int64_t M, int64_t K, MxScaleRule rule) {
  mxfp8_quantize_impl(elems, scales, x, M, K, rule);
}
void mxfp8_dequantize_cpu(float* y, const uint8_t* elems, const uint8_t* scales, int64_t M, int64_t K) {
  NIB_CHECK_MSG(K % 32 == 0, "mxfp8: K={} must be a multiple of 32", K);
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / 32; ++b)
        mxfp8_dequantize_block32(y + r * K + 32 * b, elems + r * K + 32 * b, scales[r * (K / 32) + b]);
  });
}

// ---- RHT -------------------------------------------------------------------------------------------

void rht16_te_transpose_cpu(uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K) {
  NIB_CHECK_MSG(M % 16 == 0, "rht16: M={} must be a multiple of 16", M);
  parallel_for(K, row_grain(M), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t g = 0; g < M / 16; ++g) {
        float t[16];
        for (int i = 0; i < 16; ++i) t[i] = bf16_bits_to_f32(x[(16 * g + i) * K + k]);
        rht16_bf16_exact(y_t + k * M + 16 * g, t, kRhtTeSignMask);
      }
  });
}

float nvfp4_te_quantize_rht_t_cpu(uint8_t* codes_t, uint8_t* scales_t, uint16_t* y_t, const uint16_t* x, int64_t M,
                                  int64_t K, const SrKey* sr) {
  rht16_te_transpose_cpu(y_t, x, M, K);
  return nvfp4_te_quantize_cpu(codes_t, scales_t, y_t, K, M, sr);
}

void rht16_rows_f32_cpu(float* y, const float* x, int64_t rows, int64_t cols, uint32_t sign_mask) {
  NIB_CHECK_MSG(cols % 16 == 0, "rht16: cols={} must be a multiple of 16", cols);
  parallel_for(rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < cols / 16; ++g) rht16_f32(y + r * cols + 16 * g, x + r * cols + 16 * g, sign_mask);
  });
}

// ---- fused backward operand ---------------------------------------------------------------------------

void nvfp4_2level_backward_operand_cpu(uint8_t* codes_t, uint8_t* inner_t, float* outer_t, const uint8_t* codes,
                                       const uint8_t* inner, const float* outer, int64_t M, int64_t K,
                                       uint32_t sign_mask, const SrKey& sr) {
  NIB_CHECK_MSG(M % 128 == 0, "nvfp4-2level backward operand: M={} must be a multiple of 128", M);
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4-2level backward operand: K={} must be a multiple of 16", K);
  int64_t no_in = (K + 127) / 128, mt = M / 128, kt = K / 16;
  // One task = a 128 (m) x 16 (k) tile: decode 128 input rows' 16-element blocks, transpose to
  // 16 output rows of 128, RHT each 16-group, requantize each as one 128-block with SR.
  parallel_for(mt * kt, 1, [&](int64_t t0, int64_t t1) {
    float tile[16][128];
    for (int64_t t = t0; t < t1; ++t) {
      int64_t mi = t / kt, kj = t % kt;
      for (int m = 0; m < 128; ++m) {
        int64_t row = mi * 128 + m;
        float so = outer[row * no_in + (16 * kj) / 128];
        float sp = nvfp4_2level_block_scale(inner[row * (K / 16) + kj], so);
        const uint8_t* c = codes + row * (K / 2) + 8 * kj;
        for (int i = 0; i < 16; ++i) tile[i][m] = nvfp4_2level_decode(e2m1_unpack(c, i), sp);
      }
      for (int i = 0; i < 16; ++i) {
        int64_t k = 16 * kj + i;
        for (int g = 0; g < 8; ++g) rht16_f32(&tile[i][16 * g], &tile[i][16 * g], sign_mask);
        outer_t[k * mt + mi] = nvfp4_2level_quantize_block128(codes_t + k * (M / 2) + 64 * mi, inner_t + k * (M / 16) + 8 * mi,
                                                              tile[i], 128, &sr, static_cast<uint64_t>(k * M + 128 * mi));
      }
    }
  });
}

// ---- guided --------------------------------------------------------------------------------------------

namespace {
uint32_t guide_of(const uint8_t* guide_row, int64_t c, GuidanceKind kind) {
  return kind == GuidanceKind::kFull ? e2m1_unpack(guide_row, c) : (guide_row[c >> 3] >> (c & 7)) & 1u;
}
}  // namespace

void nvfp4_te_quantize_guided_cpu(uint8_t* codes, const float* x, int64_t M, int64_t K, const uint8_t* roll_scales,
                                  float roll_amax, const uint8_t* guide, GuidanceKind kind) {
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4 guided: K={} must be a multiple of 16", K);
  Nvfp4TeGlobal g = nvfp4_te_global(roll_amax);
  int64_t gstride = kind == GuidanceKind::kFull ? K / 2 : K / 8;
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* gr = guide + r * gstride;
      for (int64_t b = 0; b < K / 16; ++b) {
        float enc = nvfp4_te_block_enc(roll_scales[r * (K / 16) + b], g);
        for (int i = 0; i < 16; i += 2) {
          int64_t c = 16 * b + i;
          codes[r * (K / 2) + c / 2] = e2m1_pack(nvfp4_te_encode_guided(x[r * K + c], enc, guide_of(gr, c, kind), kind),
                                                 nvfp4_te_encode_guided(x[r * K + c + 1], enc, guide_of(gr, c + 1, kind), kind));
        }
      }
    }
  });
}

void nvfp4_2level_quantize_guided_cpu(uint8_t* codes, const float* x, int64_t M, int64_t K, const uint8_t* roll_inner,
                                      const float* roll_outer, const uint8_t* guide, GuidanceKind kind) {
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4-2level guided: K={} must be a multiple of 16", K);
  int64_t no = (K + 127) / 128;
  int64_t gstride = kind == GuidanceKind::kFull ? K / 2 : K / 8;
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* gr = guide + r * gstride;
      for (int64_t b = 0; b < K / 16; ++b) {
        float sp = nvfp4_2level_block_scale(roll_inner[r * (K / 16) + b], roll_outer[r * no + b / 8]);
        for (int i = 0; i < 16; i += 2) {
          int64_t c = 16 * b + i;
          codes[r * (K / 2) + c / 2] =
              e2m1_pack(nvfp4_2level_encode_guided(x[r * K + c], sp, guide_of(gr, c, kind), kind),
                        nvfp4_2level_encode_guided(x[r * K + c + 1], sp, guide_of(gr, c + 1, kind), kind));
        }
      }
    }
  });
}

void e2m1_mantissa_bits_cpu(uint8_t* mbits, const uint8_t* codes, int64_t M, int64_t K) {
  NIB_CHECK_MSG(K % 8 == 0, "mantissa bits: K={} must be a multiple of 8", K);
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < K / 8; ++i) {
        uint32_t byte = 0;
        for (int j = 0; j < 8; ++j) byte |= (e2m1_unpack(codes + r * (K / 2), 8 * i + j) & 1u) << j;
        mbits[r * (K / 8) + i] = static_cast<uint8_t>(byte);
      }
  });
}

}  // namespace nibble::formats
