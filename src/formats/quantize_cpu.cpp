// CPU drivers of quantize_cpu.h: loop over the host+device per-element/per-block functions of
// nvfp4.h, mx.h, rht.h and guided.h, threaded over rows with parallel_for. The hot RTN paths
// (TE and 2-level, f32/bf16 input) process blocks structure-of-arrays (all block maxima, then
// all scales, then all elements) so GCC vectorises each loop; they call the very same scalar
// functions, so results are bit-identical to the per-block functions the GPU runs. With AVX-512,
// 2-level BF16 RTN instead compares each element with its block's exact decision thresholds
// (quantize_cpu_avx512.h, same bits by construction).
#include "formats/quantize_cpu.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "core/check.h"
#include "core/parallel.h"
#include "formats/rht.h"

namespace nibble::formats {
namespace {

// Rows per parallel chunk so that a chunk holds at least ~64K elements.
int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1)); }

// The row-wise quantizers (TE 1x16, 2-level when K % 128 == 0, MX) store every output at a flat
// offset (codes at i / 2, scale bytes at i / block, 2-level outer scales at i / 128) and key SR by
// the flat index i, so an [M, K] tensor is one flat sequence of blocks that may be cut at any
// block boundary. Their drivers cut it into pieces of kFlatPiece elements (a multiple of every
// row kernel's group: 256 for NVFP4, 512 for MX), threaded: short rows (K = 128 in small models)
// then run on the vector kernels instead of their per-block tails. fn(i, len): the piece at flat
// offset i, len elements (kFlatPiece, or less for the last; a multiple of the block).
constexpr int64_t kFlatPiece = 8192;
template <typename Fn>
void for_each_flat_piece(int64_t n, const Fn& fn) {
  const int64_t pieces = (n + kFlatPiece - 1) / kFlatPiece;
  parallel_for(pieces, row_grain(kFlatPiece), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) fn(p * kFlatPiece, std::min(kFlatPiece, n - p * kFlatPiece));
  });
}

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
// signbit_nan_positive on 16 lanes.
inline v16u vsignbit(v16f v) { return ((v16u)(v) >> 31) & (v == v ? 1u : 0u); }
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
// e2m1_rne_index on 16 lanes (a = |v|, may be NaN or > 6), by float rounding instead of seven
// threshold compares: clamp a to [0, 6] (NaN -> 0), e' = max(exponent(a), 0), C = 2^(e'+22).
// a + C lies in [C, 2C) whose ulp 2^(e'-1) is exactly the E2M1 step of a's binade (0.5 below 2),
// so the IEEE addition rounds a to the grid, ties to an even number of steps; steps = bits(a+C) -
// bits(C), and idx = steps + 2e' (steps have the parity of the code, so ties go to the even code).
// Equal to the scalar thresholds for every input (tests: golden files, TeEqualsBlockFunctions,
// VectorIndexEqualsScalarOnThresholdNeighbours).
inline v16u e2m1_rne_index16(v16f a) {
  a = a > 0.0f ? a : 0.0f;  // NaN -> 0
  a = a < 6.0f ? a : 6.0f;
  v16u e = (v16u)(a) >> 23;
  e = e > 127u ? e : 127u;
  v16u cb = (e << 23) + (22u << 23);
  v16f sum = a + (v16f)(cb);
  return ((v16u)(sum)-cb) + ((e - 127u) << 1);
}
// 16 codes -> 8 packed bytes (even element low nibble); little-endian lane pairing.
inline void pack16(uint8_t* out, v16u code) {
  v8q q = (v8q)(code);
  v8q p = (q & 0xFu) | ((q >> 32) << 4);
  v8b b = __builtin_convertvector(p, v8b);
  std::memcpy(out, &b, 8);
}
inline v16f vbroadcast(float f) { return v16f{} + f; }
inline v16f vmax0(v16f a) { return a > 0.0f ? a : 0.0f; }  // NaN -> 0 (NaN-skipping amax)

// e4m3_rne_sat_magnitude on 16 lanes (a >= 0, not NaN): the same integer/float steps.
inline v16u e4m3_rne_sat_magnitude16(v16f a) {
  v16i sub = a < 0.015625f;
  v16f s = (sub ? a : 0.0f) * 512.0f;
  v16f r = s + 8388608.0f;
  v16u q = (v16u)(r)-0x4B000000u;  // = (s + 2^23) - 2^23 as an integer (s < 8)
  v16u u = (v16u)(sub ? vbroadcast(1.0f) : a);
  v16u ur = u + 0x7FFFFu + ((u >> 20) & 1u);
  v16u code = ((((ur >> 23) & 0xFFu) - 120u) << 3) | ((ur >> 20) & 7u);
  code = code > 0x7Eu ? 0x7Eu : code;
  return sub ? q : code;
}
// e4m3_decode on 16 lanes of non-negative finite bytes (0x00..0x7E).
inline v16f e4m3_decode16(v16u byte) {
  v16u e = (byte >> 3) & 0xFu, m = byte & 7u;
  v16f subv = __builtin_convertvector(m, v16f) * 0.001953125f;
  v16f norm = (v16f)(((e + 120u) << 23) | (m << 20));
  return e == 0u ? subv : norm;
}
inline void store_bytes16(uint8_t* out, v16u v) {
  typedef uint8_t v16b __attribute__((vector_size(16)));
  v16b b = __builtin_convertvector(v, v16b);
  std::memcpy(out, &b, 16);
}

