// CUDA format kernels: host-side launchers for NVFP4 (TransformerEngine per-tensor 1x16 and 2-D
// 16x16; TetraJet-v2 double block "nvfp4-2level"), MXFP4 (three scale rules), MXFP8, their
// dequantizers, TE's RHT16 wgrad transform, and the fused backward-operand op. Every kernel
// calls the host+device functions of src/formats/ per element/block, so results are bit-exact
// with the CPU drivers (SR included: same SrKey -> same bits). Pointers are device memory, the
// caller allocates, destination first; bad shapes return a Status. `sr == nullptr` means RTN.
// In = float (F32) or uint16_t (BF16 bits), as in formats/.
// Fused BF16 GEMM operand (issue #13): the quantizers below take a last argument `operand`
// (16-byte aligned, the shape of x, or of the output for the transposing ones; null: none) that
// receives, in the same pass, the BF16 operand backend.h's dequantize_bf16 forms from the codes
// and scales (TE: code × E4M3 scale; 2-level and MXFP8: the dequantization rounded to BF16), bit
// for bit. With an operand, codes and block scales may both be null (not stored; linear layout
// only) and the 2-level outer scales too; TE still computes and stores its amax.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/status.h"
#include "formats/guided.h"
#include "formats/mx.h"
#include "formats/nvfp4.h"

