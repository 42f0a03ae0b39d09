// Whole-tensor CPU quantizers and dequantizers for every format of 01-formats.md: the portable
// reference the CUDA backend is tested against (bit-exact). Each driver loops (threaded with
// parallel_for over rows) over the host+device per-block functions of nvfp4.h / mx.h / rht.h /
// guided.h. Conventions: output first, the caller allocates; inputs row-major [M, K] with blocks
// along K; `uint16_t*` inputs are BF16 bits; packed E2M1 codes are [M, K/2] (even element in the
// low nibble); scale matrices are linear row-major. `sr == nullptr` means round-to-nearest;
// otherwise element (r, c) rounds with sr_uniform(*sr, r*K + c) (flat index in the output).
#pragma once

#include <cstdint>

#include "formats/guided.h"
#include "formats/mx.h"
#include "formats/nvfp4.h"
#include "formats/rht.h"

namespace nibble::formats {

// max |x| over n elements, NaN skipped (0 for n == 0).
float amax_cpu(const float* x, int64_t n);
float amax_cpu(const uint16_t* x_bf16, int64_t n);

// ---- NVFP4, TransformerEngine semantics (K % 16 == 0) ----------------------------------------
// codes: (M, K/2) u8 e2m1x2; scales: (M, K/16) u8 e4m3; x: (M, K) f32 | bf16. Uses the given
// per-tensor amax (max |x|, or any larger value the caller chooses).
void nvfp4_te_quantize_with_amax_cpu(uint8_t* codes, uint8_t* scales, const float* x, int64_t M, int64_t K, float amax,
                                     const SrKey* sr = nullptr);
void nvfp4_te_quantize_with_amax_cpu(uint8_t* codes, uint8_t* scales, const uint16_t* x, int64_t M, int64_t K,
                                     float amax, const SrKey* sr = nullptr);
// Computes amax = max |x| (first pass), quantizes (second pass), returns amax (what is stored).
float nvfp4_te_quantize_cpu(uint8_t* codes, uint8_t* scales, const float* x, int64_t M, int64_t K,
                            const SrKey* sr = nullptr);
float nvfp4_te_quantize_cpu(uint8_t* codes, uint8_t* scales, const uint16_t* x, int64_t M, int64_t K,
                            const SrKey* sr = nullptr);
// y: (M, K) f32 <- codes (M, K/2), scales (M, K/16), amax. Works for 1x16 and 2-D (replicated).
void nvfp4_te_dequantize_cpu(float* y, const uint8_t* codes, const uint8_t* scales, float amax, int64_t M, int64_t K);

// 2-D 16x16 tile scaling (TE weights), K % 16 == 0, any M (last tile row-padded with zeros):
// codes (M, K/2), scales (M, K/16) with tile (r/16, j)'s scale replicated on its 16 rows;
// optional columnwise outputs (may be null) codes_t (K, M/2) (M even), scales_t (K, ceil(M/16)),
// quantized from x^T with the same tile scales. RTN only. Returns amax.
float nvfp4_te_quantize_2d_cpu(uint8_t* codes, uint8_t* scales, uint8_t* codes_t, uint8_t* scales_t, const float* x,
                               int64_t M, int64_t K);

// ---- NVFP4 double block, TetraJet-v2 ("nvfp4-2level"), K % 16 == 0 -----------------------------
// codes (M, K/2), inner (M, K/16) e4m3, outer (M, ceil(K/128)) f32 (a last partial 128-block is
// the zero-padded one); x (M, K) f32 | bf16.
void nvfp4_2level_quantize_cpu(uint8_t* codes, uint8_t* inner, float* outer, const float* x, int64_t M, int64_t K,
                               const SrKey* sr = nullptr);
void nvfp4_2level_quantize_cpu(uint8_t* codes, uint8_t* inner, float* outer, const uint16_t* x, int64_t M, int64_t K,
                               const SrKey* sr = nullptr);
void nvfp4_2level_dequantize_cpu(float* y, const uint8_t* codes, const uint8_t* inner, const float* outer, int64_t M,
                                 int64_t K);

// ---- MX (K % 32 == 0) --------------------------------------------------------------------------
// MXFP4: codes (M, K/2), scales (M, K/32) e8m0. SR allowed (elements only).
void mxfp4_quantize_cpu(uint8_t* codes, uint8_t* scales, const float* x, int64_t M, int64_t K, MxScaleRule rule,
                        const SrKey* sr = nullptr);
void mxfp4_quantize_cpu(uint8_t* codes, uint8_t* scales, const uint16_t* x, int64_t M, int64_t K, MxScaleRule rule,
                        const SrKey* sr = nullptr);
void mxfp4_dequantize_cpu(float* y, const uint8_t* codes, const uint8_t* scales, int64_t M, int64_t K);
// MXFP8 (E4M3 elements): elems (M, K) e4m3, scales (M, K/32) e8m0. rule: kFloor or kRceil.
void mxfp8_quantize_cpu(uint8_t* elems, uint8_t* scales, const float* x, int64_t M, int64_t K, MxScaleRule rule);
void mxfp8_quantize_cpu(uint8_t* elems, uint8_t* scales, const uint16_t* x, int64_t M, int64_t K, MxScaleRule rule);
void mxfp8_dequantize_cpu(float* y, const uint8_t* elems, const uint8_t* scales, int64_t M, int64_t K);

// ---- RHT -----------------------------------------------------------------------------------------
// TE wgrad path: y_t (K, M) bf16 <- BF16_RNE(x^T · T) along M, x (M, K) bf16, M % 16 == 0,
// fixed TE signs (rht16_bf16_exact).
void rht16_te_transpose_cpu(uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K);
// TE wgrad operand in one call: y_t scratch (K, M) bf16 as above, then nvfp4_te_quantize_cpu of
// y_t into codes_t (K, M/2), scales_t (K, M/16); returns amax_t.
float nvfp4_te_quantize_rht_t_cpu(uint8_t* codes_t, uint8_t* scales_t, uint16_t* y_t, const uint16_t* x, int64_t M,
                                  int64_t K, const SrKey* sr = nullptr);
// y (rows, cols) f32 <- each 16-group along a row transformed by rht16_f32 (cols % 16 == 0).
// y may equal x.
void rht16_rows_f32_cpu(float* y, const float* x, int64_t rows, int64_t cols, uint32_t sign_mask);

// ---- TetraJet-v2 fused backward operand (Q4 / Q6 of 02-pretraining-recipes.md §2) -----------------
// Input: a forward-quantized nvfp4-2level tensor of shape [M, K] (codes (M, K/2), inner (M, K/16),
// outer (M, ceil(K/128))). Output: dequantize -> transpose -> RHT16 (sign_mask) along M ->
// requantize nvfp4-2level with SR (key `sr`, flat index k*M + m) along M:
// codes_t (K, M/2), inner_t (K, M/16), outer_t (K, M/128). Requires M % 128 == 0, K % 16 == 0.
// Bit-identical to nvfp4_2level_dequantize_cpu + transpose + rht16_rows_f32_cpu +
// nvfp4_2level_quantize_cpu(..., &sr).
void nvfp4_2level_backward_operand_cpu(uint8_t* codes_t, uint8_t* inner_t, float* outer_t, const uint8_t* codes,
                                       const uint8_t* inner, const float* outer, int64_t M, int64_t K,
                                       uint32_t sign_mask, const SrKey& sr);

// ---- TRACE guided rounding (K % 16 == 0) ------------------------------------------------------------
// guide: kFull -> the rollout's packed codes (M, K/2); kMantissaBit -> (M, K/8) u8 bit-packed
// mantissa bits (bit j of byte i = element 8i + j of the row). The trainer's codes use the
// rollout's scales, so only codes are written.
// TE: roll_scales (M, K/16) e4m3 + roll_amax; codes (M, K/2) <- x (M, K).
void nvfp4_te_quantize_guided_cpu(uint8_t* codes, const float* x, int64_t M, int64_t K, const uint8_t* roll_scales,
                                  float roll_amax, const uint8_t* guide, GuidanceKind kind);
// 2-level: roll_inner (M, K/16), roll_outer (M, ceil(K/128)).
void nvfp4_2level_quantize_guided_cpu(uint8_t* codes, const float* x, int64_t M, int64_t K, const uint8_t* roll_inner,
                                      const float* roll_outer, const uint8_t* guide, GuidanceKind kind);
// mbits (M, K/8) <- mantissa bits of codes (M, K/2): what 1-bit guidance records.
void e2m1_mantissa_bits_cpu(uint8_t* mbits, const uint8_t* codes, int64_t M, int64_t K);

}  // namespace nibble::formats