#if !defined(__clang__)
#define NIBBLE_FORMATS_HMAX_TREE 1
// Maxima of 16 vectors (already |.| and NaN-free), lane b = max over vector b: a shuffle tree of
// 15 merges. Each merge halves the lanes per source: output lanes = [a's groups, b's groups].
inline v16f merge_max(v16f a, v16f b, v16i lo, v16i hi) {
  v16f l = __builtin_shuffle(a, b, lo), h = __builtin_shuffle(a, b, hi);
  return l > h ? l : h;
}
inline v16f hmax16x16(const v16f* v) {
  const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  v16f l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) l1[i] = merge_max(v[2 * i], v[2 * i + 1], lo1, lo1 + 8);
  for (int i = 0; i < 4; ++i) l2[i] = merge_max(l1[2 * i], l1[2 * i + 1], lo2, lo2 + 4);
  for (int i = 0; i < 2; ++i) l3[i] = merge_max(l2[2 * i], l2[2 * i + 1], lo3, lo3 + 2);
  return merge_max(l3[0], l3[1], lo4, lo4 + 1);
}
// Same, starting from 8 vectors that already hold [block 2i: 8 partial maxima, block 2i+1: 8].
inline v16f hmax16x16_from_pairs(const v16f* p) {
  const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  v16f l2[4], l3[2];
  for (int i = 0; i < 4; ++i) l2[i] = merge_max(p[2 * i], p[2 * i + 1], lo2, lo2 + 4);
  for (int i = 0; i < 2; ++i) l3[i] = merge_max(l2[2 * i], l2[2 * i + 1], lo3, lo3 + 2);
  return merge_max(l3[0], l3[1], lo4, lo4 + 1);
}
// Lanes 0-7 = v[2i], lanes 8-15 = v[2i+1]: the per-block factor of the block pair i.
inline v16f pair_broadcast(v16f v, int i) {
  v16i idx = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  return __builtin_shuffle(v, idx + 2 * i);
}
// 32 consecutive elements (two 16-blocks) split into even and odd elements: lane j of `even` is
// element 2j, of `odd` element 2j+1, so lanes 0-7 belong to the first block, 8-15 to the second,
// and the packed byte j is code(even_j) | code(odd_j) << 4.
inline void split32(const uint16_t* x, v16f& even, v16f& odd) {
  v16u w;
  std::memcpy(&w, x, 64);
  even = (v16f)(w << 16);
  odd = (v16f)(w & 0xFFFF0000u);
}
inline void split32(const float* x, v16f& even, v16f& odd) {
  v16f a = load16(x), b = load16(x + 16);
  const v16i ie = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  even = __builtin_shuffle(a, b, ie);
  odd = __builtin_shuffle(a, b, ie + 1);
}
// 8 packed bytes -> 16 codes in element order (even element = low nibble).
inline v16u unpack_codes16(const uint8_t* p) {
  // Lanes 0-7 hold the low 32-bit word, lanes 8-15 the high one; lane i shifts out nibble i % 8
  // (a byte shuffle here made GCC extract the bytes one by one through scalar registers).
  uint32_t lo, hi;
  std::memcpy(&lo, p, 4);
  std::memcpy(&hi, p + 4, 4);
  const v16i upper = {0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1};
  const v16u sh = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
  v16u w = upper != 0 ? v16u{} + hi : v16u{} + lo;
  return (w >> sh) & 0xFu;
}
// e2m1_decode on 16 lanes (table of the 16 signed values; 0x8 -> -0.0).
inline v16f e2m1_decode16(v16u code) {
  const v16f tbl = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return __builtin_shuffle(tbl, code);
}

// ---- stochastic rounding on 16 lanes ----
// Philox4x32-10 (core/philox.h) for 16 consecutive counters `offset0 + lane` of (seed, stream).
inline void mulhilo16(uint32_t m, v16u c, v16u& hi, v16u& lo) {
  lo = c * m;
  v8q pe = ((v8q)(c)&0xFFFFFFFFull) * static_cast<uint64_t>(m);
  v8q po = ((v8q)(c) >> 32) * static_cast<uint64_t>(m);
  hi = (v16u)((pe >> 32) | (po & 0xFFFFFFFF00000000ull));
}
inline void philox16(v16u w[4], const SrKey& key, uint64_t offset0) {
  const v16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  uint32_t lo0 = static_cast<uint32_t>(offset0), hi0 = static_cast<uint32_t>(offset0 >> 32);
  v16u c0 = lane + lo0;
  v16u c1 = (v16u{} + hi0) + (c0 < lo0 ? 1u : 0u);  // carry into the high word
  v16u c2 = v16u{} + static_cast<uint32_t>(key.stream), c3 = v16u{} + static_cast<uint32_t>(key.stream >> 32);
  uint32_t k0 = static_cast<uint32_t>(key.seed), k1 = static_cast<uint32_t>(key.seed >> 32);
  for (int round = 0; round < 10; ++round) {
    v16u hi0v, lo0v, hi1v, lo1v;
    mulhilo16(0xD2511F53u, c0, hi0v, lo0v);
    mulhilo16(0xCD9E8D57u, c2, hi1v, lo1v);
    v16u n0 = hi1v ^ c1 ^ k0, n2 = hi0v ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1v;
    c2 = n2;
    c3 = lo0v;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  w[0] = c0;
  w[1] = c1;
  w[2] = c2;
  w[3] = c3;
}
// Uniforms of 256 consecutive elements from flat index0 (index0 % 8 == 0), in the even/odd
// layout of split32: ue[g] lane j = element 32g + 2j, uo[g] lane j = element 32g + 2j + 1.
// Element e uses half-word e%8 of Philox block e/8 (nvfp4.h sr_uniform): elements 2n and 2n+1
// share word n%4 of block n/4 (n = flat word index), low half even, high half odd.
inline void sr_uniforms256(v16f ue[8], v16f uo[8], const SrKey& key, uint64_t index0) {
  const v16i i01 = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  const v16i i0123 = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23};
  for (int c = 0; c < 2; ++c) {
    v16u w[4];
    philox16(w, key, (index0 >> 3) + 16 * c);  // blocks 16c .. 16c+15 of this run = elements 128c ..
    for (int half = 0; half < 2; ++half) {
      // lane 2m: word 0 (x) / 2 (y) of block 8*half + m; lane 2m+1: word 1 / 3.
      v16u x = __builtin_shuffle(w[0], w[1], i01 + 8 * half);
      v16u y = __builtin_shuffle(w[2], w[3], i01 + 8 * half);
      for (int h = 0; h < 2; ++h) {
        // lane j: word j%4 of block 8*half + 4h + j/4 = flat word 32*half + 16h + j.
        v16u words = __builtin_shuffle(x, y, i0123 + 8 * h);
        const int g = 4 * c + 2 * half + h;
        ue[g] = __builtin_convertvector(words & 0xFFFFu, v16f) * 1.52587890625e-05f;
        uo[g] = __builtin_convertvector(words >> 16, v16f) * 1.52587890625e-05f;
      }
    }
  }
}
// e2m1_sr_index on 16 lanes (same steps: down index by >= compares, table lookups, exact frac).
inline v16u e2m1_sr_index16(v16f a, v16f u) {
  v16u di = {};
  di = a >= 0.5f ? di + 1u : di;
  di = a >= 1.0f ? di + 1u : di;
  di = a >= 1.5f ? di + 1u : di;
  di = a >= 2.0f ? di + 1u : di;
  di = a >= 3.0f ? di + 1u : di;
  di = a >= 4.0f ? di + 1u : di;
  di = a >= 6.0f ? di + 1u : di;
  const v16f mag = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0, 0, 0, 0, 0, 0, 0, 0};
  const v16f inv_gaps = {2.0f, 2.0f, 2.0f, 2.0f, 1.0f, 1.0f, 0.5f, 0.5f, 1, 1, 1, 1, 1, 1, 1, 1};
  v16f down = __builtin_shuffle(mag, di), inv_gap = __builtin_shuffle(inv_gaps, di);
  v16f frac = (a - down) * inv_gap;  // exact (power-of-two factor), as e2m1_sr_index
  return di < 7u && u < frac ? di + 1u : di;
}