namespace nibble::cuda {

using formats::GuidanceKind;
using formats::MxScaleRule;
using formats::SrKey;

// Where block scales go: row-major (M, K/block) bytes, or the 128x4-tile swizzled layout
// cuBLASLt reads (formats/swizzle.h; swizzled_scale_bytes(M, K/block) bytes, padding zeroed).
enum class ScaleLayout : uint8_t { kLinear, kSwizzled };

// Whether quantize_nvfp4_te*() first computes the per-tensor amax into *amax (two passes over
// x), or uses the amax already stored there (for example a delayed or precomputed one).
enum class AmaxMode : uint8_t { kCompute, kGiven };

// amax: (1) f32 <- max |x| over n elements, NaN skipped (formats::amax_update).
template <typename In>
Status absmax(float* amax, const In* x, int64_t n, cudaStream_t stream = nullptr);

// NVFP4 TE 1x16: codes (M, K/2) u8 e2m1x2, scales (M, K/16) ue4m3, amax (1) f32; x (M, K).
// K % 16 == 0.
template <typename In>
Status quantize_nvfp4_te(uint8_t* codes, uint8_t* scales, float* amax, const In* x, int64_t M, int64_t K,
                         const SrKey* sr = nullptr, AmaxMode amax_mode = AmaxMode::kCompute,
                         ScaleLayout layout = ScaleLayout::kLinear, cudaStream_t stream = nullptr,
                         uint16_t* operand = nullptr);

// NVFP4 TE 2-D weights: one scale per 16x16 tile (tile amax), stored replicated in the
// (M, K/16) scale tensor. Any M (the last row tile is zero-padded), K % 16 == 0. RTN.
// Optional columnwise outputs (nullptr to skip): codes_t (K, M/2) (M even), scales_t
// (K, ceil(M/16)) linear, the quantization of x^T with the same tile scales
// (formats::nvfp4_te_quantize_2d_cpu).
template <typename In>
Status quantize_nvfp4_te_2d(uint8_t* codes, uint8_t* scales, uint8_t* codes_t, uint8_t* scales_t, float* amax,
                            const In* x, int64_t M, int64_t K, AmaxMode amax_mode = AmaxMode::kCompute,
                            ScaleLayout layout = ScaleLayout::kLinear, cudaStream_t stream = nullptr,
                            uint16_t* operand = nullptr);

// y (M, K) f32 or bf16 <- TE dequantization of codes (M, K/2), scales (M, K/16) linear, amax (1);
// amax null: e2m1 × E4M3 scale without the per-tensor factor (formats::nvfp4_te_bf16_operand,
// exact in BF16; the factor becomes the BF16 GEMM's alpha).
template <typename Out>
Status dequantize_nvfp4_te(Out* y, const uint8_t* codes, const uint8_t* scales, const float* amax, int64_t M,
                           int64_t K, cudaStream_t stream = nullptr);

// nvfp4-2level: codes (M, K/2), inner (M, K/16) ue4m3, outer (M, ceil(K/128)) f32; x (M, K);
// K % 16 == 0 (a row's last partial 128-block is the zero-padded one). SR index: r*K + c.
template <typename In>
Status quantize_nvfp4_2level(uint8_t* codes, uint8_t* inner, float* outer, const In* x, int64_t M, int64_t K,
                             const SrKey* sr = nullptr, ScaleLayout inner_layout = ScaleLayout::kLinear,
                             cudaStream_t stream = nullptr, uint16_t* operand = nullptr);

template <typename Out>
Status dequantize_nvfp4_2level(Out* y, const uint8_t* codes, const uint8_t* inner, const float* outer, int64_t M,
                               int64_t K, cudaStream_t stream = nullptr);

// MXFP4: codes (M, K/2), scales (M, K/32) e8m0; x (M, K); K % 32 == 0.
template <typename In>
Status quantize_mxfp4(uint8_t* codes, uint8_t* scales, const In* x, int64_t M, int64_t K, MxScaleRule rule,
                      const SrKey* sr = nullptr, ScaleLayout layout = ScaleLayout::kLinear,
                      cudaStream_t stream = nullptr);
template <typename Out>
Status dequantize_mxfp4(Out* y, const uint8_t* codes, const uint8_t* scales, int64_t M, int64_t K,
                        cudaStream_t stream = nullptr);

// MXFP8 (E4M3 elements): elems (M, K) e4m3, scales (M, K/32) e8m0; rule kFloor or kRceil.
template <typename In>
Status quantize_mxfp8(uint8_t* elems, uint8_t* scales, const In* x, int64_t M, int64_t K, MxScaleRule rule,
                      ScaleLayout layout = ScaleLayout::kLinear, cudaStream_t stream = nullptr,
                      uint16_t* operand = nullptr);
template <typename Out>
Status dequantize_mxfp8(Out* y, const uint8_t* elems, const uint8_t* scales, int64_t M, int64_t K,
                        cudaStream_t stream = nullptr);

// TRACE guided rounding: codes (M, K/2) <- x (M, K) under the rollout's scales; guide is the
// rollout's packed codes (M, K/2) for kFull or its bit-packed mantissa bits (M, K/8) for
// kMantissaBit (formats::e2m1_mantissa_bits_cpu). K % 16 == 0.
// TE: roll_scales (M, K/16) e4m3 linear, roll_amax (1) f32 (device).
template <typename In>
Status quantize_nvfp4_te_guided(uint8_t* codes, const In* x, int64_t M, int64_t K, const uint8_t* roll_scales,
                                const float* roll_amax, const uint8_t* guide, GuidanceKind kind,
                                cudaStream_t stream = nullptr);
// 2-level: roll_inner (M, K/16), roll_outer (M, ceil(K/128)).
template <typename In>
Status quantize_nvfp4_2level_guided(uint8_t* codes, const In* x, int64_t M, int64_t K, const uint8_t* roll_inner,
                                    const float* roll_outer, const uint8_t* guide, GuidanceKind kind,
                                    cudaStream_t stream = nullptr);
// The RL trainer's guided rows (backend::Backend::guided_overwrite_rows): for i < R, row rows[i]
// of the 2-level (codes (M, K/2), inner (M, K/16), outer (M, ceil(K/128))) <- the guided rounding
// of x row rows[i] (x (M, K) f32) under roll_inner row i, roll_outer row i, guide row i; stats
// (3) i64 += {rtn_mismatch, one_step, reproduced} (formats::guided_element_stats) against the
// codes replaced. rows (R) i32, distinct; roll_inner (R, K/16); roll_outer (R, ceil(K/128)); guide
// (R, K/2) or (R, K/8), 8-byte aligned. Integer atomics: the same sums in any order.
Status nvfp4_2level_guided_rows(uint8_t* codes, uint8_t* inner, float* outer, int64_t* stats, const float* x,
                                const int32_t* rows, int64_t R, int64_t K, const uint8_t* roll_inner,
                                const float* roll_outer, const uint8_t* guide, GuidanceKind kind,
                                cudaStream_t stream = nullptr);
// The TRACE records' payload of every row of a 2-level (codes, inner, outer) (M, K):
// backend::Backend::guidance_payload_rows. out (M, P) bytes.
Status guidance_payload_rows(uint8_t* out, const uint8_t* codes, const uint8_t* inner, const float* outer, int64_t M,
                             int64_t K, GuidanceKind kind, cudaStream_t stream = nullptr);

// TE wgrad RHT: y_t (K, M) bf16 <- for every row of x^T and every 16-group along M,
// formats::rht16_bf16_exact(group, sign_mask). x (M, K) bf16; M % 16 == 0.
Status rht16_transpose_bf16(uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K, uint32_t sign_mask,
                            cudaStream_t stream = nullptr);

// TE wgrad operand in one call (formats::nvfp4_te_quantize_rht_t_cpu): y_t scratch (K, M) bf16
// <- rht16_transpose_bf16(x, TE signs), then quantize_nvfp4_te of y_t into codes_t (K, M/2),
// scales_t (K, M/16), amax_t (1); operand (K, M) bf16 (null: none).
Status quantize_nvfp4_te_rht_t(uint8_t* codes_t, uint8_t* scales_t, float* amax_t, uint16_t* y_t, const uint16_t* x,
                               int64_t M, int64_t K, const SrKey* sr = nullptr, cudaStream_t stream = nullptr,
                               uint16_t* operand = nullptr);

// TetraJet-v2 RHT in place along rows: x (M, K) f32, every 16-group of a row <- rht16_f32(group, sign_mask).
Status rht16_rows_f32(float* y, const float* x, int64_t M, int64_t K, uint32_t sign_mask,
                      cudaStream_t stream = nullptr);

// The fused backward-operand op (TetraJet-v2 dgrad/wgrad operand): from an nvfp4-2level [M, K]
// operand (codes (M, K/2), inner (M, K/16), outer (M, K/128)) produce the nvfp4-2level
// quantization of  RHT16_along_M( dequant(x)^T )  as [K, M]: codes_t (K, M/2), inner_t (K, M/16),
// outer_t (K, M/128), with stochastic rounding keyed by `sr` on the flat index k*M + m of the
// [K, M] output (or RTN when sr == nullptr). M % 128 == 0, K % 16 == 0 (input outer (M, ceil(K/128))).
// Equals, bit for bit: dequantize_nvfp4_2level -> transpose -> rht16_rows_f32 -> quantize_nvfp4_2level.
// operand (K, M) bf16 (null: none).
Status nvfp4_2level_transpose_rht_requantize(uint8_t* codes_t, uint8_t* inner_t, float* outer_t,
                                             const uint8_t* codes, const uint8_t* inner, const float* outer,
                                             int64_t M, int64_t K, uint32_t sign_mask, const SrKey* sr,
                                             cudaStream_t stream = nullptr, uint16_t* operand = nullptr);

// y (K, M) <- x (M, K)^T, for any 4-byte or 2-byte element (reference path and tests).
template <typename T>
Status transpose(T* y, const T* x, int64_t M, int64_t K, cudaStream_t stream = nullptr);

}  // namespace nibble::cuda