// Partial maxima (NaN skipped) of a split pair: lanes 0-7 first block, 8-15 second block.
inline v16f pair_max_abs(v16f even, v16f odd) {
  v16f a = vmax0(vabs(even)), b = vabs(odd);
  return b > a ? b : a;  // NaN b compares false: skipped
}

// ---- 16x16 tiles held as 16 row vectors (t[i] = row i, lane k = column k) ----
// RHT16 along the rows of every column at once, without the 1/4: rows whose bit of `sign_mask`
// is set negated (sign-bit xor, as -x), then rht16_butterfly_f32's stages h = 1, 2, 4, 8 on row
// pairs (i, i + h): per column the same binary32 operations in the same order as rht16_f32.
inline void rht16_rows_of_tile(v16f t[16], uint32_t sign_mask) {
  for (int i = 0; i < 16; ++i)
    if ((sign_mask >> i) & 1u) t[i] = (v16f)((v16u)(t[i]) ^ 0x80000000u);
  rht16_butterfly(t);
}
template <int S, typename V>
inline void transpose16x16_stage(V t[16]) {
  // Row i (bit S clear) keeps its lanes without bit S and takes row i + S's lane l - S; row i + S
  // the mirror. Masks: indices 0-15 select from a (row i), 16-31 from b (row i + S).
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16i keep = (lane & S) != 0 ? lane + (16 - S) : lane, take = keep + S;
  for (int i = 0; i < 16; ++i) {
    if (i & S) continue;
    V a = t[i], b = t[i + S];
    t[i] = __builtin_shuffle(a, b, keep);
    t[i + S] = __builtin_shuffle(a, b, take);
  }
}
// In-place transpose of a 16x16 tile of 32-bit lanes: stage S (8, 4, 2, 1) swaps bit S of the
// row and the column index, two two-source permutes per row pair.
template <typename V>
inline void transpose16x16(V t[16]) {
  transpose16x16_stage<8>(t);
  transpose16x16_stage<4>(t);
  transpose16x16_stage<2>(t);
  transpose16x16_stage<1>(t);
}
#endif
#if !NIBBLE_FORMATS_HMAX_TREE
// A row of a 16x16 tile in the scalar tile paths, with elementwise binary32 + and -: rht16_butterfly
// (rht.h) on 16 such rows runs the butterfly down every column, per column the same operations in
// the same order as rht16_f32.
struct TileRow16 {
  float e[16];
};
inline TileRow16 operator+(const TileRow16& a, const TileRow16& b) {
  TileRow16 r;
  for (int k = 0; k < 16; ++k) r.e[k] = a.e[k] + b.e[k];
  return r;
}
inline TileRow16 operator-(const TileRow16& a, const TileRow16& b) {
  TileRow16 r;
  for (int k = 0; k < 16; ++k) r.e[k] = a.e[k] - b.e[k];
  return r;
}
#endif
// E8M0 rules of e8m0.h on 16 lanes of block maxima (non-negative, NaN-free; Inf possible).
inline v16u e8m0_round_up_bits16(v16f d) {
  v16u u = (v16u)(d)&0x7FFFFFFFu;
  v16u e = u >> 23, m = u & 0x7FFFFFu;
  v16u byte = e == 0u ? (m > 0x400000u ? 1u : 0u) : e + (m != 0u ? 1u : 0u);
  byte = byte > 0xFFu ? 0xFFu : byte;
  return u >= 0x7F800000u ? 0xFFu : byte;
}
inline v16u mx_scale_byte16(v16f bamax, MxScaleRule rule, bool fp8) {
  if (rule == MxScaleRule::kFloor) {
    v16u u = (v16u)(bamax)&0x7FFFFFFFu;
    v16i e = (v16i)(u >> 23) - (127 + (fp8 ? 8 : 2));
    e = e < -127 ? -127 : e;
    e = e > 128 ? 128 : e;
    v16u byte = (v16u)(e + 127);
    return u >= 0x7F800000u ? 0xFFu : byte;
  }
  if (rule == MxScaleRule::kRceil) return e8m0_round_up_bits16(bamax * (fp8 ? kRecip448 : kRecip6));
  v16u byte = e8m0_round_up_bits16(bamax / 6.0f);  // te-ceil: Inf/NaN d -> 0xFF, else clamp E to 127
  v16u u = (v16u)(bamax / 6.0f) & 0x7FFFFFFFu;
  return u >= 0x7F800000u ? 0xFFu : (byte > 254u ? 254u : byte);
}
inline v16f e8m0_inverse16(v16u byte) {
  v16u normal = (254u - byte) << 23;
  v16u sub = 0x00400000u >> (byte - 254u);
  return (v16f)(byte <= 253u ? normal : sub);
}

#include "formats/quantize_cpu_avx512.h"
#include "formats/quantize_cpu_avx512_mx.h"
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
      // NaN-skipping max is order-independent, so lanes/accumulators may be combined freely.
      float m = 0.0f;
      int64_t i = 0;
#if NIBBLE_FORMATS_AVX512
      i = len - len % 128;
      m = avx512_amax(p, i);
#elif NIBBLE_FORMATS_VEC16
      v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (; i + 64 <= len; i += 64) {
        v16f x0 = vabs(load16(p + i)), x1 = vabs(load16(p + i + 16)), x2 = vabs(load16(p + i + 32)),
             x3 = vabs(load16(p + i + 48));
        a0 = x0 > a0 ? x0 : a0;  // NaN lanes compare false: skipped
        a1 = x1 > a1 ? x1 : a1;
        a2 = x2 > a2 ? x2 : a2;
        a3 = x3 > a3 ? x3 : a3;
      }
      a0 = a1 > a0 ? a1 : a0;
      a2 = a3 > a2 ? a3 : a2;
      a0 = a2 > a0 ? a2 : a0;
      for (int j = 0; j < 16; ++j) m = amax_update(m, a0[j]);
#else
      float lane[16] = {};
      for (; i + 16 <= len; i += 16)
        for (int j = 0; j < 16; ++j) lane[j] = amax_update(lane[j], load_f32(p[i + j]));
      for (int j = 0; j < 16; ++j) m = amax_update(m, lane[j]);
#endif
      for (; i < len; ++i) m = amax_update(m, load_f32(p[i]));
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
// Encode one 16-element block with its encode factor (RTN, TE sign convention) into 8 bytes.
template <typename In>
inline void te_encode_block16(uint8_t* codes, const In* x, float enc) {
  v16f v = load16(x) * enc;
  v16i neg = v < 0.0f;
  pack16(codes, e2m1_rne_index16(vabs(v)) | ((v16u)(neg)&8u));
}
inline v16u te_code16(v16f v) {
  v16i neg = v < 0.0f;
  return e2m1_rne_index16(vabs(v)) | ((v16u)(neg)&8u);
}
// sr == nullptr: RTN; else SR with element (flat index index0 + c) as in the block functions.
template <typename In>
void te_row_rtn(uint8_t* codes, uint8_t* scales, const In* x, int64_t K, const Nvfp4TeGlobal& g,
                const SrKey* sr = nullptr, uint64_t index0 = 0) {
  int64_t nb = K / 16, b = 0;
#if NIBBLE_FORMATS_AVX512
  if constexpr (std::is_same_v<In, uint16_t>) {  // BF16: threshold search, whole row of 256-groups
    if (sr == nullptr) {
      te_row_bf16_avx512(codes, scales, x, nb / 16, g);
      b = 16 * (nb / 16);
    }
  } else if (sr == nullptr)  // 256-element groups; a group holding a NaN takes the per-block functions
    for (; b + 16 <= nb; b += 16) {
      prefetch_group_ahead(x + 16 * b, 1024);
      if (!te_group256_avx512(codes + 8 * b, scales + b, x + 16 * b, g))
        for (int64_t j = b; j < b + 16; ++j)
          scales[j] = static_cast<uint8_t>(nvfp4_te_quantize_block16(codes + 8 * j, x + 16 * j, block_amax(x + 16 * j, 16), g));
    }
#endif
#if NIBBLE_FORMATS_HMAX_TREE
  // 16 blocks at a time: elements split even/odd (see split32), block maxima by a shuffle
  // tree, the scale chain on 16 lanes, then 32 elements -> 16 packed bytes per step.
  for (; b + 16 <= nb; b += 16) {
    const In* xg = x + 16 * b;
    v16f ev[8], od[8], pm[8];
    for (int i = 0; i < 8; ++i) {
      split32(xg + 32 * i, ev[i], od[i]);
      pm[i] = pair_max_abs(ev[i], od[i]);
    }
    v16f bamax = hmax16x16_from_pairs(pm);
    v16f t = bamax * g.m;
    t = t < 448.0f ? t : 448.0f;
    v16u s = e4m3_rne_sat_magnitude16(t);
    v16f enc = 1.0f / (e4m3_decode16(s) * g.s_dec);
    enc = enc < kFltMax ? enc : kFltMax;
    store_bytes16(scales + b, s);
    if (sr == nullptr) {
      for (int i = 0; i < 8; ++i) {
        v16f e2 = pair_broadcast(enc, i);
        store_bytes16(codes + 8 * b + 16 * i, te_code16(ev[i] * e2) | (te_code16(od[i] * e2) << 4));
      }
    } else {
      v16f ue[8], uo[8];
      sr_uniforms256(ue, uo, *sr, index0 + static_cast<uint64_t>(16 * b));
      for (int i = 0; i < 8; ++i) {
        v16f e2 = pair_broadcast(enc, i);
        v16f ve = ev[i] * e2, vo = od[i] * e2;
        v16i ne = ve < 0.0f, no = vo < 0.0f;
        v16u ce = e2m1_sr_index16(vabs(ve), ue[i]) | ((v16u)(ne)&8u);
        v16u co = e2m1_sr_index16(vabs(vo), uo[i]) | ((v16u)(no)&8u);
        store_bytes16(codes + 8 * b + 16 * i, ce | (co << 4));
      }
    }
  }
#endif
  if (sr != nullptr) {
    for (; b < nb; ++b) {
      const In* xb = x + 16 * b;
      scales[b] = static_cast<uint8_t>(
          nvfp4_te_quantize_block16(codes + 8 * b, xb, block_amax(xb, 16), g, sr, index0 + static_cast<uint64_t>(16 * b)));
    }
    return;
  }
  for (; b < nb; ++b) {
    v16f xv = load16(x + 16 * b);
    uint32_t s = nvfp4_te_block_scale(hmax_abs16(xv), g);
    scales[b] = static_cast<uint8_t>(s);
    te_encode_block16(codes + 8 * b, x + 16 * b, nvfp4_te_block_enc(s, g));
  }
}
#else
template <typename In>
void te_row_rtn(uint8_t* codes, uint8_t* scales, const In* x, int64_t K, const Nvfp4TeGlobal& g,
                const SrKey* sr = nullptr, uint64_t index0 = 0) {
  if (sr != nullptr) {
    for (int64_t b = 0; b < K / 16; ++b)
      scales[b] = static_cast<uint8_t>(nvfp4_te_quantize_block16(codes + 8 * b, x + 16 * b, block_amax(x + 16 * b, 16), g,
                                                                 sr, index0 + static_cast<uint64_t>(16 * b)));
    return;
  }
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
  for_each_flat_piece(M * K, [&](int64_t i, int64_t len) {
    te_row_rtn(codes + i / 2, scales + i / 16, x + i, len, g, sr, static_cast<uint64_t>(i));
  });
}

// ---- 2-level -------------------------------------------------------------------------------------

#if NIBBLE_FORMATS_VEC16
// RTN row of whole 128-blocks (K % 128 == 0), vectorised; bit-identical to twolevel_row.
template <typename In>
void twolevel_row_vec(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t K,
                          const SrKey* sr = nullptr, uint64_t index0 = 0) {
  int64_t o = 0;
#if NIBBLE_FORMATS_AVX512
  if constexpr (std::is_same_v<In, uint16_t>) {  // BF16: threshold search, whole row of 256-groups
    if (sr == nullptr) {
      twolevel_row_bf16_avx512(codes, inner, outer, x, K / 256);
      o = 2 * (K / 256);
    }
  } else if (sr == nullptr)  // pairs of 128-blocks; a pair outside the fast range takes the per-block functions
    for (; o + 2 <= K / 128; o += 2) {
      prefetch_group_ahead(x + 128 * o, 1024);
      if (!twolevel_group256_avx512(codes + 64 * o, inner + 8 * o, outer + o, x + 128 * o))
        for (int64_t j = o; j < o + 2; ++j)
          outer[j] = nvfp4_2level_quantize_block128(codes + 64 * j, inner + 8 * j, x + 128 * j, 128);
    }
#endif
#if NIBBLE_FORMATS_HMAX_TREE
  // Two 128-blocks (16 inner blocks, 256 elements) at a time, as in te_row_rtn.
  for (; o + 2 <= K / 128; o += 2) {
    const In* xg = x + 128 * o;
    v16f ev[8], od[8], pm[8];
    for (int i = 0; i < 8; ++i) {
      split32(xg + 32 * i, ev[i], od[i]);
      pm[i] = pair_max_abs(ev[i], od[i]);
    }
    v16f bamax = hmax16x16_from_pairs(pm);
    // Outer amax of lanes 0-7 and of lanes 8-15 (butterfly max; the lanes are NaN-free and
    // non-negative, so the order of the maxima does not matter), then
    // nvfp4_2level_outer_scale on all lanes.
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16f am = bamax;
    for (int h = 1; h < 8; h <<= 1) {
      v16f p = __builtin_shuffle(am, lane ^ h);
      am = p > am ? p : am;
    }
    v16f so = (am * kRecip448) * kRecip6;
    so = so == 0.0f ? 1.0f : so;
    outer[o] = so[0];
    outer[o + 1] = so[8];
    v16f t = (bamax / so) * kRecip6;
    t = t < 448.0f ? t : 448.0f;
    v16u si = e4m3_rne_sat_magnitude16(t);
    store_bytes16(inner + 8 * o, si);
    v16f sp = e4m3_decode16(si) * so;
    v16f ue[8], uo[8];
    if (sr != nullptr) sr_uniforms256(ue, uo, *sr, index0 + static_cast<uint64_t>(128 * o));
    for (int i = 0; i < 8; ++i) {
      v16f p2 = pair_broadcast(sp, i);
      v16i zero = p2 == 0.0f;
      v16f qe = vabs(ev[i]) / p2, qo = vabs(od[i]) / p2;
      qe = zero ? 0.0f : qe;
      qo = zero ? 0.0f : qo;
      v16u ie = sr == nullptr ? e2m1_rne_index16(qe) : e2m1_sr_index16(qe, ue[i]);
      v16u io = sr == nullptr ? e2m1_rne_index16(qo) : e2m1_sr_index16(qo, uo[i]);
      store_bytes16(codes + 64 * o + 16 * i, (ie | (vsignbit(ev[i]) << 3)) | ((io | (vsignbit(od[i]) << 3)) << 4));
    }
  }
#endif
  if (sr != nullptr) {  // remaining single 128-block: per-block functions
    for (; o < K / 128; ++o)
      outer[o] = nvfp4_2level_quantize_block128(codes + 64 * o, inner + 8 * o, x + 128 * o, 128, sr,
                                                index0 + static_cast<uint64_t>(128 * o));
    return;
  }
  for (; o < K / 128; ++o) {
    const In* xo = x + 128 * o;
    float bamax[16];
#if NIBBLE_FORMATS_HMAX_TREE
    // Two 128-blocks' worth of lanes: the first 8 vectors are this block, the rest repeat them.
    v16f a[16];
    for (int b = 0; b < 8; ++b) a[b] = a[b + 8] = vmax0(vabs(load16(xo + 16 * b)));
    v16f bm = hmax16x16(a);
    for (int b = 0; b < 8; ++b) bamax[b] = bm[b];
#else
    for (int b = 0; b < 8; ++b) bamax[b] = hmax_abs16(load16(xo + 16 * b));
#endif
    float amax = 0.0f;
    for (int b = 0; b < 8; ++b) amax = amax_update(amax, bamax[b]);
    float so = nvfp4_2level_outer_scale(amax);
    outer[o] = so;
    for (int b = 0; b < 8; ++b) {
      uint32_t si = nvfp4_2level_inner_scale(bamax[b], so);
      inner[8 * o + b] = static_cast<uint8_t>(si);
      float sp = nvfp4_2level_block_scale(si, so);
      v16f xv = load16(xo + 16 * b);
      v16u sign = vsignbit(xv) << 3;
      v16u code = sp == 0.0f ? sign : (e2m1_rne_index16(vabs(xv) / sp) | sign);
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
        float p = sp[b], rp = nvfp4_2level_block_reciprocal(p);
        for (int i = 0; i < 8; ++i) {
          uint32_t lo = nvfp4_2level_encode_rtn(load_f32(xg[16 * b + 2 * i]), p, rp);
          uint32_t hi = nvfp4_2level_encode_rtn(load_f32(xg[16 * b + 2 * i + 1]), p, rp);
          cg[8 * b + i] = e2m1_pack(lo, hi);
        }
      }
    } else {
      for (int b = 0; b < gb; ++b) {
        float p = sp[b], rp = nvfp4_2level_block_reciprocal(p), u[16];
        sr_uniforms(u, *sr, index0 + static_cast<uint64_t>((b0 + b) * 16), 16);
        for (int i = 0; i < 8; ++i) {
          uint32_t lo = nvfp4_2level_encode_sr(load_f32(xg[16 * b + 2 * i]), p, rp, u[2 * i]);
          uint32_t hi = nvfp4_2level_encode_sr(load_f32(xg[16 * b + 2 * i + 1]), p, rp, u[2 * i + 1]);
          cg[8 * b + i] = e2m1_pack(lo, hi);
        }
      }
    }
  }
}

// One row of K elements (K % 16 == 0; its last 128-block may be partial). Whole pairs of 128-blocks
// go to twolevel_row_vec; the rest (< 256 elements: a single 128-block and/or a partial one) is
// quantized as the start of a zero-padded 256-element pair, which gives the same bits: zeros do
// not change a block maximum, a partial 128-block is defined as its zero-padded block (01-formats
// §3), each element's SR draw depends on its own flat index only, and the padding's outputs are
// dropped. (Rows of K = 112 or 448 are what OutControl leaves after taking outlier channels out.)
template <typename In>
void twolevel_quantize_row(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t K, const SrKey* sr,
                           uint64_t index0) {
#if NIBBLE_FORMATS_VEC16
  const int64_t whole = K / 256 * 256, tail = K - whole;
  if (whole > 0) twolevel_row_vec(codes, inner, outer, x, whole, sr, index0);
  if (tail > 0) {
    In padded[256] = {};
    std::memcpy(padded, x + whole, static_cast<size_t>(tail) * sizeof(In));
    uint8_t c[128], in[16];
    float o[2];
    twolevel_row_vec(c, in, o, padded, 256, sr, index0 + static_cast<uint64_t>(whole));
    std::memcpy(codes + whole / 2, c, static_cast<size_t>(tail / 2));
    std::memcpy(inner + whole / 16, in, static_cast<size_t>(tail / 16));
    std::memcpy(outer + whole / 128, o, static_cast<size_t>((tail + 127) / 128) * sizeof(float));
  }
#else
  twolevel_row(codes, inner, outer, x, K, sr, index0);
#endif
}

template <typename In>
void twolevel_quantize_impl(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t M, int64_t K,
                            const SrKey* sr) {
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4-2level: K={} must be a multiple of 16", K);
  if (K % 128 == 0) {  // no partial 128-block: a flat sequence of 128-blocks
    for_each_flat_piece(M * K, [&](int64_t i, int64_t len) {
      twolevel_quantize_row(codes + i / 2, inner + i / 16, outer + i / 128, x + i, len, sr, static_cast<uint64_t>(i));
    });
    return;
  }
  int64_t no = (K + 127) / 128;  // each row ends with a partial (zero-padded) 128-block
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      twolevel_quantize_row(codes + r * (K / 2), inner + r * (K / 16), outer + r * no, x + r * K, K, sr,
                            static_cast<uint64_t>(r * K));
  });
}

// ---- MX -----------------------------------------------------------------------------------------

#if NIBBLE_FORMATS_HMAX_TREE
// e4m3_rne_sat on 16 lanes (NaN -> 0x7F, sign bit = signbit otherwise).
inline v16u e4m3_rne_sat16(v16f v) {
  v16u mag = e4m3_rne_sat_magnitude16(v == v ? vabs(v) : 0.0f);
  v16u sign = ((v16u)(v) >> 24) & 0x80u;
  return v == v ? (mag | sign) : 0x7Fu;
}

// One row of K (K % 512 == 0 for the vector part) MX elements: 16 blocks of 32 at a time.
template <typename In>
int64_t mx_row_vec(uint8_t* out, uint8_t* scales, const In* x, int64_t K, MxScaleRule rule, bool fp8,
                   const SrKey* sr, uint64_t index0) {
  int64_t nb = K / 32, b = 0;
  for (; b + 16 <= nb; b += 16) {
    const In* xg = x + 32 * b;
    v16f ev[16], od[16], pm[16];
    for (int j = 0; j < 16; ++j) {
      split32(xg + 32 * j, ev[j], od[j]);
      pm[j] = pair_max_abs(ev[j], od[j]);
    }
    v16u byte = mx_scale_byte16(hmax16x16(pm), rule, fp8);
    v16f inv = e8m0_inverse16(byte);
    store_bytes16(scales + b, byte);
    v16f ue[16], uo[16];
    if (sr != nullptr) {
      sr_uniforms256(ue, uo, *sr, index0 + static_cast<uint64_t>(32 * b));
      sr_uniforms256(ue + 8, uo + 8, *sr, index0 + static_cast<uint64_t>(32 * b + 256));
    }
    for (int j = 0; j < 16; ++j) {
      v16f ve = ev[j] * inv[j], vo = od[j] * inv[j];
      if (fp8) {
        typedef uint8_t v16b __attribute__((vector_size(16)));
        v16b be = __builtin_convertvector(e4m3_rne_sat16(ve), v16b), bo = __builtin_convertvector(e4m3_rne_sat16(vo), v16b);
        const v16b lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
        v16b l = __builtin_shuffle(be, bo, lo), h = __builtin_shuffle(be, bo, lo + 8);
        std::memcpy(out + 32 * (b + j), &l, 16);
        std::memcpy(out + 32 * (b + j) + 16, &h, 16);
        continue;
      }
      v16u se, so;
      if (rule == MxScaleRule::kTeCeil) {
        v16i ne = ve < 0.0f, no = vo < 0.0f;
        se = (v16u)(ne)&1u;
        so = (v16u)(no)&1u;
      } else {
        se = vsignbit(ve);
        so = vsignbit(vo);
      }
      v16u ie = sr == nullptr ? e2m1_rne_index16(vabs(ve)) : e2m1_sr_index16(vabs(ve), ue[j]);
      v16u io = sr == nullptr ? e2m1_rne_index16(vabs(vo)) : e2m1_sr_index16(vabs(vo), uo[j]);
      store_bytes16(out + 16 * (b + j), (ie | (se << 3)) | ((io | (so << 3)) << 4));
    }
  }
  return b;  // blocks done
}
#endif

// One piece of n elements (n % 32 == 0) at flat index index0: MXFP4 codes (n / 2 bytes) or MXFP8
// elements (n), scales (n / 32). BF16 RTN on AVX-512: quantize_cpu_avx512_mx.h over whole
// 512-groups; otherwise 16 blocks at a time (mx_row_vec); the rest per block (mx.h).
template <typename In>
void mx_piece(uint8_t* out, uint8_t* scales, const In* x, int64_t n, MxScaleRule rule, bool fp8, const SrKey* sr,
              uint64_t index0) {
  int64_t b = 0;
#if NIBBLE_FORMATS_AVX512
  if constexpr (std::is_same_v<In, uint16_t>) {
    if (sr == nullptr) {
      mx_row_bf16_avx512(out, scales, x, n / 512, rule, fp8);
      b = 16 * (n / 512);
    }
  }
#endif
#if NIBBLE_FORMATS_HMAX_TREE
  if (b == 0) b = mx_row_vec(out, scales, x, n, rule, fp8, sr, index0);
#endif
  for (; b < n / 32; ++b)
    scales[b] = static_cast<uint8_t>(
        fp8 ? mxfp8_quantize_block32(out + 32 * b, x + 32 * b, rule)
            : mxfp4_quantize_block32(out + 16 * b, x + 32 * b, rule, sr, index0 + static_cast<uint64_t>(32 * b)));
}

template <typename In>
void mxfp4_quantize_impl(uint8_t* codes, uint8_t* scales, const In* x, int64_t M, int64_t K, MxScaleRule rule,
                         const SrKey* sr) {
  NIB_CHECK_MSG(K % 32 == 0, "mxfp4: K={} must be a multiple of 32", K);
  for_each_flat_piece(M * K, [&](int64_t i, int64_t len) {
    mx_piece(codes + i / 2, scales + i / 32, x + i, len, rule, false, sr, static_cast<uint64_t>(i));
  });
}

template <typename In>
void mxfp8_quantize_impl(uint8_t* elems, uint8_t* scales, const In* x, int64_t M, int64_t K, MxScaleRule rule) {
  NIB_CHECK_MSG(K % 32 == 0, "mxfp8: K={} must be a multiple of 32", K);
  NIB_CHECK_MSG(rule != MxScaleRule::kTeCeil, "mxfp8: the te-ceil rule is MXFP4 only");
  for_each_flat_piece(M * K, [&](int64_t i, int64_t len) {
    mx_piece(elems + i, scales + i / 32, x + i, len, rule, true, nullptr, static_cast<uint64_t>(i));
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
#if NIBBLE_FORMATS_AVX512  // 16 blocks at a time, flat (outputs at flat offsets)
  if ((M * K) % 256 == 0) {
    for_each_flat_piece(M * K, [&](int64_t i, int64_t len) {
      alignas(64) float f[16];
      for (int64_t b = 0; b < len / 16; b += 16) {
        const v16u bytes = avx512_load_bytes16(scales + i / 16 + b);
        const v16f fv = (e4m3_decode16_nan(bytes) * amax) * kRecip2688;  // nvfp4_te_dequant_factor
        std::memcpy(f, &fv, sizeof(f));
        avx512_decode_blocks<false>(y + i + 16 * b, codes + i / 2 + 8 * b, f, 16);
      }
    });
    return;
  }
#endif
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / 16; ++b) {
#if NIBBLE_FORMATS_HMAX_TREE  // GCC shuffles (unpack_codes16)
        // e2m1_decode(code) * factor on 16 lanes: the same two binary32 values multiplied.
        v16f v = e2m1_decode16(unpack_codes16(codes + r * (K / 2) + 8 * b)) *
                 nvfp4_te_dequant_factor(scales[r * (K / 16) + b], amax);
        std::memcpy(y + r * K + 16 * b, &v, 64);
#else
        nvfp4_te_dequantize_block16(y + r * K + 16 * b, codes + r * (K / 2) + 8 * b, scales[r * (K / 16) + b], amax);
#endif
      }
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
#if NIBBLE_FORMATS_AVX512  // pairs of 128-blocks, flat (outputs at flat offsets)
  if (K % 128 == 0 && (M * K) % 256 == 0) {
    for_each_flat_piece(M * K, [&](int64_t i, int64_t len) {
      alignas(64) float f[16];
      for (int64_t o = 0; o < len / 128; o += 2) {
        const float* ob = outer + i / 128 + o;  // lanes 0-7: ob[0], 8-15: ob[1]
        const v16u bytes = avx512_load_bytes16(inner + i / 16 + 8 * o);
        const v16f so = (v16f)_mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(ob[0]), _mm512_set1_ps(ob[1]));
        const v16f fv = e4m3_decode16_nan(bytes) * so;  // nvfp4_2level_block_scale
        std::memcpy(f, &fv, sizeof(f));
        avx512_decode_blocks<true>(y + i + 128 * o, codes + i / 2 + 64 * o, f, 16);
      }
    });
    return;
  }
#endif
  parallel_for(M, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = 0; o < no; ++o) {
        int n = static_cast<int>(std::min<int64_t>(128, K - 128 * o));
#if NIBBLE_FORMATS_HMAX_TREE  // GCC shuffles (unpack_codes16)
        // (+-mag) * sp == +-(mag * sp) for every non-NaN sp (IEEE rounding is sign-symmetric).
        for (int b = 0; b < n / 16; ++b) {
          float sp = nvfp4_2level_block_scale(inner[r * (K / 16) + 8 * o + b], outer[r * no + o]);
          v16f v = e2m1_decode16(unpack_codes16(codes + r * (K / 2) + 64 * o + 8 * b)) * sp;
          std::memcpy(y + r * K + 128 * o + 16 * b, &v, 64);
        }
#else
        nvfp4_2level_dequantize_block128(y + r * K + 128 * o, codes + r * (K / 2) + 64 * o, inner + r * (K / 16) + 8 * o,
                                         outer[r * no + o], n);
#endif
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
  // Tile = 16 rows (one RHT group along M) x 16 columns: load it row-major (signs applied:
  // negation is exact), run the butterfly on every column at once (k-lanes), store transposed. A
  // column whose values pass rht16_bf16_sums_fit_f32 takes rht16_bf16_f32's binary32 steps (exact
  // there, so rht16_bf16_exact's bits); any other column rht16_bf16_exact itself (exact_column:
  // the column's values, signs applied, to output row k).
  auto exact_column = [&](const float* column, int64_t g, int64_t k) {
    uint16_t out[16];
    rht16_bf16_exact(out, column, 0u);
    std::memcpy(y_t + k * M + 16 * g, out, sizeof out);
  };
  auto tile16 = [&](int64_t g, int64_t k0) {
    int kw = static_cast<int>(std::min<int64_t>(16, K - k0));
#if NIBBLE_FORMATS_HMAX_TREE  // row vectors (k-lanes): butterfly across them, transpose in registers
    v16f t[16];
    v16u hi = {}, lo = v16u{} + 0xFFFFFFFFu;  // rht16_bf16_sums_fit_f32's bounds, per column
    for (int i = 0; i < 16; ++i) {
      const uint16_t* xr = x + (16 * g + i) * K + k0;
      alignas(64) uint16_t part[16] = {};
      if (kw < 16) std::memcpy(part, xr, 2 * kw);
      v16u w = (v16u)(load16(kw < 16 ? part : xr)) ^ (((kRhtTeSignMask >> i) & 1u) << 31);
      t[i] = (v16f)(w);
      v16u b = w & 0x7FFFFFFFu;
      hi = b > hi ? b : hi;
      lo = b - 1u < lo ? b - 1u : lo;
    }
    rht16_rows_of_tile(t, 0u);
    v16u bits[16];
    for (int i = 0; i < 16; ++i) {  // f32_to_bf16_bits of finite values (other columns are redone)
      v16u u = (v16u)(t[i] * 0.25f);
      bits[i] = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    }
    transpose16x16(bits);
    typedef uint16_t v16h __attribute__((vector_size(32)));
    for (int k = 0; k < kw; ++k) {
      if (rht16_bf16_fit_from_bounds(hi[k], lo[k])) {
        v16h out = __builtin_convertvector(bits[k], v16h);
        std::memcpy(y_t + (k0 + k) * M + 16 * g, &out, 32);
      } else {
        float column[16];
        for (int i = 0; i < 16; ++i)
          column[i] = u32_as_float((static_cast<uint32_t>(x[(16 * g + i) * K + k0 + k]) << 16) ^
                                   (((kRhtTeSignMask >> i) & 1u) << 31));
        exact_column(column, g, k0 + k);
      }
    }
#else
    TileRow16 tile[16] = {};
    for (int i = 0; i < 16; ++i) {
      const uint16_t* xr = x + (16 * g + i) * K + k0;
      const uint32_t flip = ((kRhtTeSignMask >> i) & 1u) << 31;
      for (int k = 0; k < kw; ++k) tile[i].e[k] = u32_as_float((static_cast<uint32_t>(xr[k]) << 16) ^ flip);
    }
    uint32_t hi[16] = {}, lo[16];  // rht16_bf16_sums_fit_f32's bounds, per column
    std::fill(lo, lo + 16, 0xFFFFFFFFu);
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 16; ++k) {
        const uint32_t b = float_as_u32(tile[i].e[k]) & 0x7FFFFFFFu;
        hi[k] = std::max(hi[k], b);
        lo[k] = std::min(lo[k], b - 1u);
      }
    bool fits[16];
    for (int k = 0; k < 16; ++k) {
      fits[k] = rht16_bf16_fit_from_bounds(hi[k], lo[k]);
      if (!fits[k] && k < kw) {  // the double form on this column (signs already applied)
        float column[16];
        for (int i = 0; i < 16; ++i) column[i] = tile[i].e[k];
        exact_column(column, g, k0 + k);
      }
    }
    rht16_butterfly(tile);
    for (int k = 0; k < kw; ++k)
      if (fits[k])
        for (int j = 0; j < 16; ++j) y_t[(k0 + k) * M + 16 * g + j] = f32_to_bf16_bits(tile[j].e[k] * 0.25f);
#endif
  };
  // Task = 32 rows x 32 columns (2 x 2 tiles): whole 64-byte lines read and written. Consecutive
  // tasks walk down M, so each of the task's 32 output rows is written sequentially.
  int64_t gt = (M / 16 + 1) / 2, kt = (K + 31) / 32;
  parallel_for(gt * kt, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t gp = t % gt, kp = t / gt;
      if (gp + 2 < gt)  // the 32 input lines of the task two ahead (a 32-row stride: not prefetched by the hardware)
        for (int64_t r = 32 * (gp + 2); r < std::min<int64_t>(32 * (gp + 3), M); ++r) __builtin_prefetch(x + r * K + 32 * kp);
      for (int64_t g = 2 * gp; g < std::min<int64_t>(2 * gp + 2, M / 16); ++g)
        for (int64_t k0 = 32 * kp; k0 < std::min<int64_t>(32 * kp + 32, K); k0 += 16) tile16(g, k0);
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
#if NIBBLE_FORMATS_HMAX_TREE
    // rht16_f32 on one 16-lane vector: sign flip = sign-bit xor (same as negation), stage h pairs
    // lane i with lane i^h: lanes without bit h get t[i] + t[i+h], lanes with it t[i-h] - t[i].
    v16u flip = {};
    for (int i = 0; i < 16; ++i) flip[i] = ((sign_mask >> i) & 1u) << 31;
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < cols / 16; ++g) {
        v16f t = (v16f)((v16u)(load16(x + r * cols + 16 * g)) ^ flip);
        for (int h = 1; h < 16; h <<= 1) {
          v16f p = __builtin_shuffle(t, lane ^ h);
          t = (lane & h) != 0 ? p - t : t + p;
        }
        t = t * 0.25f;
        std::memcpy(y + r * cols + 16 * g, &t, 64);
      }
#else
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < cols / 16; ++g) rht16_f32(y + r * cols + 16 * g, x + r * cols + 16 * g, sign_mask);
#endif
  });
}

// ---- fused backward operand ---------------------------------------------------------------------------

void nvfp4_2level_backward_operand_cpu(uint8_t* codes_t, uint8_t* inner_t, float* outer_t, const uint8_t* codes,
                                       const uint8_t* inner, const float* outer, int64_t M, int64_t K,
                                       uint32_t sign_mask, const SrKey& sr) {
  NIB_CHECK_MSG(M % 128 == 0, "nvfp4-2level backward operand: M={} must be a multiple of 128", M);
  NIB_CHECK_MSG(K % 16 == 0, "nvfp4-2level backward operand: K={} must be a multiple of 16", K);
  int64_t no_in = (K + 127) / 128, kt = K / 16;
  // One task = a TM (m) x 16 (k) tile, TM = 256 when M allows (two output 128-blocks per row, the
  // vectorised requantizer's unit), else 128: decode the TM input rows' 16-element blocks into
  // tile[m][k], RHT along m (16-row groups; each op is per k-lane, the same binary32 operations
  // as rht16_f32 on a transposed row), transpose to rows of TM along m, requantize with SR.
  const int TM = M % 256 == 0 ? 256 : 128;
  int64_t mt = M / TM;
  parallel_for(mt * kt, 1, [&](int64_t t0, int64_t t1) {
#if !NIBBLE_FORMATS_HMAX_TREE
    alignas(64) TileRow16 tile[256];
#endif
    alignas(64) float rows[16][256];
    for (int64_t t = t0; t < t1; ++t) {
      int64_t mi = t / kt, kj = t % kt;
#if NIBBLE_FORMATS_HMAX_TREE
      // Per 16-row group in registers: decode the 16 rows' blocks (row vectors, k-lanes), RHT
      // across them, transpose, store as 16-element pieces of the 16 output rows. The first tile
      // of every 128-column stripe prefetches the rows' next code line (the tile 8 columns on).
      for (int g = 0; g < TM / 16; ++g) {
        v16f tg[16];
        for (int i = 0; i < 16; ++i) {
          int64_t row = mi * TM + 16 * g + i;
          const uint8_t* c = codes + row * (K / 2) + 8 * kj;
          if ((kj & 7) == 0) __builtin_prefetch(c + 64);
          float sp = nvfp4_2level_block_scale(inner[row * (K / 16) + kj], outer[row * no_in + (16 * kj) / 128]);
          tg[i] = e2m1_decode16(unpack_codes16(c)) * sp;
        }
        rht16_rows_of_tile(tg, sign_mask);
        for (int i = 0; i < 16; ++i) tg[i] = tg[i] * 0.25f;
        transpose16x16(tg);
        for (int k = 0; k < 16; ++k) std::memcpy(&rows[k][16 * g], &tg[k], 64);
      }
#else
      for (int m = 0; m < TM; ++m) {
        int64_t row = mi * TM + m;
        float sp = nvfp4_2level_block_scale(inner[row * (K / 16) + kj], outer[row * no_in + (16 * kj) / 128]);
        const uint8_t* c = codes + row * (K / 2) + 8 * kj;
        for (int i = 0; i < 16; ++i) tile[m].e[i] = nvfp4_2level_decode(e2m1_unpack(c, i), sp);
      }
      for (int g = 0; g < TM / 16; ++g) {
        TileRow16* tg = tile + 16 * g;
        for (int i = 0; i < 16; ++i)
          if ((sign_mask >> i) & 1u)
            for (int k = 0; k < 16; ++k) tg[i].e[k] = -tg[i].e[k];
        rht16_butterfly(tg);
      }
      for (int m = 0; m < TM; ++m)
        for (int k = 0; k < 16; ++k) rows[k][m] = tile[m].e[k] * 0.25f;
#endif
      for (int i = 0; i < 16; ++i) {
        int64_t k = 16 * kj + i, m0 = mi * TM;
        float* ot = outer_t + k * (M / 128) + m0 / 128;
        uint8_t* ct = codes_t + k * (M / 2) + m0 / 2;
        uint8_t* it = inner_t + k * (M / 16) + m0 / 16;
        twolevel_quantize_row(ct, it, ot, rows[i], TM, &sr, static_cast<uint64_t>(k * M + m0));
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
